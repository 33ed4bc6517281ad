"""Where the 4-bit GEMM's one-row time goes: row_qmm_cp against itself with parts cut out.

Issue 3 asks 12288 x 4096 at one row for <= 11.3 us; the default staging takes ~12.3 and a
kernel that only reads the same bytes 9.1 (bench/gpu_read_ceiling.py). This script times, side
by side under Nsight Compute (device time, caches flushed before each launch), texts of
row_qmm_cp at each shape's default staging, each built from csrc/cuda/row_gemm.cu as the
package builds it, then cut:

  full   the kernel as shipped (asserted bit-identical to row_qmm_tc, as the package's call is);
  mem    its data movement only: the same cp.async ring, ldmatrix reads and x loads, the
         dequantisation, mmas and group folds replaced by an XOR of the words read;
  comp   its arithmetic only: the weight and scale copies dropped (the ring is read as it is);
  nox    x's loads from global memory replaced by register values (no x traffic at all);
  even   the group fold of even output columns only (x rows 0, 2, ...: what one row needs);
  notail no arithmetic on the last chunk (full - notail: what the last chunk's arithmetic, done
         after the last copy has landed, adds);
  nxm    no X = sum x mmas (X from the x pairs' bits): what precomputed group sums would save;
  xw0    every warp reads K slice 0's x (a block's warps share x through L1; timing only);
  xpD    (session 57; same bits) chunk ci + D's x rows asked of L1 (prefetch.global.L1) at the top
         of chunk ci, so its loads D turns later hit L1, not L2;
  fsN / fdN (session 58; same bits) the first weight stage committed in N parts (2, 4), chunk 0 computed
         part by part after each part's wait; fd issues the later parts just before the chunk loop;
  il     chunks dealt to the warps in turn (w, w + SPLIT, ...), not as contiguous K slices: the
         block's warps read each row's next bytes side by side (DRAM locality; timing only).

Cuts combine with "+" (comp+nox: the arithmetic with no load at all). `_cbN` / `_nsN` / `_xeN` /
`_ntN` / `_spN` / `_onN` / `_xsN` / `_c0N` change the staging: N blocks a stage / N stages /
x-load timing N / N weight tiles a block / a K split of N / the one-row variant on or off / x
staged once at one row or not (left out: the package's default, _cuda.cp_xs) / the one-row fold
of column 0 only or not (left out: with XS); `_urN` / `_prN` / `_f2N`: N chunks a loop turn / the
first weight stage before the scales (1) or not / at 9..16 rows the second tile constant (1) or
not (left out: the default staging's). For example full_cb4_ns4, comp+nox_nt1_sp8, full_on0, full_xs1, full_c00, full_ur2_pr1, full_f21. `hi` / `hi2` keep every bit: they move the 4-bit pairs' shifts
from the ALU pipe to the FMA pipe (the high word of a multiply), for j = 1, 3 / every j > 0. If full ~ mem, the copies'
pattern is the limit; if full ~ comp, the arithmetic is. Every variant but full, hi and hi2 is
for timing only.
FLOOR_VARIANTS (comma-separated) picks the cases, FLOOR_ROWS the row counts (default 1,16),
FLOOR_SHAPES the shapes (e.g. 12288x4096,4096x12288; the report lists those too),
TF_CP_SMEM_KB the shared-memory ceiling.

On the H200 (after building the project there):
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        --kernel-name regex:"tfcp|tfmark" python3 bench/gpu_cp_floor.py > floor.csv
    python3 bench/gpu_cp_floor.py --report floor.csv
"""

from __future__ import annotations

import os
import statistics
import sys

import mlx.core as mx

SHAPES = [tuple(int(v) for v in t.split("x"))
          for t in os.environ.get("FLOOR_SHAPES", "12288x4096,4096x12288,4096x4096").split(",")]
REPS = int(os.environ.get("FLOOR_REPS", "5"))
ROWS = [int(v) for v in os.environ.get("FLOOR_ROWS", "1,16").split(",")]

# The texts the cuts look for, in the minified form the package compiles (`_sources.minified`).
def _min(text: str) -> str:
    from tensorfold.kernels._sources import minified
    return minified(text)


