"""Host time per op of MLX's evaluation (on the H200: encoding each kernel into MLX's CUDA
graph and launching it), by op kind: a chain of N dependent ops of one kind is built, then
mx.async_eval's host time is divided by N. Medians over --reps chains; device time is not
included (the device runs behind the host). Run eagerly (not compiled), like the compiled
step's replay, which calls the same eval_gpu of each primitive.

    python3 bench/gpu_host_ops.py [--n 400] [--reps 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def text_chains(x):
    """One custom kernel (a copy) with kernel texts of three sizes: MLX's CustomKernel::eval_gpu
    hashes the whole text at every launch (std::hash: 1.4 us for 11 KB on the 2-core CI host), and
    our 4-bit GEMMs' texts are ~11 KB. The third keeps the 11 KB in a file that the text includes
    by its absolute path. Session 43 on the H200: NVRTC takes it, and it costs what the short text
    does (3.0 / 6.1 / 3.2 us a launch for include / 11 KB / 0.3 KB), so kernel bodies now live in
    files (kernels._sources, TENSORFOLD_CUDA_TEXT)."""
    import os
    import tempfile
    pad = "".join(f"#define TF_PAD_{i} {i}\n" for i in range(500))        # ~11 KB of text
    path = os.path.join(tempfile.mkdtemp(prefix="tf_text_"), "tf_pad.cuh")
    with open(path, "w") as f:
        f.write(pad)
    body = ("unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "if (i < 2048) out[i] = a[i];\n")

    def kern(name, header):
        k = mx.fast.cuda_kernel(name=name, input_names=["a"], output_names=["out"], source=body,
                                header=header)
        return lambda t: k(inputs=[t], grid=(t.shape[1], 1, 1), threadgroup=(256, 1, 1),
                           output_shapes=[t.shape], output_dtypes=[t.dtype])[0]
    return {
        "custom: copy, text ~0.3 KB": (x, kern("tf_text_small", "")),
        "custom: copy, text ~11 KB": (x, kern("tf_text_big", pad)),
        "custom: copy, text 11 KB by absolute #include": (x, kern("tf_text_incl", f'#include "{path}"\n')),
    }


def chains():
    from tensorfold import kernels as K
    from tensorfold.kernels import moe as KM
    x = mx.random.normal((1, 2048)).astype(mx.bfloat16)
    lg = mx.random.normal((1, 128))
    w = mx.random.normal((256, 2048)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, 64, 4)
    ew = mx.random.normal((16, 256, 2048)).astype(mx.bfloat16)
    eq = tuple(mx.quantize(ew, 64, 4)) + (64, 4)
    ed = tuple(mx.quantize(mx.random.normal((16, 2048, 256)).astype(mx.bfloat16), 64, 4)) + (64, 4)
    idx = mx.array([[1, 3, 5, 7, 9, 11, 13, 15]], dtype=mx.int32)
    sc = mx.full((1, 8), 0.125, mx.float32)
    norm = mx.ones((2048,), mx.bfloat16)
    sw = mx.compile(lambda a, c: a * mx.sigmoid(a) * c, shapeless=True)
    mx.eval(x, lg, wq, s, b, eq[:3], ed[:3], norm)

    def pad(y):       # back to x's shape without another kernel: a view
        return y.reshape(1, -1)[:, :2048] if y.size >= 2048 else y

    return {
        **text_chains(x),
        "add (binary)": (x, lambda t: t + x),
        "astype x2 (2 kernels)": (x, lambda t: t.astype(mx.float32).astype(mx.bfloat16)),
        "rms_norm": (x, lambda t: mx.fast.rms_norm(t, norm, 1e-6)),
        "compiled swiglu": (x, lambda t: sw(t, x)),
        "softmax [1,128]": (lg, lambda t: mx.softmax(t, axis=-1, precise=True)),
        "sum + subtract (2 kernels)": (lg, lambda t: t - mx.sum(t, axis=-1, keepdims=True)),
        "take_along_axis": (lg, lambda t: mx.take_along_axis(t, mx.zeros((1, 128), mx.int32), axis=-1)),
        "custom: row_quantized_matmul + concat (2 kernels)": (x, lambda t: pad(mx.concatenate([K.row_quantized_matmul(t, wq, s, b, 64, 4)] * 8, -1))),
        "custom: moe route + sum + add (3 kernels)": (lg, lambda t: KM.route(t, 8, True)[1].reshape(1, 8).sum() + t),
        "custom: expert_glu": (x, lambda t: KM.expert_glu(t, eq, eq, idx).reshape(1, -1)[:, :2048]),
        "custom: expert_sum + a copy of h (2 kernels)": (x, lambda t: KM.expert_sum(mx.broadcast_to(t[:, None, :256], (1, 8, 256)), ed, idx, sc, t)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", default="", help="run the chains whose name holds this text (e.g. 'text')")
    args = ap.parse_args()
    print(f"# host time per op, chains of {args.n}, median of {args.reps}; {mx.default_device()}")
    print("| op (one kernel unless said) | host us per chain link (async_eval) | graph build us per link |")
    print("|---|---:|---:|")
    for name, (x0, f) in chains().items():
        if args.only not in name:
            continue
        launch, build = [], []
        for r in range(args.reps + 1):
            mx.synchronize()
            t0 = time.perf_counter()
            t = x0
            for _ in range(args.n):
                t = f(t)
            t1 = time.perf_counter()
            mx.async_eval(t)
            t2 = time.perf_counter()
            mx.eval(t)
            if r:
                build.append((t1 - t0) / args.n * 1e6)
                launch.append((t2 - t1) / args.n * 1e6)
        print(f"| {name} | {statistics.median(launch):.1f} | {statistics.median(build):.1f} |", flush=True)


if __name__ == "__main__":
    main()
