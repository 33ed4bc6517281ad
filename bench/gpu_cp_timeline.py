"""Where a warp of the 4-bit GEMM spends its time: row_qmm_cp with per-warp clock stamps.

bench/gpu_cp_floor.py showed the kernel 2.6 µs longer than its copies alone on 12288 x 4096 at
one row, though its arithmetic alone is shorter than the copies. This script builds the shipped
text (gpu_cp_floor.variant_text, any of its variants) with stamps of the SM's cycle counter
(clock64) and of the global timer in each warp: at entry, after each chunk's stage wait, after
each chunk's arithmetic (pinned behind its accumulators), after the loop, and, in warp 0, after
the split-K reduction and store. It launches the kernel on cold caches (a 256 MB read first;
each launch's output checked against the package's call where the variant keeps the bits) and
prints, per chunk, the median and 90th percentile over warps of how long a warp waited for its
stage and how long its arithmetic took, where the warps of an SM start and end relative to the
SM's first start, and how long each SM runs after its last stage landed (the tail).

On the H200 (no ncu needed):  python3 bench/gpu_cp_timeline.py [SHAPE ...]   (default 12288x4096)
env: TL_VARIANT (default full), TL_ROWS (default 1), TL_REPS (default 5), TL_ONE (0: not the
one-row variant), TL_OPTS (a staging other than the default: cb4_ns3, xs1, as
gpu_cp_floor's options). Only a process's first launch has given a clean timeline on the H200 (later
ones waited ~100-300 µs for their first stage, after the L2 flush as a write and as a read
alike): run TL_REPS=1 several times (bench/gpu_run.sh s23e does).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np

import gpu_cp_floor as fl

# stamp slots of one warp
SM, G0, C0 = 0, 1, 2      # SM id, global timer at entry (ns), clock at entry
# then CPW wait stamps, CPW compute stamps, the loop's end, warp 0's end (clock), global timer at end

def timeline_text(variant: str) -> tuple[str, str]:
    header, body = fl.variant_text(variant)
    head = ("const int lane=threadIdx.x&31;\nconst int warp=threadIdx.x>>5;\n")
    assert body.count(head) == 1
    prologue = (head + "constexpr int TLS=2*CPW+6;\n"
                "const size_t TLB=((size_t)(blockIdx.y*gridDim.x+blockIdx.x)*SPLIT+warp)*TLS;\n"
                "if(lane==0){unsigned int sm;asm volatile(\"mov.u32 %0, %%smid;\":\"=r\"(sm));tl[TLB]=sm;"
                "asm volatile(\"mov.u64 %0, %%globaltimer;\":\"=l\"(tl[TLB+1]));"
                "asm volatile(\"mov.u64 %0, %%clock64;\":\"=l\"(tl[TLB+2]));}\n")
    body = body.replace(head, prologue)
    wait = "tf_cp_async_wait<NS-2>();\n__syncwarp();\n"
    assert body.count(wait) == 1
    body = body.replace(wait, wait + "if(lane==0)asm volatile(\"mov.u64 %0, %%clock64;\":\"=l\"(tl[TLB+3+ci]));\n")
    fin = body.index("tf_tc_finish<")
    end = body.rindex("}\n", 0, fin)           # the chunk loop's closing brace
    pin = ("asm volatile(\"\"::\"f\"(acc[0][0][0]),\"f\"(acc[NT-1][0][3]):\"memory\");\n"
           "if(lane==0)asm volatile(\"mov.u64 %0, %%clock64;\":\"=l\"(tl[TLB+3+CPW+ci]));\n")
    body = body[:end] + pin + body[end:]
    fin = body.index("tf_tc_finish<")
    loop_end = ("if(lane==0){asm volatile(\"mov.u64 %0, %%clock64;\":\"=l\"(tl[TLB+3+2*CPW]));"
                "asm volatile(\"mov.u64 %0, %%globaltimer;\":\"=l\"(tl[TLB+5+2*CPW]));}\n")
    body = body[:fin] + loop_end + body[fin:]
    body += "if(lane==0)asm volatile(\"mov.u64 %0, %%clock64;\":\"=l\"(tl[TLB+4+2*CPW]));\n"
    return header, body


def summarize(tl: np.ndarray, cpw: int, split: int) -> list[str]:
    """Lines of the report from the stamps [warps, 2 CPW + 6] of one launch (cycles / ns). Cycles
    become µs at the SM clock the two timers give (cycles / ns from entry to the loop's end,
    median over warps): under Nsight's unlocked clocks the H200 ran at ~1.7 GHz, not 1.98."""
    sm = tl[:, SM]
    c0 = tl[:, C0].astype(np.int64)
    waits = tl[:, 3:3 + cpw].astype(np.int64)
    comps = tl[:, 3 + cpw:3 + 2 * cpw].astype(np.int64)
    loop = tl[:, 3 + 2 * cpw].astype(np.int64)
    g0, g1 = tl[:, G0].astype(np.int64), tl[:, 5 + 2 * cpw].astype(np.int64)
    ok = g1 > g0
    ghz = float(np.median((loop - c0)[ok] / (g1 - g0)[ok])) if ok.any() else 1.98
    # per-SM origin: the SM's first entry
    base = np.zeros_like(c0)
    tails, spans = [], []
    for s in np.unique(sm):
        m = sm == s
        base[m] = c0[m].min()
        last_land = waits[m, -1].max()
        end = loop[m].max()
        tails.append((end - last_land) / ghz / 1000)
        spans.append((end - c0[m].min()) / ghz / 1000)
    us = lambda a: a / ghz / 1000.0   # noqa: E731
    q = lambda a: f"{np.median(a):6.2f} / {np.percentile(a, 90):6.2f}"   # noqa: E731
    out = [f"warps {len(tl)}, SMs {len(np.unique(sm))}, chunks a warp {cpw}, split {split}, "
           f"SM clock {ghz:.2f} GHz",
           "| what (µs, median / p90 over warps) | value |", "|---|---|",
           f"| entry after the SM's first entry | {q(us(c0 - base))} |",
           f"| chunk 0: entry -> stage landed | {q(us(waits[:, 0] - c0))} |"]
    for ci in range(cpw):
        if ci:
            out.append(f"| chunk {ci}: arithmetic {ci - 1} done -> stage landed (wait) | "
                       f"{q(us(waits[:, ci] - comps[:, ci - 1]))} |")
        out.append(f"| chunk {ci}: arithmetic | {q(us(comps[:, ci] - waits[:, ci]))} |")
    out += [f"| warp: entry -> loop done | {q(us(loop - c0))} |",
            f"| SM: first entry -> last loop done | {q(np.array(spans))} |",
            f"| SM: last stage landed -> last loop done (tail) | {q(np.array(tails))} |",
            f"| global: entries' spread over the GPU (ns timer) | {(g0.max() - g0.min()) / 1000:.2f} |",
            f"| global: first entry -> last loop done (ns timer) | {(g1.max() - g0.min()) / 1000:.2f} |"]
    return out


