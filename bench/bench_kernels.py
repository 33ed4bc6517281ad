"""Microbenchmarks: tensorfold's row-exact kernels vs MLX's own ops, M = 1, 2, 4, 8, 16.

pytest-benchmark mode (default device; on a CUDA machine that is the GPU):
    pytest bench/bench_kernels.py --benchmark-only [-k qmm]
    TF_BENCH_QUICK=1 pytest bench/bench_kernels.py ...   # smaller shapes (CPU)
Table mode (markdown: median us, GB/s, MLX/ours time ratio; CPU and, if present, GPU):
    python bench/bench_kernels.py --table [--quick] [--cpu-only | --gpu-only] [--full-cpu] [--ops qmm,mm,attn]
(the CPU part of the table uses the quick shapes unless --full-cpu)

Every timed call evaluates its result (mx.eval inside the timed function). Weights are
rotated over several copies so that the bytes touched per round exceed 60 MB (no L2 hits
on the GPU). Shapes are real model shapes: 4096x4096, 4096->12288, 12288->4096 and the
151936x4096 LM head; attention with 32 query / 8 KV heads, D=128 at 1k / 8k / 32k keys.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from tensorfold import kernels as K

MS = [1, 2, 4, 8, 16]
ROTATE_BYTES = 64 * 2**20

FULL_GEMM = [(4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]  # (N, K)
QUICK_GEMM = [(1024, 1024), (3072, 1024), (1024, 3072), (16384, 1024)]
FULL_KEYS = [1024, 8192, 32768]
QUICK_KEYS = [1024, 4096]


def quick() -> bool:
    return os.environ.get("TF_BENCH_QUICK", "0") not in ("", "0")


def gemm_shapes(q=None):
    return QUICK_GEMM if (quick() if q is None else q) else FULL_GEMM


def attn_keys(q=None):
    return QUICK_KEYS if (quick() if q is None else q) else FULL_KEYS


# ---------------------------------------------------------------- cases

class Case:
    """Builds inputs once; `ours()` / `theirs()` each run one evaluated call on the next
    weight copy."""

    def __init__(self, op, shape, M, dtype=mx.bfloat16):
        self.op, self.shape, self.M, self.dtype = op, shape, M, dtype
        rng = np.random.default_rng(0)
        self.i = 0
        if op in ("qmm", "mm"):
            N, Kd = shape
            if op == "qmm":
                per = N * Kd // 2 + 2 * N * (Kd // 64) * 2
            else:
                per = N * Kd * 2
            self.copies = max(2, math.ceil(ROTATE_BYTES / per)) if on_gpu() else 1
            self.weights = []
            for c in range(self.copies):
                w = mx.random.normal((N, Kd), key=mx.random.key(c)) * 0.02
                if op == "qmm":
                    wq, s, b = mx.quantize(w, group_size=64, bits=4)
                    self.weights.append((wq, s.astype(dtype), b.astype(dtype)))
                else:
                    self.weights.append((w.astype(dtype),))
                mx.eval(self.weights[-1])
            self.x = mx.array(rng.standard_normal((M, Kd)).astype(np.float32)).astype(dtype)
            self.bytes = per + M * Kd * 2 + M * N * 2
        else:  # attn
            L = shape
            B, Hq, Hkv, D = 1, 32, 8, 128
            per = 2 * B * Hkv * L * D * 2
            self.copies = max(2, math.ceil(ROTATE_BYTES / per)) if on_gpu() else 1
            self.weights = []
            for c in range(self.copies):
                kv = mx.random.normal((2, B, Hkv, L, D), key=mx.random.key(c)).astype(dtype)
                mx.eval(kv)
                self.weights.append((kv[0], kv[1]))
            self.q = mx.array(rng.standard_normal((B, Hq, M, D)).astype(np.float32)).astype(dtype)
            self.offset = L - M
            self.scale = D ** -0.5
            self.bytes = per
        mx.eval(self.x if op != "attn" else self.q)

    def _next(self):
        w = self.weights[self.i % self.copies]
        self.i += 1
        return w

    def _ours(self):
        w = self._next()
        if self.op == "qmm":
            return K.row_quantized_matmul(self.x, *w, 64, 4)
        if self.op == "mm":
            return K.row_matmul(self.x, *w)
        return K.row_attention(self.q, w[0], w[1], self.offset, self.scale)

    def _theirs(self):
        w = self._next()
        if self.op == "qmm":
            return mx.quantized_matmul(self.x, *w, transpose=True, group_size=64, bits=4)
        if self.op == "mm":
            return self.x @ w[0].T
        return mx.fast.scaled_dot_product_attention(
            self.q, w[0], w[1], scale=self.scale, mask="causal" if self.M > 1 else None)

    def ours(self):
        mx.eval(self._ours())

    def theirs(self):
        mx.eval(self._theirs())

    # Stream mode (GPU): STREAM calls on rotating weight copies, all evaluated by one
    # mx.eval; time / STREAM is the per-call device time with launch latency overlapped,
    # as inside a model's forward. Every result is evaluated.
    STREAM = 24

    def ours_stream(self):
        mx.eval([self._ours() for _ in range(self.STREAM)])

    def theirs_stream(self):
        mx.eval([self._theirs() for _ in range(self.STREAM)])


def on_gpu() -> bool:
    return mx.default_device().type == mx.gpu


# ---------------------------------------------------------------- pytest-benchmark

def _params():
    out = []
    for op in ("qmm", "mm"):
        for shape in gemm_shapes():
            for M in MS:
                out.append((op, shape, M))
    for L in attn_keys():
        for M in MS:
            out.append(("attn", L, M))
    return out


try:
    import pytest

    _P = _params()
    _IDS = [f"{op}-{'x'.join(map(str, s)) if isinstance(s, tuple) else s}-M{M}" for op, s, M in _P]

    @pytest.fixture(scope="module")
    def _cases():
        return {}

    @pytest.mark.parametrize("impl", ["tensorfold", "mlx"])
    @pytest.mark.parametrize("op,shape,M", _P, ids=_IDS)
    def test_bench(benchmark, _cases, op, shape, M, impl):
        key = (op, shape, M)
        if key not in _cases:
            _cases.clear()  # keep one case's weights alive at a time
            _cases[key] = Case(op, shape, M)
        case = _cases[key]
        fn = case.ours if impl == "tensorfold" else case.theirs
        benchmark.group = f"{op} {shape} M={M}"
        slow_mlx_cpu = impl == "mlx" and not on_gpu() and op == "qmm"
        if slow_mlx_cpu:  # MLX's CPU quantized matmul is ~1 s per call at full shapes
            benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=1)
        else:
            benchmark(fn)
except ImportError:  # table mode without pytest installed
    pass


# ---------------------------------------------------------------- table mode

def _median_us(fn, min_time=0.3, max_reps=50, min_reps=3):
    fn()  # warm up (JIT, allocator)
    ts = []
    t_start = time.perf_counter()
    while len(ts) < max_reps and (len(ts) < min_reps or time.perf_counter() - t_start < min_time):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def table(ops, q, device_names, full_cpu=False):
    lines = []
    gpu_q = q
    for dev_name in device_names:
        q = gpu_q if dev_name == "gpu" else (gpu_q or not full_cpu)
        dev = mx.cpu if dev_name == "cpu" else mx.gpu
        mx.set_default_device(dev)
        face = K.backend_face()
        lines.append(f"\n### {dev_name} (tensorfold face: {face})\n")
        if dev_name == "gpu":
            lines.append(f"(stream mode: {Case.STREAM} calls on rotating weights per mx.eval, "
                         "us per call; last column: one evaluated call each, ours / MLX us)\n")
            lines.append("| op | shape | M | tensorfold us | GB/s | MLX us | MLX/tensorfold "
                         "| single call us |")
            lines.append("|---|---|---|---|---|---|---|---|")
        else:
            lines.append("| op | shape | M | tensorfold us | GB/s | MLX us | MLX/tensorfold |")
            lines.append("|---|---|---|---|---|---|---|")
        for op in ops:
            shapes = attn_keys(q) if op == "attn" else gemm_shapes(q)
            for shape in shapes:
                for M in MS:
                    case = Case(op, shape, M)
                    sh = "x".join(map(str, shape)) if isinstance(shape, tuple) else f"{shape} keys"
                    if dev_name == "gpu":
                        n = Case.STREAM
                        t_ours = _median_us(case.ours_stream, max_reps=30) / n
                        t_mlx = _median_us(case.theirs_stream, max_reps=30) / n
                        t1_ours = _median_us(case.ours)
                        t1_mlx = _median_us(case.theirs)
                        gbs = case.bytes / (t_ours * 1e-6) / 1e9
                        lines.append(f"| {op} | {sh} | {M} | {t_ours:.1f} | {gbs:.0f} | "
                                     f"{t_mlx:.1f} | {t_mlx / t_ours:.2f} | "
                                     f"{t1_ours:.0f} / {t1_mlx:.0f} |")
                    else:
                        t_ours = _median_us(case.ours)
                        max_reps = 3 if (dev_name == "cpu" and op == "qmm") else 50
                        t_mlx = _median_us(case.theirs, min_time=0.2, max_reps=max_reps,
                                           min_reps=1)
                        gbs = case.bytes / (t_ours * 1e-6) / 1e9
                        lines.append(f"| {op} | {sh} | {M} | {t_ours:.0f} | {gbs:.1f} | "
                                     f"{t_mlx:.0f} | {t_mlx / t_ours:.2f} |")
                    print(lines[-1], file=sys.stderr, flush=True)
                    del case
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", action="store_true", help="print a markdown table")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (also TF_BENCH_QUICK=1)")
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--gpu-only", action="store_true")
    ap.add_argument("--full-cpu", action="store_true",
                    help="full shapes on CPU too (MLX's CPU quantized matmul takes minutes)")
    ap.add_argument("--ops", default="qmm,mm,attn")
    args = ap.parse_args()
    if not args.table:
        ap.print_help()
        return
    devices = [] if args.gpu_only else ["cpu"]
    gpu = (hasattr(mx, "cuda") and mx.cuda.is_available()) or mx.metal.is_available()
    if gpu and not args.cpu_only:
        devices.append("gpu")
    print(table(args.ops.split(","), args.quick or quick(), devices, args.full_cpu))


if __name__ == "__main__":
    main()
