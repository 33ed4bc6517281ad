"""Sparse (selected-key) attention for DeepSeek V3.2-style models, row-exact.

* ``sparse_attention(q, k, v, indices, offset, scale)`` -- each query row attends only to
  the key positions its indexer selected (``indices [B, M, T]``, shared by the row's heads).
  The kernels gather those keys themselves: no L x S mask, no dense score matrix.
* ``select_topk(scores, k, offset)`` -- the indexer's deterministic top-k selection.
* ``use_sparse(chunk_end, topk)`` -- the position-only rule for when to switch to sparse.

Contract (docs/kernels.md, "sparse_attention"): row i of the output is bit-identical
whatever M is, whatever the other rows (queries or index lists) hold, and whatever the KV
capacity is. Its bits depend only on its query, the ordered list of its *kept* indices
(entries e with 0 <= e <= offset+i, in the order given; padding / out-of-range entries are
skipped wherever they sit) and the keys those name. Softmax in fp32, online, over chunks of
consecutive kept entries in list order (CUDA, bf16 / f16: scores and sums on tensor cores,
csrc/cuda/sparse_attention.cu). Given the full causal set 0..offset+i in ascending order (what
``select_topk`` returns while a row sees at most ``topk`` keys) the result is bit-identical to
``row_attention`` on the CPU face; on CUDA the two kernels have different arithmetic and agree
within the stated tolerance only.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from tensorfold import _ext

__all__ = ["sparse_attention", "select_topk", "use_sparse"]

StreamLike = Optional[Union[mx.Stream, mx.Device, mx.DeviceType]]


def use_sparse(chunk_end: int, topk: int) -> bool:
    """Position-only rule: a chunk of query rows ending (exclusive) at absolute position
    ``chunk_end`` uses sparse attention iff ``chunk_end > topk``, i.e. once its last row
    can see more than ``topk`` keys. It depends on positions only, so a resumed prompt
    and a fresh one make the same choice for the same chunk.

    On the CPU face either choice gives the same bits for a row that sees at most ``topk``
    keys: ``select_topk`` then returns that row's full causal set in ascending order, and
    ``sparse_attention`` over the full causal set equals ``row_attention`` bit for bit. On
    the CUDA face it does not (different arithmetic, equal within tolerance only), so a
    caller that must keep drafted == serial has to pick the kernel per row position
    (``use_sparse(p + 1, topk)`` for the row at position p), not per chunk.
    """
    return int(chunk_end) > int(topk)


def sparse_attention(q: mx.array, k: mx.array, v: mx.array, indices: mx.array, offset,
                     scale: float, *, stream: StreamLike = None) -> mx.array:
    """Row-exact attention over selected keys (GQA).

    q [B, Hq, M, D]; k, v [B, Hkv, cap, D] (KV buffers, Hq a multiple of Hkv); indices
    [B, M, T] int32: row i of batch b attends to keys ``indices[b, i, t]`` that satisfy
    ``0 <= e <= offset+i`` (entries < 0 are padding, larger ones are ignored: causal by
    construction), shared by all heads. offset: int or int32 scalar array. Returns
    [B, Hq, M, D] in q's dtype promoted with k's and v's. A row with no kept index returns zeros; a row whose
    position falls outside the buffer returns NaN (an int offset is checked up front and
    raises instead). Duplicate entries count once per occurrence.

    D: a multiple of 16 on CPU (64..576 tested, e.g. MLA's 576-wide latent with one KV
    head); CUDA: bf16 / f16 (q, k, v of one dtype) with D a multiple of 16 on tensor cores,
    any other dtype / D on CUDA cores (docs/kernels.md).
    """
    from . import as_int32, check_attention_shapes, check_scale, offset_array
    check_attention_shapes(q, k, v, "sparse_attention")
    scale = check_scale(scale, "sparse_attention")
    if indices.ndim != 3 or indices.shape[0] != q.shape[0] or indices.shape[1] != q.shape[2]:
        raise ValueError("sparse_attention: indices must be [B, M, T]")
    indices = as_int32(indices, "sparse_attention: indices")
    off = offset_array(offset, q.shape[2], k.shape[2], "sparse_attention")
    from . import backend_face, _gpu_stream, _empty, promoted
    q = promoted(q, k, v)
    if q.size == 0:
        return _empty(q.shape, q.dtype)
    face = backend_face(stream)
    if face == "cuda":
        from . import _cuda
        return _cuda.sparse_attention(q, k, v, indices, off, float(scale), _gpu_stream(stream))
    if face == "metal":
        return _metal_sparse_attention(q, k, v, indices, off, float(scale), _gpu_stream(stream))
    return _ext.sparse_attention(q, k, v, indices, off, float(scale))


@functools.lru_cache(maxsize=None)
def _metal_kernel():
    from ._sources import sections
    sec = sections("metal", "sparse_attention.metal")
    return mx.fast.metal_kernel(
        name="tf_sparse_attn", input_names=["q", "k", "v", "indices", "offset", "scale_f"],
        output_names=["out"], source=sec["sparse_attn"], header=sec["header"],
        ensure_row_contiguous=True)


def _metal_sparse_attention(q, k, v, indices, offset, scale, stream):
    """Metal face (metal/sparse_attention.metal): never compiled by Apple's compiler nor run on
    a GPU (no Apple GPU); CI runs it on the CPU emulation of tests/metal_emu."""
    B, HQ, M, D = q.shape
    return _metal_kernel()(
        inputs=[q, k, v, indices, offset, mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("TK", k.dtype), ("D", D), ("HQ", HQ), ("HKV", k.shape[1])],
        grid=(32, B * HQ * M, 1), threadgroup=(32, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype], stream=stream)[0]


_U64_MAX = 0xFFFFFFFFFFFFFFFF


def select_topk(scores: mx.array, k: int, offset, *, stream: StreamLike = None) -> mx.array:
    """Deterministic top-k key selection of the indexer.

    scores [B, M, S] (any float dtype; compared as float32). Row i (position offset+i)
    sees keys 0..min(offset+i, S-1). Returns int32 [B, M, k]: the positions of the k
    highest visible scores, ties going to the lower position (-0.0 == +0.0; NaN ranks
    below -inf), sorted ascending by position, padded at the end with -1 when fewer than
    k keys are visible. Exact and row-independent on any device: each (score, position)
    pair is packed into a unique uint64 key, so the selection is a pure function of the
    row's visible scores. offset: int or int32 scalar array.
    """
    if scores.ndim != 3:
        raise ValueError("select_topk: scores must be [B, M, S]")
    from . import as_index, as_int32
    k = as_index(k, "select_topk: k")
    if k <= 0:
        raise ValueError("select_topk: k must be positive")
    B, M, S = scores.shape
    if isinstance(offset, mx.array):
        off = as_int32(offset.reshape(()), "select_topk: offset", low=-2**31)
    else:
        off = mx.array(max(min(as_index(offset, "select_topk: offset"), 2**31 - 1), -2**31), dtype=mx.int32)
    off = mx.minimum(off, S)      # past S-1 every key is visible anyway; off + i cannot wrap
    s = stream
    x = mx.add(scores.astype(mx.float32, stream=s), 0.0, stream=s)  # -0.0 -> +0.0
    u = x.view(mx.uint32)
    neg = mx.right_shift(u, 31, stream=s) == 1
    sortable = mx.where(neg, mx.bitwise_invert(u, stream=s),
                        mx.bitwise_or(u, mx.array(0x80000000, dtype=mx.uint32), stream=s),
                        stream=s)
    sortable = mx.where(mx.isnan(x, stream=s), mx.array(0, dtype=mx.uint32), sortable, stream=s)
    hi = mx.bitwise_invert(sortable, stream=s).astype(mx.uint64)  # high score -> small
    pos = mx.arange(S, dtype=mx.uint32).astype(mx.uint64)
    key = mx.bitwise_or(mx.left_shift(hi, 32, stream=s), pos, stream=s)
    limit = off + mx.arange(M, dtype=mx.int32)  # [M]
    visible = mx.arange(S, dtype=mx.int32)[None, :] <= limit[:, None]  # [M, S]
    umax = mx.array(np.uint64(_U64_MAX))
    key = mx.where(visible[None], key, umax, stream=s)
    kk = min(k, S)
    if kk < S:
        key = mx.partition(key, kk - 1, axis=-1, stream=s)[..., :kk]
    key = mx.sort(key, axis=-1, stream=s)[..., :kk]  # unique keys: any algorithm, same set
    sel = mx.bitwise_and(key, mx.array(np.uint64(0xFFFFFFFF)), stream=s).astype(mx.int32)
    big = mx.array(2**31 - 1, dtype=mx.int32)
    sel = mx.where(key == umax, big, sel, stream=s)
    sel = mx.sort(sel, axis=-1, stream=s)
    sel = mx.where(sel == big, mx.array(-1, dtype=mx.int32), sel, stream=s)
    if kk < k:
        sel = mx.concatenate([sel, mx.full((B, M, k - kk), -1, dtype=mx.int32)], axis=-1)
    return sel
