"""Log-probabilities of the generated tokens (a request's `logprobs` / `top_logprobs`).

They are the model's own distribution: log_softmax of the model's raw logits row (float32), before
the penalties (which give `sample` its own float64 row), temperature and the top_k / min_p / top_p
filters -- what vLLM returns by default. Computed on the host in float64 from that row alone, so a
token's logprobs are a pure function of its row's bits: drafted == serial and resumed == fresh hold
for them bit for bit, as for the tokens (tests/test_logprobs.py).

The n most likely ids come most likely first; among equal logprobs the lower id first. A logprob
that is not finite (a -inf logit; a broken row's NaN) is reported as -9999.0, OpenAI's value for a
token of no measurable probability, since JSON has no infinities."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_TOP = 20          # top alternatives a request may ask for (OpenAI's chat limit, vLLM's default)
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    id: int
    logprob: float | None                       # None: a prompt's first token (nothing before it)
    top: tuple[tuple[int, float], ...] | None = ()     # (id, logprob) of the n most likely ids


def _finite(v: float) -> float:
    return v if math.isfinite(v) else FLOOR


def log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log_softmax of one logits row (NaN where the row has a NaN, -inf for -inf logits)."""
    x = np.asarray(row, dtype=np.float64)
    m = np.max(x)
    if np.isnan(m):
        return np.full_like(x, np.nan)
    if m == np.inf:                   # the +inf logits share the mass (a broken row, reported as is)
        return np.where(x == m, 0.0, -np.inf)
    if m == -np.inf:                  # every logit -inf: no token has any probability
        return np.full_like(x, -np.inf)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def top_ids(lp: np.ndarray, n: int) -> np.ndarray:
    """The n ids of largest logprob, largest first, the lower id first among equals (NaN last)."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    key = np.where(np.isnan(lp), -np.inf, lp)
    n = min(n, key.shape[0])
    kth = np.partition(key, key.shape[0] - n)[key.shape[0] - n]     # the n-th largest value
    cand = np.flatnonzero(key >= kth)                                # ascending ids, ties included
    order = np.lexsort((cand, -key[cand]))                           # by value, then by id
    return cand[order[:n]]


def token_logprob(row: np.ndarray, token: int, n: int) -> TokenLogprob:
    """The sampled `token`'s logprob and the n most likely ids' under the logits `row`."""
    lp = log_softmax(row)
    top = tuple((int(i), _finite(float(lp[i]))) for i in top_ids(lp, n))
    return TokenLogprob(int(token), _finite(float(lp[token])), top)
