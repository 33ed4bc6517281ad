"""Keyed sampling: the token at a position is a pure function of (logits row, seed, position).

Gumbel-max over the filtered, temperature-scaled logits, with one uniform per (seed, absolute
position, token id) from a counter-based hash (SplitMix64 finaliser). Candidates are ordered by
(value desc, id asc), so ties always go to the lower id. Nothing depends on call order, batch
or window: a verify round and a one-row step sample the same token from the same logits."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np

from .types import SamplingParams

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_G = np.uint64(0x9E3779B97F4A7C15)
_BELOW_ONE = np.nextafter(1.0, 0.0)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def keyed_uniforms(seed: int, position: int, n: int, ids: np.ndarray | None = None) -> np.ndarray:
    """Uniforms in (0, 1), one per token id (0..n-1, or the given ids), for (seed, position)."""
    if ids is None:
        ids = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = _mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _mix(np.uint64(position) * _G + _G))
        h = _mix(base + (ids.astype(np.uint64) + np.uint64(1)) * _G)
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
    # the top 53-bit value, 2^53 - 1, rounds to exactly 1.0 (+ 0.5 is a tie there, rounded to
    # even): -log(-log(u)) = inf, and that id won whatever its logit (once in 2^53 ids). Only that
    # value moves, to the largest double below 1; every other uniform keeps its bits.
    return np.minimum(u, _BELOW_ONE)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request with n > 1: choice 0 keeps the request's seed (so it
    is the n = 1 reply), the others a hash of (seed, choice)."""
    if choice == 0:
        return seed
    data = (seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little") + int(choice).to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(b"choice" + data).digest()[:8], "little")


def prompt_seed(token_ids) -> int:
    """The default seed: a hash of the prompt's token ids (same conversation, same reply)."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _top(x: np.ndarray, m: int) -> np.ndarray:
    """Ids of the m largest finite-or-not values, ordered by (value desc, id asc); ties at the
    boundary are all included before ordering, so the result does not depend on partitioning."""
    n = x.shape[0]
    if m < n:
        part = np.argpartition(-x, m - 1)[:m]
        cand = np.flatnonzero(x >= x[part].min())
    else:
        cand = np.arange(n)
    return cand[np.lexsort((cand, -x[cand]))]


def filtered_logits(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature-scaled float64 logits with filtered-out ids at -inf.

    Scaled as (logit - max) / T, the largest at 0: with a tiny positive T (1e-310 is valid JSON)
    logit / T overflowed, the best ids became +inf and then left the candidates. Non-finite
    logits are out, except +inf: where a row has +inf logits they outweigh every finite one
    (softmax's limit), so the +inf ids alone stay, equally likely (greedy picks the first of them;
    they had been dropped with NaN, and sampling picked among the finite ones)."""
    x = logits.astype(np.float64)
    pos = np.isposinf(x)
    if pos.any():
        x = np.where(pos, 0.0, -np.inf)
    finite = np.isfinite(x)
    top = np.max(x[finite]) if finite.any() else 0.0
    with np.errstate(over="ignore"):
        x = np.where(finite, (x - top) / p.temperature, -np.inf)
    if not finite.any():
        return x             # nothing to filter (the top-p walk raised on an empty row)
    if p.top_k and 0 < p.top_k < x.shape[0]:
        kth = _top(x, p.top_k)[: p.top_k]
        y = np.full_like(x, -np.inf)
        y[kth] = x[kth]
        x = y
    if p.min_p and p.min_p > 0.0:
        x = np.where((x - np.max(x)) >= np.log(p.min_p), x, -np.inf)
    if p.top_p and p.top_p < 1.0:
        kept = np.isfinite(x)
        top = np.max(x)
        z = np.sum(np.exp(x[kept] - top))          # normaliser over every kept id, in id order
        n_kept = int(kept.sum())
        m = min(n_kept, 1024)
        while True:
            order = _top(x, m)
            order = order[np.isfinite(x[order])]
            cum = np.cumsum(np.exp(x[order] - top)) / z
            if cum[-1] >= p.top_p or len(order) >= n_kept:
                break
            m = min(n_kept, m * 8)                   # rare: a very flat distribution
        n = int(np.searchsorted(cum, p.top_p, side="left")) + 1
        y = np.full_like(x, -np.inf)
        y[order[:n]] = x[order[:n]]
        x = y
    return x


def sample(logits: np.ndarray, seed: int, position: int, p: SamplingParams) -> int:
    """The token at absolute `position` for this logits row (1-D float array)."""
    if p.temperature <= 0.0:
        return int(np.argmax(logits))  # first maximum: ties to the lower id
    x = filtered_logits(logits, p)
    finite = np.isfinite(x)
    if finite.all():                               # no filter took an id out: no gather needed
        u = keyed_uniforms(seed, position, x.shape[0])
        return int(np.argmax(x - np.log(-np.log(u))))
    ids = np.flatnonzero(finite)                   # ascending ids
    if ids.size == 0:
        # no finite logit at all (a broken checkpoint's NaN row): greedy's rule, as the greedy
        # path gives it, where this raised (argmax of nothing) and the request failed with a 500
        return int(np.argmax(logits))
    u = keyed_uniforms(seed, position, x.shape[0], ids)
    g = x[ids] - np.log(-np.log(u))
    return int(ids[np.argmax(g)])  # argmax returns the lowest id among equal maxima


_IDS: dict[int, tuple[mx.array, mx.array]] = {}   # V -> evaluated (arange(0, V), arange(V, 2V))


def greedy_device(logits: mx.array) -> mx.array:
    """The device twin of the greedy branch of `sample` (temperature <= 0): for logits [..., V]
    returns the int32 token id(s) [...] that ``int(np.argmax(row))`` gives for the same row cast
    to float32, bit for bit, without reading the logits back to the host.

    The tie rule is explicit, not MLX's argmax's: the lowest id among the row's maxima. NaN is
    ordered as numpy orders it (the first NaN wins, whatever MLX's max does with NaN); a row of
    -inf gives id 0, as numpy does. Only a cast, comparisons, max and min: nothing rounds."""
    x = logits.astype(mx.float32)          # exact; also faster than bf16 compares on the CPU
    V = x.shape[-1]
    tabs = _IDS.get(V)
    if tabs is None:
        tabs = _IDS[V] = (mx.arange(V, dtype=mx.int32), mx.arange(V, 2 * V, dtype=mx.int32))
        mx.eval(tabs)
    ids, ids_v = tabs
    nan = mx.isnan(x)
    m = mx.max(mx.where(nan, -mx.inf, x), axis=-1, keepdims=True)
    # NaN ids stay in [0, V) and come first; the maxima's ids go to [V, 2V); the rest to 2V.
    # A row always has a NaN or a maximum (-inf == -inf), so the min is < 2V.
    r = mx.min(mx.where(nan, ids, mx.where(x == m, ids_v, 2 * V)), axis=-1)
    return r % V
