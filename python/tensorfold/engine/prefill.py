"""Grid prefill: the one place where prompt chunking is decided.

Chunk boundaries sit at multiples of the grid size counted from token 0 of the prompt, whatever
was restored from a snapshot (snapshots exist only at grid points). So a chunk's input — the
cached KV before it and its own tokens — is the same whether the prompt came fresh or resumed,
and so are its bits. The mode (name, grid) is part of every prompt-cache key."""

from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


PREFILL_OPS = ("mlx", "kernels")


@dataclass(frozen=True)
class PrefillMode:
    """How prompts are prefilled. `ops`: "mlx" runs MLX's own forward over the grid chunks (their
    KV bit-identical to mlx-lm's chunked prefill; the default); "kernels" runs the row-exact
    decode kernels over each grid chunk (on MLX's CPU backend ~100x faster for quantized models;
    other bits than "mlx"). Either way the prompt's last token is one row-exact step."""
    name: str = "grid"
    grid: int = 2048
    ops: str = "mlx"

    def __post_init__(self):
        if self.ops not in PREFILL_OPS:
            raise ValueError(f"prefill ops must be one of {PREFILL_OPS}, got {self.ops!r}")
        if self.grid < 1:
            raise ValueError("prefill grid must be positive")

    @property
    def key(self) -> str:
        return f"{self.name}-{self.grid}-{self.ops}"


def grid_chunks(start: int, end: int, grid: int) -> list[tuple[int, int]]:
    """[(s, e)] covering [start, end), cut at every multiple of `grid`. `start` must be a grid point."""
    if start % grid:
        raise ValueError(f"prefill must start on a grid point, got {start}")
    out, s = [], start
    while s < end:
        e = min((s // grid + 1) * grid, end)
        out.append((s, e))
        s = e
    return out


# Reply rows reserved with the prompt: a reply that fits never grows the cache (a growth copies
# every cached row and retraces the compiled exact step at the new capacity).
REPLY_ROWS = 1024


def reserve_rows(n_prompt: int, room: int = 0) -> int:
    """The KV rows a request reserves before its prompt's first chunk: the prompt's, and up to
    REPLY_ROWS of the `room` its reply may take (max_tokens, bounded by the context). 0 with
    TENSORFOLD_RESERVE_PROMPT=0 (the cache then grows chunk by chunk)."""
    if os.environ.get("TENSORFOLD_RESERVE_PROMPT") == "0":
        return 0
    return n_prompt + max(0, min(room, REPLY_ROWS))


class PrefillCancelled(Exception):
    """`cancel` was set between two chunks; the cache holds the chunks done (whole grid chunks)."""


def prefill(model, cache, ids: list[int], mode: PrefillMode,
            on_grid_point: Callable[[int], None] | None = None,
            progress: Callable[[int, int], None] | None = None, reserve: int | None = None,
            cancel=None):
    """Prefill ids[cache.offset:] on the grid; returns the last row's logits [vocab].

    Chunks [s, e) cut at multiples of the grid cover ids[:-1]; the last token then runs alone
    through the row-exact ops and the LM head. Both are functions of the prompt alone, fresh or
    resumed. reserve: KV rows to make room for first (default reserve_rows(len(ids))).
    cancel: a threading.Event checked before each chunk and before the last token; when set,
    PrefillCancelled is raised (a chunk under way runs to its end: it is one MLX evaluation)."""
    exact = mode.ops == "kernels"
    # the whole prompt's KV rows at once: growing chunk by chunk re-copies every row already
    # written at each chunk (O(n^2) for a long prompt). No result depends on the capacity
    # (KVCache; tested fresh, resumed, grown, reserved far past the prompt).
    cache.reserve(reserve_rows(len(ids)) if reserve is None else reserve)
    for s, e in grid_chunks(cache.offset, len(ids) - 1, mode.grid):
        if cancel is not None and cancel.is_set():
            raise PrefillCancelled
        model.forward(mx.array([ids[s:e]]), cache, exact=exact, logits=False)
        mx.eval(cache.arrays())
        if e % mode.grid == 0 and on_grid_point is not None:
            on_grid_point(e)
        if progress is not None:
            progress(e, len(ids))
    # the prompt's last token alone, through the LM head (as mlx-lm does: ~15% faster on the
    # CPU than carrying the LM head in the last chunk), and through the row-exact ops, as a
    # decode step: a function of the prompt only (no snapshot after it: a snapshot holds only
    # KV computed by whole grid chunks). Not MLX's one-row forward: on MLX's CUDA backend its
    # sdpa picks cuDNN or its vector kernel for one query row from the K/V buffers' state
    # (evaluated or not, buffer size), not their values, so a resumed prompt's last token got
    # other bits than the fresh one (measured on the H200: bench/gpu_diag_prefill.py).
    if cancel is not None and cancel.is_set():
        raise PrefillCancelled
    logits = model.forward(mx.array([ids[-1:]]), cache, exact=True, all_logits=True)
    mx.eval(cache.arrays() + [logits])
    if progress is not None:
        progress(len(ids), len(ids))
    return logits[0]
