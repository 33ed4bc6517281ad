"""Keyed sampling: the token at a position is a pure function of (logits row, seed, position).

Gumbel-max over the filtered, temperature-scaled logits, with one uniform per (seed, absolute
position, token id) from a counter-based hash (SplitMix64 finaliser). Candidates are ordered by
(value desc, id asc), so ties always go to the lower id. Nothing depends on call order, batch
or window: a verify round and a one-row step sample the same token from the same logits."""

from __future__ import annotations

import hashlib

import numpy as np

from .types import SamplingParams

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_G = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def keyed_uniforms(seed: int, position: int, n: int) -> np.ndarray:
    """Uniforms in (0, 1), one per token id 0..n-1, for (seed, position)."""
    with np.errstate(over="ignore"):
        base = _mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _mix(np.uint64(position) * _G + _G))
        h = _mix(base + np.arange(1, n + 1, dtype=np.uint64) * _G)
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def prompt_seed(token_ids) -> int:
    """The default seed: a hash of the prompt's token ids (same conversation, same reply)."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _order(x: np.ndarray) -> np.ndarray:
    """Indices by value desc, id asc."""
    return np.lexsort((np.arange(x.shape[0]), -x))


def filtered_logits(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature-scaled float64 logits with filtered-out ids at -inf."""
    x = logits.astype(np.float64) / p.temperature
    keep = np.isfinite(x)
    if p.top_k and 0 < p.top_k < x.shape[0]:
        kth = _order(x)[: p.top_k]
        mask = np.zeros_like(keep)
        mask[kth] = True
        keep &= mask
    if p.min_p and p.min_p > 0.0:
        m = np.max(x[keep])
        keep &= (x - m) >= np.log(p.min_p)
    if p.top_p and p.top_p < 1.0:
        idx = _order(np.where(keep, x, -np.inf))
        idx = idx[keep[idx]]
        z = x[idx] - x[idx[0]]
        probs = np.exp(z)
        probs /= probs.sum()
        cum = np.cumsum(probs)
        n = int(np.searchsorted(cum, p.top_p, side="left")) + 1
        mask = np.zeros_like(keep)
        mask[idx[:n]] = True
        keep &= mask
    return np.where(keep, x, -np.inf)


def sample(logits: np.ndarray, seed: int, position: int, p: SamplingParams) -> int:
    """The token at absolute `position` for this logits row (1-D float array)."""
    if p.temperature <= 0.0:
        return int(np.argmax(logits))  # first maximum: ties to the lower id
    x = filtered_logits(logits, p)
    u = keyed_uniforms(seed, position, x.shape[0])
    g = x - np.log(-np.log(u))
    return int(np.argmax(g))  # argmax returns the lowest id among equal maxima
