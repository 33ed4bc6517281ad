"""Offline syntax / type check of the CUDA faces with nvcc (no GPU needed).

Builds each kernel, from the sources in this folder (not the installed package's copy), exactly as
mx.fast.cuda_kernel would wrap it (see tensorfold.kernels._cuda.standalone_source; the header includes
common.cuh through tensorfold.kernels._sources.sections, the same path as the JIT) for a few template
configurations and runs
`nvcc -gencode arch=compute_90a,code=sm_90a -c` (MLX's JIT targets sm_90a on Hopper: jit_module.cpp's
arch tag; this image's `nvcc -arch=sm_90a` still emits sm_90 PTX). Usage: python csrc/cuda/nvcc_check.py [-v] [--ptx-hash] [--text-file] [--batch=N] [kernel names]

By default the cases go into files of about 24 (--batch=N; each case in a namespace of its own),
since nvcc's fixed cost per file is most of a case's time; -v (ptxas's register report) and
--ptx-hash compile a file a case.

--ptx-hash compiles to PTX instead and prints one hash per case, over the PTX without its
comments and line / file directives, static locals' mangled names cut to their own names: a
change meant to keep the generated code (comments, layout, refactors) must keep every hash.

--text-file builds each case as MLX gets it by default since session 43 (TENSORFOLD_CUDA_TEXT=file:
the header and the body, as a device function, in a file the text includes; a file a case, so
slower). This checker's default stays the inline text, which batches. With --ptx-hash the
file mode's hashes equal the inline ones for 534 of 550 cases (session 42; the other 16 order some
independent address arithmetic differently): the same operations from a text MLX builds and
hashes in a fraction of the time.
"""

import concurrent.futures
import hashlib

import os
import re
import subprocess
import sys
import tempfile

import mlx.core as mx

# the kernel sources next to this file, not the installed package's copy (which may predate an edit)
os.environ["TENSORFOLD_CUDA_SOURCES"] = os.path.dirname(os.path.abspath(__file__))

try:    # the installed package (CI), else this checkout's python/ (development)
    import tensorfold.kernels._cuda  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tensorfold.kernels._cuda import standalone_source  # noqa: E402

bf, f16, f32, u32, i32 = mx.bfloat16, mx.float16, mx.float32, mx.uint32, mx.int32

from tensorfold.kernels._cuda import attn_plan, attn_tc_smem, cp_ca  # noqa: E402