# the compute of one chunk: from the group loop to the end of the chunk loop
_COMPUTE_FROM = _min("#pragma unroll\nfor (int gi = 0; gi < GPC; ++gi) {")
_MEM_CONSUME = _min("""{
  unsigned int h = 0u;
#pragma unroll
  for (int b = 0; b < CB; ++b) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) h ^= wq[b][nt][0] ^ wq[b][nt][1];
    h ^= xv[b][0].x ^ xv[b][0].y ^ xv[b][0].z ^ xv[b][0].w;
  }
  acc[0][0][0] = __fadd_rn(acc[0][0][0], __uint_as_float(h & 0x3f7fffffu));
}""")
_X_LOAD = _min("dst[b][mt] = __ldg(reinterpret_cast<const uint4*>(xrow[mt] + (size_t)ci * CB * 32 + b * 32 + xof));")
_X_REG = _min("dst[b][mt] = make_uint4(0x3f803f80u ^ (ci * 77u + b), lane * 0x10001u, 0x3f80u + b, 0x40003f80u ^ lane);")
_FOLD_LOOP = _min("for (int i = 0; i < 4; i += C0 ? 2 : 1) {\nconst float2 v = sb(nt, i >> 1);")
# the 4-bit pairs' shifts (nibbles j, j + 4 down to bits 0 / 16): `hi` takes j = 1, 3 as the high
# word of a multiply (IMAD.HI, on the FMA pipe, not the ALU pipe's SHF), `hi2` every j > 0
_Q4_SHIFT = _min("return tf_nib_or<0x43004300u>(w >> (4 * j));")
_Q4_HI = {"hi": _min("return tf_nib_or<0x43004300u>(j & 1 ? __umulhi(w, 1u << (32 - 4 * j)) : w >> (4 * j));"),
          "hi2": _min("return tf_nib_or<0x43004300u>(j ? __umulhi(w, 1u << (32 - 4 * j)) : w);")}
# nxm (timing only): no X = sum x mmas; X from the x pairs' bits by one AND a step, as if the
# group sums came precomputed (the bound on what X computed once a launch, not once a warp, gives)
_X_MMA = _min("if (xmma) tf_mma(X[0], ones, &xb[0][2 * s], tag);\nif (two) tf_mma(X[1], ones, &xb[1][2 * s], tag);")
_X_FAKE = _min("X[0][s] = __uint_as_float(xb[0][s] & 0x3f7fffffu);\nif (two) X[1][s] = __uint_as_float(xb[1][s] & 0x3f7fffffu);")
# xw0 (timing only): every warp of a block reads K slice 0's x, so a block's warps share their x
# loads through L1 (4x fewer distinct x bytes a block): the bound on blocks that each take one K
# slice of SPLIT row tiles (the slices then summed across blocks)
_X_SLICE = _min("xrow[0] += (size_t)blkw * 32;\nxrow[1] += (size_t)blkw * 32;")
# il (timing only): warp w takes the block's chunks w, w + SPLIT, ... instead of a contiguous K
# slice, so the warps of a block read each weight row's next SPLIT * CB * 16 bytes side by side
# (the scales stay the contiguous slice's: the same bytes, not the right groups)
_IL = [("const int blkw=warp*(KSL/32);", "const int blkw=warp*CB;"),
       ("wsrc[0]+(size_t)ci*CB*4;", "wsrc[0]+(size_t)ci*SPLIT*CB*4;"),
       ("wsrc[i]+(size_t)ci*CB*4);", "wsrc[i]+(size_t)ci*SPLIT*CB*4);"),
       ("xrow[mt]+(size_t)ci*CB*32+", "xrow[mt]+(size_t)ci*SPLIT*CB*32+")]