def run(shapes, variant: str, R: int, reps: int):
    from tensorfold.kernels import _cuda
    gpu = mx.default_stream(mx.gpu)
    flush = mx.zeros((64 * 1024 * 1024,), dtype=mx.float32)
    for N, K in shapes:
        wq, s, b, x16, res = fl.inputs(N, K)
        x = x16[:R]
        cb, ns, xe, nt, ur, pro, f2 = _cuda.cp_staging(N, K, 64, R > 8)
        o = {k[:2]: int(k[2:]) for k in os.environ.get("TL_OPTS", "").split("_") if k}
        assert set(o) <= {"cb", "ns", "xe", "xs", "c0"}, o
        cb, ns, xe = o.get("cb", cb), o.get("ns", ns), o.get("xe", xe)
        split = _cuda.tc_plan(N, K, 64, 4)[2]
        _, template, grid, tg, oshape, odtype = _cuda._qmm_cp_call(
            x.dtype, s.dtype, K, N, 64, R, False, cb, ns, xe, nt, split, None, ur, pro,
            int(os.environ["TL_ONE"]) if os.environ.get("TL_ONE") else None, o.get("xs"), o.get("c0"), f2)
        t = dict(template)
        smem = _cuda.cp_plan(N, K, 64, 4, cb, ns, nt, split, t["XS"])[3]
        cpw = K // split // (32 * cb)
        nwarps = grid[0] // 32 * grid[1]
        k = fl.kernel(variant, smem, timeline_text(variant), "tftl_", ("out", "tl"))
        ref = _cuda.quantized_matmul(x, wq, s, b, 64, 4, gpu)
        print(f"\n### {N} x {K}, {R} row(s), {variant}, staging {(cb, ns, xe, nt, ur, pro, f2)}, "
              f"ONE {t['ONE']}, XS {t['XS']}")
        runs = []
        for _ in range(reps):
            mx.eval(flush.sum())       # evict L2: a 256 MB read
            y, tl = k(inputs=[x, wq, s, b, res], template=template, grid=grid, threadgroup=tg,
                      output_shapes=oshape + [(nwarps * (2 * cpw + 6),)],
                      output_dtypes=odtype + [mx.uint64], stream=gpu)
            mx.eval(y, tl)
            if set(variant.split("+")) <= fl.EXACT:
                assert mx.array_equal(y, ref).item(), (N, K, R, variant)
            runs.append(np.array(tl).reshape(nwarps, 2 * cpw + 6))
        # the median launch by its global span
        spans = [int(t[:, 5 + 2 * cpw].max()) - int(t[:, G0].min()) for t in runs]
        mid = runs[spans.index(sorted(spans)[len(spans) // 2])]
        print("spans (µs):", " ".join(f"{v / 1000:.2f}" for v in spans))
        print("\n".join(summarize(mid, cpw, split)))


if __name__ == "__main__":
    shapes = [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:]] or [(12288, 4096)]
    run(shapes, os.environ.get("TL_VARIANT", "full"), int(os.environ.get("TL_ROWS", "1")),
        int(os.environ.get("TL_REPS", "5")))
