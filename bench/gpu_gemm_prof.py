"""One row_quantized_matmul call per shape (after a warm-up call), for Nsight Compute:
`ncu --kernel-name regex:row_qmm_tc --launch-skip 1 --launch-count 1 --section ... python3
bench/gpu_gemm_prof.py --n 24576 --k 4096 --rows 1` (4-bit, group 64, bf16)."""
import argparse

import mlx.core as mx

from tensorfold import kernels as K


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=24576)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    a = ap.parse_args()
    w = mx.random.normal((a.n, a.k)) * 0.02
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    x = (mx.random.normal((a.rows, a.k)) * 0.5).astype(mx.bfloat16)
    mx.eval(wq, s, b, x)
    for _ in range(2):
        mx.eval(K.row_quantized_matmul(x, wq, s, b, 64, 4))
    mx.synchronize()


if __name__ == "__main__":
    main()
