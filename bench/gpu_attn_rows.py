"""Device time of row_attention against MLX's sdpa at every row count (issue 3: attention at
1k / 8k / 32k keys, M = 1, 2, 4, 8, 16), measured by Nsight Compute.

On the H200 (after building the project there):
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 bench/gpu_attn_rows.py > attn.csv
    python3 bench/gpu_attn_rows.py --report attn.csv

32 query / 8 KV heads, D = 128, bf16 (the 8B's attention). The M rows sit at the end of the
cache (offset = keys - M), the offset a device array as in the compiled step. Every kernel runs
alone with cold caches (ncu flushes them before each replay). Between cases a marker kernel names
the case. Ours is one call's kernels summed (partials + merge); MLX's is its sdpa (causal past one
row) summed the same way. ATTN_IMPL=a,b (env) times other row_attention launch plans where the
kernels module offers them (`_cuda.attn_impl`: "span", "g1" .. "g8"), each against the default's output bit for bit;
a suffix c<DC> also sets the merge's columns a block (`_cuda.ATTN_MERGE_COLS`, the wide-columns rule off; cD a whole
row): "c64", "s4c128", "c32" (the columns before session 41 everywhere).

ATTN_CACHE=step (with `ncu --cache-control none`; gpu_run.sh `s41a`, `s41b`): caches as in a decode
step instead of all cold. Each call reads K / V from its own copy (gpu_kernel_time.cold_copies;
the setup's calls and bit checks use the original, which the rotation leaves out),
and q is written by a kernel right before the call (q + 0), as the step's q/k norm + RoPE writes it.
So K / V come from HBM, and what the op writes and reads back itself (the span or group partials
between its partials kernel and its merge; MLX sdpa's between its two kernels) stays in L2, as in
a real step. With the default (all cold), ncu flushes L2 before every kernel, the merge's included.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections import defaultdict

from ncu_csv import ncu_rows, ncu_us

KEYS = [int(v) for v in os.environ.get("ATTN_KEYS", "1024,8192,32768").split(",")]
ROWS = [int(v) for v in os.environ.get("ATTN_ROWS", "1,2,4,8,16").split(",")]
REPS = int(os.environ.get("ATTN_REPS", "5"))
WARM = int(os.environ.get("ATTN_WARM", "2"))    # untimed calls before each entry's timed ones
STEP = os.environ.get("ATTN_CACHE", "cold") == "step"
HQ, HKV, D = 32, 8, 128


def plan_and_cols(impl, cols0, wide0):
    """An ATTN_IMPL entry: a launch plan, optionally with the merge's columns a block as a suffix
    c<DC> (cD: a whole row a block; the bits do not depend on it), which also turns the wide-columns
    rule off: "s4c64", "c128" (the default plan), "wg4". Returns (_cuda.attn_impl,
    _cuda.ATTN_MERGE_COLS, _cuda.ATTN_MERGE_COLS_WIDE); None: the defaults."""
    m = re.fullmatch(r"(.*?)(?:c(\d+|D))?", impl or "")
    if m[2] is None:
        return (m[1] or None), cols0, wide0
    return (m[1] or None), (None if m[2] == "D" else int(m[2])), None


def run():
    import mlx.core as mx
    from gpu_kernel_time import cold_copies, marker
    from tensorfold import kernels as K
    from tensorfold.kernels import _cuda
    impls = [v for v in os.environ.get("ATTN_IMPL", "").split(",") if v]
    cols0, wide0 = _cuda.ATTN_MERGE_COLS, _cuda.ATTN_MERGE_COLS_WIDE
    scale = D ** -0.5
    bad = 0
    for L in KEYS:
        marker("setup")
        k = mx.random.normal((1, HKV, L, D)).astype(mx.bfloat16)
        v = mx.random.normal((1, HKV, L, D)).astype(mx.bfloat16)
        mx.eval(k, v)
        kvs = cold_copies((k, v)) if STEP else []     # the setup's calls use k, v themselves
        turn = [0]

        def call(fn, q):
            """One timed call: the next K / V copy, q written right before (step caches)."""
            if not STEP:
                return mx.eval(fn(q, k, v))
            kk, vv = kvs[turn[0] % len(kvs)]
            turn[0] += 1
            mx.eval(fn(q + mx.zeros_like(q), kk, vv))
        for M in ROWS:
            marker("setup")
            q = mx.random.normal((1, HQ, M, D)).astype(mx.bfloat16)
            off = _cuda.device_array([L - M], mx.int32)     # as the compiled step's offset
            ref = K.row_attention(q, k, v, off, scale)
            mx.eval(ref)
            for impl in [None] + impls:
                _cuda.attn_impl, _cuda.ATTN_MERGE_COLS, _cuda.ATTN_MERGE_COLS_WIDE = plan_and_cols(impl, cols0, wide0)
                marker("setup")
                if impl is not None:
                    same = bool(mx.array_equal(K.row_attention(q, k, v, off, scale), ref).item())
                    bad += not same
                    print(f"L{L} M{M} {impl}: {'same bits' if same else 'MISMATCH'}", file=sys.stderr)
                # two untimed calls first, for every entry alike: until session 42 the default ("ours")
                # was timed first after a cache size's setup, and its one-row calls came out up to
                # 1.2 us slower than the same launch timed next (2k keys: 11.0 against 10.0, s42c)
                for _ in range(WARM):
                    call(lambda q_, k_, v_: K.row_attention(q_, k_, v_, off, scale), q)
                marker(f"L{L}_M{M}_{(impl or 'ours').replace('.', 'b')}")
                for _ in range(REPS):
                    call(lambda q_, k_, v_: K.row_attention(q_, k_, v_, off, scale), q)
            _cuda.attn_impl, _cuda.ATTN_MERGE_COLS, _cuda.ATTN_MERGE_COLS_WIDE = None, cols0, wide0
            sdpa = lambda q_, k_, v_: mx.fast.scaled_dot_product_attention(  # noqa: E731
                q_, k_, v_, scale=scale, mask="causal" if M > 1 else None)
            marker("setup")
            for _ in range(WARM):
                call(sdpa, q)
            marker(f"L{L}_M{M}_sdpa")
            for _ in range(REPS):
                call(sdpa, q)
    marker("end")
    if bad:
        print(f"{bad} launch plans gave other bits", file=sys.stderr)


def report(path):
    cur, data = None, defaultdict(list)
    for r in ncu_rows(path):
        name = r.get("Kernel Name") or r.get("Function Name") or ""
        if "tfmark_" in name:
            cur = name.split("tfmark_")[1].split("(")[0].split("<")[0]
            continue
        if cur is None or cur in ("end", "setup") or r["Metric Name"] != "gpu__time_duration.sum":
            continue
        impl = cur.split("_", 2)[2]
        mlx_sdpa = "sdpa" in name.lower() or "cudnn" in name.lower()    # its flash kernel and its reduction
        if not (mlx_sdpa if impl == "sdpa" else "row_attn" in name):
            continue    # the marker's input copy; the next case's inputs
        short = name.split("(")[0].split("<")[0].replace("mlx::", "").replace("custom_kernel_tf_", "")
        data[cur].append((short, ncu_us(r)))
    impls = sorted({c.split("_", 2)[2] for c in data}, key=lambda s: (s == "sdpa", s != "ours", s))
    print("| keys | M | " + " | ".join(f"{i} us" for i in impls) + " | ours / ours M=1 | sdpa / ours | ours kernels |")
    print("|---|---|" + "---|" * len(impls) + "---|---|---|")
    base = {}
    for L in sorted({int(c.split("_")[0][1:]) for c in data}):
        for M in sorted({int(c.split("_")[1][1:]) for c in data if c.startswith(f"L{L}_")}):
            t, parts = {}, ""
            for i in impls:
                ks = data.get(f"L{L}_M{M}_{i}", [])
                # a call's kernels: up to the first kernel's next launch
                per = next((j for j in range(1, len(ks)) if ks[j][0] == ks[0][0]), len(ks))
                calls = [ks[j:j + per] for j in range(0, len(ks), per)][:REPS]
                if not ks or len(calls) < REPS or len(calls[-1]) < per:
                    t[i] = float("nan")
                    continue
                t[i] = statistics.median(sum(u for _, u in c) for c in calls)
                if i == "ours":
                    parts = " + ".join(f"{n} {statistics.median(c[j][1] for c in calls):.1f}"
                                       for j, (n, _) in enumerate(calls[0]))
            if M == 1:
                base[L] = t.get("ours")
            rel = t["ours"] / base[L] if base.get(L) else float("nan")
            print(f"| {L} | {M} | " + " | ".join(f"{t[i]:.1f}" for i in impls)
                  + f" | {rel:.2f} | {t.get('sdpa', float('nan')) / t['ours']:.2f} | {parts} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--report")
    a = ap.parse_args()
    if a.report:
        return report(a.report)
    run()


if __name__ == "__main__":
    main()