# xpD (session 57; keeps every bit): at the top of chunk ci, before its x loads, each lane asks L1 for
# one 128-byte line of chunk ci + D's x rows (prefetch.global.L1; 16 rows x CB / 2 lines, rows past
# `rows` repeating the last), so XE 1's loads of that chunk, D turns later, hit L1 instead of L2
_LOOP_TOP = _min("for (int ci = 0; ci < CPW; ++ci) {")
_XP = """{
  constexpr int LPR = CB / 2;
  const int cn = ci + XPD;
  if (two && cn < CPW) {
#pragma unroll
    for (int e = lane; e < 16 * LPR; e += 32) {
      const int rr = min(e / LPR, rows - 1);
      const T* pf = x + (size_t)(r0 + rr) * K + (size_t)blkw * 32 + (size_t)cn * CB * 32 + (e % LPR) * 64;
      asm volatile("prefetch.global.L1 [%0];" :: "l"(pf));
    }
  }
}"""
# fsN / fdN (session 58; keep every bit): the first weight stage committed in N parts (N = 2, 4; each
# part CB / N blocks, whole groups; a lane's copies all belong to one part, unit lane % CB), chunk 0
# computed part by part, each after its own wait, so a warp starts its arithmetic once the first part
# has landed instead of the whole stage (session 23's timeline: every warp waits ~3 us for its first
# stage, then runs its arithmetic back to back). fs issues the parts back to back; fd issues part 0
# first and the others just before the chunk loop (after XS's x staging at one row: an L2 round trip
# later), so the first parts of every warp lead the DRAM queue. NS 2 only.
_FS_PRO = _min("""if (!PRO) scp();
#pragma unroll
for (int st = 0; st < NS - 1; ++st) {
if (st < CPW) issue(st);
if (PRO && st == 0) scp();
tf_cp_async_commit();
}""")
_FS_PRO_NEW = """static_assert(NS == 2 && CB % (2 * FSP) == 0 && (CB / FSP) % BPG == 0);
const int mypart = (lane % UPR) / (UPR / FSP);
auto waitn = [](int n) {
  if (n <= 0) tf_cp_async_wait<0>();
  else if (n == 1) tf_cp_async_wait<1>();
  else if (n == 2) tf_cp_async_wait<2>();
  else if (n == 3) tf_cp_async_wait<3>();
  else tf_cp_async_wait<4>();
};
if (!PRO) scp();
#pragma unroll
for (int p = 0; p < (FSD ? 1 : FSP); ++p) {
  if (p == mypart) issue(0);
  if (PRO && p == 0) scp();
  tf_cp_async_commit();
}"""
_FS_LATE = _min("uint4 xv[CB][2], xn[CB][2];")
_FS_LATE_NEW = """if (FSD) {
#pragma unroll
  for (int p = 1; p < FSP; ++p) {
    if (p == mypart) issue(0);
    tf_cp_async_commit();
  }
}
uint4 xv[CB][2], xn[CB][2];"""
_FS_WAIT = _min("tf_cp_async_wait<NS - 2>();\n__syncwarp();")
_FS_WAIT_NEW = "waitn(ci == 0 ? FSP - 1 : 0);\n__syncwarp();"
_FS_LDM = _min("""unsigned int wq[CB][NT][2];
#pragma unroll
for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
for (int b = 0; b < CB; b += 2) {
unsigned int d[4];
tf_ldmatrix4(st + tf_swz<UPR>(16 * nt + lrow, b + (lm >> 1)), d);
wq[b][nt][0] = d[0]; wq[b][nt][1] = d[1]; wq[b + 1][nt][0] = d[2]; wq[b + 1][nt][1] = d[3];
}
}""")
_FS_LDM_NEW = """unsigned int wq[CB][NT][2];
auto ldw = [&](int b0, int b1) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int b = 0; b < CB; b += 2) {
      if (b >= b0 && b < b1) {
        unsigned int d[4];
        tf_ldmatrix4(st + tf_swz<UPR>(16 * nt + lrow, b + (lm >> 1)), d);
        wq[b][nt][0] = d[0]; wq[b][nt][1] = d[1]; wq[b + 1][nt][0] = d[2]; wq[b + 1][nt][1] = d[3];
      }
    }
  }
};
ldw(0, ci == 0 ? CB / FSP : CB);"""
_FS_GROUP = _min("for (int gi = 0; gi < GPC; ++gi) {\nfloat P[NT][2][4], X[2][4];")
_FS_GROUP_NEW = """for (int gi = 0; gi < GPC; ++gi) {
  if (ci == 0 && gi > 0 && (gi * BPG) % (CB / FSP) == 0) {
    waitn(FSP - (gi * BPG) / (CB / FSP));
    __syncwarp();
    ldw(gi * BPG, gi * BPG + CB / FSP);
  }
  float P[NT][2][4], X[2][4];"""


def _first_parts(body: str, parts: int, late: bool) -> str:
    body = _min(f"constexpr int FSP = {parts};\nconstexpr bool FSD = {'true' if late else 'false'};") + body
    for old, new in ((_FS_PRO, _FS_PRO_NEW), (_FS_LATE, _FS_LATE_NEW), (_FS_WAIT, _FS_WAIT_NEW),
                     (_FS_LDM, _FS_LDM_NEW), (_FS_GROUP, _FS_GROUP_NEW)):
        body = _replace(body, old, _min(new))
    return body


# cuts that keep every bit (their results are asserted equal to row_qmm_tc's)
EXACT = {"full", "hi", "hi2", "xp1", "xp2", "xp3", "fs2", "fs4", "fd2", "fd4"}


def _replace(text: str, old: str, new: str) -> str:
    old, new = old.rstrip("\n"), new.rstrip("\n")
    assert text.count(old) == 1, old
    return text.replace(old, new)


