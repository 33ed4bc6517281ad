"""Metal faces of the row-exact kernels: mx.fast.metal_kernel over metal/row_ops.metal.

Never compiled by Apple's compiler nor run on a GPU (no Apple GPU available); CI runs them on
a CPU emulation of Metal (tests/metal_emu, tests/test_metal_faces.py); see docs/kernels.md.
Kernels are created lazily, only when an op is called on a Metal GPU stream.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ._sources import sections

_KERNELS = {
    "row_qmm": (["x", "w", "scales", "biases"], ["out"]),
    "row_mm": (["x", "w"], ["out"]),
    "row_attn": (["q", "k", "v", "offset", "scale_f"], ["out"]),
}


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    inputs, outputs = _KERNELS[name]
    sec = sections("metal", "row_ops.metal")
    return mx.fast.metal_kernel(
        name=f"tf_{name}", input_names=inputs, output_names=outputs,
        source=sec[name], header=sec["header"], ensure_row_contiguous=True)


def quantized_matmul(x, w, scales, biases, group_size, bits, stream):
    N = w.shape[0]
    Kd = w.shape[1] * 32 // bits
    lead = x.shape[:-1]
    x2 = x.reshape(-1, Kd)
    R = x2.shape[0]
    out = _kernel("row_qmm")(
        inputs=[x2, w, scales, biases],
        template=[("T", x.dtype), ("S", scales.dtype), ("K", Kd), ("N", N),
                  ("GS", group_size), ("BITS", bits)],
        grid=(32, N, -(-R // 16)), threadgroup=(32, 1, 1),
        output_shapes=[(R, N)], output_dtypes=[x.dtype], stream=stream)[0]
    return out.reshape(*lead, N)


def matmul(x, w, stream):
    N, Kd = w.shape
    if Kd % 32 != 0:
        raise ValueError("row_matmul (metal): K must be a multiple of 32")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, Kd)
    R = x2.shape[0]
    out = _kernel("row_mm")(
        inputs=[x2, w],
        template=[("T", x.dtype), ("W", w.dtype), ("K", Kd), ("N", N)],
        grid=(32, N, -(-R // 16)), threadgroup=(32, 1, 1),
        output_shapes=[(R, N)], output_dtypes=[x.dtype], stream=stream)[0]
    return out.reshape(*lead, N)


def attention(q, k, v, offset, scale, stream):
    B, HQ, M, D = q.shape
    return _kernel("row_attn")(
        inputs=[q, k, v, offset, mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("TK", k.dtype), ("D", D), ("HQ", HQ), ("HKV", k.shape[1])],
        grid=(32, B * HQ * M, 1), threadgroup=(32, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype], stream=stream)[0]
