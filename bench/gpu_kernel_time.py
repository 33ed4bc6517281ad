"""Device time of each GEMM kernel (ours vs MLX's own op), measured by Nsight Compute.

On the H200 (after building the project there):
    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
        --kernel-name regex:"custom_kernel_tf|qmv|qmm|gemv|nvjet|splitK" \
        python3 bench/gpu_kernel_time.py > ncu.csv
    python3 bench/gpu_kernel_time.py --report ncu.csv

ncu times every kernel alone with cold caches (it flushes them before each replay), so the
numbers are device time without launch or host overhead. Without the --kernel-name filter ncu
also replays every small MLX kernel (random weights, quantization) and takes minutes; it writes
its CSV only when the program ends, so never cut it short with a timeout. Between cases the script runs a
tiny marker kernel named after the case, which is how --report groups the kernels.

GEMM_CACHE=step (with `ncu --cache-control none`; gpu_run.sh `s41a`): caches as in a decode
step instead of all cold. Each call reads its weights from its own copy, rotated over copies of at
least STEP_COLD_BYTES in all (cold when they come back: the L2 is 50 MB), and x is written by a
kernel right before the call (x + 0), as the step's previous op writes it. So the weights come from
HBM and x from L2; with the default, ncu flushes L2 before every kernel and x comes from HBM too.

GEMM_TOUCH=1 (with GEMM_CACHE=step): before each call a kernel that ncu does not time reads one
element every 64 KB of the copy's arrays. That warms the address translations of the copy and leaves
~0.2 % of it in L2. Session 43 measured rotation 0.3-1.6 us slower than the flush at one row on the
smaller 8B shapes, and the same at 8-16 rows. Session 44 (`gpu_run.sh s44a`, two rounds): the touched
calls took the rotated calls' times, not the flush's (4096x4096 one row: flush 6.4, rotation 7.9-8.0,
touched 8.1-8.2 us). So the gap is not page walks that a touch from any SM warms. The touch kernel runs
on a few SMs (one thread a 64 KB), so the per-SM TLBs of the timed kernel's SMs stay cold: those are
not ruled out.
"""

from __future__ import annotations

import os
import statistics
import sys

import mlx.core as mx

from ncu_csv import ncu_rows, ncu_us

SHAPES = [(4096, 4096), (6144, 4096), (24576, 4096), (12288, 4096), (4096, 12288),
          (151936, 4096)]
MS = [int(m) for m in os.environ.get("GEMM_MS", "1,2,4,8,16").split(",")]   # e.g. GEMM_MS=1,8,9,16
COPY_CEILING_GBS = 4300     # issue 3: the H200's ~4.3 TB/s copy ceiling
REPS = int(os.environ.get("GEMM_REPS", "3"))   # calls a case; the report needs the same value
CACHE = os.environ.get("GEMM_CACHE", "cold")
STEP = CACHE == "step"
# GEMM_CACHE=wflush / rflush (with `ncu --cache-control none`; prepared in session 44, not run): one weight
# buffer, as with the flush, but L2 emptied before each call by an untimed MLX kernel that writes (wflush) or
# reads (rflush) 256 MB, instead of by ncu. If these take the flush's one-row times, the rotation's extra
# time comes with the copies' new addresses; if they take the rotation's, with what L2 holds or how it was
# emptied. GEMM_XFRESH=0 (with step): x not rewritten before each call, to see what that write costs.
SWEEP = CACHE if CACHE in ("wflush", "rflush") else None
XFRESH = os.environ.get("GEMM_XFRESH", "1") == "1"
# untimed calls before each case's timed ones (both impls): session 42 found the attention table's
# first case after a setup timed up to 1.2 us slow at one row (gpu_attn_rows.py, ATTN_WARM)
# GEMM_WARM=copies (with step): one untimed call on each copy before a case's timed ones, so the copies
# go round once and L2 holds their clean lines, as in a decode step's steady state
WARM_ENV = os.environ.get("GEMM_WARM", "2")
WARM = -1 if WARM_ENV == "copies" else int(WARM_ENV)
# GEMM_COLD=read (with step; prepared in session 46): cold_copies empties L2 by reading 256 MB instead of
# writing it. Written, L2 is left full of dirty lines, and the first calls after it (one row, ours: the
# first case of each shape) write them back while they stream their weights; with a read it holds clean
# ones. Session 44's rotation gap (one row 4096x4096 8.0 against the flush's 6.4 us, none at 16 rows,
# which run later) fits the written one; s45b's wflush / rflush and this tell.
COLD = os.environ.get("GEMM_COLD", "write")
STEP_COLD_BYTES = 192e6
TOUCH = STEP and os.environ.get("GEMM_TOUCH", "0") == "1"
TOUCH_STRIDE_BYTES = 64 << 10


