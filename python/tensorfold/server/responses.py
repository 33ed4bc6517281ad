"""OpenAI-shaped reply objects (chat.completion, text_completion, chunks, usage, errors)."""

from __future__ import annotations

import json
import time
import uuid

from ..engine.types import GenerationStats
from ..tokenizer import IncrementalDetokenizer


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


def echo_text(tokenizer, prompt, ids) -> str:
    """The text `echo` puts before a completion: the prompt as its ids decode, less a BOS the
    tokenizer added. That is the prompt as sent, except where the tokenizer normalises it (NFC, a
    space SentencePiece puts after a typed <s>): text_offset counts in this text, so the two agree."""
    if ids is None:                 # an engine without prepare(): the prompt as sent
        return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
    return tokenizer.decode(list(ids)[1:] if tokenizer.added_bos(prompt, ids) else list(ids))


class TextOffsets:
    """Where each token of a completion choice starts in the choice's text (logprobs' text_offset):
    the echoed prompt's tokens in echo_text (a BOS the tokenizer added takes no room), then the
    completion's tokens in its text as the engine's detokenizer emits it (the same context: the
    prompt's tail). A token whose text is held back (part of a character, a byte run) starts where
    that text will; the token that releases held text starts where its own bytes do, after it."""

    def __init__(self, tokenizer, prompt_ids, echo: str | None, skip_first: bool = False):
        self.tok, self.prompt, self.echo = tokenizer, list(prompt_ids or []), echo
        self.k = 0
        if echo is not None:
            self.skip_first = skip_first
            self._start(0, IncrementalDetokenizer(tokenizer))
        else:
            self.skip_first = False
            self._start(0, IncrementalDetokenizer(tokenizer, context=self.prompt[-64:]))

    def _start(self, base: int, detok) -> None:
        self.base, self.emitted, self.detok = base, 0, detok

    def next(self, token_id: int) -> int:
        if self.echo is not None and self.k == len(self.prompt):        # the completion follows the prompt
            self._start(len(self.echo), IncrementalDetokenizer(self.tok, context=self.prompt[-64:]))
        at = self.base + self.emitted
        if not (self.k == 0 and self.skip_first):
            out = self.detok.add(token_id)
            own = self.tok.token_bytes(token_id).decode("utf-8", "ignore")
            if own and len(out) > len(own):     # held text released before this token's own
                at += len(out) - len(own)
            self.emitted += len(out)
        self.k += 1
        return at


class ReplyBuilder:
    """Builds the objects for one request of `kind` "chat" or "completion"."""

    def __init__(self, kind: str, model: str, *, usage_field: bool = False, tokenizer=None,
                 prompt_ids=None, echo: str | None = None, skip_bos: bool = False):
        """usage_field: every chunk carries "usage": null (stream_options.include_usage, as OpenAI
        streams it; the usage chunk at the end has the counts). tokenizer: names the tokens of
        the logprobs (a request that asks for them); prompt_ids / echo: the prompt's ids and, with
        `echo`, its text (where completions' text_offset counts from: TextOffsets)."""
        self.prompt_ids, self.echo, self.skip_bos = prompt_ids, echo, skip_bos
        self.kind = kind
        self.model = model
        self.usage_field = usage_field
        self.tokenizer = tokenizer
        self._offsets: dict[int, TextOffsets] = {}      # completions' logprobs, a choice's
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
        at = self._offsets.get(index)
        if at is None:
            at = self._offsets[index] = TextOffsets(self.tokenizer, self.prompt_ids, self.echo, self.skip_bos)
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
            out["text_offset"].append(at.next(lp.id))
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
