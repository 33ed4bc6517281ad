"""Sweep the tensor-core GEMM plans on real shapes, timed by Nsight Compute: row_qmm_tc's
(NT, CB, SPLIT, DB) and row_qmm_cp's ("cp", CB, NS).

On the H200:
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        --kernel-name regex:"row_qmm|tfmark" python3 bench/gpu_tc_sweep.py [--cp] > sweep.csv
    python3 bench/gpu_tc_sweep.py --report sweep.csv

Used to choose kernels._cuda.tc_plan / cp_plan (functions of the weight shape only); the rows
of one shape never change the plan. 4-bit, group 64, bf16 activations, M = 1 and 16. With
--cp: the default row_qmm_tc plan and the row_qmm_cp stagings, each cp output checked
bit-identical to row_qmm_tc's (same SPLIT, same arithmetic). With --dense (bf16 weights,
`--kernel-name regex:"row_mm|tfmark"`, and `--report FILE --dense`): row_mm_tc's register
plans and row_mm_cp's stagings, each checked bit-identical to the default row_mm_tc plan.
"""

from __future__ import annotations

import os
import statistics
import sys

import mlx.core as mx

SHAPES = [(12288, 4096), (4096, 4096), (151936, 4096), (4096, 12288)]  # (N, K)
CP_SHAPES = [(24576, 4096), (4096, 12288), (4096, 4096), (6144, 4096), (151936, 4096)]
REPS = int(os.environ.get("SWEEP_REPS", "3"))


def plans(N, K):
    out = []
    nblk = K // 32
    for NT in (1, 2):
        for CB, DB in ((4, False), (2, True), (4, True)):
            if nblk % CB:
                continue
            nchunk = nblk // CB
            for SPLIT in ((1, 2) if N > 100000 else (4, 8)):
                if nchunk % SPLIT == 0:
                    out.append((NT, CB, SPLIT, DB))
    return out


def cp_plans(N, K):
    from tensorfold.kernels._cuda import cp_plan, tc_plan
    tc = tc_plan(N, K, 64, 4)
    out = [tc]
    # stagings ("cp", CB, NS, XE, NT[, SPLIT]); CP_STAGINGS="4.2.0.1,4.2.1.2,4.2.1.1.4" overrides
    # the list (a fifth value: another split, i.e. another reduction order; row_qmm_tc with that
    # split comes first, as its reference)
    st = [tuple(int(v) for v in t.split(".")) for t in os.environ.get("CP_STAGINGS", "").split(",") if t] or \
        [(4, 2, 0, 1), (4, 2, 1, 1), (4, 3, 1, 1), (4, 2, 2, 1), (8, 2, 1, 1), (4, 2, 1, 2), (4, 2, 2, 2),
         (8, 2, 1, 2), (4, 2, 0, 2)]
    # a sixth value: CA (constant-offset copies, 0 / 1; left out: the default, from CB 8; split
    # 0 = the default), e.g. 8.2.1.2.0.0; a seventh: UR (chunks a loop turn, 1 / 2 / 4), e.g.
    # 4.2.2.1.0.0.2; an eighth: PRO (1: the first weight stage copied before the scales, the
    # scales in 16-byte copies), e.g. 8.2.1.2.0.1.1.1. (Sessions 16-18 ran stagings with values
    # since removed: PF sixth, stages asked of L2 ahead; SF seventh, float scale pairs; session 19
    # L2 eighth, the copies' L2 prefetch size; session 21 PW ninth, a warp per 8-row tile past
    # 8 rows; this report mislabels their CSVs.)
    for cb, ns, xe, *rest in st:
        nt = rest[0] if rest else 1
        split = (rest[1] or None) if len(rest) > 1 else None
        lean = tuple(rest[2:5])
        p = cp_plan(N, K, 64, 4, cb, ns, nt, split)
        if p is None or (p[0], p[1]) != (cb, ns):
            continue
        if split == tc[2]:
            split = None
        if split is not None:
            if (K // 32 // tc[1]) % split:
                continue
            ref = (tc[0], tc[1], split, tc[3])
            if ref not in out:
                out.append(ref)
        plan = ("cp", cb, ns, xe, nt)
        if split or lean:
            plan += (split or 0,)
        out.append(plan + lean)
    return out


DENSE_SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096), (151936, 4096)]