def variant_text(variant: str) -> tuple[str, str]:
    """(header, body) of row_qmm_cp cut to `variant` (full, or cuts joined by "+": mem, comp, nox,
    notail, even, nxm, xw0, il, hi, hi2): the package's minified sections (`_sources.sections`), cut, then pruned as
    `_sources.kernel_text` prunes them."""
    from tensorfold.kernels import _sources as S
    sec = S.sections("cuda", "row_gemm.cu")
    header, body = sec["header"], sec["row_qmm_cp"]
    start = _COMPUTE_FROM.rstrip("\n")
    for cut in variant.split("+"):
        if cut in ("mem", "notail"):
            a = body.index(start)
            b = body.rindex("}\n", 0, body.index("tf_tc_finish<"))     # the chunk loop's end
            inner = _MEM_CONSUME if cut == "mem" else "if(ci+1<CPW){\n" + body[a:b] + "}\n"
            body = body[:a] + inner + body[b:]
        elif cut == "comp":
            for lam in ("auto issue = [&](int ci) {", "auto scp = [&]() {"):
                body = _replace(body, _min(lam), _min(lam).rstrip("\n") + "return;")
        elif cut == "nox":
            body = _replace(body, _X_LOAD, _X_REG)
        elif cut == "even":
            header = _replace(header, _FOLD_LOOP, _FOLD_LOOP.replace("C0?2:1", "2"))
        elif cut == "nxm":
            body = _replace(body, _X_MMA, _X_FAKE)
        elif cut == "xw0":
            body = _replace(body, _X_SLICE, "")
        elif cut == "il":
            for a, b in _IL:
                body = _replace(body, a, b)
        elif cut in ("xp1", "xp2", "xp3"):
            body = _replace(body, _LOOP_TOP, _LOOP_TOP.rstrip("\n") + "\n" + _min(_XP.replace("XPD", cut[2:])))
        elif cut in ("fs2", "fs4", "fd2", "fd4"):
            body = _first_parts(body, int(cut[2]), cut[1] == "d")
        elif cut in _Q4_HI:
            header = _replace(header, _Q4_SHIFT, _Q4_HI[cut])
        elif cut != "full":
            raise ValueError(variant)
    return S.pruned(header, body), body


def kernel(variant: str, smem: int, text=None, prefix: str = "tfcp_", outputs=("out",)):
    """row_qmm_cp's inputs and launch with `variant`'s text (or `text`, a (header, body) pair)."""
    header, body = text or variant_text(variant)
    return mx.fast.cuda_kernel(name=prefix + variant.replace("+", "_"), input_names=["x", "w", "scales", "biases", "res"],
                               output_names=list(outputs), source=body, header=header,
                               ensure_row_contiguous=True, shared_memory=smem)


def inputs(N: int, K: int):
    """A random N x K weight quantized as mlx-community's checkpoints (4 bits, group 64, bf16
    scales), 16 bf16 x rows and the unused residual: (wq, scales, biases, x16, res), evaluated."""
    w = mx.random.normal((N, K)) * 0.02
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    del w
    x16 = (mx.random.normal((16, K)) * 0.5).astype(mx.bfloat16)
    res = mx.zeros((1,), dtype=mx.bfloat16)
    mx.eval(wq, s, b, x16, res)
    return wq, s, b, x16, res


VARIANTS = "full,mem,comp,full_ns3,mem_ns3,full_ns4,mem_ns4"
MISMATCHES = []


def cases():
    """(tag, variant, options) of each FLOOR_VARIANTS entry: the staging options of the module's
    docstring (`_cbN`, `_spN`, ...; a K split is another reduction order, checked against
    row_qmm_tc with that split); the default staging's value where one is left out."""
    out = []
    for tag in os.environ.get("FLOOR_VARIANTS", VARIANTS).split(","):
        v, *opts = tag.split("_")
        o = {k[:2]: int(k[2:]) for k in opts}
        assert set(o) <= {"cb", "ns", "xe", "nt", "sp", "on", "xs", "c0", "ur", "pr", "f2"}, tag
        out.append((tag, v, o))
    return out


