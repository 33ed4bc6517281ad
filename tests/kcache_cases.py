"""Every decode kernel family once, for tests/test_kcache.py's CUDA checks (run in a process of its own:
MLX keeps each module it loaded or compiled for the life of the process).

    python tests/kcache_cases.py OUT.npz     # the outputs' bits, and _kcache.stats as "stats"
"""
from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np


def cases():
    from tensorfold import kernels as K
    rng = np.random.default_rng(48)

    def rand(shape, dtype, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    st = mx.default_stream(mx.gpu)
    out = []
    for N, Kd, gs, b in ((4096, 4096, 64, 4), (1152, 384, 64, 8), (72, 256, 32, 4)):
        wq, s, bb = mx.quantize(rand((N, Kd), mx.float32, 0.05), group_size=gs, bits=b)
        s, bb, x = s.astype(mx.bfloat16), bb.astype(mx.bfloat16), rand((16, Kd), mx.bfloat16)
        for M in (1, 16):
            out.append(lambda wq=wq, s=s, bb=bb, x=x[:M], gs=gs, b=b:
                       K.row_quantized_matmul(x, wq, s, bb, gs, b, stream=st))
    w, x = rand((4096, 4096), mx.bfloat16, 0.05), rand((16, 4096), mx.bfloat16)
    for M in (1, 16):
        out.append(lambda w=w, x=x[:M]: K.row_matmul(x, w, stream=st))
    for Hq, Hkv, D, dtype in ((32, 8, 128, mx.bfloat16), (8, 2, 64, mx.float32)):
        k, v = rand((1, Hkv, 5000, D), dtype), rand((1, Hkv, 5000, D), dtype)
        for M, off in ((1, 4095), (16, 4984)):
            q = rand((1, Hq, M, D), dtype)
            out.append(lambda q=q, k=k, v=v, off=off, D=D: K.row_attention(q, k, v, off, D ** -0.5, stream=st))
    qkv = rand((1, 16, 12 * 128), mx.bfloat16, 2.0)
    qn, kn = rand((128,), mx.bfloat16), rand((128,), mx.bfloat16)
    inv = mx.array([10000.0 ** (-i / 128) for i in range(0, 128, 2)], dtype=mx.float32)
    out.append(lambda: mx.concatenate(
        [t.reshape(-1) for t in K.fused_qk_norm_rope(qkv, 8, 2, qn, kn, 1e-6, inv, 1.0, 1000)]))
    E, N, Kd = 8, 256, 512
    wq, s, bb = mx.quantize(rand((E * N, Kd), mx.float32, 0.05), group_size=64, bits=4)
    wq, s, bb = wq.reshape(E, N, -1), s.astype(mx.bfloat16).reshape(E, N, -1), bb.astype(mx.bfloat16).reshape(E, N, -1)
    xe, ind = rand((16, Kd), mx.bfloat16), mx.array(np.arange(48).reshape(16, 3) % E, dtype=mx.int32)
    out.append(lambda: K.row_expert_matmul(xe, wq, s, bb, ind, 64, 4, stream=st))
    q, k, v = rand((1, 8, 4, 128), mx.bfloat16), rand((1, 2, 600, 128), mx.bfloat16), rand((1, 2, 600, 128), mx.bfloat16)
    sel = np.stack([np.sort(np.random.default_rng(i).choice(500 + i + 1, 64, replace=False)) for i in range(4)])
    sind = mx.array(sel[None].astype(np.int32))
    out.append(lambda: K.sparse_attention(q, k, v, sind, 500, 128 ** -0.5, stream=st))
    return out


def main(path: str) -> None:
    from tensorfold.kernels import _kcache
    res = {}
    for i, f in enumerate(cases()):
        y = f()
        mx.eval(y)
        a = np.array(y.astype(mx.float32) if y.dtype == mx.bfloat16 else y)
        res[f"c{i}"] = a.view(np.uint32 if a.dtype == np.float32 else np.uint16) if a.dtype.kind == "f" else a
    np.savez(path, stats=np.array(json.dumps(_kcache.stats)), **res)


if __name__ == "__main__":
    main(sys.argv[1])
