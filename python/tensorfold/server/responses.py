"""OpenAI-shaped reply objects (chat.completion, text_completion, chunks, usage, errors)."""

from __future__ import annotations

import codecs
import json
import time
import uuid

from ..engine.types import GenerationStats


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def error_body(message: str, *, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(stats) -> dict:
    """stats: one choice's GenerationStats, or a list of them (n > 1: the prompt counted once, the
    completions summed)."""
    every = [s or GenerationStats() for s in (stats if isinstance(stats, list) else [stats])] or [GenerationStats()]
    first, done = every[0], sum(s.completion_tokens for s in every)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": done,
            "total_tokens": first.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def tensorfold_block(stats: GenerationStats | None) -> dict:
    s = stats or GenerationStats()
    return {"prefill_s": round(s.prefill_s, 6), "ttft_s": round(s.ttft_s, 6),
            "decode_tps": round(s.decode_tps, 3), "drafted": s.drafted, "accepted": s.accepted,
            "token_hash": s.token_hash}


def token_str(b: bytes) -> str:
    """A token's text for a logprobs entry: its bytes as UTF-8, or, where they are part of a
    character, "bytes:" and the bytes escaped (as OpenAI names such tokens); `bytes` has them raw."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


class ReplyBuilder:
    """Builds the objects for one request of `kind` "chat" or "completion"."""

    def __init__(self, kind: str, model: str, *, usage_field: bool = False, tokenizer=None):
        """usage_field: every chunk carries "usage": null (stream_options.include_usage, as OpenAI
        streams it; the usage chunk at the end has the counts). tokenizer: names the tokens of
        the logprobs (a request that asks for them)."""
        self.kind = kind
        self.model = model
        self.usage_field = usage_field
        self.tokenizer = tokenizer
        self._offsets: dict[int, list] = {}     # completions' logprobs, a choice's: [next offset, utf-8 decoder]
        self.id = new_id(kind)
        self.created = int(time.time())

    def _entry(self, token_id: int, logprob: float) -> tuple[str, dict]:
        b = self.tokenizer.token_bytes(token_id)
        s = token_str(b)
        return s, {"token": s, "logprob": logprob, "bytes": list(b)}

    def logprobs(self, lps, index: int = 0) -> dict | None:
        """The `logprobs` of a choice for these engine TokenLogprobs (None: none asked). Chat:
        {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}; completions
        (OpenAI's legacy form): {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset},
        the top dicts holding the n most likely tokens and the sampled one."""
        if lps is None:
            return None
        if self.kind == "chat":
            content = []
            for lp in lps:
                _, e = self._entry(lp.id, lp.logprob)
                e["top_logprobs"] = [self._entry(i, v)[1] for i, v in lp.top]
                content.append(e)
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        at = self._offsets.setdefault(index, [0, codecs.getincrementaldecoder("utf-8")("replace")])
        for lp in lps:
            s, _ = self._entry(lp.id, lp.logprob)
            if lp.logprob is None:          # an echoed prompt's first token: nothing before it
                top = None
            else:
                top = {self._entry(i, v)[0]: v for i, v in lp.top}
                top.setdefault(s, lp.logprob)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            # the character where the token's bytes start in the text they decode to (the length
            # of its name counted "bytes:\\xf0" as 10 characters)
            out["text_offset"].append(at[0])
            at[0] += len(at[1].decode(self.tokenizer.token_bytes(lp.id)))
        return out

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices) -> dict:
        """The whole reply from its choices (server/choices.Choice): with tool calls made, a content
        of nothing but whitespace is null, as OpenAI sends it. The `tensorfold` block is choice 0's."""
        out = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        items = []
        for ch in choices:
            content, lp = ch.text, self.logprobs(ch.lps, ch.index)
            if self.kind == "chat":
                msg = {"role": "assistant", "content": content}
                if ch.tool_calls:
                    msg["content"] = content if content.strip() else None
                    msg["tool_calls"] = ch.tool_calls
                if ch.reasoning_text:
                    msg["reasoning_content"] = ch.reasoning_text
                items.append({"index": ch.index, "message": msg, "logprobs": lp, "finish_reason": ch.finish})
            else:
                items.append({"index": ch.index, "text": content, "logprobs": lp, "finish_reason": ch.finish})
        stats = [ch.stats for ch in choices]
        out.update(choices=items, usage=usage(stats), tensorfold=tensorfold_block(stats[0] if stats else None))
        return out

    def chunk(self, *, content: str | None = None, reasoning: str | None = None, role: bool = False,
              finish: str | None = None, stats=None, logprobs=None, tool_calls=None, first_call: int = 0,
              index: int = 0) -> dict:
        """tool_calls: calls completed in this chunk, each sent whole, numbered (`index`) from
        first_call in the order of the reply."""
        if self.kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = [dict(c, index=first_call + k) for k, c in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs, index),
                      "finish_reason": finish}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": content or "", "logprobs": self.logprobs(logprobs, index),
                      "finish_reason": finish}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if self.usage_field:
            out["usage"] = None
        if stats is not None:
            out["tensorfold"] = tensorfold_block(stats)
        return out

    def usage_chunk(self, stats) -> dict:
        """stats: a list of the choices' (the usage sums them; the `tensorfold` block is choice 0's)."""
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out.update(choices=[], usage=usage(stats), tensorfold=tensorfold_block(stats[0] if stats else None))
        return out


def sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
