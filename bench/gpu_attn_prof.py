"""One row_attention call (after one warm-up call) at a given key count and M, for Nsight
Compute: `ncu --kernel-name regex:row_attn --launch-skip 2 --launch-count 2 --section ...
python3 bench/gpu_attn_prof.py --keys 32768 --rows 1` (32 query / 8 KV heads, D = 128, bf16);
--impl names a launch plan (`_cuda.attn_impl`, e.g. wg4), else the default's."""
import argparse

import mlx.core as mx

from tensorfold import kernels as K
from tensorfold.kernels import _cuda


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--impl", default=None)
    a = ap.parse_args()
    _cuda.attn_impl = a.impl
    L, M = a.keys, a.rows
    k = mx.random.normal((1, 8, L, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, L, 128)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, M, 128)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    for _ in range(2):
        mx.eval(K.row_attention(q, k, v, L - M, 128 ** -0.5))
    mx.synchronize()


if __name__ == "__main__":
    main()