CASES = []
for T in (bf, f16, f32):
    for bits in (2, 3, 4, 5, 6, 8):
        CASES.append(("row_qmm", dict(T=T, S=T, K=4096, N=4096, GS=64, BITS=bits),
                      dict(x=T, w=u32, scales=T, biases=T), dict(out=T)))
    CASES.append(("row_mm", dict(T=T, W=T, K=4096, N=151936),
                  dict(x=T, w=T), dict(out=T)))
    for D in (64, 80, 96, 128, 256, 576):
        if T == f32 and D == 576:
            continue          # more than 48 KB for 32 fp32 keys: attn_plan refuses it
        NCH, VS, _ = attn_plan(D, T)
        CASES.append(("row_attn_partial", dict(T=T, TK=T, D=D, HQ=32, HKV=8, NCH=NCH, VS=VS),
                      dict(q=T, k=T, v=T, offset=i32, scale_f=f32), dict(part=f32)))
        if D in (80, 128, 256, 576):
            for DC in sorted({32, 64, D}):       # 64: attn_merge_cols' choice up to 8k keys
                CASES.append(("row_attn_merge", dict(T=T, D=D, SPAN=32 * NCH, DC=DC, MW=16, E=1),
                              dict(part=f32, offset=i32, q=T, k=T), dict(out=T)))
        if attn_tc_smem(D, T, T, T) is not None:
            CASES.append(("row_attn_tc", dict(T=T, D=D, HQ=32, HKV=8),
                          dict(q=T, k=T, v=T, offset=i32, scale_f=f32), dict(part=f32)))
            for NW, NB, SPB, KW in ((1, 2, 8, 1), (8, 2, 1, 1), (4, 2, 8, 1), (4, 2, 8, 2), (8, 2, 8, 2),
                                    (1, 2, 1, 2), (4, 2, 8, 4)):
                CASES.append(("row_attn_tcg", dict(T=T, D=D, HQ=32, HKV=8, NW=NW, NB=NB, SPB=SPB, KW=KW),
                              dict(q=T, k=T, v=T, offset=i32, scale_f=f32), dict(part=f32)))
            for NW, SPB in ((4, 8), (2, 1), (1, 8)):
                CASES.append(("row_attn_tcr", dict(T=T, D=D, HQ=32, HKV=8, NW=NW, NB=2, SPB=SPB),
                              dict(q=T, k=T, v=T, offset=i32, scale_f=f32), dict(part=f32)))
            if D in (64, 128):
                for NB, SPB in ((2, 8), (3, 1), (2, 16)):
                    CASES.append(("row_attn_wg", dict(T=T, D=D, HQ=32, HKV=8, NB=NB, SPB=SPB),
                                  dict(q=T, k=T, v=T, offset=i32, scale_f=f32), dict(part=f32)))
            for E, MW in ((8, 1), (16, 1), (8, 4), (16, 4), (1, 1), (1, 4)):
                CASES.append(("row_attn_merge", dict(T=T, D=D, SPAN=64, DC=32, MW=MW, E=E),
                              dict(part=f32, offset=i32, q=T, k=T), dict(out=T)))
            if D > 64:      # 64 columns a block: caches up to 8k keys (attn_merge_cols), MW up to 8 there
                for E, MW in ((1, 1), (1, 2), (1, 4), (1, 8), (8, 1), (16, 1)):
                    CASES.append(("row_attn_merge", dict(T=T, D=D, SPAN=64, DC=64, MW=MW, E=E),
                                  dict(part=f32, offset=i32, q=T, k=T), dict(out=T)))
    # row_expert.cu (MoE decode): Qwen3-30B-A3B-like expert shapes
    for bits in (2, 3, 4, 5, 6, 8):
        CASES.append(("row_expert_qmm", dict(T=T, S=T, K=2048, N=768, E=128, TOPK=8, GS=64,
                                             BITS=bits),
                      dict(x=T, w=u32, scales=T, biases=T, indices=i32), dict(out=T)))
    CASES.append(("row_expert_mm", dict(T=T, W=T, K=2048, N=768, E=128, TOPK=8),
                  dict(x=T, w=T, indices=i32), dict(out=T)))
    # the fused MoE-decode kernels: gate + up + SwiGLU, down + combine + residual
    for bits in (3, 4, 8):
        CASES.append(("row_expert_qmm_glu", dict(T=T, S=T, K=2048, N=768, E=128, TOPK=8, GS=64,
                                                 BITS=bits),
                      dict(x=T, wg=u32, sg=T, bg=T, wu=u32, su=T, bu=T, indices=i32), dict(h=T)))
        for RES in (True, False):
            CASES.append(("row_expert_qmm_sum", dict(T=T, S=T, K=768, N=2048, E=128, TOPK=8,
                                                     GS=64, BITS=bits, RES=RES),
                          dict(h=T, w=u32, scales=T, biases=T, indices=i32, scores=f32, res=T),
                          dict(out=T)))
    CASES.append(("row_expert_mm_glu", dict(T=T, W=T, K=2048, N=768, E=128, TOPK=8),
                  dict(x=T, wg=T, wu=T, indices=i32), dict(h=T)))
    CASES.append(("row_expert_mm_sum", dict(T=T, W=T, K=768, N=2048, E=128, TOPK=8, RES=True),
                  dict(h=T, w=T, indices=i32, scores=f32, res=T), dict(out=T)))
for E, TOPK, NORM in ((128, 8, True), (256, 8, False), (60, 4, True), (1024, 32, True)):
    CASES.append(("moe_route", dict(E=E, TOPK=TOPK, NORM=NORM), dict(logits=f32),
                  dict(inds=i32, scores=f32)))
for T in (bf, f16, f32):    # the MoE router: x as it is, fp32 logits (8-bit routers, as mlx-lm's)
    for bits in (4, 8):
        CASES.append(("row_qmm", dict(T=T, S=T, K=2048, N=128, GS=64, BITS=bits),
                      dict(x=T, w=u32, scales=T, biases=T), dict(out=f32)))
    CASES.append(("row_mm", dict(T=T, W=T, K=2048, N=128), dict(x=T, w=T), dict(out=f32)))
    # moe_route fused into the gate + up + SwiGLU kernels
    for bits in (4, 8):
        CASES.append(("row_expert_qmm_glu_route", dict(T=T, S=T, K=2048, N=768, E=128, TOPK=8,
                                                       GS=64, BITS=bits, NORM=True),
                      dict(x=T, wg=u32, sg=T, bg=T, wu=u32, su=T, bu=T, logits=f32),
                      dict(h=T, inds=i32, scores=f32)))
    CASES.append(("row_expert_mm_glu_route", dict(T=T, W=T, K=2048, N=768, E=60, TOPK=4, NORM=False),
                  dict(x=T, wg=T, wu=T, logits=f32), dict(h=T, inds=i32, scores=f32)))

