"""row_check: on the real loaded weights, k single decode steps against the same k tokens verified
in windows of every size the engine's drafting can ask for."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import kernels

# The window's first position by default: the k tokens straddle key 128, the end of the CPU face's
# first 128-key attention chunk and of two of the CUDA face's 64-key spans, so a kernel whose bits
# changed once a window's keys pass a chunk's edge fails the check (at positions 5..5+k-1 it passed).
STRADDLE = 128
ALL_SIZES_UP_TO = 17     # every window size up to this (the contract's 16 rows and one past them)
MAX_K = 33               # tokens checked at most: windows of 32 and 33 rows cross the CPU GEMM's 32-row block


def window_sizes(k: int) -> list[int]:
    """The verify-window sizes checked for k tokens: every size from 2 to min(k, 17), then 32, 33 and
    k where k reaches them (k is at most MAX_K: the engine checks min(draft width + 1, MAX_K) tokens,
    and each size costs about k / size calls)."""
    return sorted({*range(2, min(k, ALL_SIZES_UP_TO) + 1), *(w for w in (32, 33, k) if 2 <= w <= min(k, MAX_K))})


def row_check(model, k: int = 8, prompt_len: int | None = None, seed: int = 0) -> bool:
    """True when every row of every exact call equals the same row computed alone, bit for bit: the
    k tokens fed one at a time, then again in windows of w rows (w in window_sizes(k); the last
    window of a pass holds what is left, k mod w rows), each window one call on the cache the
    windows before it filled, as a verify round runs. Until session 59 only one window of k rows
    was checked, so a kernel whose bits differed at one row count (5) alone passed."""
    rng = np.random.default_rng(seed)
    vocab = model.cfg.vocab_size
    if prompt_len is None:
        prompt_len = max(5, STRADDLE - k // 2)
    prompt = rng.integers(3, vocab, size=prompt_len).tolist()
    steps = rng.integers(3, vocab, size=k).tolist()

    with kernels.compiles_batched():       # the CUDA face's kernels missing from the cache compiled side by side first
        # the prompt through the exact kernels (MLX's own forward took ~7 s for 124 tokens of a 4-bit
        # model on a 2-core CPU), once: each pass then trims the cache back to it, as a rejected
        # draft does (rows past the offset are never read)
        c = model.new_cache()
        model.forward(mx.array([prompt]), c, exact=True, logits=False)
        serial = [model.forward(mx.array([[t]]), c, exact=True, all_logits=True)[0] for t in steps]
        mx.eval(serial)
        for w in window_sizes(k):
            c.trim(prompt_len)
            rows = []
            for i in range(0, k, w):
                rows.extend(model.forward(mx.array([steps[i:i + w]]), c, exact=True, all_logits=True))
            mx.eval(rows)
            if not all(bool(mx.array_equal(serial[i], rows[i]).item()) for i in range(k)):
                return False
    return True
