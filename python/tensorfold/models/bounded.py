"""Bounded prefill for the families whose layers are heavy (MoE, DSA): each layer's hidden
state and cache writes go to the native LayerQueue, which starts evaluating them and waits on
layer i - depth before more is built, so at most `queue_depth` layers are queued ahead of the
device. For qwen3_moe peak memory then does not grow with the prompt (measured on the H200,
docs/benchmarks.md "Session 14"). deepseek_v32's grows slowly, inside one layer: its indexer
scores each row against every key. mlx-lm's ops build [index heads, chunk rows, keys] at once (an
audit measured 46 / 94 MiB more per 1k prompt tokens with 8 / 32 index heads on the CPU); since
session 50 dsa.py takes a sparse chunk INDEX_ROWS rows at a time, head by head: ~5 MiB per 1k
tokens whatever the heads (tests/test_dsa.py). Decode (exact=True) is not queued."""

from __future__ import annotations

import os
from typing import NamedTuple

from .. import _ext


class QueueStats(NamedTuple):
    """What the last prefill forward's LayerQueue saw."""
    depth: int
    max_in_flight: int
    pushed: int


def queue_depth(default: int) -> int:
    """The LayerQueue's depth: `default`, or TENSORFOLD_QUEUE_DEPTH (a positive integer; the
    bench's knob for where a prefill's peak memory comes from)."""
    v = os.environ.get("TENSORFOLD_QUEUE_DEPTH", "")
    if not v:
        return default
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"TENSORFOLD_QUEUE_DEPTH must be a positive integer, got {v!r}")
    return int(v)


class BoundedPrefill:
    """Mixin before DenseModel: `class MoEModel(BoundedPrefill, DenseModel)`."""

    queue_depth = 2
    _queue = None
    last_queue = None      # QueueStats of the last prefill forward (instrumentation)

    def _layer_done(self, i: int, h, cache, exact: bool) -> None:
        if self._queue is not None:
            self._queue.push([h, cache.keys[i], cache.values[i]])

    def _piece_done(self, arrays: list) -> None:
        """A heavy transient inside a layer is done (the MoE prefill's dequantized experts,
        0.4 GB a projection on Qwen3-30B-A3B): its product goes to the same queue, so the host
        waits on the piece `depth` pushes back before it allocates the next one, and at most
        `depth` such copies are queued ahead of the device instead of `depth` layers' worth.
        H200 (docs/benchmarks.md "Session 14"): 1.64 GB above weights + KV in every chunk, at
        most 2.11 GB at 64k and at 128k; 4.61 / 6.14 GB with whole layers."""
        if self._queue is not None:
            self._queue.push(arrays)

    def forward(self, ids, cache, *, exact: bool, all_logits: bool = False, logits: bool = True):
        self._queue = None if exact else _ext.LayerQueue(queue_depth(self.queue_depth))
        try:
            return super().forward(ids, cache, exact=exact, all_logits=all_logits, logits=logits)
        finally:
            q, self._queue = self._queue, None
            if q is not None:   # keep the numbers, not the queue (it references the last layers)
                self.last_queue = QueueStats(q.depth, q.max_in_flight, q.pushed)
