"""Engine.generate's and Engine's arguments, checked: a RequestError naming the argument (a
ValueError for the constructor's), as server/protocol.py checks an HTTP request's fields before
they reach the engine. Python callers had none of those checks: max_tokens = NaN passed `< 1`
and decoded past the context, a float one failed inside MLX (std::bad_cast), a numpy int64 seed
overflowed in the sampler after the prefill, and wrong types surfaced as Python's own errors
naming nothing. Values are returned normalized (numpy integers as ints) and the caller's
SamplingParams is never changed."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator

from ..errors import RequestError
from .types import Prompt, SamplingParams

SEED_BITS = 64      # seeds are used mod 2^64 (sampling.keyed_uniforms); the server takes signed 64-bit


def shown(v: int) -> str:
    """An integer for an error message: a huge one by its size (1e300 as an int is 301 digits)."""
    return str(v) if v.bit_length() <= 64 else f"a {v.bit_length()}-bit number"


def integer(v, name: str, low: int | None = None, high: int | None = None) -> int:
    """v as a Python int (numpy integers too; bool, float and NaN refused), within [low, high]."""
    if isinstance(v, bool):
        raise RequestError(f"{name} must be an integer, got {v!r}", param=name)
    try:
        n = operator.index(v)
    except TypeError:
        raise RequestError(f"{name} must be an integer, got {v!r}"[:200], param=name) from None
    if (low is not None and n < low) or (high is not None and n > high):
        span = f"at least {low}" if high is None else f"from {low} to {high}"
        raise RequestError(f"{name} must be {span}, got {shown(n)}", param=name)
    return n


def real(v, name: str) -> float:
    """v as a float (ints and numpy numbers too; bool and strings refused). Ranges: the caller's
    (_sampling_error, which also refuses NaN)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise RequestError(f"{name} must be a number, got {v!r}"[:200], param=name)
    return float(v)


def flag(v, name: str) -> bool:
    """A boolean: "no" or 0 counted as true or false by truthiness is refused."""
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be True or False, got {v!r}"[:200], param=name)
    return v


def sampling(p) -> SamplingParams:
    """A checked copy of generate's `sampling` (None: the defaults)."""
    if p is None:
        return SamplingParams()
    if not isinstance(p, SamplingParams):
        raise RequestError(f"sampling must be a SamplingParams, got {type(p).__name__}", param="sampling")
    floats = {f: real(getattr(p, f), f) for f in ("temperature", "top_p", "min_p", "presence_penalty",
                                                   "frequency_penalty", "repetition_penalty")}
    seed = None if p.seed is None else integer(p.seed, "seed", -2 ** (SEED_BITS - 1), 2 ** SEED_BITS - 1)
    return dataclasses.replace(p, **floats, top_k=integer(p.top_k, "top_k"), seed=seed,
                               choice=integer(p.choice, "choice", 0, 2 ** SEED_BITS - 1),
                               logit_bias=logit_bias(p.logit_bias))


MAX_BIAS = 100.0     # OpenAI's range: -100 bans a token in effect, 100 forces it


def _is_token_id(v) -> bool:
    """An int or numpy integer >= 0 (not a bool); the vocabulary bound is Engine.generate's."""
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and v >= 0


def logit_bias(v) -> dict[int, float] | None:
    """None, or a mapping of token ids (ints, numpy ints) to numbers in [-100, 100]: a new dict of
    Python ints and floats (None where empty). The ids' upper bound is the model's vocabulary, which
    Engine.generate checks."""
    if v is None:
        return None
    if not hasattr(v, "items"):
        raise RequestError(f"logit_bias must be a dict of token id -> bias, got {v!r}"[:200], param="logit_bias")
    out = {}
    for k, b in v.items():
        if not _is_token_id(k):
            raise RequestError(f"logit_bias: a key must be a token id (an integer >= 0), got {k!r}"[:200],
                               param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise RequestError(f"logit_bias: the bias of token {int(k)} must be a number from -100 to 100, "
                               f"got {b!r}"[:200], param="logit_bias")
        out[int(k)] = float(b)
    return out or None


def token_ids(v, name: str) -> list[int]:
    """None, or a list / tuple of token ids (ints, numpy ints; >= 0): a list of Python ints. The
    upper bound, the vocabulary, is Engine.generate's to check."""
    if v is None:
        return []
    if not isinstance(v, (list, tuple)) or not all(_is_token_id(i) for i in v):
        raise RequestError(f"{name} must be a list of token ids (integers >= 0), got {v!r}"[:200], param=name)
    return [int(i) for i in v]


def stops(v) -> list[str] | None:
    """None, a string, or a list / tuple of strings ([None] was read as no stop)."""
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        raise RequestError(f"stop must be a string or a list of strings, got {v!r}"[:200], param="stop")
    return list(v)


def other(*, draft, ignore_eos, keep_prompt, enable_thinking, tools, cancel, prepared) -> None:
    """generate's remaining arguments: their types."""
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of tool objects", param="tools")
    flag(draft, "draft")
    flag(ignore_eos, "ignore_eos")
    flag(keep_prompt, "keep_prompt")
    if enable_thinking is not None:
        flag(enable_thinking, "enable_thinking")
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise RequestError("cancel must be a threading.Event (anything with is_set())", param="cancel")
    if prepared is not None and not isinstance(prepared, Prompt):
        raise RequestError(f"prepared must be a Prompt (Engine.prepare), got {type(prepared).__name__}",
                           param="prepared")


def constructor(context, draft_width, prefill_mode, prompt_cache_gib=2.0, snapshot_gib=8.0, drafts=True,
                thinking=None):
    """Engine's arguments, checked (ValueError naming the argument): context=-5 was taken and failed
    every request, 0 was read as the default, draft_width=-2 failed inside numpy; prompt_cache_gib
    "x" was multiplied into a 1 GiB string and -1 taken (the CLI refuses it), drafts="no" read by
    truthiness. A prefill_mode may be named as the CLI's --prefill names it ("mlx", "kernels")."""
    from .prefill import PREFILL_OPS, PrefillMode
    for name, v in (("prompt_cache_gib", prompt_cache_gib), ("snapshot_gib", snapshot_gib)):
        # GiB as the CLI takes them: finite, >= 0, at most 2^62 bytes
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not 0 <= v <= 2 ** 32:
            raise ValueError(f"{name} must be a number of GiB from 0 to {2 ** 32}, got {v!r}"[:200])
    if not isinstance(drafts, bool):
        raise ValueError(f"drafts must be True or False, got {drafts!r}"[:200])
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"thinking must be True, False or None, got {thinking!r}"[:200])
    for name, v, low in (("context", context, 1), ("draft_width", draft_width, 0)):
        if v is None and name == "context":
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            raise ValueError(f"{name} must be an integer of at least {low}, got {v!r}")
    if isinstance(prefill_mode, str):
        if prefill_mode not in PREFILL_OPS:
            raise ValueError(f"prefill_mode must be a PrefillMode or one of {PREFILL_OPS}, got {prefill_mode!r}")
        prefill_mode = PrefillMode(ops=prefill_mode)
    if not isinstance(prefill_mode, PrefillMode):
        raise ValueError(f"prefill_mode must be a PrefillMode, got {type(prefill_mode).__name__}")
    return (None if context is None else int(context)), int(draft_width), prefill_mode
