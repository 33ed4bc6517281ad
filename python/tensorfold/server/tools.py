"""Tool calls (chat `tools`): the tools reach the chat template, and the reply's tool-call blocks
become OpenAI `tool_calls`.

One format is parsed: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes form of
Qwen2.5 / Qwen3 (mlx-lm's `json_tools`), recognised as mlx-lm recognises it: a chat template that
writes `<tool_call>` and `tool_call.name`. A model whose template has another format (Llama 3.1's
bare JSON, Qwen3-Coder's `<function=...>`, DeepSeek's) gets a 400 for a request with tools, rather than
a reply whose calls stay unparsed text.

Nothing is lost: a block that is not a JSON object with a string `name` stays in the content as the
model wrote it, and so does a block the reply ends inside (max_tokens, a stop string)."""

from __future__ import annotations

import json
import uuid

from .reasoning import _partial_suffix

START, END = "<tool_call>", "</tool_call>"


def tool_format(tokenizer) -> str | None:
    """"json" where the chat template writes Hermes-style tool calls, else None."""
    # the template a request with tools renders (a checkpoint's "tool_use" one where it has one)
    t = getattr(tokenizer, "tools_template", None) or getattr(tokenizer, "chat_template", None)
    if isinstance(t, str) and START in t and "tool_call.name" in t and "<function=" not in t:
        return "json"
    return None


def parse_call(raw: str) -> dict | None:
    """An OpenAI tool call from a block's text, or None where it is not one."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):           # already a JSON string: kept as written where it is JSON
        try:
            json.loads(args)
        except (ValueError, RecursionError):
            return None
    else:
        args = json.dumps(args, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


class ToolCallSplitter:
    """Feed content deltas; get (content, [tool calls]) back. A start tag split across deltas, and
    a block until its end tag, are held back; `final` releases what is held."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.inside = False
        self.buf = ""
        self.calls = 0              # tool calls made so far
        self._blank = ""            # stream_feed: content that is all whitespace so far
        self._spoke = False         # stream_feed: content with more than whitespace went out

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        if not self.enabled:
            return text, []
        self.buf += text
        content, calls = "", []
        while True:
            if not self.inside:
                i = self.buf.find(START)
                if i >= 0:
                    content += self.buf[:i]
                    self.buf, self.inside = self.buf[i + len(START):], True
                    continue
                keep = 0 if final else _partial_suffix(self.buf, START)
                content += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            i = self.buf.find(END)
            if i < 0:
                if final:               # the reply ended inside the block: its text as written
                    content += START + self.buf
                    self.buf, self.inside = "", False
                break
            raw, self.buf, self.inside = self.buf[:i], self.buf[i + len(END):], False
            call = parse_call(raw)
            if call is None:
                content += START + raw + END
            else:
                calls.append(call)
        self.calls += len(calls)
        return content, calls

    def stream_feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """feed() for a stream, whose content must join to what the reply not streamed has: content
        that is all whitespace waits until more comes, and is dropped where the reply made calls
        (the message's content is null then; two calls written a newline apart streamed '\n')."""
        content, calls = self.feed(text, final)
        if not self.enabled or self._spoke:
            return content, calls
        self._blank += content
        if self._blank.strip() or (final and not self.calls):
            content, self._blank, self._spoke = self._blank, "", True
            return content, calls
        return "", calls