def run():
    from gpu_kernel_time import marker
    from tensorfold.kernels import _cuda
    if os.environ.get("TF_CP_SMEM_KB"):     # a higher shared-memory ceiling (more stages, say)
        _cuda.CP_SMEM_LIMIT = int(os.environ["TF_CP_SMEM_KB"]) * 1024
    gpu = mx.default_stream(mx.gpu)
    for N, K in SHAPES:
        wq, s, b, x16, res = inputs(N, K)
        tc = _cuda.tc_plan(N, K, 64, 4)
        for R in ROWS:
            x = x16[:R]
            cb, ns, xe, nt, ur, pro, f2 = _cuda.cp_staging(N, K, 64, R > 8)
            refs = {}     # row_qmm_tc's bits with each split (the package's call has them)
            for tag, variant, o in cases():
                st = dict(cb=cb, ns=ns, xe=xe, nt=nt, sp=tc[2]) | o
                plan = _cuda.cp_plan(N, K, 64, 4, st["cb"], st["ns"], st["nt"], st["sp"])
                if plan is None or plan[1] != st["ns"] or (K // 32 // tc[1]) % st["sp"]:
                    print(N, K, R, tag, "does not apply", file=sys.stderr)
                    continue
                if st["sp"] not in refs:     # another split is another order: tc's bits with it
                    refs[st["sp"]] = _cuda.quantized_matmul(x, wq, s, b, 64, 4, gpu,
                                                            plan=(tc[0], tc[1], st["sp"], tc[3]))
                call = _cuda._qmm_cp_call(x.dtype, s.dtype, K, N, 64, R, False, st["cb"], st["ns"],
                                          st["xe"], st["nt"], st["sp"], None, o.get("ur", ur),
                                          o.get("pr", pro), o.get("on"),
                                          o.get("xs"), o.get("c0"), o.get("f2", f2))
                _, template, grid, tg, oshape, odtype = call
                if o.get("xs") and not dict(template)["XS"]:
                    print(N, K, R, tag, "XS does not apply", file=sys.stderr)
                    continue
                k = kernel(variant, _cuda.cp_plan(N, K, 64, 4, st["cb"], st["ns"], st["nt"], st["sp"],
                                                  dict(template)["XS"])[3])
                marker(f"{N}x{K}_M{R}_{tag.replace('+', '_')}")   # "+" is no C name
                try:
                    for _ in range(REPS):
                        y = k(inputs=[x, wq, s, b, res], template=template, grid=grid, threadgroup=tg,
                              output_shapes=oshape, output_dtypes=odtype)[0]
                        mx.eval(y)
                except RuntimeError as e:     # a launch past the SM's registers, say
                    print(N, K, R, tag, "failed:", str(e)[:300], file=sys.stderr, flush=True)
                    continue
                if set(variant.split("+")) <= EXACT and not mx.array_equal(y, refs[st["sp"]]).item():
                    # row_qmm_tc's bits (for that split): a mismatch is reported, the run goes on
                    print(N, K, R, tag, "MISMATCH: not row_qmm_tc's bits", file=sys.stderr, flush=True)
                    MISMATCHES.append((N, K, R, tag))
            print(N, K, R, "staging", (cb, ns, xe, nt, ur, pro, f2), "split", tc[2],
                  file=sys.stderr, flush=True)
    marker("end")
    if MISMATCHES:
        sys.exit(f"MISMATCH in {MISMATCHES}")


def report(path: str):
    from ncu_csv import ncu_rows, ncu_us
    times: dict[str, list[float]] = {}
    tag = None
    for r in ncu_rows(path):
        if r["Metric Name"] != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0].replace("custom_kernel_", "")
        if name.startswith("tfmark_"):
            tag = name[len("tfmark_"):]
        elif name.startswith("tfcp_") and tag:
            times.setdefault(tag, []).append(ncu_us(r))
    cols = []
    for t in times:
        c = t.split("_", 2)[2]
        if c not in cols:
            cols.append(c)
    print("| shape | rows | " + " | ".join(cols) + " | full - mem | full - comp |")
    print("|---|---:|" + "---:|" * (len(cols) + 2))
    rows = sorted({int(t.split("_")[1][1:]) for t in times})
    for N, K in SHAPES:
        for R in rows:
            med = {c: statistics.median(times[f"{N}x{K}_M{R}_{c}"]) for c in cols
                   if f"{N}x{K}_M{R}_{c}" in times}
            if not med:
                continue
            cells = [f"{med[c]:.2f}" if c in med else "-" for c in cols]
            d1 = f"{med['full'] - med['mem']:.2f}" if {"full", "mem"} <= med.keys() else "-"
            d2 = f"{med['full'] - med['comp']:.2f}" if {"full", "comp"} <= med.keys() else "-"
            print(f"| {N} x {K} | {R} | " + " | ".join(cells) + f" | {d1} | {d2} |")
    print(f"\nus, ncu device time, medians of {REPS} launches each (caches flushed before each)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        report(sys.argv[2])
    else:
        run()
