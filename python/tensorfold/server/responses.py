"""OpenAI-shaped reply objects (chat.completion, text_completion, chunks, usage, errors)."""

from __future__ import annotations

import json
import time
import uuid

from ..engine.types import GenerationStats


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def error_body(message: str, *, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(stats: GenerationStats | None) -> dict:
    s = stats or GenerationStats()
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


def tensorfold_block(stats: GenerationStats | None) -> dict:
    s = stats or GenerationStats()
    return {"prefill_s": round(s.prefill_s, 6), "ttft_s": round(s.ttft_s, 6),
            "decode_tps": round(s.decode_tps, 3), "drafted": s.drafted, "accepted": s.accepted,
            "token_hash": s.token_hash}


class ReplyBuilder:
    """Builds the objects for one request of `kind` "chat" or "completion"."""

    def __init__(self, kind: str, model: str, *, usage_field: bool = False):
        """usage_field: every chunk carries "usage": null (stream_options.include_usage, as OpenAI
        streams it; the usage chunk at the end has the counts)."""
        self.kind = kind
        self.model = model
        self.usage_field = usage_field
        self.id = new_id(kind)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, content: str, reasoning: str | None, finish: str | None, stats) -> dict:
        if self.kind == "chat":
            msg = {"role": "assistant", "content": content}
            if reasoning:
                msg["reasoning_content"] = reasoning
            choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}
            out = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
            out = self._head("text_completion")
        out.update(choices=[choice], usage=usage(stats), tensorfold=tensorfold_block(stats))
        return out

    def chunk(self, *, content: str | None = None, reasoning: str | None = None, role: bool = False,
              finish: str | None = None, stats=None) -> dict:
        if self.kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if self.usage_field:
            out["usage"] = None
        if stats is not None:
            out["tensorfold"] = tensorfold_block(stats)
        return out

    def usage_chunk(self, stats) -> dict:
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out.update(choices=[], usage=usage(stats), tensorfold=tensorfold_block(stats))
        return out


def sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