def touch(arrays):
    """One element every TOUCH_STRIDE_BYTES of each array read by a kernel whose name ncu's filter
    (custom_kernel_tf|qmv|qmm|...) leaves out: address translations warmed, next to nothing in L2."""
    if not hasattr(touch, "kernel"):
        touch.kernel = mx.fast.cuda_kernel(
            name="zz_touch", input_names=["a", "stride"], output_names=["o"],
            source="""
                unsigned int i = (blockIdx.x * blockDim.x + threadIdx.x) * (unsigned int)stride[0];
                if (i < a_shape[0] && static_cast<float>(a[i]) == 1234.5f) o[0] = 1.0f;""")
    outs = []
    for a in arrays:
        flat = a.reshape(-1)
        stride = max(1, TOUCH_STRIDE_BYTES // a.itemsize)
        n = -(-flat.size // stride)
        outs.append(touch.kernel(inputs=[flat, mx.array([stride], dtype=mx.int32)], grid=(-(-n // 128) * 128, 1, 1),
                                 threadgroup=(128, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32],
                                 init_value=0)[0])
    mx.eval(outs)


def l2_sweep(kind: str):
    """256 MB through L2 by an MLX kernel the ncu filter leaves out: written (wflush) or read (rflush)."""
    if not hasattr(l2_sweep, "buf"):
        l2_sweep.buf = mx.zeros((64 << 20,), mx.float32) + 1
        mx.eval(l2_sweep.buf)
    mx.eval(l2_sweep.buf + 1 if kind == "wflush" else mx.sum(l2_sweep.buf))


def cold_copies(ws):
    """Step caches (GEMM_CACHE / ATTN_CACHE=step): copies of the arrays ws (new buffers, same values),
    at least two and STEP_COLD_BYTES in all, for timed calls to take in turn, so each copy comes back
    after the others have pushed it out of the 50 MB L2; L2 is flushed once they are made."""
    n = max(2, -(-int(STEP_COLD_BYTES) // sum(a.nbytes for a in ws)))
    out = [tuple(a + mx.zeros_like(a) for a in ws) for _ in range(n)]
    mx.eval(out)
    if COLD == "read":
        l2_sweep("rflush")      # 256 MB read: the copies out of L2, which is left clean
    else:
        mx.eval(mx.zeros((64 << 20,), mx.float32) + 1)    # 256 MB written: the copies out of L2
    return out


def marker(tag: str):
    k = mx.fast.cuda_kernel(name=f"tfmark_{tag}", input_names=["a"], output_names=["o"],
                            source="o[0] = a[0];")
    mx.eval(k(inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
              output_shapes=[(1,)], output_dtypes=[mx.float32])[0])


def use_staging_env():
    """MM_STAGING=CB.NS.XE.NT (e.g. 2.3.1.1): the dense GEMMs run row_mm_cp with that staging;
    MM_STAGING=tc: row_mm_tc, the register kernel (the same bits). CP_UR=1 / 2 / 4: the 4-bit
    GEMMs run their default stagings with that many chunks a loop turn. Benchmarks only; call before
    the first dense call, whose launch is then cached."""
    if os.environ.get("MM_STAGING"):
        from tensorfold.kernels import _cuda
        v = os.environ["MM_STAGING"]
        staging = None if v == "tc" else tuple(int(t) for t in v.split("."))
        _cuda.mm_cp_staging = lambda N, K: staging
    if os.environ.get("CP_UR"):    # the 4-bit default stagings, UR chunks a loop turn
        from tensorfold.kernels import _cuda
        ur, base = int(os.environ["CP_UR"]), _cuda.cp_staging

        def staging(N, K, gs, two=False):
            cb, ns, xe, nt, _, pro = base(N, K, gs, two)
            return cb, ns, xe, nt, ur, pro
        _cuda.cp_staging = staging


def run():
    from tensorfold import kernels as K
    use_staging_env()
    shapes = SHAPES     # GEMM_SHAPES=4096x4096,12288x4096 and GEMM_OPS=qmm narrow a run
    if os.environ.get("GEMM_SHAPES"):
        shapes = [tuple(int(v) for v in t.split("x")) for t in os.environ["GEMM_SHAPES"].split(",")]
    for op in os.environ.get("GEMM_OPS", "qmm,mm").split(","):
        for (N, Kd) in shapes:
            if op == "mm" and N not in (4096, 151936):
                continue
            w = mx.random.normal((N, Kd)) * 0.02
            if op == "qmm":
                wq, s, b = mx.quantize(w, group_size=64, bits=4)
                s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
                mx.eval(wq, s, b)
                ws = cold_copies((wq, s, b)) if STEP else None
            else:
                wb = w.astype(mx.bfloat16)
                mx.eval(wb)
                ws = cold_copies((wb,)) if STEP else None
            del w
            turn = 0
            for M in MS:
                x = (mx.random.normal((M, Kd)) * 0.5).astype(mx.bfloat16)
                mx.eval(x)
                x0 = x
                for impl in ("ours", "mlx"):
                    warm = len(ws) if WARM < 0 and STEP else max(WARM, 0)
                    for tag, n in (("setup", warm), (f"{op}_{N}x{Kd}_M{M}_{impl}", REPS)):
                        marker(tag)
                        for _ in range(n):
                            if STEP:    # the next copy; x written right before the call
                                cur = ws[turn % len(ws)]
                                turn += 1
                                if op == "qmm":
                                    wq, s, b = cur
                                else:
                                    wb, = cur
                                if TOUCH:
                                    touch(cur)
                                x = x0 + mx.zeros_like(x0) if XFRESH else x0
                            elif SWEEP:     # one weight buffer, L2 emptied by a kernel; x written after
                                l2_sweep(SWEEP)
                                x = x0 + mx.zeros_like(x0)
                            if op == "qmm":
                                y = (K.row_quantized_matmul(x, wq, s, b, 64, 4) if impl == "ours" else
                                     mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64,
                                                         bits=4))
                            else:
                                y = K.row_matmul(x, wb) if impl == "ours" else x @ wb.T
                            mx.eval(y)
    marker("end")


def report(path):
    rows = ncu_rows(path)
    cur, data = None, {}
    for r in rows:
        name = r.get("Kernel Name") or r.get("Function Name") or ""
        if "tfmark_" in name:
            cur = name.split("tfmark_")[1].split("(")[0].split("<")[0]
            continue
        if cur is None or cur in ("setup", "end"):
            continue
        impl = cur.rsplit("_", 1)[1]
        ours = "custom_kernel_tf_row" in name
        mlx_gemm = any(t in name for t in ("qmv", "qmm", "gemv", "nvjet", "splitK", "gemm", "cutlass"))
        if (impl == "ours" and not ours) or (impl == "mlx" and not mlx_gemm):
            continue  # the marker's input fill and the next case's setup kernels
        d = data.setdefault(cur, {})
        e = d.setdefault(r["ID"], {"name": name})
        e[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
        e.setdefault("unit_" + r["Metric Name"], r["Metric Unit"])
    print("| op | N x K | M | ours us | ours GB/s | of 4.3 TB/s | MLX us | MLX GB/s | MLX / ours | kernels (ours; MLX) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted({k.rsplit("_", 1)[0] for k in data if k != "end"},
                  key=lambda k: (k.split("_")[0], [int(v) for v in k.split("_")[1].split("x")],
                                 int(k.split("_M")[1])))
    for key in keys:
        op, shape, m = key.split("_")
        out = []
        names = []
        for impl in ("ours", "mlx"):
            ks = data.get(f"{key}_{impl}", {})
            # one call may launch several kernels: sum per call (REPS calls, in launch order),
            # median over calls
            unit = next((e.get("unit_gpu__time_duration.sum") for e in ks.values()), "ns")
            scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0}.get(unit, 1e-3)
            bunit = next((e.get("unit_dram__bytes_read.sum") for e in ks.values()), "byte")
            bscale = {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6}.get(bunit, 1)
            es = [ks[i] for i in sorted(ks, key=int)]
            if len(es) % REPS:      # a call's kernels can't be told apart: the whole, per call
                raise SystemExit(f"{key}_{impl}: {len(es)} kernels for {REPS} calls (GEMM_REPS?)")
            per = len(es) // REPS
            calls = [es[i:i + per] for i in range(0, len(es), per)]
            ts = [sum(e.get("gpu__time_duration.sum", 0.0) for e in c) * scale for c in calls]
            bs = [sum(e.get("dram__bytes_read.sum", 0.0) for e in c) * bscale for c in calls]
            t = statistics.median(ts) if ts else 0.0
            gbs = statistics.median(b / (u * 1e-6) / 1e9 for b, u in zip(bs, ts) if u) if t else 0.0
            out.append((t, gbs))
            names.append(",".join(sorted({e["name"].split("(")[0][:40] for e in ks.values()})))
        (to, go), (tm, gm) = out
        print(f"| {op} | {shape} | {m[1:]} | {to:.1f} | {go:.0f} | {go / COPY_CEILING_GBS:.0%} | "
              f"{tm:.1f} | {gm:.0f} | "
              f"{tm / to if to else 0:.2f} | {names[0]}; {names[1]} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        report(sys.argv[2])
    else:
        run()
