"""Row-exact kernels: quantized matmul, dense matmul and causal attention.

Contract (docs/kernels.md): row i of each op's output is bit-identical whether the call
holds 1 row or M rows, whatever the other rows contain and whatever capacity the KV
buffers have. Each op has three faces:

* CPU  -- MLX primitives in the C++ extension (``tensorfold._ext``), multithreaded AVX2.
* CUDA -- ``mx.fast.cuda_kernel`` over ``csrc/cuda/*.cu`` (installed to
  ``tensorfold/_kernels/cuda``).
* Metal -- ``mx.fast.metal_kernel`` over ``metal/row_ops.metal`` (never compiled or run
  in this project's CI).

The face follows the stream / device: a GPU stream (or GPU default device) uses CUDA when
``mx.cuda.is_available()``, else Metal when ``mx.metal.is_available()``; everything else
uses the CPU primitive.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
from typing import Callable, Optional, Union

import mlx.core as mx

from tensorfold import _ext

__all__ = [
    "backend_face",
    "uses_tensor_cores",
    "row_quantized_matmul",
    "row_matmul",
    "row_attention",
    "row_check_ops",
    "fused_qk_norm_rope",
    "sparse_attention",
    "select_topk",
    "use_sparse",
]

StreamLike = Optional[Union[mx.Stream, mx.Device, mx.DeviceType]]


def _cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


def mlx_runs_on_cuda() -> bool:
    """Whether MLX's own ops (prefill, mlx-lm's forward) run on a CUDA GPU: the default device is a
    GPU and this MLX's GPU backend is CUDA (whatever face TENSORFOLD_KERNELS picks for ours)."""
    return mx.default_device() == mx.gpu and _cuda_available()


def _metal_available() -> bool:
    return hasattr(mx, "metal") and mx.metal.is_available()


def _device_of(stream: StreamLike) -> mx.Device:
    if stream is None:
        return mx.default_device()
    if isinstance(stream, mx.Stream):
        return stream.device
    if isinstance(stream, mx.Device):
        return stream
    return mx.Device(stream)  # a DeviceType such as mx.cpu / mx.gpu


def backend_face(stream: StreamLike = None) -> str:
    """"cpu" | "cuda" | "metal": which face the row ops use for `stream` (default device).
    TENSORFOLD_KERNELS=cpu forces the CPU face (e.g. where a GPU face cannot compile)."""
    if os.environ.get("TENSORFOLD_KERNELS", "").lower() == "cpu":
        return "cpu"
    dev = _device_of(stream)
    return _face_of(dev.type == mx.gpu)


@functools.lru_cache(maxsize=None)
def _face_of(gpu: bool) -> str:
    """The face for a GPU / CPU device (which GPU backend this MLX has is fixed per process)."""
    if gpu:
        if _cuda_available():
            return "cuda"
        if _metal_available():
            return "metal"
    return "cpu"


def uses_tensor_cores(x: mx.array, w: mx.array, scales: Optional[mx.array], group_size: int,
                      bits: int) -> bool:
    """Whether the CUDA face of row_quantized_matmul (bits > 0) / row_matmul (bits == 0)
    takes its tensor-core kernel for these dtypes and this weight shape (never M-dependent)."""
    from . import _cuda
    if bits:
        K = w.shape[-1] * 32 // bits
        return _cuda.quantized_tc_ok(x.dtype, scales.dtype, K, group_size, bits)
    return _cuda.matmul_tc_ok(x.dtype, w.dtype, w.shape[-1])


def _gpu_stream(stream: StreamLike):
    if isinstance(stream, mx.Stream):
        return stream
    return mx.default_stream(_device_of(stream))


_I32_MAX = 2**31 - 1


def as_int32(a: mx.array, what: str, low: int = -1) -> mx.array:
    """Integer ids / offsets for a kernel, as int32: a float array is refused (it was truncated:
    1.9 read as 1), and wider integers are clipped to [low, 2^31 - 1] rather than wrapped (2^32 + 1
    read as 1), so an out-of-range value stays out of range (a NaN row, an ignored key)."""
    if not isinstance(a, mx.array):
        raise ValueError(f"{what} must be an mlx array of integers, got {type(a).__name__}")
    if a.dtype == mx.int32:
        return a
    if not mx.issubdtype(a.dtype, mx.integer):
        raise ValueError(f"{what} must be integers, got {a.dtype}")
    if a.dtype in (mx.int8, mx.int16, mx.uint8, mx.uint16):
        return a.astype(mx.int32)
    if a.dtype in (mx.uint32, mx.uint64):
        return mx.minimum(a, _I32_MAX).astype(mx.int32)
    return mx.clip(a, low, _I32_MAX).astype(mx.int32)


