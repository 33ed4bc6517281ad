"""row_attention's outputs over every path of row_attn_merge (E 1 / 8 / 16; one warp or groups side by
side; DC 32 or D), saved to an .npz, or two such files compared bit for bit: a change meant to keep the
merge's bits is run once on the sources before it (TENSORFOLD_CUDA_SOURCES) and once after.
  python3 bench/gpu_merge_bits.py OUT.npz | --compare A.npz B.npz"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from tensorfold import kernels as K
from tensorfold.kernels import _cuda


def dump(path):
    out = {}
    st = mx.default_stream(mx.gpu)
    _cuda.ATTN_MERGE_COLS_WIDE = None     # DC exactly as each entry says (32 or D)
    for (Hq, Hkv, D, dtype) in ((32, 8, 128, mx.bfloat16), (12, 4, 80, mx.float16)):
        for cap in (1000, 2000, 3 * 1024 + 300, 40000):      # MW 1, 2, 4, 16 with span partials
            mx.random.seed(cap + D)
            k = mx.random.normal((1, Hkv, cap, D)).astype(dtype)
            v = mx.random.normal((1, Hkv, cap, D)).astype(dtype)
            for M, off in ((1, cap - 1), (16, cap - 16), (3, min(1022, cap - 3))):
                q = mx.random.normal((1, Hq, M, D)).astype(dtype)
                for plan in ("span", "s4", "g4k", "wd4"):      # E 1 (4 / 16 warps), E 8, E 16
                    for dc in (32, None):
                        for pre in (1, 4):
                            _cuda.attn_impl, _cuda.ATTN_MERGE_COLS, _cuda.ATTN_MERGE_WARPS_PRE = plan, dc, pre
                            o = K.row_attention(q, k, v, off, D ** -0.5, stream=st)
                            out[f"{D}-{cap}-{M}-{off}-{plan}-{dc}-{pre}"] = np.array(o.view(mx.uint16))
    np.savez(path, **out)
    print(f"{len(out)} outputs to {path}")


def compare(a, b):
    x, y = np.load(a), np.load(b)
    bad = [n for n in x.files if not np.array_equal(x[n], y[n])]
    print(f"{len(x.files) - len(bad)} of {len(x.files)} outputs bit-identical" + (f"; differ: {bad[:8]}" if bad else ""))
    return not bad and x.files == y.files


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    dump(sys.argv[1])
