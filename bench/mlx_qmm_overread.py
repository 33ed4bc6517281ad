"""Reproducer for MLX's CUDA quantized-matmul over-read (session 45): one mx.quantized_matmul of
M x K by a 4-bit N x K weight, its output evaluated. Run it under compute-sanitizer:

    compute-sanitizer --tool memcheck python3 bench/mlx_qmm_overread.py M N K [group_size] [bits]

From 8 rows, where N % 128 == 0 and K % max(64, group size) == 0, MLX takes qmm_sm80_kernel
(mlx/backend/cuda/device/qmm_sm80.cuh), whose mainloop fetches K tile 2 before it clamps the tile
index: reads past x and the weight where K <= 2 x max(64, group size). Each case wants a process
of its own (a memcheck error ends the CUDA context). bench/gpu_run.sh qmm_overread sweeps K."""
import sys

import mlx.core as mx
import numpy as np


def main(argv):
    M, N, K = (int(a) for a in argv[1:4])
    gs = int(argv[4]) if len(argv) > 4 else 64
    bits = int(argv[5]) if len(argv) > 5 else 4
    mx.set_cache_limit(0)      # freed buffers go back to CUDA: reads past them are seen
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((N, K), dtype=np.float32)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((M, K), dtype=np.float32)).astype(mx.bfloat16)
    mx.eval(wq, s, b, x)
    y = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    ref = x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=gs, bits=bits).astype(mx.float32).T
    err = mx.max(mx.abs(y.astype(mx.float32) - ref)).item() / (mx.max(mx.abs(ref)).item() + 1e-30)
    print(f"M={M} N={N} K={K} gs={gs} bits={bits} device={mx.default_device()} rel_err={err:.3g}")


if __name__ == "__main__":
    main(sys.argv)