# tensor-core GEMMs, with the plans the wrapper picks for real shapes
from tensorfold.kernels._cuda import cp_one, cp_plan, cp_staging, mm_cp_plan, tc_plan  # noqa: E402

for T in (bf, f16):
    for N, K, GS, bits in ((4096, 4096, 64, 4), (151936, 4096, 64, 4), (72, 256, 32, 4),
                           (4096, 12288, 128, 8), (72, 256, 64, 8), (1152, 384, 64, 4)):
        NT, CB, SPLIT, DB = tc_plan(N, K, GS, bits)
        CASES.append(("row_qmm_tc", dict(T=T, S=T, K=K, N=N, GS=GS, BITS=bits, NT=NT, CB=CB,
                                         SPLIT=SPLIT, DB=DB),
                      dict(x=T, w=u32, scales=T, biases=T), dict(out=T)))
    for N, K, GS in ((4096, 4096, 64), (151936, 4096, 64), (4096, 12288, 64), (24576, 4096, 32),
                     (12288, 4096, 64), (24576, 4096, 64), (6144, 4096, 64),
                     (4096, 4096, 128), (72, 256, 32), (1152, 384, 64)):
        # the default stagings (up to 8 rows, as one row takes them: ONE where it applies; past
        # 8); every x-load timing x tile count on one shape (bf16)
        combos = [(two, *cp_staging(N, K, GS, two)) for two in (False, True)]
        if (N, K, GS) == (1152, 384, 64) and T == bf:
            combos = [(two, 4, 2, x, t, 1, 0, 0) for two in (False, True) for x in (0, 1, 2) for t in (1, 2)]
        for TWO, cb, ns, XE, NT, UR, PRO, F2 in combos:
            CB, NS, SPLIT, _ = cp_plan(N, K, GS, 4, cb, ns, NT)
            CA = cp_ca(N, CB, NT)    # as the default call
            # one row: x staged once (XS) or not, column 0 folded alone (C0: the default with XS)
            for XS, C0 in ((False, False), (False, True), (True, True)) if not TWO else ((False, False),):
                CASES.append(("row_qmm_cp", dict(T=T, S=T, K=K, N=N, GS=GS, SPLIT=SPLIT, CB=CB, NS=NS,
                                                 RES=N == 4096, TWO=TWO, XE=0 if XS else XE, NT=NT, CA=CA, UR=UR,
                                                 PRO=bool(PRO), ONE=not TWO and cp_one(1, CB, GS), XS=XS,
                                                 C0=C0, F2=TWO and (F2 or T != bf)),   # fp16: F2 always
                              dict(x=T, w=u32, scales=T, biases=T, res=T), dict(out=T)))
    # per-copy pointers on CB 8 (CA off), two chunks a loop turn (UR 2; with 16 rows too), the
    # first weight stage before the scales (PRO; 16-byte scale copies where NG, NGW % 8 == 0:
    # not 4096 x 4096 g128, NGW 4)
    for N, K, GS, cb, ns, XE, NT, UR, TWO, CA, PRO in (
            (12288, 4096, 64, 8, 2, 1, 2, 1, False, False, False),
            (4096, 4096, 64, 4, 2, 2, 1, 2, True, False, False),
            (4096, 12288, 64, 8, 2, 1, 1, 2, False, False, False),
            (12288, 4096, 64, 8, 2, 1, 2, 1, False, True, True),
            (4096, 12288, 64, 4, 2, 2, 2, 2, True, False, True),
            (4096, 4096, 128, 4, 2, 2, 1, 1, False, False, True),
            # three and four weight tiles a block (16 rows; CA where every block is full)
            (12288, 4096, 64, 4, 2, 1, 3, 1, True, False, True),
            (12288, 4096, 64, 8, 2, 1, 3, 1, True, True, True),
            (12288, 4096, 64, 4, 2, 1, 4, 1, True, False, False)):
        CB, NS, SPLIT, _ = cp_plan(N, K, GS, 4, cb, ns, NT)
        CASES.append(("row_qmm_cp", dict(T=T, S=T, K=K, N=N, GS=GS, SPLIT=SPLIT, CB=CB, NS=NS,
                                         RES=False, TWO=TWO, XE=XE, NT=NT, CA=CA, UR=UR, PRO=PRO,
                                         ONE=False, XS=False, C0=False, F2=False),
                      dict(x=T, w=u32, scales=T, biases=T, res=T), dict(out=T)))
    for N, K in ((4096, 4096), (151936, 4096), (72, 256)):
        NT, CB, SPLIT, DB = tc_plan(N, K)
        CASES.append(("row_mm_tc", dict(T=T, K=K, N=N, NT=NT, CB=CB, SPLIT=SPLIT, DB=DB),
                      dict(x=T, w=T), dict(out=T)))
    # row_mm_cp: the stagings the s16d sweep starts from (bf16), one on fp16
    for N, K, cb, ns, xe, nt in (((4096, 4096, 2, 3, 1, 1), (4096, 4096, 1, 3, 0, 2),
                                  (151936, 4096, 4, 4, 1, 2), (4096, 12288, 2, 4, 1, 1),
                                  (72, 256, 1, 2, 1, 1)) if T == bf else ((4096, 4096, 2, 3, 1, 1),)):
        CB, NS, SPLIT, _ = mm_cp_plan(N, K, cb, ns, nt)
        for TWO in (False, True):
            CASES.append(("row_mm_cp", dict(T=T, K=K, N=N, SPLIT=SPLIT, CB=CB, NS=NS, XE=xe, NT=nt,
                                            TWO=TWO), dict(x=T, w=T), dict(out=T)))