def as_index(v, what: str) -> int:
    """A Python integer (bool and numpy integers too), or ValueError: 2.7 used to be read as 2."""
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {v!r}") from None


FLOAT_TYPES = (mx.float32, mx.bfloat16, mx.float16)


def promoted(x: mx.array, *others) -> mx.array:
    """x cast to the float type MLX's own op would return for these operands (its promotion: one
    dtype stays; bf16 with fp16, or anything with fp32, is fp32), so that the kernels' output
    type, x's, is MLX's: with bf16 x and fp32 weights the result was rounded to bf16, 10^3 times
    MLX's error. The cast is exact; the engine's calls share one dtype and never take it."""
    for a in (x, *others):
        if a is not None and (not isinstance(a, mx.array) or a.dtype not in FLOAT_TYPES):
            # numpy arrays and float64 / integer arrays had been cast to fp32 without a word, or
            # failed with "Cannot interpret 'mlx.core.float32' as a data type"
            raise ValueError("operands must be mlx arrays of float32, bfloat16 or float16, got "
                             + (f"{a.dtype}" if isinstance(a, mx.array) else type(a).__name__))
    types = {x.dtype, *(o.dtype for o in others if o is not None)}
    return x if len(types) == 1 or x.dtype == mx.float32 else x.astype(mx.float32)


def check_scale(scale, what: str) -> float:
    """An attention's softmax scale as a float: a finite real number (NaN or inf made every row NaN
    without an error; a string was parsed)."""
    if isinstance(scale, mx.array) and scale.size == 1:
        scale = scale.item()
    if isinstance(scale, (bool, str, bytes)) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"{what}: scale must be a finite number, got {scale!r}"[:200])
    return float(scale)


def _check_k(x: mx.array, what: str) -> None:
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{what}: x must have a positive number of columns (K), got shape {x.shape}")


# The shapes every face needs, checked before the face is chosen: the CPU primitives check them
# too, but the GPU faces' wrappers did not, and a mismatch there read past a buffer or returned
# garbage (x narrower than w's K; a group size other than 32 / 64 / 128; Hq not a multiple of
# Hkv; k and v of other capacities).
QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def _check_quantized(x, w, scales, biases, group_size, bits, what: str) -> None:
    if not isinstance(scales, mx.array) or not isinstance(biases, mx.array):
        raise ValueError(f"{what}: scales and biases must be arrays (MLX affine quantization)")
    if type(bits) is not int or type(group_size) is not int:   # 4.0 passed `in` and then nanobind
        raise ValueError(f"{what}: bits and group_size must be integers, got {bits!r} / {group_size!r}")
    if bits not in QUANT_BITS:
        raise ValueError(f"{what}: bits must be one of {QUANT_BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{what}: group_size must be one of {GROUP_SIZES}, got {group_size}")
    if not isinstance(w, mx.array) or w.ndim != 2 or w.dtype != mx.uint32:
        raise ValueError(f"{what}: w must be a 2-D uint32 mlx array, got " + (
            f"{w.dtype} {w.shape}" if isinstance(w, mx.array) else type(w).__name__))
    N, K = w.shape[0], w.shape[1] * 32 // bits
    if x.shape[-1] != K:
        raise ValueError(f"{what}: x has {x.shape[-1]} columns, w takes K = {K}")
    if K % group_size:
        raise ValueError(f"{what}: K = {K} is not a multiple of group_size {group_size}")
    want = (N, K // group_size)
    if tuple(scales.shape) != want or tuple(biases.shape) != want:
        raise ValueError(f"{what}: scales / biases must be {list(want)}, got "
                         f"{list(scales.shape)} / {list(biases.shape)}")


def _check_dense(x, w, what: str) -> None:
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"{what}: w must be [N, K] with K = x's last dimension, got x {x.shape}, "
                         f"w {w.shape}")


