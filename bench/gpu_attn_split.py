"""Where row_attn_tc's time goes at short contexts (issue 4): variants of the kernel text that
leave stages out, and a per-block timeline read from %globaltimer.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name regex:"tfv_|tfmark" \\
        python3 bench/gpu_attn_split.py > split.csv && python3 bench/gpu_attn_split.py --report split.csv
    python3 bench/gpu_attn_split.py --trace      # per-block start / load / end times (no ncu)

32 query / 8 KV heads, D = 128, bf16 (the 8B shape). The variants are for timing only: their
results are garbage by design."""
from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict

import mlx.core as mx

from tensorfold.kernels import _cuda
from tensorfold.kernels._sources import sections

GT = ("__device__ __forceinline__ unsigned long long tfv_gt() { unsigned long long t; "
      "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); return t; }\n"
      "__device__ __forceinline__ unsigned int tfv_smid() { unsigned int s; "
      "asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s)); return s; }\n")
WAIT = "tf_cp_async_wait_all();"
EXIT = "if (s0 > maxp) return;"
CP = ("tf_cp_async16(ks + j * KST + x, k + src);\ntf_cp_async16(vs + j * KST + x, v + src);")


def variants():
    body = sections("cuda", "row_attention.cu")["row_attn_tc"]
    for s in (WAIT, EXIT, CP):
        assert body.count(s) == 1, s
    return {
        "full": body,
        "empty": body.replace(EXIT, "if (s0 > maxp || true) return;"),
        "load": body.replace(WAIT, WAIT + "\nreturn;"),
        "noload": body.replace(CP, ""),
        # the two scalars read as literals (is reading them from MLX's managed memory slow?)
        "const": body.replace("offset[0]", "OFFC").replace("scale_f[0]", "0.08838834764831845f"),
    }


def traced():
    body = sections("cuda", "row_attention.cu")["row_attn_tc"]
    slot = "trace[((size_t)blockIdx.y * gridDim.x + blockIdx.x) * 4 + %d]"
    body = body.replace("const int M = q_shape[2];",
                        "const unsigned long long tfv_t0 = tfv_gt();\nconst int M = q_shape[2];", 1)
    body = body.replace(EXIT, EXIT + "\nif (threadIdx.x == 0) " + slot % 0 + " = tfv_t0;", 1)
    body = body.replace(WAIT, WAIT + "\nif (threadIdx.x == 0) " + slot % 1 + " = tfv_gt();", 1)
    body += ("\n__syncthreads();\nif (threadIdx.x == 0) { " + slot % 2 + " = tfv_gt(); "
             + slot % 3 + " = tfv_smid(); }\n")
    return body


def kernel(name, body, outputs=("part",)):
    header = GT + sections("cuda", "row_attention.cu")["header"]
    return mx.fast.cuda_kernel(name=name, input_names=["q", "k", "v", "offset", "scale_f"],
                               output_names=list(outputs), source=body, header=header,
                               ensure_row_contiguous=True,
                               shared_memory=_cuda.attn_tc_smem(128, mx.bfloat16, mx.bfloat16,
                                                                mx.bfloat16))


def scalars(off, dev):
    """offset and scale arrays: host-made [1] arrays (MLX puts arrays made from host data, and
    every array of <= 8 bytes, in CUDA managed memory), or [4] arrays computed on the GPU
    (device memory)."""
    if not dev:
        return mx.array([off], mx.int32), mx.array([128 ** -0.5], mx.float32)
    o = mx.array([off, 0, 0, 0], mx.int32) + 0
    s = mx.array([128 ** -0.5, 0, 0, 0], mx.float32) * 1
    mx.eval(o, s)
    return o, s


