"""Host cost of one op call: graph building (Python + MLX, no evaluation) and evaluation.

    python3 bench/gpu_overhead.py          # on the GPU machine (or CPU: face "cpu")

For each op: build 400 lazy calls on two small weights (median of 5 rounds, us per call),
then mx.eval them all (us per call, host + device). Small shapes, so device time is tiny
and what is measured is the per-call overhead a decode step pays for every op it builds.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from tensorfold import kernels as K


def probe(name, fn, n=400, rounds=5):
    fn()
    mx.eval(fn())
    build, ev = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ys = [fn() for _ in range(n)]
        t1 = time.perf_counter()
        mx.eval(ys)
        t2 = time.perf_counter()
        build.append((t1 - t0) / n * 1e6)
        ev.append((t2 - t1) / n * 1e6)
    print(f"| {name} | {statistics.median(build):.1f} | {statistics.median(ev):.1f} |", flush=True)


def main():
    print(f"face {K.backend_face()}, mlx {mx.__version__}")
    print("| op (M=1, 512x512) | build us/call | eval us/call |")
    print("|---|---|---|")
    w = mx.random.normal((512, 512)) * 0.02
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    wb = w.astype(mx.bfloat16)
    x = mx.random.normal((1, 512)).astype(mx.bfloat16)
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    kv = mx.random.normal((1, 2, 256, 128)).astype(mx.bfloat16)
    off = mx.array([200], dtype=mx.int32)
    mx.eval(wq, s, b, wb, x, q, kv, off)
    probe("mlx quantized_matmul", lambda: mx.quantized_matmul(x, wq, s, b, transpose=True,
                                                             group_size=64, bits=4))
    probe("ours row_quantized_matmul", lambda: K.row_quantized_matmul(x, wq, s, b, 64, 4))
    probe("mlx matmul", lambda: x @ wb.T)
    probe("ours row_matmul", lambda: K.row_matmul(x, wb))
    probe("mlx sdpa", lambda: mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.1))
    probe("ours row_attention", lambda: K.row_attention(q, kv, kv, 200, 0.1))
    probe("mlx add", lambda: x + x)
    probe("mlx rms_norm", lambda: mx.fast.rms_norm(x, wb[0], 1e-5))


if __name__ == "__main__":
    main()