def check_attention_shapes(q, k, v, what: str) -> None:
    """q [B, Hq, M, D], k and v [B, Hkv, cap, D] of one shape and dtype, Hq a multiple of Hkv."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{what}: q [B, Hq, M, D], k/v [B, Hkv, cap, D]")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v must have the same shape, got {k.shape} / {v.shape}")
    if k.dtype != v.dtype:
        # one KV buffer type (the engine's caches): the CUDA face stages V as K's type, and read
        # mixed it gave garbage with no error (a static audit; the CPU and Metal faces took it)
        raise ValueError(f"{what}: k and v must have the same dtype, got {k.dtype} / {v.dtype}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{what}: q {q.shape} and k {k.shape} differ in batch or head size")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{what}: Hq = {q.shape[1]} must be a multiple of Hkv = {k.shape[1]}")


def row_quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                         group_size: int = 64, bits: int = 4, *, residual: Optional[mx.array] = None,
                         stream: StreamLike = None) -> mx.array:
    """Row-exact ``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)``.

    x [..., M, K] (float32 / bfloat16 / float16); w uint32 [N, K*bits/32]; scales and
    biases [N, K/group_size]. Returns [..., M, N] in x's dtype promoted with the scales' as MLX's
    op promotes it (`promoted`), fp32 accumulation.
    bits in {2, 3, 4, 5, 6, 8}; group_size in {32, 64, 128}.

    residual [..., M, N]: returns ``product + residual`` (a layer's residual add). The CUDA
    face's 4-bit kernel adds it in its store, out = T(T(acc) + residual), saving a launch; the
    other faces and kernels add it with MLX's add. Either way a per-element op, so row i's bits
    still depend on row i alone.
    """
    _check_k(x, "row_quantized_matmul")
    _check_quantized(x, w, scales, biases, group_size, bits, "row_quantized_matmul")
    x = promoted(x, scales, biases)
    if x.size == 0 or w.shape[0] == 0:
        y = _empty((*x.shape[:-1], w.shape[0]), x.dtype)
        return y if residual is None else y + residual
    face = backend_face(stream)
    if face == "cuda":
        from . import _cuda
        return _cuda.quantized_matmul(x, w, scales, biases, group_size, bits, _gpu_stream(stream),
                                      residual=residual)
    if face == "metal":
        from . import _metal
        y = _metal.quantized_matmul(x, w, scales, biases, group_size, bits, _gpu_stream(stream))
    else:
        y = _ext.row_quantized_matmul(x, w, scales, biases, group_size, bits)
    return y if residual is None else y + residual


def fused_qk_norm_rope(qkv: mx.array, heads: int, kv_heads: int, q_norm: Optional[mx.array],
                       k_norm: Optional[mx.array], eps: float, inv_freq: mx.array,
                       rope_scale: float, offset, *, kv=None, stream: StreamLike = None):
    """(q [B, H, L, hd], k [B, Hk, L, hd]) from a fused q|k|v projection qkv [B, L, (H + 2 Hk) hd]:
    per-head RMSNorm (q_norm / k_norm, when given) and non-traditional RoPE at positions
    offset .. offset + L - 1 (offset an int or an int32 [1] array), in one launch.

    The CUDA face only (csrc/cuda/qk_norm_rope.cu; head sizes 64, 128, 256): it replaces four
    MLX launches of a decode step's layer. Returns None elsewhere, and the caller runs MLX's
    rms_norm and rope, which are per-row too. Each face is row-exact; their bits differ.

    kv = (k_cache, v_cache[, fence]), caches [B, Hk, cap, hd]: the key and value rows are
    written into those buffers IN PLACE at rows offset.. (the compiled decode step's cache
    write, two launches fewer per layer) and q alone is returned. MLX does not see that write:
    a later kernel queued in the same CUDA graph that reads the buffers is ordered after it only
    if it takes an array produced after it (the attention takes q); the fence, an array the
    kernel never reads, orders the write after the kernel that produced it (the previous step's
    attention: dense.StepCache.in_place)."""
    if backend_face(stream) != "cuda" or qkv.ndim != 3:
        return None
    from . import _cuda
    hd = qkv.shape[-1] // (heads + 2 * kv_heads)
    if hd not in _cuda.QK_HEAD_DIMS or qkv.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return None
    if q_norm is not None and not (q_norm.dtype == k_norm.dtype == qkv.dtype):
        return None
    offset = check_fused_qk(qkv, heads, kv_heads, q_norm, k_norm, inv_freq, offset, kv)
    return _cuda.qk_norm_rope(qkv, heads, kv_heads, q_norm, k_norm, eps, inv_freq, rope_scale,
                              offset, _gpu_stream(stream), kv=kv)


def check_fused_qk(qkv: mx.array, heads: int, kv_heads: int, q_norm, k_norm, inv_freq: mx.array,
                   offset, kv=None) -> mx.array:
    """fused_qk_norm_rope's arguments checked (ValueError) before its CUDA launch, which reads
    them unchecked: qkv [B, L, (H + 2 Hk) hd], norms [hd] (both or neither), inv_freq float32
    [hd / 2], the kv buffers [B, Hk, cap, hd] of qkv's dtype, and offset an integer (rows offset
    .. offset + L - 1 in int32; the rows past a kv buffer's capacity are not written) or an
    integer [1] array. Returns the offset as an int32 [1] array. Face-independent, so the CPU
    suite tests it (tests/test_kernels.py)."""
    heads, kv_heads = as_index(heads, "fused_qk_norm_rope: heads"), as_index(
        kv_heads, "fused_qk_norm_rope: kv_heads")
    if qkv.ndim != 3 or heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"fused_qk_norm_rope: qkv [B, L, C] and heads a multiple of kv_heads, got "
                         f"shape {qkv.shape}, heads {heads}, kv_heads {kv_heads}")
    B, L, C = qkv.shape
    hd = C // (heads + 2 * kv_heads)
    if hd == 0 or hd % 2 or hd * (heads + 2 * kv_heads) != C:
        raise ValueError(f"fused_qk_norm_rope: qkv's last axis {C} is not (heads + 2 kv_heads) x "
                         f"an even head size")
    if (q_norm is None) != (k_norm is None) or any(
            n is not None and tuple(n.shape) != (hd,) for n in (q_norm, k_norm)):
        raise ValueError(f"fused_qk_norm_rope: q_norm and k_norm must both be [{hd}] or both None")
    if inv_freq.dtype != mx.float32 or tuple(inv_freq.shape) != (hd // 2,):
        raise ValueError(f"fused_qk_norm_rope: inv_freq must be float32 [{hd // 2}], got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")
    if kv is not None:
        if len(kv) not in (2, 3):
            raise ValueError("fused_qk_norm_rope: kv must be (k_cache, v_cache[, fence])")
        kc, vc = kv[0], kv[1]
        if kc.ndim != 4 or tuple(kc.shape) != tuple(vc.shape) or tuple(kc.shape[:2]) != (B, kv_heads) \
                or kc.shape[3] != hd or not (kc.dtype == vc.dtype == qkv.dtype):
            raise ValueError(f"fused_qk_norm_rope: kv buffers must be [{B}, {kv_heads}, cap, {hd}] "
                             f"of {qkv.dtype}, got {kc.dtype} {tuple(kc.shape)} and {vc.dtype} "
                             f"{tuple(vc.shape)}")
    # (rows past a kv buffer's capacity are not written: the bound is int32's)
    return offset_array(offset, L, 2**31 - 1, "fused_qk_norm_rope")


def _empty(shape, dtype) -> mx.array:
    """The result of a call with no row (or no column): nothing is launched on any face (a GPU
    grid of 0 threads is no launch: CUDA refuses it, and MLX would hand Metal a threadgroup of 0
    threads, tests/test_metal_faces.py)."""
    return mx.zeros(tuple(shape), dtype=dtype)


def row_matmul(x: mx.array, w: mx.array, *, stream: StreamLike = None) -> mx.array:
    """Row-exact ``x @ w.T`` with w [N, K] (float32 / bfloat16 / float16), in x's dtype promoted
    with w's (`promoted`)."""
    _check_k(x, "row_matmul")
    _check_dense(x, w, "row_matmul")
    x = promoted(x, w)
    if x.size == 0 or w.shape[0] == 0:
        return _empty((*x.shape[:-1], w.shape[0]), x.dtype)
    face = backend_face(stream)
    if face == "cuda":
        from . import _cuda
        return _cuda.matmul(x, w, _gpu_stream(stream))
    if face == "metal":
        from . import _metal
        return _metal.matmul(x, w, _gpu_stream(stream))
    return _ext.row_matmul(x, w)


def offset_array(offset, rows: int, limit: int, who: str) -> mx.array:
    """A kernel's offset as the int32 [1] array it reads: an integer with rows offset .. offset +
    rows - 1 within `limit` positions (a KV buffer's capacity), or an integer scalar array (the
    compiled step's, computed on the device: clipped to int32, never wrapped; its range is the
    kernel's to check). The one reader of offsets for row_attention, sparse_attention and
    fused_qk_norm_rope."""
    if isinstance(offset, mx.array):
        if offset.size != 1:
            raise ValueError(f"{who}: offset must be a scalar")
        return as_int32(offset if offset.shape == (1,) else offset.reshape(1), f"{who}: offset",
                        low=-2**31)
    offset = as_index(offset, f"{who}: offset")
    if offset < 0 or offset + rows > limit:
        raise ValueError(f"{who}: offset {offset}: rows {offset}..{offset + rows - 1} do not fit "
                         f"{limit} positions")
    # a fresh host array (MLX's managed memory on CUDA): the compiled decode step passes a
    # device array instead (KVCache.step_offset); one made per call by a GPU op was slower
    # (sparse_attention on the H200: 0.10 -> 0.23 ms at M = 1, 0.29 -> 0.37 ms at M = 64, 64k
    # keys; docs/benchmarks.md, "Sparse attention on the H200")
    return mx.array([offset], dtype=mx.int32)


def row_attention(q: mx.array, k: mx.array, v: mx.array, offset, scale: float, *,
                  stream: StreamLike = None) -> mx.array:
    """Row-exact causal GQA attention over KV buffers.

    q [B, Hq, M, D]; k, v [B, Hkv, cap, D] with the M new keys already written at
    offset..offset+M-1. Query row i sits at position offset+i and attends to keys
    0..offset+i. offset: int or int32 scalar array. Returns [B, Hq, M, D] in q's dtype promoted
    with k's and v's (`promoted`).
    Rows whose position falls outside the buffer come back NaN (an int offset is checked
    up front and raises instead).
    """
    check_attention_shapes(q, k, v, "row_attention")
    scale = check_scale(scale, "row_attention")
    off = offset_array(offset, q.shape[2], k.shape[2], "row_attention")
    q = promoted(q, k, v)
    if q.size == 0:
        return _empty(q.shape, q.dtype)
    face = backend_face(stream)
    if face == "cuda":
        from . import _cuda
        return _cuda.attention(q, k, v, off, float(scale), _gpu_stream(stream))
    if face == "metal":
        from . import _metal
        return _metal.attention(q, k, v, off, float(scale), _gpu_stream(stream))
    return _ext.row_attention(q, k, v, off, float(scale))


def check_expert_args(x_shape, w, scales, biases, indices_shape, group_size, bits, what: str) -> None:
    """The shapes every face of the routed-expert ops needs (the CPU primitive checks them too;
    checked here so that the GPU faces never read past a buffer): ValueError otherwise.
    x_shape: the activations' shape [..., K]; indices_shape: the expert ids' [..., k]."""
    x_shape, indices_shape = tuple(x_shape), tuple(indices_shape)
    if scales is not None:      # the bits and group size first, as _check_quantized: bits 7 was
        # reported as a column count, 4.0 reached nanobind's "incompatible function arguments"
        if type(bits) is not int or type(group_size) is not int:
            raise ValueError(f"{what}: bits and group_size must be integers, got {bits!r} / {group_size!r}")
        if bits not in QUANT_BITS or group_size not in GROUP_SIZES:
            raise ValueError(f"{what}: bits must be one of {QUANT_BITS} and group_size one of "
                             f"{GROUP_SIZES}, got {bits} / {group_size}")
    if w.ndim != 3 or (scales is None) != (biases is None):
        raise ValueError(f"{what}: w must be [E, N, K'] with scales and biases both given or "
                         f"both None, got w {w.shape}")
    if len(indices_shape) < 1 or indices_shape[:-1] != x_shape[:-1]:
        raise ValueError(f"{what}: indices {indices_shape} must be x's leading dims "
                         f"{x_shape[:-1]} plus k")
    if scales is not None and (tuple(scales.shape) != tuple(biases.shape)
                               or scales.shape[:2] != w.shape[:2]):
        raise ValueError(f"{what}: scales / biases {scales.shape} / {biases.shape} do not "
                         f"match w {w.shape}")
    K = w.shape[2] * 32 // bits if scales is not None and bits else w.shape[2]
    if x_shape[-1] != K:
        raise ValueError(f"{what}: x has {x_shape[-1]} columns, the experts take {K}")
    if scales is not None and (not group_size or scales.shape[2] * group_size != K):
        raise ValueError(f"{what}: scales {scales.shape} do not match group size {group_size} "
                         f"over {K} columns")


def row_expert_matmul(x: mx.array, w: mx.array, scales: Optional[mx.array],
                      biases: Optional[mx.array], indices: mx.array, group_size: int = 64,
                      bits: int = 4, *, stream: StreamLike = None) -> mx.array:
    """Row-exact routed-expert matmul (MoE decode): ``out[..., j, :] = x @ dequant(w[indices[..., j]]).T``.

    x [..., K] (float32 / bfloat16 / float16); indices [..., k] int32 with x's leading dims;
    w uint32 [E, N, K*bits/32] with scales / biases [E, N, K/group_size] (MLX affine, as
    mx.gather_qmm takes them), or scales = biases = None and a float w [E, N, K].
    Returns [..., k, N] in x's dtype promoted (`promoted`). Each (row, j) is the fixed-order dot product of
    row_quantized_matmul / row_matmul (bit-identical to it on that expert's weight): it
    depends on K only, never on the other rows or their experts. An index outside [0, E)
    gives a NaN row (CPU face).
    """
    indices = as_int32(indices, "row_expert_matmul: indices")
    _check_k(x, "row_expert_matmul")
    check_expert_args(x.shape, w, scales, biases, indices.shape, group_size, bits, "row_expert_matmul")
    x = promoted(x, scales, biases) if scales is not None else promoted(x, w)
    if x.size == 0 or indices.size == 0 or w.shape[1] == 0:
        return _empty((*x.shape[:-1], indices.shape[-1], w.shape[1]), x.dtype)
    face = backend_face(stream)
    if face == "cuda":
        from . import _cuda
        return _cuda.expert_matmul(x, w, scales, biases, indices, group_size, bits, _gpu_stream(stream))
    if face == "metal":
        return _metal_expert_matmul(x, w, scales, biases, indices, group_size, bits, _gpu_stream(stream))
    return _ext.row_expert_matmul(x, w, scales, biases, indices, group_size, bits)


def row_check_ops() -> dict[str, Callable]:
    """The row-exact ops by name, for callers that verify the contract at start-up."""
    return {
        "row_quantized_matmul": row_quantized_matmul,
        "row_matmul": row_matmul,
        "row_attention": row_attention,
    }


# Sparse (selected-key) attention, DeepSeek V3.2-style (kernels/sparse.py).
from .sparse import select_topk, sparse_attention, use_sparse  # noqa: E402
# the CUDA face's kernel compiles that a block of graph building needs, side by side at its end (_kcache)
from ._kcache import batched as compiles_batched  # noqa: E402,F401


@functools.lru_cache(maxsize=None)
def _metal_expert_kernel(quant: bool):
    from ._sources import sections
    name = "row_expert_qmm" if quant else "row_expert_mm"
    sec = sections("metal", "row_expert.metal")
    inputs = ["x", "w", "scales", "biases", "indices"] if quant else ["x", "w", "indices"]
    return mx.fast.metal_kernel(name=f"tf_{name}", input_names=inputs, output_names=["out"],
                                source=sec[name], header=sec["header"], ensure_row_contiguous=True)


def _metal_expert_matmul(x, w, scales, biases, indices, group_size, bits, stream):
    """Metal face of row_expert_matmul over metal/row_expert.metal, with the arithmetic of
    metal/row_ops.metal. Never compiled by Apple's compiler nor run on a GPU (no Apple GPU in this
    project); its tests run on the CPU emulation of tests/metal_emu (tests/test_metal_faces.py)."""
    quant = scales is not None
    E, N = w.shape[0], w.shape[1]
    K = x.shape[-1]
    if K % 32 != 0:   # the kernels take K in whole 32-element chunks (a tail was dropped)
        raise ValueError("row_expert_matmul (metal): K must be a multiple of 32")
    k = indices.shape[-1]
    x2, i2 = x.reshape(-1, K), indices.reshape(-1, k)
    R = x2.shape[0]
    kern = _metal_expert_kernel(quant)
    tmpl = [("T", x.dtype), ("K", K), ("N", N), ("E", E), ("TOPK", k)]
    tmpl += [("S", scales.dtype), ("GS", group_size), ("BITS", bits)] if quant else [("W", w.dtype)]
    args = [x2, w, scales, biases, i2] if quant else [x2, w, i2]
    out = kern(inputs=args, template=tmpl, grid=(32, N, R * k), threadgroup=(32, 1, 1),
               output_shapes=[(R, k, N)], output_dtypes=[x.dtype], stream=stream)[0]
    return out.reshape(*x.shape[:-1], k, N)