def call(kern, q, k, v, off, outputs=1, dev=False, consts=False):
    B, HQ, M, D = q.shape
    HKV, cap = k.shape[1], k.shape[2]
    nspan = -(-cap // 64)
    shapes = [(B * HQ * M, nspan, D + 2)] + ([(nspan * B * HKV * 4,)] if outputs == 2 else [])
    dts = [mx.float32] + ([mx.uint64] if outputs == 2 else [])
    o, sc = scalars(off, dev)
    tmpl = [("T", mx.bfloat16), ("D", 128), ("HQ", 32), ("HKV", 8)] + ([("OFFC", off)] if consts else [])
    return kern(inputs=[q, k, v, o, sc], template=tmpl,
                grid=(nspan * 128, B * HKV, 1), threadgroup=(128, 1, 1),
                output_shapes=shapes, output_dtypes=dts, init_value=0 if outputs == 2 else None)


def marker(tag):
    k = mx.fast.cuda_kernel(name=f"tfmark_{tag}", input_names=["a"], output_names=["o"],
                            source="o[0] = a[0];")
    mx.eval(k(inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
              output_shapes=[(1,)], output_dtypes=[mx.float32])[0])


def inputs(L, M):
    k = mx.random.normal((1, 8, L, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, L, 128)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, M, 128)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    return q, k, v


def run_variants(keys, rows):
    from tensorfold import kernels as K
    ks = {n: kernel(f"tfv_{n}", b) for n, b in variants().items()}
    for L in keys:
        for M in rows:
            q, k, v = inputs(L, M)
            for n, kern in ks.items():
                for dev in (False, True):
                    marker(f"L{L}_M{M}_{n}{'_dev' if dev else ''}")
                    for _ in range(3):
                        mx.eval(call(kern, q, k, v, L - M, dev=dev, consts=n == "const")[0])
            marker(f"L{L}_M{M}_api")
            for _ in range(3):
                mx.eval(K.row_attention(q, k, v, L - M, 128 ** -0.5))
            marker(f"L{L}_M{M}_api_dev")
            for _ in range(3):
                mx.eval(K.row_attention(q, k, v, scalars(L - M, True)[0][:1], 128 ** -0.5))
            marker(f"L{L}_M{M}_sdpa")
            for _ in range(3):
                mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5))
    mx.synchronize()


def report(path):
    rows = [r for r in csv.DictReader(l for l in open(path) if l.startswith('"'))]
    tag, acc = None, defaultdict(lambda: defaultdict(list))
    for r in rows:
        name = r.get("Kernel Name") or ""
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1e3 if r["Metric Unit"] in ("ns", "nsecond") else (v if r["Metric Unit"] in ("us", "usecond") else v * 1e3)
        name = name.split("(")[0].split("<")[0].replace("mlx::", "").replace("custom_kernel_", "")
        if name.startswith("tfmark_"):
            tag = name[len("tfmark_"):]
            continue
        if tag:
            acc[tag][name[:40]].append(us)
    print("| case | kernel | launches | median us |")
    print("|---|---|---|---|")
    for t, ks in acc.items():
        for n, xs in ks.items():
            print(f"| {t} | {n} | {len(xs)} | {statistics.median(xs):.1f} |")


def trace(L, M, dev):
    q, k, v = inputs(L, M)
    kern = kernel("tfv_trace", traced(), outputs=("part", "trace"))
    for _ in range(5):
        part, tr = call(kern, q, k, v, L - M, outputs=2, dev=dev)
        mx.eval(part, tr)
    t = tr.reshape(-1, 4).tolist()
    t = [x for x in t if x[0]]
    base = min(x[0] for x in t)
    start = sorted((x[0] - base) / 1e3 for x in t)
    load = [(x[1] - x[0]) / 1e3 for x in t]
    comp = [(x[2] - x[1]) / 1e3 for x in t]
    end = max(x[2] - base for x in t) / 1e3
    per_sm = defaultdict(int)
    for x in t:
        per_sm[x[3]] += 1
    q4 = lambda xs: [round(statistics.quantiles(xs, n=4)[i], 2) for i in range(3)] + [round(max(xs), 2)]
    print(f"L={L} M={M} {'device' if dev else 'managed'} scalars: {len(t)} blocks on {len(per_sm)} SMs (max {max(per_sm.values())} per SM); "
          f"last block ends {end:.2f} us after the first starts")
    print(f"  start offsets us (q1, median, q3, max): {q4(start)}")
    print(f"  load (start -> cp.async done) us: {q4(load)}")
    print(f"  compute (-> end) us: {q4(comp)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--report")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--keys", default="2048,32768")
    ap.add_argument("--rows", default="1,4")
    a = ap.parse_args()
    if a.report:
        return report(a.report)
    keys = [int(x) for x in a.keys.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    if a.trace:
        for L in keys:
            for M in rows:
                for dev in (False, True):
                    trace(L, M, dev)
        return
    run_variants(keys, rows)


if __name__ == "__main__":
    main()