def dense_plans(N, K):
    """row_mm_tc's register plans with its default SPLIT (the same bits) and row_mm_cp's
    stagings ("cp", CB, NS, XE, NT); MM_STAGINGS="2.3.1.1,4.2.1.2" overrides the stagings, and
    MM_TC_PLANS=default keeps only the default register plan (the reference of the bit check)."""
    from tensorfold.kernels._cuda import mm_cp_plan, tc_plan
    tc = tc_plan(N, K)
    out = [tc]
    nblk = K // 32
    for NT in (() if os.environ.get("MM_TC_PLANS") == "default" else (1, 2)):
        for CB in (1, 2, 4):
            for DB in (False, True):
                p = (NT, CB, tc[2], DB)
                if nblk % CB == 0 and (nblk // CB) % tc[2] == 0 and p not in out:
                    out.append(p)
    st = [tuple(int(v) for v in t.split(".")) for t in os.environ.get("MM_STAGINGS", "").split(",") if t] or \
        [(cb, ns, 1, nt) for cb in (1, 2, 4) for ns in (2, 3, 4) for nt in (1, 2)] + [(2, 3, 0, 1), (1, 3, 0, 2)]
    out += [("cp", *p) for p in st if mm_cp_plan(N, K, p[0], p[1], p[3]) is not None]
    return out


def plan_split(plan, default):
    """The split (reduction order) a sweep plan runs with."""
    if plan[0] == "cp":
        return (plan[5] or default) if len(plan) > 5 else default
    return plan[2]


def timed(case, plan, ones, call):
    """REPS evaluated calls after a marker naming (case, plan); row-exact: row 0 of the 16-row
    call has the bits of the 1-row call (`ones` keeps each plan's 1-row result)."""
    from gpu_kernel_time import marker
    marker(f"{case}_" + "_".join(str(v if isinstance(v, str) else int(v)) for v in plan))
    for _ in range(REPS):
        y = call()
        mx.eval(y)
    if y.shape[0] == 1:
        ones[plan] = y
    else:
        assert mx.array_equal(y[:1], ones[plan]).item(), ("row 0 differs", plan)
    return y


def run_dense():
    """Dense bf16 weights: every plan == the default row_mm_tc plan bitwise (same SPLIT), row 0
    of the 16-row call == the 1-row call."""
    from tensorfold.kernels import _cuda
    from gpu_kernel_time import marker
    stream = mx.default_stream(mx.gpu)
    for N, K in sweep_shapes(DENSE_SHAPES):
        w = (mx.random.normal((N, K)) * 0.02).astype(mx.bfloat16)
        x16 = (mx.random.normal((16, K)) * 0.5).astype(mx.bfloat16)
        mx.eval(w, x16)
        ones = {}
        for M in (1, 16):
            x = x16[:M]
            ref = None
            for plan in dense_plans(N, K):
                y = timed(f"{N}x{K}_M{M}", plan, ones, lambda: _cuda.matmul(x, w, stream, plan=plan))
                ref = y if ref is None else ref
                assert mx.array_equal(y, ref).item(), ("differs from row_mm_tc", plan)
        print(N, K, "row-exact for", len(dense_plans(N, K)), "plans (== row_mm_tc bitwise)",
              file=sys.stderr, flush=True)
    marker("end")


def sweep_shapes(default):
    """SWEEP_SHAPES (e.g. 6144x4096,151936x4096) or `default`, one by one until SWEEP_BUDGET_S is
    spent (the sweep then stops cleanly, so that ncu still writes its report). TF_CP_SMEM_KB
    raises the cp kernels' shared-memory ceiling first (sweep only)."""
    import time
    from tensorfold.kernels import _cuda
    if os.environ.get("TF_CP_SMEM_KB"):
        _cuda.CP_SMEM_LIMIT = int(os.environ["TF_CP_SMEM_KB"]) * 1024
        _cuda.cp_staging.cache_clear()
    t_end = time.perf_counter() + float(os.environ.get("SWEEP_BUDGET_S", "1e9"))
    shapes = default
    if os.environ.get("SWEEP_SHAPES"):
        shapes = [tuple(int(v) for v in t.split("x")) for t in os.environ["SWEEP_SHAPES"].split(",")]
    for N, K in shapes:
        if time.perf_counter() > t_end:
            print("sweep budget spent before", N, K, file=sys.stderr)
            return
        yield N, K


def run(cp=False):
    from tensorfold.kernels import _cuda
    from gpu_kernel_time import marker
    stream = mx.default_stream(mx.gpu)
    for N, K in sweep_shapes(CP_SHAPES if cp else SHAPES):
        w = mx.random.normal((N, K)) * 0.02
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
        mx.eval(wq, s, b)
        del w
        x16 = (mx.random.normal((16, K)) * 0.5).astype(mx.bfloat16)
        mx.eval(x16)
        ones = {}
        split0 = _cuda.tc_plan(N, K, 64, 4)[2]
        for M in (1, 16):
            x = x16[:M]
            ref, refs = None, {}
            for plan in (cp_plans(N, K) if cp else plans(N, K)):
                y = timed(f"{N}x{K}_M{M}", plan, ones,
                          lambda: _cuda.quantized_matmul(x, wq, s, b, 64, 4, stream, plan=plan))
                yf = y.astype(mx.float32)
                if cp:        # same SPLIT, same arithmetic: the same bits as row_qmm_tc
                    sp = refs.setdefault(plan_split(plan, split0), yf)
                    assert mx.array_equal(yf, sp).item(), ("cp != tc", plan)
                # every plan computes the same product (to the rounding of its own order)
                ref = yf if ref is None else ref
                err = mx.abs(yf - ref).max().item()
                assert err < 0.05 * (mx.abs(ref).max().item() + 1e-6), (plan, err)
        print(N, K, "row-exact for", len(cp_plans(N, K) if cp else plans(N, K)), "plans",
              "(cp == tc bitwise)" if cp else "", file=sys.stderr, flush=True)
    marker("end")


def report(path, dense=False):
    from ncu_csv import ncu_rows, ncu_us
    cur, t = None, {}
    for r in ncu_rows(path):
        n = r.get("Kernel Name") or ""
        if "tfmark_" in n:
            cur = n.split("tfmark_")[1].split("(")[0]
            continue
        if cur is None or ("row_qmm" not in n and "row_mm" not in n) or r["Metric Name"] != "gpu__time_duration.sum":
            continue
        t.setdefault(cur, []).append(ncu_us(r))
    by_shape = {}
    for key, v in t.items():
        shape, m, *plan = key.split("_")
        by_shape.setdefault((shape, m), []).append((statistics.median(v), plan))
    def label(p):   # cp plans name their values (a split of 0 is the default, left out)
        if p[0] != "cp":
            return f"NT{p[0]} CB{p[1]} S{p[2]} DB{p[3]}"
        return "cp " + " ".join(f"{n}{v}" for n, v in zip(("CB", "NS", "XE", "NT", "S", "CA", "UR", "PRO"), p[1:])
                                if not (n == "S" and v == "0"))

    for (shape, m), lst in sorted(by_shape.items()):
        N, K = map(int, shape.split("x"))
        byts = N * K * 2 if dense else N * K / 2 + N * K / 64 * 4
        lst.sort()
        print(f"{shape} {m}: " + "; ".join(
            f"{label(p)}: {us:.1f} us {byts / us / 1e6:.2f} TB/s" for us, p in lst[:8]))
        print("    worst:", "; ".join(f"{'/'.join(p)} {us:.1f}" for us, p in lst[-3:]))


if __name__ == "__main__":
    dense = "--dense" in sys.argv   # bf16 weights (the report's TB/s: 2 bytes a weight)
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        report(sys.argv[2], dense)
    else:
        sys.path.insert(0, "bench")
        run_dense() if dense else run(cp="--cp" in sys.argv)