# sparse_attention: D 64..256 (K staged in shared memory where it fits 48 KB) and the MLA
# latent widths 512 / 576 with one KV head (K read from global memory).
from tensorfold.kernels._cuda import sparse_smem, sparse_tc_plan, sparse_tile  # noqa: E402

for T in (bf, f16, f32):
    for D, HQ, HKV in ((64, 32, 8), (128, 32, 8), (192, 16, 4), (256, 8, 2), (512, 16, 1),
                       (576, 128, 1)):
        stage, smem = sparse_smem(D, T)
        assert smem <= 48 * 1024, (D, T, smem)
        CASES.append(("sparse_attn", dict(T=T, TK=T, D=D, HQ=HQ, HKV=HKV, STAGE=stage),
                      dict(q=T, k=T, v=T, indices=i32, offset=i32, scale_f=f32), dict(out=T)))
        CASES.append(("sparse_partial", dict(T=T, TK=T, D=D, HQ=HQ, HKV=HKV, DT=sparse_tile(D, T)[0]),
                      dict(q=T, k=T, v=T, kept=i32, nkept=i32, scale_f=f32, rinfo=i32),
                      dict(part=f32)))
        tc = sparse_tc_plan(D, HQ // HKV, T, T, T)
        if tc is not None:
            assert tc[3] <= 48 * 1024, (D, T, tc)
            CASES.append(("sparse_tc", dict(T=T, D=D, HQ=HQ, HKV=HKV, DT=tc[0], NST=tc[1], HB=tc[2]),
                          dict(q=T, k=T, v=T, indices=i32, offset=i32, scale_f=f32, rinfo=i32),
                          dict(part=f32, nkept=i32)))
    CASES.append(("sparse_merge", dict(T=T, D=576, HQ=16),
                  dict(part=f32, nkept=i32, q=T, rinfo=i32), dict(out=T)))
# sparse_tc at head sizes that are 16- / 32-multiples only (DT 16 / 32), a GQA group of 2, and
# the other tilings of D = 576 the tests compare (SPARSE_TC_TILES)
for T in (bf, f16):
    for D, HQ, HKV, DT, NST in ((80, 4, 2, 16, 4), (96, 16, 1, 32, 4), (576, 16, 1, 64, 4),
                                (576, 16, 1, 64, 3), (576, 16, 1, 32, 8), (576, 16, 1, 96, 3)):
        HB = 16 if HQ // HKV > 8 else 8
        CASES.append(("sparse_tc", dict(T=T, D=D, HQ=HQ, HKV=HKV, DT=DT, NST=NST, HB=HB),
                      dict(q=T, k=T, v=T, indices=i32, offset=i32, scale_f=f32, rinfo=i32),
                      dict(part=f32, nkept=i32)))
for T in (bf, f16, f32):
    for HD, NORM in ((128, True), (64, False), (256, True)):
        CASES.append(("qk_norm_rope", dict(T=T, H=32, HK=8, HD=HD, NORM=NORM),
                      dict(qkv=T, qn=T, kn=T, inv_freq=f32, params=f32, offset=i32), dict(q=T, k=T)))
        CASES.append(("qk_norm_rope_kv", dict(T=T, H=32, HK=8, HD=HD, NORM=NORM),
                      dict(qkv=T, qn=T, kn=T, inv_freq=f32, params=f32, offset=i32, kc=T, vc=T,
                           fence=f32),
                      dict(q=T)))
CASES.append(("sparse_compact", dict(), dict(indices=i32, offset=i32, k=bf), dict(kept=i32, nkept=i32)))


def _tag(case):
    name, tmpl = case[:2]
    return f"{name} {dict((k, str(v)) for k, v in tmpl.items())}"


_LOCAL = re.compile(r"_ZZ\w+")


def _local_name(m):
    """A function's static local (a __shared__ array declared in a body) is mangled with its
    function's name, which differs between the kernel and file mode's tf_body_<name>: keep the
    local's own name (the trailing E<length><name>), so the hash covers the code alone."""
    sym = m.group(0)
    for i in range(len(sym) - 2, 3, -1):
        if sym[i] == "E":
            j = i + 1
            while j < len(sym) and sym[j].isdigit():
                j += 1
            if j > i + 1 and len(sym) - j == int(sym[i + 1:j]):
                return "_ZZlocal_" + sym[j:]
    return sym


def _compile(tmp, idx, case, ptx, verbose, text="inline"):
    name, tmpl, ins, outs = case
    path = os.path.join(tmp, f"k{idx}.cu")
    with open(path, "w") as f:
        f.write(standalone_source(name, tmpl, ins, outs, text=text))
    cmd = ["nvcc", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-ptx" if ptx else "-c", path, "-o", path + ".o"]
    if verbose:
        cmd.append("-Xptxas=-v")
    r = subprocess.run(cmd, capture_output=True, text=True)
    tag = _tag(case)
    if r.returncode != 0:
        return False, f"FAIL {tag}\n{r.stderr[-4000:]}"
    if ptx:
        keep = [_LOCAL.sub(_local_name, ln) for ln in open(path + ".o").read().splitlines()
                if ln.strip() and not ln.lstrip().startswith(("//", ".loc", ".file"))]
        tag = hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16] + " " + tag
    out = "ok   " + tag
    if verbose and r.stderr:
        out += "\n" + r.stderr.strip()[-600:]
    return True, out


def _compile_batch(tmp, batch):
    """Several cases in one translation unit, each in a namespace of its own (their includes
    once, at the top): nvcc's fixed cost (~2.5 s a file on the CI machine, most of a case's
    time) is paid once a batch. A failing batch is compiled again case by case, so a failure
    names its case with its own error."""
    includes, parts = [], []
    for idx, (name, tmpl, ins, outs) in batch:
        body = []
        for ln in standalone_source(name, tmpl, ins, outs).splitlines():
            if ln.startswith("#include"):
                if ln not in includes:
                    includes.append(ln)
            else:
                body.append(ln)
        parts.append(f"namespace tf_case{idx} {{\n" + "\n".join(body) + f"\n}} // tf_case{idx}\n")
    path = os.path.join(tmp, f"b{batch[0][0]}.cu")
    with open(path, "w") as f:
        f.write("\n".join(includes) + "\n" + "".join(parts))
    r = subprocess.run(["nvcc", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-c", path, "-o", path + ".o"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return [(True, "ok   " + _tag(case)) for _, case in batch]
    return [_compile(tmp, idx, case, False, False) for idx, case in batch]


def main():
    verbose = "-v" in sys.argv
    ptx = "--ptx-hash" in sys.argv
    text = "file" if "--text-file" in sys.argv else "inline"
    if text == "file":      # the generated files go to a scratch cache, not the user's
        os.environ.setdefault("TENSORFOLD_CACHE_DIR", tempfile.mkdtemp(prefix="tf_nvcc_check_"))
    only = [a for a in sys.argv[1:] if not a.startswith("-")]
    size = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--batch=")), 24)
    cases = [(i, c) for i, c in enumerate(CASES) if not only or c[0] in only]
    with tempfile.TemporaryDirectory() as tmp, \
            concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        if ptx or verbose or size <= 1 or text == "file":   # a file a case: its own PTX hash / ptxas
            # report; file mode's bodies are included files, which batches' per-case namespaces can't wrap
            results = list(pool.map(lambda ic: _compile(tmp, ic[0], ic[1], ptx, verbose, text), cases))
        else:   # cases dealt round-robin into files of about `size`, so heavy kernels spread
            nb = max(1, -(-len(cases) // size))
            batches = [cases[b::nb] for b in range(nb)]
            done = {}
            for batch, rs in zip(batches, pool.map(lambda b: _compile_batch(tmp, b), batches)):
                done.update(zip((i for i, _ in batch), rs))
            results = [done[i] for i, _ in cases]
    for _, text in results:     # in case order, whatever order they finished in
        print(text)
    failed = sum(not ok for ok, _ in results)
    print(f"{len(cases) - failed}/{len(cases)} compiled")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
