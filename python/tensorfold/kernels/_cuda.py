"""CUDA faces of the row-exact kernels: mx.fast.cuda_kernel (NVRTC JIT) over csrc/cuda/*.cu.

Kernel objects are created lazily and only when ``mx.cuda.is_available()``. All shape
constants passed as template arguments are weight / head shapes; the number of rows M,
the KV capacity and the offset reach the kernels at run time (shapes / input arrays).
"""

from __future__ import annotations

import functools
import re
import warnings

import mlx.core as mx

from . import _kcache
from ._sources import body_file_text, cache_dir, cuda_text_mode, kernel_text, written_once

GEMM_ROWS_PER_BLOCK = 16
GEMM_COLS_PER_BLOCK = 16
GEMM_THREADS = 256
GEMM_KT = 1024
ATTN_WARPS = 8     # row_attn_partial: warps per block (row slots x chunks of 32 keys)
ATTN_MERGE_WARPS = 16
ATTN_MERGE_WARPS_PRE = 1   # for halves or group results (tests: > 1, groups side by side; the same bits)
# columns per merge block: 32 spreads a row's merge over D / 32 blocks (4x the blocks at D = 128;
# the merge was latency-bound on one block per row: 11.6 us at 32k keys, session 6); None: one
# block per row. Bit-identical either way (row_attention.cu, row_attn_merge).
ATTN_MERGE_COLS = 32
# (rows a call from, capacity up to, columns): calls of at least that many query rows (B * HQ * M) on
# caches up to that capacity take wider merge blocks. Session 41 (H200, step caches) set 64 columns for
# 16 rows up to 4k keys; session 42 (s42b / s42c, 32 q / 8 KV heads, D 128) timed 32 against 64 columns
# at 1, 8 and 16 rows from 1k to 32k keys: 64 was as fast or faster in 12 of 12 cases up to 8k keys
# (by up to 0.9 us: 1k keys one row 8.4 -> 8.2, 16 rows 12.6 -> 11.9; 4k keys 16 rows 21.5 -> 20.6) and
# within the runs' spread past it (12k-32k: -0.9 to +0.9 us). Rows below 32 were not timed and keep 32
# columns. Launch shape only: the same bits (108 of 108 timed variants checked). None: ATTN_MERGE_COLS
# everywhere (the benchmarks' and tests' explicit columns).
ATTN_MERGE_COLS_WIDE = (32, 8192, 64)
SMEM_LIMIT = 48 * 1024  # dynamic shared memory per block, the default limit

# (input names, output names, file) of each kernel
_KERNELS = {
    "row_qmm": (["x", "w", "scales", "biases"], ["out"], "row_gemm.cu"),
    "row_mm": (["x", "w"], ["out"], "row_gemm.cu"),
    "row_qmm_tc": (["x", "w", "scales", "biases"], ["out"], "row_gemm.cu"),
    "row_mm_tc": (["x", "w"], ["out"], "row_gemm.cu"),
    "row_qmm_cp": (["x", "w", "scales", "biases", "res"], ["out"], "row_gemm.cu"),
    "row_mm_cp": (["x", "w"], ["out"], "row_gemm.cu"),
    "row_attn_partial": (["q", "k", "v", "offset", "scale_f"], ["part"], "row_attention.cu"),
    "row_attn_tc": (["q", "k", "v", "offset", "scale_f"], ["part"], "row_attention.cu"),
    "row_attn_tcg": (["q", "k", "v", "offset", "scale_f"], ["part"], "row_attention.cu"),
    "row_attn_tcr": (["q", "k", "v", "offset", "scale_f"], ["part"], "row_attention.cu"),
    "row_attn_wg": (["q", "k", "v", "offset", "scale_f"], ["part"], "row_attention.cu"),
    "row_attn_merge": (["part", "offset", "q", "k"], ["out"], "row_attention.cu"),
    "sparse_attn": (["q", "k", "v", "indices", "offset", "scale_f"], ["out"],
                    "sparse_attention.cu"),
    "sparse_compact": (["indices", "offset", "k"], ["kept", "nkept"], "sparse_attention.cu"),
    "sparse_partial": (["q", "k", "v", "kept", "nkept", "scale_f", "rinfo"], ["part"],
                       "sparse_attention.cu"),
    "sparse_merge": (["part", "nkept", "q", "rinfo"], ["out"], "sparse_attention.cu"),
    "sparse_tc": (["q", "k", "v", "indices", "offset", "scale_f", "rinfo"], ["part", "nkept"],
                  "sparse_attention.cu"),
    "qk_norm_rope": (["qkv", "qn", "kn", "inv_freq", "params", "offset"], ["q", "k"],
                     "qk_norm_rope.cu"),
    "qk_norm_rope_kv": (["qkv", "qn", "kn", "inv_freq", "params", "offset", "kc", "vc", "fence"],
                        ["q"], "qk_norm_rope.cu"),
    "row_expert_qmm": (["x", "w", "scales", "biases", "indices"], ["out"], "row_expert.cu"),
    "row_expert_mm": (["x", "w", "indices"], ["out"], "row_expert.cu"),
    "row_expert_qmm_glu": (["x", "wg", "sg", "bg", "wu", "su", "bu", "indices"], ["h"],
                           "row_expert.cu"),
    "row_expert_mm_glu": (["x", "wg", "wu", "indices"], ["h"], "row_expert.cu"),
    "row_expert_qmm_sum": (["h", "w", "scales", "biases", "indices", "scores", "res"], ["out"],
                           "row_expert.cu"),
    "row_expert_mm_sum": (["h", "w", "indices", "scores", "res"], ["out"], "row_expert.cu"),
    "row_expert_qmm_glu_route": (["x", "wg", "sg", "bg", "wu", "su", "bu", "logits"],
                                 ["h", "inds", "scores"], "row_expert.cu"),
    "row_expert_mm_glu_route": (["x", "wg", "wu", "logits"], ["h", "inds", "scores"],
                                "row_expert.cu"),
    "moe_route": (["logits"], ["inds", "scores"], "row_expert.cu"),
}


def _texts(name: str, outputs: list[str], kinds: tuple | None = None) -> tuple[str, str]:
    """(header, source) MLX gets for kernel `name`: the pruned header and the body (kinds None), or
    TENSORFOLD_CUDA_TEXT=file's include of a file holding both and one call (kinds: the template
    arguments' (name, kind) in order; _sources.body_file_text)."""
    inputs, _, filename = _KERNELS[name]
    header, body = kernel_text("cuda", filename, name)
    if kinds is None:
        return header, body
    text, call = body_file_text(name, header, body, inputs, outputs, list(kinds))
    try:
        path = written_once(text, "tf_" + name)
    except OSError as e:            # an unwritable cache directory: the inline text, the same bits
        if not _texts.warned:
            _texts.warned = True
            warnings.warn(f"tensorfold: CUDA kernel texts inline (cannot write {cache_dir()}: {e}; "
                          "set TENSORFOLD_CACHE_DIR)", RuntimeWarning, stacklevel=2)
        return header, body
    return f'#include "{path}"\n', call


_texts.warned = False


def _outputs(name: str, unused_out: bool) -> list[str]:
    return _KERNELS[name][1] + (["unused_out"] if unused_out else [])


def _make(name: str, shared_memory: int, unused_out: bool, header: str, source: str):
    kname, outputs = f"tf_{name}" + ("_nm" if unused_out else ""), _outputs(name, unused_out)
    kernel = mx.fast.cuda_kernel(
        name=kname,
        input_names=_KERNELS[name][0],
        output_names=outputs,
        source=source,
        header=header,
        ensure_row_contiguous=True,
        shared_memory=shared_memory,
    )
    if not (_kcache.enabled() and mx.cuda.is_available()):   # else MLX compiles each instance in each process
        return kernel
    return _kcache.CachedKernel(kernel, kname, header, source, _KERNELS[name][0], outputs)


@functools.lru_cache(maxsize=None)
def _kernel(name: str, shared_memory: int, unused_out: bool = False):
    """unused_out (ATTN_NO_MERGE, benchmarks only): one more output, which the body never writes.
    Under TENSORFOLD_CUDA_TEXT=file a callable with the kernel's interface that makes one kernel a
    template signature (the file's device function takes the template arguments by kind)."""
    if cuda_text_mode() == "file":
        def call(*, template=(), **kw):
            return _file_instance(name, shared_memory, unused_out, tuple(template))(template=template, **kw)
        return call
    return _make(name, shared_memory, unused_out, *_texts(name, _outputs(name, unused_out)))


@functools.lru_cache(maxsize=None)
def _file_instance(name: str, shared_memory: int, unused_out: bool, template: tuple):
    """The file-mode kernel of one template instance. MLX compiles an instance at its first launch,
    which must find the included file: so each new instance writes or checks it once (written again
    where it is gone or damaged, e.g. a cache directory cleaned under a long-running server).
    Instances of one template signature share a kernel object (their texts are the same)."""
    kinds = tuple((k, _template_kind(v)) for k, v in template)
    return _file_kernel(name, shared_memory, unused_out, *_texts(name, _outputs(name, unused_out), kinds))


@functools.lru_cache(maxsize=None)
def _file_kernel(name: str, shared_memory: int, unused_out: bool, header: str, source: str):
    return _make(name, shared_memory, unused_out, header, source)


def clear_kernel_caches() -> None:
    """Forget every kernel object and every launch plan holding one (the *_call caches keep the
    kernel they were made with), so the next launch reads TENSORFOLD_CUDA_TEXT, ATTN_NO_MERGE and
    the other creation-time settings again. Benchmarks and tests only."""
    for f in list(globals().values()):
        if callable(getattr(f, "cache_clear", None)):
            f.cache_clear()


def _template_kind(v) -> str:
    return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "type"


def _rows_per_block(dtype) -> int:
    """MAXM in row_gemm.cu: x is staged in shared memory as its own dtype, <= 32 KB."""
    return 8 if dtype == mx.float32 else GEMM_ROWS_PER_BLOCK


def _rows_bucket(rows: int, per_block: int) -> int:
    b = 1
    while b < min(rows, per_block):
        b *= 2
    return b


def _gemm_launch(R: int, N: int, dtype):
    per = _rows_per_block(dtype)
    nblk = -(-N // GEMM_COLS_PER_BLOCK)
    rblk = -(-R // per)
    # launch size only; the code (and each row's arithmetic) is the same for all M
    smem = _rows_bucket(R, per) * GEMM_KT * dtype.size
    return (nblk * GEMM_THREADS, rblk, 1), (GEMM_THREADS, 1, 1), smem


# ---- tensor-core plan (row_qmm_tc / row_mm_tc): a function of the weight shape only ----
TC_TYPES = (mx.bfloat16, mx.float16)
TC_TARGET_WARPS = 132 * 32   # enough warps in flight to cover HBM latency on an H200
# 4-bit weights (row_qmm_cp): 3,072 warps are enough. H200 (bench/gpu_tc_sweep.py, ncu, medians;
# docs/benchmarks.md "Session 14"), M = 1 / 16: 12288 x 4096 split 4 12.85 / 16.69 us against
# split 8's 12.64 / 20.67; 24576 x 4096 split 2 20.51 / 29.12 against split 4's 21.89 / 30.05.
# The other 8B / MoE shapes keep their splits (6144 and 4096 rows: split 8 gives 3,072 or fewer).
TC_TARGET_WARPS_Q4 = 3072
TC_MAX_SPLIT = 8          # <= 256 threads per block: launchable at any register count
WORDS_IN_FLIGHT = 8          # weight words per lane per chunk (H200 sweep: NT 1, CB 4 best)


def tc_plan(N: int, K: int, group_size: int | None = None, bits: int | None = None):
    """(NT, CB, SPLIT, DB) for the tensor-core GEMMs: NT 16-column tiles per warp, CB
    32-element blocks per chunk (every load of a chunk is issued before its first use),
    SPLIT warps splitting K inside a block, DB double-buffered chunks (chunk i + 1 loads
    while chunk i computes). A function of (N, K, group size, bits) only: never of the
    number of rows, so every M runs the same arithmetic."""
    if bits is None:            # dense: a uint4 (8 weights) per lane per weight row per block
        NT = 2 if N > 16 else 1
        per_block = NT * 2 * 4
        bpg = 1
    else:                       # one 16-row tile per warp: <= 128 registers with DB
        NT = 1
        per_block = NT * 2 * (bits // 4)
        bpg = group_size // 32
    nblk = K // 32
    cb_max = max(1, WORDS_IN_FLIGHT // per_block)
    cands = [cb for cb in range(bpg, max(cb_max, bpg) + 1, bpg)
             if nblk % cb == 0 and cb // bpg in (1, 2, 4)]
    CB = max(cands)
    nchunk = nblk // CB
    nblocks = -(-N // (16 * NT))
    divs = [d for d in range(1, TC_MAX_SPLIT + 1) if nchunk % d == 0]
    target = TC_TARGET_WARPS_Q4 if bits == 4 else TC_TARGET_WARPS
    enough = [d for d in divs if nblocks * d >= target]
    SPLIT = min(enough) if enough else max(divs)
    return NT, CB, SPLIT, False   # DB: no gain on the H200 sweep (bench/gpu_tc_sweep.py)


def _tc_launch(R: int, N: int, NT: int, SPLIT: int):
    nblocks = -(-N // (16 * NT))
    smem = (SPLIT - 1) * NT * 2 * 4 * 32 * 4
    return (nblocks * 32 * SPLIT, -(-R // 16), 1), (32 * SPLIT, 1, 1), smem


@functools.lru_cache(maxsize=4096)
def _qmm_tc_call(T, S, K: int, N: int, gs: int, bits: int, R: int, plan=None):
    """Everything about one tensor-core quantized call but its arrays, computed once per
    (dtypes, shape, rows): the per-call Python cost is what a decode step pays per op."""
    NT, CB, SPLIT, DB = plan or tc_plan(N, K, gs, bits)
    grid, tg, smem = _tc_launch(R, N, NT, SPLIT)
    kern = _kernel("row_qmm_tc", smem)
    template = [("T", T), ("S", S), ("K", K), ("N", N), ("GS", gs), ("BITS", bits),
                ("NT", NT), ("CB", CB), ("SPLIT", SPLIT), ("DB", DB)]
    return kern, template, grid, tg, [(R, N)], [T]


# row_qmm_cp's shared-memory ceiling. MLX raises a kernel's limit itself above 48,000 bytes
# (cuFuncSetAttribute in its CustomKernel); an H200 SM has 227 KB. Two weight tiles per block on
# the split-8 shapes need 55-72 KB (cp_staging; 72 KB is the most measured); bench/gpu_tc_sweep.py
# may try more (TF_CP_SMEM_KB).
CP_SMEM_LIMIT = 72 * 1024


def cp_plan(N: int, K: int, group_size: int, bits: int, cb: int = 4, ns: int | None = None,
            nt: int = 1, split: int | None = None, xs: bool = False):
    """(CB, NS, SPLIT, dynamic shared memory) of row_qmm_cp (4-bit weights through a cp.async
    pipeline), or None where it does not apply. SPLIT is tc_plan's, so the output has the bits
    of row_qmm_tc; CB (blocks per stage), NS (stages) and NT (16-row weight tiles per block)
    only move data. A function of the weight shape only; cp_staging picks the default.
    `split` overrides tc_plan's SPLIT (bench/gpu_tc_sweep.py only: another split is another
    reduction order, the bits of row_qmm_tc with that split). `xs`: room for XS's staged x slice
    (2 K bytes a block) too, which may take a block past CP_SMEM_LIMIT up to CP_XS_SMEM_LIMIT."""
    if bits != 4:
        return None
    SPLIT = split or tc_plan(N, K, group_size, bits)[2]
    bpg = group_size // 32
    ksl = K // SPLIT
    ng, ngw = K // group_size, ksl // group_size
    if nt not in (1, 2, 3, 4) or K % SPLIT or cb % bpg or cb % 2 or ksl % (32 * cb) or ng % 2 or ngw % 2:
        return None
    cpw = ksl // (32 * cb)

    extra = 2 * K if xs else 0
    limit = max(CP_SMEM_LIMIT, CP_XS_SMEM_LIMIT) if xs else CP_SMEM_LIMIT

    def smem(n):
        return nt * ((SPLIT - 1) * 1024 + SPLIT * (n * cb * 256 + 64 * ngw))

    for n in ((ns,) if ns else (2,)):   # H200 sweep: 2 stages fastest on 4 of 5 shapes
        if n <= max(2, cpw) and smem(n) <= CP_SMEM_LIMIT and smem(n) + extra <= limit:
            return cb, n, SPLIT, smem(n) + extra
    return None


CP_WIDE_N = 16384   # from this many output columns: 8 blocks a stage, two weight tiles a block
CP_MID_N = 8192     # from this many: two weight tiles a block (past 48 KB with split 8)
CP_LONG_K = 8192    # from this many input columns: CB 8 up to 8 rows, two weight tiles past them
CP_TWO_XE1_N = 6144  # past 8 rows, from this many columns: x loaded before the wait (XE 1), one tile
CP_TWO_NT3_MAX_N = 24576   # past 8 rows, wide shapes up to this many columns: three weight tiles


@functools.lru_cache(maxsize=4096)
def cp_staging(N: int, K: int, group_size: int, two: bool = False) -> tuple[int, ...]:
    """row_qmm_cp's default staging (CB, NS, XE, NT, UR, PRO, F2), a function of the weight shape and
    of `two` (the launch has more than 8 rows: the TWO variant, already a kernel of its own). Each
    staging moves data, never a row's bits: every staging == row_qmm_tc bitwise at M = 1..16
    (tests/test_kernels.py::test_cuda_cp_pipeline_equals_register_kernel, and the sweep), so
    rows 0..7 of a 16-row call keep the bits of the 1-row call whichever staging each takes.

    H200 sweeps (bench/gpu_tc_sweep.py --cp, ncu device time, cold caches, M = 1 / 16;
    docs/benchmarks.md, sessions 12-14):
      - from CP_WIDE_N columns, where it fits: CB 8, x loaded before the wait (XE 1), two weight
        tiles a block (NT 2): 151936 x 4096 127.3 / 171.8 us, 24576 x 4096 (split 2) 20.5 /
        29.1 us;
      - from CP_MID_N columns: CB 8 up to 8 rows, CB 4 past them (XE 1, NT 2): 12288 x 4096
        (split 4) 12.85 / 16.69 us (session 14; CB 4 at M = 1 13.26, CB 8 at M = 16 17.78);
      - narrower: CB 4, x loaded one chunk ahead (XE 2), one tile a block (4096 x 12288 14.4
        us, 4096 x 4096 6.8 us at M = 1); past 8 rows with K >= CP_LONG_K two tiles (72 KB with
        split 8): 4096 x 12288 at M = 16 22.1 -> 19.2 us. Not with K = 4096: 4096 x 4096 9.9 ->
        9.5 us but 6144 x 4096 13.9 -> 15.7 (192 blocks on 132 SMs);
      - session 15: up to 8 rows with K >= CP_LONG_K, CB 8 and XE 1: 4096 x 12288 14.4 -> 13.7
        us; past 8 rows from CP_TWO_XE1_N columns, XE 1 (about 74 registers against XE 2's 130,
        so more blocks an SM): 6144 x 4096 13.2 / 13.4 -> 11.0 / 11.1 us in two sweeps, while
        4096 x 4096 stays with XE 2 (9.8 / 9.8 against 9.9 / 10.4);
      - session 19: two chunks a loop turn (UR 2) where x is loaded one chunk ahead into two
        tiles (XE 2, NT 2: the hand-over of the next chunk's x becomes register renaming):
        4096 x 12288 at M = 16 18.5 -> 16.6 / 16.7 us in two sweeps. Everywhere else UR 2 and 4
        measured slower or the same (docs/benchmarks.md, "Session 19");
      - session 20: the first weight stage copied before the scales (PRO 1) where one sweep
        (medians of 5) measured it faster: 12288 x 4096 past 8 rows 16.7 -> 15.9 us, 4096 x
        12288 at one row 12.6 -> 12.3, 4096 x 4096 at one row 7.5 -> 6.9 (6144 x 4096, the
        same staging, 8.7 both). Not where it measured slower or the same: 4096 x 4096 past 8
        rows 9.4 -> 9.8, 24576 x 4096 past 8 rows 28.4 -> 28.8, CB 8 at one row (12288 /
        24576 x 4096 12.4 / 20.0 both), 4096 x 12288 and 6144 x 4096 past 8 rows (16.7 both,
        11.3 -> 11.4);
      - session 25, past 8 rows (bench/gpu_run.sh s25b / s25c / floorx, ncu medians of 5, M = 16;
        docs/benchmarks.md "Session 25"): F2 (the second tile's branches constant) where three
        runs measured it faster: 12288 x 4096 15.90-16.16 -> 14.91-15.23 us and 4096 x 4096 9.41-9.57
        -> 8.70-8.90, and with two tiles there 8.22; not on 4096 x 12288 (16.6-17.2 -> 19.0-19.4),
        6144 x 4096 (11.3 -> 12.5-12.7) or 24576 x 4096 (28.2 -> 28.1-28.8). Three tiles a block on
        24576 x 4096 (CB 8: 512 blocks of 2 warps against 768; x read from L2 a third less):
        28.22 -> 26.91, and 28.06 -> 27.30 in medians of 9; not on 12288 x 4096 (15.9 -> 20.0,
        256 blocks of 4 warps). In medians of 9 (s25d) the new defaults against the old at 16 rows:
        12288 x 4096 16.16 -> 15.04, 4096 x 4096 9.54 -> 8.26;
      - session 26 (bench/gpu_run.sh s26d, floorx 26e, medians of 7, M = 16): no staging beat
        these: XE 2 + UR 2 with or without F2 (12288 x 4096 14.94 -> 20.5-24.6 us), hi / hi2, CB 8,
        NS 3, another K split (12288 x 4096 split 8 20.6 against 15.0)."""
    def fits(cb, nt):
        return cp_plan(N, K, group_size, 4, cb, 2, nt) is not None
    if two and CP_WIDE_N <= N <= CP_TWO_NT3_MAX_N and N % (16 * 3) == 0 and fits(8, 3):   # full blocks
        return 8, 2, 1, 3, 1, 0, 0
    if (N >= CP_WIDE_N or (N >= CP_MID_N and not two)) and fits(8, 2):
        return 8, 2, 1, 2, 1, 0, 0
    if N >= CP_MID_N and fits(4, 2):
        return 4, 2, 1, 2, 1, 1, int(two)
    if two and K >= CP_LONG_K and fits(4, 2):
        return 4, 2, 2, 2, 2, 0, 0
    if not two and K >= CP_LONG_K and N >= 4096 and fits(8, 1):     # (measured at N = 4096)
        return 8, 2, 1, 1, 1, 1, 0
    if two and N >= CP_TWO_XE1_N:
        return 4, 2, 1, 1, 1, 0, 0
    if two and N >= 4096 and fits(4, 2):     # (measured at N = 4096)
        return 4, 2, 2, 2, 1, 0, 1
    return 4, 2, 2, 1, 1, 0, 0


# row_qmm_cp's copies of a stage from one pointer and constant offsets (CA: data movement only,
# the same bits), where every block is full and a stage holds 8 or more blocks a row. H200 sweep
# (bench/gpu_run.sh s18c, ncu medians of 5, M = 1 / 16; docs/benchmarks.md "Session 18"): CB 8
# 12288 x 4096 12.6 -> 12.2 / 22.7 -> 17.0 us, 24576 x 4096 20.6 -> 20.2 / 29.6 -> 28.3,
# 4096 x 12288 12.5 -> 12.3 / 25.4 -> 19.5; with CB 4 slower on three of five shapes (12288 x
# 4096 13.9 -> 17.3 / 16.4 -> 19.3), so not there.
CP_CA_MIN_CB = 8


def cp_ca(N: int, cb: int, nt: int, ca: int | None = None) -> bool:
    """Whether row_qmm_cp addresses its copies as one pointer and constant offsets (CA): asked
    for (ca), or by default from CP_CA_MIN_CB blocks a stage; only where every block is full and
    a stage's copies cover whole rows (the kernel's static_assert)."""
    return (cb >= CP_CA_MIN_CB if ca is None else bool(ca)) and N % (16 * nt) == 0 and 32 % cb == 0


# XS: a one-row launch stages its warps' x slices once in shared memory as mma pairs, so a chunk
# reads x with 8 shared loads and no pair moves (nvcc sm_90, 12288 x 4096's chunk loop: 523 -> 494
# instructions, ALU-pipe ones 277 -> 246). Measured on the H200 (bench/gpu_run.sh s24a and floorx,
# ncu medians of 5, M = 1, before C0; docs/benchmarks.md "Session 24"): 12288 x 4096 12.29 ->
# 11.55-11.71 us, 4096 x 12288 12.35 -> 11.55-11.71, 6144 x 4096 8.42 -> 7.74, 4096 x 4096
# 6.78-6.88 -> 6.46-6.56, 24576 x 4096 19.62 -> 19.14, but the LM head 151936 x 4096 127.6 ->
# 135-137 (37 waves of blocks, each staging its x): so up to CP_XS_MAX_N columns. The x slice
# (2 K bytes a block) may take a block past CP_SMEM_LIMIT, up to CP_XS_SMEM_LIMIT (4096 x 12288:
# 75 KB, 2 blocks a SM). With C0 as well (the one-row fold of column 0 only, _qmm_cp_call):
# 12288 x 4096 11.23 us (2.52 TB/s), 4096 x 12288 11.38, 24576 x 4096 18.37. C0 is the default
# only where XS is on: session 26 (bench/gpu_run.sh s26e, ncu medians of 18, C0 against C0 off)
# 12288 x 4096 11.39 / 11.63 us, 24576 x 4096 18.58 / 19.10, but on the LM head 151936 x 4096,
# where XS is off, 129.01 / 127.55 (and 129.54 / 127.46 in s26a).
CP_XS_MAX_N = 24576
CP_XS_SMEM_LIMIT = 100 * 1024


def cp_xs(N: int, R: int) -> bool:
    """Whether a row_qmm_cp launch of R rows stages x once (XS) by default."""
    return R == 1 and N <= CP_XS_MAX_N


def cp_one(R: int, cb: int, gs: int) -> bool:
    """Whether a row_qmm_cp launch of R rows takes the ONE variant: one row, and an even number
    of groups a stage (each odd group's X comes from the even group's X mmas, in the column no
    row is stored from: the same bits, a third fewer mmas with one weight tile, a sixth with two)."""
    return R == 1 and (cb * 32 // gs) % 2 == 0


@functools.lru_cache(maxsize=4096)
def _qmm_cp_call(T, S, K: int, N: int, gs: int, R: int, res: bool = False, cb: int = 4,
                 ns: int | None = None, xe: int = 0, nt: int = 1, split: int | None = None,
                 ca: int | None = None, ur: int = 1, pro: int = 0, one: int | None = None,
                 xs: int | None = None, c0: int | None = None, f2: int | None = 0):
    if xe not in (0, 1, 2) or ca not in (None, 0, 1) or ur not in (1, 2, 4) or pro not in (0, 1) \
            or any(v not in (None, 0, 1) for v in (one, xs, c0, f2)):
        raise ValueError(f"row_qmm_cp: no staging XE {xe}, CA {ca}, UR {ur}, PRO {pro}, ONE {one}, "
                         f"XS {xs}, C0 {c0}, F2 {f2}")
    plan = cp_plan(N, K, gs, 4, cb, ns, nt, split or None)
    if plan is None:
        return None
    # XS (None: cp_xs's default): one row, and room for the staged x slice (else the same launch
    # without it). Its x loads are shared loads after the stage wait: XE does not apply (0).
    want = cp_xs(N, R) if xs is None else bool(xs) and R == 1
    xs_plan = cp_plan(N, K, gs, 4, cb, ns, nt, split or None, True) if want else None
    xs = xs_plan is not None
    plan, xe = (xs_plan, 0) if xs else (plan, xe)
    # C0 (None: with XS, as measured; see above): at one row, the group fold of column 0 only (the
    # rest is never stored)
    c0 = (xs if c0 is None else bool(c0)) and R == 1
    # F2 (0 / None: off; cp_staging's default turns it on where measured faster): 9..16 rows,
    # the second tile's branches constant
    f2 = bool(f2) and 8 < R <= 16
    ca = cp_ca(N, cb, nt, ca)
    CB, NS, SPLIT, smem = plan
    kern = _kernel("row_qmm_cp", smem)
    one = (one is None or bool(one)) and cp_one(R, CB, gs)
    template = [("T", T), ("S", S), ("K", K), ("N", N), ("GS", gs), ("SPLIT", SPLIT),
                ("CB", CB), ("NS", NS), ("RES", res), ("TWO", R > 8),
                ("XE", xe), ("NT", nt), ("CA", ca), ("UR", ur), ("PRO", bool(pro)), ("ONE", one),
                ("XS", xs), ("C0", c0), ("F2", f2)]
    grid = (-(-N // (16 * nt)) * 32 * SPLIT, -(-R // 16), 1)
    return kern, template, grid, (32 * SPLIT, 1, 1), [(R, N)], [T]


def mm_cp_plan(N: int, K: int, cb: int = 2, ns: int = 3, nt: int = 1, split: int | None = None):
    """(CB, NS, SPLIT, dynamic shared memory) of row_mm_cp (dense bf16 / fp16 weights through a
    cp.async pipeline), or None where it does not apply. SPLIT is tc_plan's, so the output has
    the bits of row_mm_tc; CB (32-element blocks a stage), NS (stages) and NT (16-row weight tiles
    a block) only move data. `split` overrides SPLIT (sweeps only: another reduction order)."""
    SPLIT = split or tc_plan(N, K)[2]
    if K % SPLIT or nt not in (1, 2) or ns < 2:
        return None
    ksl = K // SPLIT
    if ksl % (32 * cb):
        return None
    smem = nt * 1024 * ((SPLIT - 1) + SPLIT * ns * cb)
    return (cb, ns, SPLIT, smem) if smem <= CP_SMEM_LIMIT else None


# row_mm_cp's default staging (CB, NS, XE, NT) per weight shape, or None: row_mm_tc (registers).
# Measured on the H200 in session 17 (`bash bench/gpu_run.sh s16d`, ncu, each plan asserted ==
# row_mm_tc bitwise): CB 2, NS 3 was the fastest plan at M = 1 on 4096x4096 (11.1 us against
# row_mm_tc's 16.8) and 4096x12288 (28.7 us against 67.9); CB 1, NS 3 (13.4 us on 4096x4096)
# serves K slices of 32 elements (e.g. K = 768 or 256 at split 8). Where neither fits a shape
# (mm_cp_plan is None), _mm_default_call falls back to row_mm_tc: same bits either way.
# Read once per (dtype, shape, rows) by _mm_default_call.
MM_CP_DEFAULTS = ((2, 3, 1, 1), (1, 3, 1, 1))


def mm_cp_staging(N: int, K: int):
    for cb, ns, xe, nt in MM_CP_DEFAULTS:
        if mm_cp_plan(N, K, cb, ns, nt) is not None:
            return cb, ns, xe, nt
    return None


@functools.lru_cache(maxsize=4096)
def _mm_cp_call(T, K: int, N: int, R: int, cb: int = 2, ns: int = 3, xe: int = 1, nt: int = 1,
                split: int | None = None):
    plan = mm_cp_plan(N, K, cb, ns, nt, split)
    if plan is None:
        return None
    CB, NS, SPLIT, smem = plan
    kern = _kernel("row_mm_cp", smem)
    template = [("T", T), ("K", K), ("N", N), ("SPLIT", SPLIT), ("CB", CB), ("NS", NS),
                ("XE", xe), ("NT", nt), ("TWO", R > 8)]
    grid = (-(-N // (16 * nt)) * 32 * SPLIT, -(-R // 16), 1)
    return kern, template, grid, (32 * SPLIT, 1, 1), [(R, N)], [T]


@functools.lru_cache(maxsize=4096)
def _mm_default_call(T, K: int, N: int, R: int):
    """The default dense call (row_mm_cp where mm_cp_staging names a staging, else row_mm_tc),
    resolved once per (dtype, shape, rows): one cache lookup per call on the decode path."""
    staging = mm_cp_staging(N, K)
    return (staging and _mm_cp_call(T, K, N, R, *staging)) or _mm_tc_call(T, K, N, R)


@functools.lru_cache(maxsize=4096)
def _mm_tc_call(T, K: int, N: int, R: int, plan=None):
    NT, CB, SPLIT, DB = plan or tc_plan(N, K)
    grid, tg, smem = _tc_launch(R, N, NT, SPLIT)
    kern = _kernel("row_mm_tc", smem)
    template = [("T", T), ("K", K), ("N", N), ("NT", NT), ("CB", CB), ("SPLIT", SPLIT),
                ("DB", DB)]
    return kern, template, grid, tg, [(R, N)], [T]


def quantized_tc_ok(x_dtype, scales_dtype, K: int, group_size: int, bits: int) -> bool:
    """Whether row_quantized_matmul takes the tensor-core face (dtype / shape only)."""
    return (x_dtype in TC_TYPES and scales_dtype in TC_TYPES and bits in (4, 8)
            and group_size in (32, 64, 128) and K % group_size == 0)


def matmul_tc_ok(x_dtype, w_dtype, K: int) -> bool:
    return x_dtype in TC_TYPES and w_dtype == x_dtype and K % 64 == 0


def quantized_matmul(x, w, scales, biases, group_size, bits, stream, plan=None, residual=None,
                     out_float=False):
    """plan: override, for benchmarks that sweep plans only: ("cp", CB, NS[, XE, NT, SPLIT, CA, UR, PRO, ONE, XS, C0, F2])
    for row_qmm_cp (SPLIT 0 or None: tc_plan's; CA: constant-offset copies, 0 / 1, left out:
    from CB 8; UR: chunks a loop turn, 1, 2 or 4; PRO 1: the first weight stage copied before the
    scales, the scales in 16-byte copies where they allow; ONE 0: not the one-row variant; XS: x staged
    once at one row, 1 / 0 / None: cp_xs's default; C0: at one row, column 0 folded alone, 1 / 0 / None: with XS; F2 1: 9..16 rows, the second tile's
    branches constant),
    (NT, CB, SPLIT, DB) for row_qmm_tc (the 4-bit default is row_qmm_cp where cp_plan applies).
    residual: added to the product -- in row_qmm_cp's store where its dtype and shape allow,
    else by MLX's add after the kernel. out_float: a float32 result with the bits of this op on
    x.astype(float32) (row_qmm, whatever x's dtype: no copy of x)."""
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"row_quantized_matmul (cuda): unsupported bits {bits}")
    N = w.shape[0]
    K = w.shape[1] * 32 // bits
    lead = x.shape[:-1]
    x2 = x if x.ndim == 2 else x.reshape(-1, K)
    R = x2.shape[0]
    inputs = [x2, w, scales, biases]
    fused = False
    tc = quantized_tc_ok(x.dtype, scales.dtype, K, group_size, bits) and not out_float
    cp_call = None
    if tc and bits == 4 and (plan is None or plan[0] == "cp"):
        fused = residual is not None and residual.dtype == x.dtype and residual.shape == (*lead, N)
        if plan is None:
            cb, ns, xe, nt, ur, pro, f2 = cp_staging(N, K, group_size, R > 8)
            plan = ("cp", cb, ns, xe, nt, 0, None, ur, pro, None, None, None, f2)
        cp_call = _qmm_cp_call(x.dtype, scales.dtype, K, N, group_size, R, fused, *plan[1:])
    if cp_call is not None:
        kern, template, grid, tg, oshape, odtype = cp_call
        inputs.append(residual.reshape(R, N) if fused else _const_array((0.0,), x.dtype))
    elif tc:
        fused = False
        kern, template, grid, tg, oshape, odtype = _qmm_tc_call(
            x.dtype, scales.dtype, K, N, group_size, bits, R,
            None if plan is None or plan[0] == "cp" else plan)
    else:
        grid, tg, smem = _gemm_launch(R, N, x.dtype)
        kern = _kernel("row_qmm", smem)
        template = [("T", x.dtype), ("S", scales.dtype), ("K", K), ("N", N),
                    ("GS", group_size), ("BITS", bits)]
        oshape, odtype = [(R, N)], [mx.float32 if out_float else x.dtype]
    out = kern(inputs=inputs, template=template, grid=grid, threadgroup=tg,
               output_shapes=oshape, output_dtypes=odtype, stream=stream)[0]
    out = out if x.ndim == 2 else out.reshape(*lead, N)
    return out if residual is None or fused else out + residual


def matmul(x, w, stream, plan=None, out_float=False):
    """plan: override, for benchmarks that sweep plans only: ("cp", CB, NS, XE, NT[, SPLIT]) for
    row_mm_cp, (NT, CB, SPLIT, DB) for row_mm_tc (the default, or row_mm_cp where mm_cp_staging
    names a staging). out_float: as quantized_matmul's (row_mm on x as it is, a float32 result)."""
    N, K = w.shape
    if K % 32 != 0:
        raise ValueError("row_matmul (cuda): K must be a multiple of 32")
    lead = x.shape[:-1]
    x2 = x if x.ndim == 2 else x.reshape(-1, K)
    R = x2.shape[0]
    if matmul_tc_ok(x.dtype, w.dtype, K) and not out_float:
        if plan is None:
            call = _mm_default_call(x.dtype, K, N, R)
        elif plan[0] == "cp":
            call = _mm_cp_call(x.dtype, K, N, R, *plan[1:])
            if call is None:
                raise ValueError(f"row_mm_cp: staging {plan} does not apply to {N} x {K}")
        else:
            call = _mm_tc_call(x.dtype, K, N, R, plan)
        kern, template, grid, tg, oshape, odtype = call
        out = kern(inputs=[x2, w], template=template, grid=grid, threadgroup=tg,
                   output_shapes=oshape, output_dtypes=odtype, stream=stream)[0]
        return out if x.ndim == 2 else out.reshape(*lead, N)
    grid, tg, smem = _gemm_launch(R, N, x.dtype)
    out = _kernel("row_mm", smem)(
        inputs=[x2, w],
        template=[("T", x.dtype), ("W", w.dtype), ("K", K), ("N", N)],
        grid=grid, threadgroup=tg,
        output_shapes=[(R, N)], output_dtypes=[mx.float32 if out_float else x.dtype], stream=stream,
    )[0]
    return out.reshape(*lead, N)


@functools.lru_cache(maxsize=4096)
def _const_array(values: tuple, dtype) -> mx.array:
    """A small kernel argument (softmax scale, row range) as an evaluated array, made once per
    value (a decode step would otherwise build and copy one per layer)."""
    a = device_array(values, dtype)
    mx.eval(a)
    return a


def device_array(values, dtype) -> mx.array:
    """A small kernel argument in device memory. MLX's CUDA allocator puts arrays made from host
    data, and every array of <= 8 bytes, in managed memory (cudaMallocManaged; the <= 8-byte ones
    in a pool shared with the host), where a kernel's reads cost microseconds: H200, row_attn_tc
    at 2k keys 36 us with its offset and scale there, 7.8 us with them in device memory (Nsight
    Compute, bench/gpu_attn_split.py). So the values are padded to 16 bytes, copied by one GPU
    op (whose output is a device allocation), and the result is a view of the first len(values)."""
    n = len(values)
    pad = max(n, -(-16 // dtype.size))
    return (mx.array(list(values) + [0] * (pad - n), dtype=dtype) + 0)[:n]


def _scale_array(scale: float) -> mx.array:
    return _const_array((float(scale),), mx.float32)


LOG2E = 1.4426950408889634   # log2(e): row_attention.cu's scores are in base 2 (tf_ex2)


def attn_plan(D: int, kdtype) -> tuple[int, bool, int]:
    """(NCH, VS, dynamic shared memory bytes) of row_attn_partial, a function of the head size and
    KV dtype only: spans of NCH chunks of 32 keys (2 where they fit 48 KB), their keys in padded
    rows, their values too (VS) where that fits, and the chunk partials the first chunk's warps
    merge. SPAN = 32 * NCH is part of every row's arithmetic (row_attention.cu)."""
    for nch, vs in ((2, True), (1, True), (1, False)):
        smem = 32 * nch * (D + 8) * kdtype.size + (32 * nch * D * kdtype.size if vs else 0) \
            + (ATTN_WARPS // nch) * (nch - 1) * (D + 2) * 4
        if smem <= SMEM_LIMIT:
            return nch, vs, smem
    raise NotImplementedError(f"row_attention (cuda): head size {D} with {kdtype} keys needs more "
                              "than 48 KB of shared memory for 32 keys; use bf16/fp16 KV")


def attn_tc_smem(D: int, q_dtype, k_dtype, v_dtype) -> int | None:
    """Dynamic shared memory of row_attn_tc (tensor cores), or None where it does not apply:
    it needs bf16/f16 q, K and V of one dtype and D a multiple of 16 up to 128 (a function of
    dtypes and head size only, so every call of a model takes the same path)."""
    if not (q_dtype == k_dtype == v_dtype and q_dtype in (mx.bfloat16, mx.float16)):
        return None
    if D % 16 or D > 128:
        return None
    return (2 * 64 + 8) * (D + 8) * 2 + 8 * 68 * 4 + 8 * 72 * 2 + 8 * 2 * 4


@functools.lru_cache(maxsize=1024)
def _attn_launch(q_dtype, k_dtype, v_dtype, D: int, HQ: int, HKV: int):
    """(partial kernel, its template, threads per block, dynamic shared memory, SPAN) of one
    model's attention: the tensor-core partials where they apply, else the CUDA-core ones."""
    tc_smem = attn_tc_smem(D, q_dtype, k_dtype, v_dtype)
    if tc_smem is not None:
        return ("row_attn_tc", (("T", q_dtype), ("D", D), ("HQ", HQ), ("HKV", HKV)), 128,
                tc_smem, 64)
    NCH, VS, smem = attn_plan(D, k_dtype)
    return ("row_attn_partial", (("T", q_dtype), ("TK", k_dtype), ("D", D), ("HQ", HQ),
                                 ("HKV", HKV), ("NCH", NCH), ("VS", VS)),
            32 * ATTN_WARPS, smem, 32 * NCH)


ATTN_HALF_SPANS = 8         # row_attention.cu's tree: spans folded into a half, two halves a group
ATTN_TCG_BUFFERS = 2        # row_attn_tcg: spans of K / V staged at once
# benchmarks: "span" (row_attn_tc), or row_attn_tcg as "s<NW>" (span blocks) / "g<NW>" (half
# blocks) with NW 8-row tiles, "k" / "kk" for two / four warps a tile (KW), ".<NB>" buffers optional
# (e.g. "g4.3", "s2", "g4k"); a "t" first for row_attn_tcr, NW 16-row tiles ("tg4", "ts2.3"); "w"
# for row_attn_wg ("ws4", "wg4", and "wd4": a group a block)
attn_impl = None
# benchmarks only, WRONG OUTPUTS: the partials kernel gets a second output of q's shape that it never
# writes, which attention() returns without launching the merge: the most a merge fused into the
# partials kernel (one launch a layer fewer) could save, host time and device time together
# (bench_engine.py --no-merge-too; gpu_run.sh s42a)
ATTN_NO_MERGE = False


def attn_tcg_smem(D: int, NW: int, NB: int = ATTN_TCG_BUFFERS, KW: int = 1) -> int:
    """Dynamic shared memory of row_attn_tcg: NB spans' K and V, each row tile's weights, and each
    warp's score maxima (exchanged between a tile's two warps with KW 2)."""
    return (NB * 2 * 64 * (D + 8) + NW * 8 * 72) * 2 + NW * KW * 8 * 4


def attn_tcr_smem(D: int, NW: int, NB: int = ATTN_TCG_BUFFERS) -> int:
    """Dynamic shared memory of row_attn_tcr: NB spans' K and V and each warp's 16 query rows (its
    weights stay in registers)."""
    return (NB * 2 * 64 + 16 * NW) * (D + 8) * 2


@functools.lru_cache(maxsize=1)
def wgmma_device() -> bool:
    """Whether the CUDA device is Hopper (compute capability 9.x), where MLX's JIT compiles for
    sm_90a (mlx/backend/cuda/jit_module.cpp: the arch tag "a" from 9.0) and row_attn_wg's wgmma
    exists. Anything else (Ampere, Ada, Blackwell's tcgen05) runs row_attn_tcr, which gives the
    same bits."""
    try:
        return int(mx.device_info().get("compute_capability_major", 0)) == 9
    except Exception:   # an MLX without device_info: no wgmma
        return False


def attn_wg_runs(D: int) -> bool:
    """Whether row_attn_wg runs for head size D here (64 or 128, on Hopper); else a "w" plan runs
    row_attn_tcr, which gives the same bits."""
    return D in (64, 128) and wgmma_device()


def attn_wg_smem(D: int, NB: int = ATTN_TCG_BUFFERS) -> int:
    """Dynamic shared memory of row_attn_wg: NB spans' K and V and the block's 64 query rows, in
    wgmma's 128-byte swizzled layout (no padding)."""
    return (NB * 2 * 64 + 64) * D * 2


def attn_tcg_plan(R: int, cap: int, nkv: int, wg: bool) -> tuple[int, int, int, int] | None:
    """(SPB, NW, NB, KW) of row_attn_tcg, or None for row_attn_tc (R query rows a KV head, nkv = B *
    HKV, wg: attn_wg_runs). Launch shape only: every plan gives every row the same bits (row_attention.cu), so this
    may look at the row count and the capacity. row_attn_tc walks a span's rows 8 at a time
    between block barriers and writes one fp32 partial a row and 64 keys, which the merge reads
    back; row_attn_tcg gives each warp 8 rows alone: with SPB 1 (span blocks) it writes the span
    partials as row_attn_tc does, with SPB 8 (half blocks, "g") it folds half a group's spans in
    the block, one partial a row and 512 keys, but runs a block's spans one after another;
    row_attn_wg's SPB 16 ("wd4") folds both halves and the group, one partial a row and 1,024 keys.
    (Sessions 29-36 measured group blocks of 16 spans, before the tree's halves.)
    Measured on the H200 (session 29, 32 / 8 heads, D = 128, bench/gpu_attn_rows.py, us):
    - group blocks win where the launch has at least about a block an SM (4 warps: 32k keys at
      1 row 45.5 against row_attn_tc's 53.9, 16 rows 116.7 against 269.1; 8k keys at 16 rows
      39.1 against 74.8), with 8 warps once 4-warp blocks would pass three an SM at 64 rows
      (32k keys, 16 rows: 98.8 against 116.7, and 80.4 against 122.7 once the kernel fit 128
      registers, two 8-warp blocks an SM; 8k keys, 16 rows: 48.9 against 37.4);
    - span blocks with 4 warps win below that at any row count (1k keys: 10.8 / 10.9 / 11.8 /
      14.8 at 1 / 4 / 8 / 16 rows against 11.8 / 14.6 / 20.6 / 31.8; 8k keys: 21.0 / 25.7 /
      36.2 against 22.0 / 30.4 / 45.3).
    Session 30 (same tool): two warps an 8-row tile (KW 2, "k") where group blocks of 4 tiles
    number at least 128: 8k keys, 16 rows 36.4 against g4's 37.5; 32k keys, 1 / 8 rows 45.4 /
    55.2 against 45.5 / 55.9 (at 32k keys, 16 rows g8 stays: 80.3, g4k 98.9). Below that,
    2-tile group blocks with two warps a tile where they number at least 128: 8k keys, 8 rows
    29.4 against s4's 36.1 (at 16 rows, where 4-tile blocks reach 128, g2k takes 40.1).
    Session 31 (base-2 scores): row_attn_tcr's group blocks of four 16-row warps ("tg4") where g8
    was: 32k keys, 16 rows 69.5 against g8's 73.9; elsewhere its one warp's chain a span is
    longer (1k keys, one row: 36.3 against g4k's 24.8; 8k keys, 16 rows 46.8 against 34.8).
    Session 33: row_attn_wg's group blocks ("wg4": tcr's arithmetic on wgmma, a warpgroup of 64
    rows, 128-byte swizzled shared memory) where tg4 was: 32k keys, 16 rows 54.4 against 70.0.
    Elsewhere no faster than the defaults (8k keys, 16 rows 35.0 against 34.4; 32k keys, one row
    41.2 against g4k's 42.8, within the spread between runs) or slower (fewer group blocks than
    SMs: 8k keys, one row 26.9 against 20.2). Session 34: also at 32k keys and 8 rows (32 rows a
    KV head, half a warpgroup's), 45.3 against g4k's 52.6 (8k keys, 8 rows: 29.6 against g2k's
    27.1). Session 35: past 16 rows a KV head and past 64 groups where row_attn_wg runs (measured
    from 96 groups, where g4k's or g2k's blocks outnumber the SMs; 72-88 groups not measured): 12k
    keys, 16 / 12 / 8 / 5 rows 37.4 / 35.0 / 31.0 / 29.6 against the default's 50.2 / 49.4 / 37.3 /
    37.0; 16k keys, 16 rows 38.5 against 50.7; 24k keys 46.1 against 77.3 (8k keys, 64 groups: 16
    rows 34.3 against g4k's 34.4, 8 rows 29.9 against g2k's 27.4; at 16 rows a KV head g4k stays:
    16k keys 29.0 against 30.2). Session 36, after row_attn_wg's q rows went by cp.async (they were
    plain loads, one round trip after another): also past 32 rows at 64 groups, 8k keys at 16 rows
    32.9 against g4k's 34.6 (8 rows: 29.4 against g2k's 27.4, which stays). Off Hopper, or at head
    sizes other than 64 / 128, "wg4" runs tcr's tg4 (the same bits).
    Session 37, the tree's halves (a group of 16 spans = two halves of 8, each folded from (-inf,
    0, 0)): half blocks (128 at 8k keys, where groups were 64) and row_attn_wg's wd4 (a group a
    block, the halves in registers). Where row_attn_wg runs, at 1 / 8 / 16 rows: 8k keys g4k 17.4
    (span blocks 20.2), wg4 21.0, wg4 26.5 (were 19.9 / 27.4 / 32.9); 16k keys g4k 26.7, wg4 28.7,
    wd4 35.9 (wg4 38.0; were 27.6 / 31.1 / 36.5); 32k keys wd4 42.0 / 44.3 / 51.8 (g4k 46.9, wg4
    52.5 / 68.7; were 43.2 / 44.4 / 52.4); 1k keys span blocks as before (10.3 / 11.5 / 14.1).
    Session 38, at caps that rule was not set from (s38a): 24k keys (384 halves) wd4 also at 1 and 8
    rows, 37.2 / 39.8 against g4k's 41.2 and wg4's 45.9; below 128 halves, 4-tile half blocks (g4k)
    from 128 of them (4k keys, 16 rows 22.6 against g2k's 24.4), 2-tile ones (g2k) where their 16-row
    count reaches 128 (2k keys, 16 rows 18.5 against s4's 22.0; 4k keys, 8 rows 18.1 against 22.8),
    span blocks below (1k keys, 2k keys at 8 rows: 14.3 against g2k's 17.1; 4k keys at one row).
    Off Hopper the session-36 rule stands, in halves (unmeasured there)."""
    impl = attn_impl
    if impl is None:
        halves = -(-cap // (64 * ATTN_HALF_SPANS)) * nkv
        blocks = halves * -(-R // 32)                               # of 4-tile half blocks
        if wg and (halves >= 384 or (halves >= 256 and R > 32)):   # row_attn_wg, a group a block (sessions 37-38)
            impl = "wd4"
        elif wg and halves >= 128:                                  # half blocks: wgmma's past 16 rows
            impl = "wg4" if R > 16 else "g4k"
        elif wg:                                                    # below 128 halves (session 38)
            impl = "g4k" if blocks >= 128 else ("g2k" if halves * -(-R // 16) >= 128 else "s4")
        elif blocks >= 256:  # "wg4" past 768 4-tile blocks past 32 rows (off Hopper tcr's tg4, which lost to g4k below)
            impl = "wg4" if R > 32 and blocks > 768 else "g4k"
        else:
            impl = "g2k" if halves * -(-R // 16) >= 256 else "s4"
    return None if impl == "span" else _tcg_plan(impl)


@functools.lru_cache(maxsize=64)
def _tcg_plan(impl: str) -> tuple[int, int, int, int]:
    """(SPB, NW, NB, KW) of a plan name (parsed once: attention's wrapper runs every step); KW 0
    stands for row_attn_tcr (a "t" first: 16-row tiles, rows on the mma's M side), -1 for
    row_attn_wg (a "w" first, NW 4: a warpgroup of 64 rows on wgmma's M side)."""
    m = re.fullmatch(r"([tw]?)([sgd])([1-8])(k{0,2})(?:\.(\d+))?", impl)   # [t|w] s|g|d <NW> [k|kk] [.NB]
    if (not m or int(m[5] or ATTN_TCG_BUFFERS) < 2 or (m[1] and m[4]) or (m[1] == "w" and m[3] != "4")
            or (m[2] == "d" and m[1] != "w")):
        raise ValueError(f"row_attn_tcg plan {impl!r}: [t]s|g<1-8 row tiles>[k|kk, not with t]"
                         "[.<buffers, >= 2>], or ws4 / wg4 / wd4[.<buffers>]")
    kw = {"t": 0, "w": -1}.get(m[1], 2 ** len(m[4]))
    spb = {"s": 1, "g": ATTN_HALF_SPANS, "d": 2 * ATTN_HALF_SPANS}[m[2]]
    return spb, int(m[3]), int(m[5] or ATTN_TCG_BUFFERS), kw


def attn_merge_cols(rows: int, cap: int, D: int) -> int:
    """Columns a row_attn_merge block writes: ATTN_MERGE_COLS (None: the whole row), or
    ATTN_MERGE_COLS_WIDE's columns for calls of enough rows on caches up to 8k keys. Launch shape only: every
    column count gives the same bits (row_attention.cu, row_attn_merge)."""
    if ATTN_MERGE_COLS is None:
        return D
    if ATTN_MERGE_COLS_WIDE is not None:
        r, c, dc = ATTN_MERGE_COLS_WIDE
        if rows >= r and cap <= c:
            return min(dc, D)
    return min(ATTN_MERGE_COLS, D)


def attention(q, k, v, offset, scale, stream):
    B, HQ, M, D = q.shape
    HKV, cap = k.shape[1], k.shape[2]
    name, template, threads, smem, span = _attn_launch(q.dtype, k.dtype, v.dtype, D, HQ, HKV)
    nspan = -(-cap // span)
    R = HQ // HKV * M                           # query rows a KV head
    wg = attn_wg_runs(D)
    plan = attn_tcg_plan(R, cap, B * HKV, wg) if name == "row_attn_tc" else None
    spb = 1                                     # spans a partial: a span, a half or a group
    if plan is not None:
        spb, nw, nb, kw = plan
        if kw < 0 and not wg:                   # tcr gives row_attn_wg's bits (halves)
            kw, spb = 0, min(spb, ATTN_HALF_SPANS)
        nspan = -(-cap // (span * spb))         # blocks along the keys, a partial each
        template = template + (("NW", nw), ("NB", nb), ("SPB", spb))
        if kw < 0:                              # row_attn_wg: a warpgroup 64 rows (sm_90a)
            name, threads, rows, smem = "row_attn_wg", 128, 64, attn_wg_smem(D, nb)
            template = template[:4] + (("NB", nb), ("SPB", spb))
        elif kw == 0:                           # row_attn_tcr: a warp a 16-row tile
            name, threads, rows, smem = "row_attn_tcr", 32 * nw, 16 * nw, attn_tcr_smem(D, nw, nb)
        else:
            name, threads, rows, smem = "row_attn_tcg", 32 * nw * kw, 8 * nw, attn_tcg_smem(D, nw, nb, kw)
            template = template + (("KW", kw),)
        grid = nspan * -(-R // rows) * threads
    else:
        grid = nspan * threads
    outs = _kernel(name, smem, unused_out=ATTN_NO_MERGE)(
        inputs=[q, k, v, offset, _scale_array(scale * LOG2E)],
        template=list(template),
        grid=(grid, B * HKV, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(B * HQ * M, nspan, D + 2)] + ([q.shape] if ATTN_NO_MERGE else []),
        output_dtypes=[mx.float32] + ([q.dtype] if ATTN_NO_MERGE else []),
        stream=stream,
    )
    if ATTN_NO_MERGE:
        return outs[1]
    part = outs[0]
    dc = attn_merge_cols(B * HQ * M, cap, D)
    # warps a merge block: one a group of the capacity, up to 16, for span partials; one for halves
    # or groups, walked 16 at a time (session 37: 16 warps a row at 16 rows, 32k keys, took 19.4 us)
    mw = min(ATTN_MERGE_WARPS if spb == 1 else ATTN_MERGE_WARPS_PRE, -(-cap // (2 * ATTN_HALF_SPANS * span)))
    out = _kernel("row_attn_merge", mw * (dc + 2) * 4)(
        inputs=[part, offset, q, k],
        template=[("T", q.dtype), ("D", D), ("SPAN", span), ("DC", dc), ("MW", mw), ("E", spb)],
        grid=(B * HQ * M * -(-D // dc) * 32 * mw, 1, 1),
        threadgroup=(32 * mw, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype], stream=stream,
    )[0]
    return out


SPARSE_C = 64
SPARSE_WARPS = 8


def sparse_smem(D: int, kdtype) -> tuple[bool, int]:
    """(STAGE, dynamic shared memory bytes) of sparse_attn: K chunks are staged in shared
    memory when they fit 48 KB, else read from global memory (same arithmetic)."""
    base = SPARSE_WARPS * SPARSE_C * 4 + (SPARSE_C + 32) * 4
    stage_bytes = SPARSE_C * (D + 1) * kdtype.size
    stage = base + stage_bytes <= SMEM_LIMIT
    return stage, base + (stage_bytes if stage else 0)


SPARSE_SCRATCH = 256 * 2**20   # bytes of span partials per launch of the split form
SPARSE_TC_THREADS = 128        # sparse_tc: 4 warps
SPARSE_TC_TILES = None         # sparse_tc: (DT, NST) override (tests / bench; None: the plan's)


def sparse_tile(D: int, kdtype) -> tuple[int, int]:
    """(DT, dynamic shared memory bytes) of sparse_partial: the widest D tile (dividing D,
    16-byte rows) whose keys (padded) and values fit 48 KB next to the softmax weights."""
    base = SPARSE_WARPS * SPARSE_C * 4 + SPARSE_C * 4
    for dt in sorted({t for t in (D, 256, 192, 128, 96, 64, 32) if t <= D}, reverse=True):
        smem = base + SPARSE_C * (2 * dt + 1) * kdtype.size
        if D % dt == 0 and (dt * kdtype.size) % 16 == 0 and smem <= SMEM_LIMIT:
            return dt, smem
    raise NotImplementedError(f"sparse_attention (cuda): no D tile for head size {D}")


def sparse_tc_plan(D: int, G: int, q_dtype, k_dtype, v_dtype):
    """(DT, NST, HB, dynamic shared memory bytes) of sparse_tc (tensor cores), or None where it
    does not apply (it needs bf16 / f16 q, K and V of one dtype and D a multiple of 16). A
    function of dtypes, D and the GQA group size only, so every call of a model takes the same
    path. DT (the D tile of the cp.async ring), NST (tiles in the ring) and HB (heads per block)
    move data only: they never change a row's arithmetic (the mma chains run over 16-wide
    steps whatever the tile)."""
    if not (q_dtype == k_dtype == v_dtype and q_dtype in (mx.bfloat16, mx.float16)) or D % 16:
        return None
    if SPARSE_TC_TILES is not None:
        DT, NST = SPARSE_TC_TILES
    else:
        DT, NST = (64 if D % 64 == 0 else (32 if D % 32 == 0 else 16)), 4
    HB = 16 if G > 8 else 8
    smem = (NST * SPARSE_C * (DT + 8) * 2 + HB * (SPARSE_C + 4) * 4
            + HB * (SPARSE_C + 8) * 2 + HB * 2 * 4 + SPARSE_C * 4 + 8 * 4)
    if D % DT or DT % 16 or NST < 2 or smem > SMEM_LIMIT:
        raise ValueError(f"sparse_tc: tiles {(DT, NST)} do not fit D = {D} in 48 KB")
    return DT, NST, HB, smem


def sparse_attention(q, k, v, indices, offset, scale, stream, split: bool = True):
    """Sparse selected-key attention (csrc/cuda/sparse_attention.cu), any D.

    bf16 / f16 (q, K, V of one dtype, D % 16 == 0): `sparse_tc` -- one block per (span of 64
    kept entries, kv head, query row, 16 heads) compacts the row's list itself, streams the
    span's keys and values through a cp.async ring and scores / sums on tensor cores -- then
    `sparse_merge` folds the spans in order. Other dtypes (CUDA cores): the kept entries are
    compacted per row (sparse_compact), every span of 64 of them is its own block
    (sparse_partial, D tiled) and the spans are merged in order (sparse_merge) -- the arithmetic
    of the one-kernel form (split=False, sparse_attn, CUDA-core dtypes only), spread over blocks.
    Query rows go in groups so that the span partials stay under SPARSE_SCRATCH."""
    B, HQ, M, D = q.shape
    HKV, NI = k.shape[1], indices.shape[2]
    G = HQ // HKV
    tc = sparse_tc_plan(D, G, q.dtype, k.dtype, v.dtype)
    if not split:
        if tc is not None:
            raise ValueError("sparse_attention (cuda): the one-kernel form has the CUDA-core "
                             "arithmetic; bf16 / f16 use the tensor-core split form")
        return _sparse_fused(q, k, v, indices, offset, scale, stream)
    nspan = max(1, -(-NI // SPARSE_C))
    scale_f = _scale_array(scale)
    per_row = B * HQ * nspan * (D + 2) * 4
    group = max(1, min(M, SPARSE_SCRATCH // per_row))
    # rows x head groups in the grid's z: at most GRID_YZ_MAX (a 2,048-row chunk is far below)
    group = min(group, max(1, GRID_YZ_MAX // -(-G // (tc[2] if tc is not None else SPARSE_WARPS))))
    if tc is not None:
        DT, NST, HB, smem = tc
        kern = _kernel("sparse_tc", smem)
        template = [("T", q.dtype), ("D", D), ("HQ", HQ), ("HKV", HKV), ("DT", DT), ("NST", NST),
                    ("HB", HB)]

        def partials(r0, rows):     # the row's list compacted in the kernel
            rinfo = _const_array((r0, rows, 0), mx.int32)
            part, nkept = kern(
                inputs=[q, k, v, indices, offset, scale_f, rinfo], template=template,
                grid=(nspan * SPARSE_TC_THREADS, B * HKV, rows * -(-G // HB)),
                threadgroup=(SPARSE_TC_THREADS, 1, 1),
                output_shapes=[(B * HQ * rows, nspan, D + 2), (B * rows,)],
                output_dtypes=[mx.float32, mx.int32], stream=stream)
            return part, nkept, rinfo
    else:
        kept, nkept_all = _kernel("sparse_compact", 0)(
            inputs=[indices, offset, k], grid=(B * M * 32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(B * M, NI), (B * M,)], output_dtypes=[mx.int32, mx.int32],
            stream=stream)
        DT, smem = sparse_tile(D, k.dtype)

        def partials(r0, rows):
            rinfo = _const_array((r0, rows, r0), mx.int32)
            part = _kernel("sparse_partial", smem)(
                inputs=[q, k, v, kept, nkept_all, scale_f, rinfo],
                template=[("T", q.dtype), ("TK", k.dtype), ("D", D), ("HQ", HQ), ("HKV", HKV),
                          ("DT", DT)],
                grid=(nspan * 32 * SPARSE_WARPS, B * HKV, rows * -(-G // SPARSE_WARPS)),
                threadgroup=(32 * SPARSE_WARPS, 1, 1),
                output_shapes=[(B * HQ * rows, nspan, D + 2)], output_dtypes=[mx.float32],
                stream=stream)[0]
            return part, nkept_all, rinfo
    merge = _kernel("sparse_merge", 0)
    outs = []
    for r0 in range(0, M, group):
        rows = min(group, M - r0)
        part, nkept, rinfo = partials(r0, rows)
        outs.append(merge(
            inputs=[part, nkept, q, rinfo], template=[("T", q.dtype), ("D", D), ("HQ", HQ)],
            grid=(B * HQ * rows * -(-D // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
            output_shapes=[(B, HQ, rows, D)], output_dtypes=[q.dtype], stream=stream)[0])
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _sparse_fused(q, k, v, indices, offset, scale, stream):
    """The one-kernel form: one block per (query row, 8 heads) walks all the row's spans."""
    B, HQ, M, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    stage, smem = sparse_smem(D, k.dtype)
    scale_f = _scale_array(scale)
    return _kernel("sparse_attn", smem)(
        inputs=[q, k, v, indices, offset, scale_f],
        template=[("T", q.dtype), ("TK", k.dtype), ("D", D), ("HQ", HQ), ("HKV", HKV),
                  ("STAGE", stage)],
        grid=(-(-G // SPARSE_WARPS) * 32 * SPARSE_WARPS, B * HKV, M),
        threadgroup=(32 * SPARSE_WARPS, 1, 1),
        output_shapes=[q.shape], output_dtypes=[q.dtype], stream=stream,
    )[0]


QK_HEAD_DIMS = (64, 128, 256)


def qk_norm_rope(qkv, H: int, HK: int, q_norm, k_norm, eps: float, inv_freq, rope_scale: float,
                 offset, stream, kv=None):
    """q [B, H, L, hd], k [B, HK, L, hd] from qkv [B, L, (H + 2 HK) hd]: per-head RMSNorm (when
    q_norm is given) and RoPE in one launch (csrc/cuda/qk_norm_rope.cu). With kv = (kc, vc), the
    KV cache buffers [B, HK, cap, hd] (and optionally a fence: any array, never read, that the
    launch waits for in MLX's CUDA graph), the key and value rows are written into them in place
    at rows offset.. (qk_norm_rope_kv) and only q is returned."""
    B, L, C = qkv.shape
    hd = C // (H + 2 * HK)
    norm = q_norm is not None
    dummy = _const_array((0.0,), qkv.dtype)
    warps = B * L * (H + HK)
    inputs = [qkv, q_norm if norm else dummy, k_norm if norm else dummy, inv_freq,
              _const_array((float(eps), float(rope_scale)), mx.float32), offset]
    launch = dict(template=[("T", qkv.dtype), ("H", H), ("HK", HK), ("HD", hd), ("NORM", norm)],
                  grid=(-(-warps // 4) * 128, 1, 1), threadgroup=(128, 1, 1), stream=stream)
    if kv is not None:
        kc, vc = kv[0], kv[1]
        fence = kv[2] if len(kv) > 2 else dummy
        return _kernel("qk_norm_rope_kv", 0)(inputs=inputs + [kc, vc, fence],
                                             output_shapes=[(B, H, L, hd)],
                                             output_dtypes=[qkv.dtype], **launch)[0]
    return _kernel("qk_norm_rope", 0)(inputs=inputs, output_shapes=[(B, H, L, hd), (B, HK, L, hd)],
                                      output_dtypes=[qkv.dtype, qkv.dtype], **launch)


GRID_YZ_MAX = 65535     # CUDA's limit on a grid's y and z dimensions


def _in_row_pieces(R: int, per_row: int, launch):
    """launch(cut, n) -> the outputs (rows on the leading axis) of n rows, where cut(arr, per=1)
    gives arr's rows of the piece (per rows of arr a row); called on row pieces whose grids keep
    y (per_row blocks a row) within GRID_YZ_MAX, the pieces' outputs joined. The kernels are
    row-exact, so a row's bits do not depend on the piece it is in; a call that fits (every decode
    step, a 2,048-row prefill chunk at top-8: 16,384) is one launch of the arrays as they are."""
    step = max(1, GRID_YZ_MAX // per_row)
    if R <= step:
        return launch(lambda arr, per=1: arr, R)
    parts = [launch(lambda arr, per=1, a=a: arr[a * per:min(R, a + step) * per], min(R, a + step) - a)
             for a in range(0, R, step)]
    return [mx.concatenate(list(outs), axis=0) for outs in zip(*parts)]


def _expert_shape(w, scales, bits, what: str):
    """(E, N, K, quantized) of a stacked expert weight, with the CUDA faces' limits checked."""
    E, N = w.shape[0], w.shape[1]
    quant = scales is not None
    K = w.shape[2] * 32 // bits if quant else w.shape[2]
    if K % 32 != 0:
        raise ValueError(f"{what} (cuda): K must be a multiple of 32")
    if quant and bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"{what} (cuda): unsupported bits {bits}")
    return E, N, K, quant


def _expert_template(x, w, scales, K, N, E, topk, group_size, bits, quant):
    if quant:
        return [("T", x.dtype), ("S", scales.dtype), ("K", K), ("N", N), ("E", E),
                ("TOPK", topk), ("GS", group_size), ("BITS", bits)]
    return [("T", x.dtype), ("W", w.dtype), ("K", K), ("N", N), ("E", E), ("TOPK", topk)]


def expert_matmul(x, w, scales, biases, indices, group_size, bits, stream):
    """row_expert_matmul: x [..., K], indices [..., k] -> [..., k, N] (csrc/cuda/row_expert.cu)."""
    E, N, K, quant = _expert_shape(w, scales, bits, "row_expert_matmul")
    topk = indices.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    R = x2.shape[0]
    idx = indices.reshape(-1).astype(mx.int32)
    name = "row_expert_qmm" if quant else "row_expert_mm"
    tmpl = _expert_template(x, w, scales, K, N, E, topk, group_size, bits, quant)

    def launch(cut, n):     # blocks (column block, row x expert) in the grid
        return _kernel(name, 0)(
            inputs=[cut(x2), w, scales, biases, cut(idx, topk)] if quant else [cut(x2), w, cut(idx, topk)],
            template=tmpl, grid=(-(-N // GEMM_COLS_PER_BLOCK) * GEMM_THREADS, n * topk, 1),
            threadgroup=(GEMM_THREADS, 1, 1),
            output_shapes=[(n * topk, N)], output_dtypes=[x.dtype], stream=stream)
    out = _in_row_pieces(R, topk, launch)[0]
    return out.reshape(*lead, topk, N)


def expert_glu(x, gate, up, indices, group_size, bits, stream):
    """kernels.moe.expert_glu: x [R, K], indices [R, k] -> h [R, k, N] (row_expert_*_glu)."""
    E, N, K, quant = _expert_shape(gate[0], gate[1], bits, "expert_glu")   # shapes: kernels.moe
    R, topk = indices.shape
    # the row_expert kernels read no shapes: arrays go in and out in their callers' shapes (the
    # same row-major memory as the flat [R * k, ...] the kernels index), with no reshape nodes
    # in the decode step's graph (bench/step_graph.py)
    name = "row_expert_qmm_glu" if quant else "row_expert_mm_glu"
    tmpl = _expert_template(x, gate[0], gate[1], K, N, E, topk, group_size, bits, quant)

    def launch(cut, n):
        return _kernel(name, 0)(
            inputs=_glu_inputs(cut(x), gate, up, cut(indices), quant), template=tmpl,
            grid=(-(-N // GEMM_COLS_PER_BLOCK) * GEMM_THREADS, n * topk, 1),
            threadgroup=(GEMM_THREADS, 1, 1),
            output_shapes=[(n, topk, N)], output_dtypes=[x.dtype], stream=stream)
    return _in_row_pieces(R, topk, launch)[0]


def _glu_inputs(x, gate, up, last, quant):
    """The row_expert_*_glu(_route) kernels' inputs: x, gate's and up's arrays, then the ids (or
    the router's logits)."""
    return [x, *gate[:3], *up[:3], last] if quant else [x, gate[0], up[0], last]


def expert_sum(h, down, indices, scores, residual, group_size, bits, stream):
    """kernels.moe.expert_sum: h [R, k, K], indices / scores [R, k] -> [R, N] (row_expert_*_sum)."""
    E, N, K, quant = _expert_shape(down[0], down[1], bits, "expert_sum")   # shapes: kernels.moe
    R, topk = indices.shape
    res = (residual.reshape(R, N).astype(h.dtype) if residual is not None
           else _const_array((0.0,), h.dtype))
    # h [R, k, K], indices / scores [R, k] as they are (see expert_glu)
    name = "row_expert_qmm_sum" if quant else "row_expert_mm_sum"
    tmpl = _expert_template(h, down[0], down[1], K, N, E, topk, group_size, bits, quant)
    tmpl = tmpl + [("RES", residual is not None)]

    def launch(cut, n):         # a block a (column pair, row): rows in the grid's y
        weights = [*down[:3]] if quant else [down[0]]
        return _kernel(name, 0)(
            inputs=[cut(h), *weights, cut(indices), cut(scores), res if residual is None else cut(res)],
            template=tmpl, grid=(-(-N // 2) * 32 * topk, n, 1), threadgroup=(32 * topk, 1, 1),
            output_shapes=[(n, N)], output_dtypes=[h.dtype], stream=stream)
    return _in_row_pieces(R, 1, launch)[0]


def expert_glu_route(x, gate, up, logits, k, normalize, group_size, bits, stream):
    """kernels.moe.route_glu: x [R, K], logits fp32 [R, E] -> (h [R, k, N], indices int32
    [R, k], scores fp32 [R, k]) (row_expert_*_glu_route: moe_route + row_expert_*_glu)."""
    E, N, K, quant = _expert_shape(gate[0], gate[1], bits, "route_glu")   # shapes: kernels.moe
    R = x.shape[0]
    name = "row_expert_qmm_glu_route" if quant else "row_expert_mm_glu_route"
    tmpl = _expert_template(x, gate[0], gate[1], K, N, E, k, group_size, bits, quant)
    tmpl = tmpl + [("NORM", bool(normalize))]

    def launch(cut, n):
        return _kernel(name, 0)(
            inputs=_glu_inputs(cut(x), gate, up, cut(logits), quant), template=tmpl,
            grid=(-(-N // GEMM_COLS_PER_BLOCK) * GEMM_THREADS, n * k, 1),
            threadgroup=(GEMM_THREADS, 1, 1),
            output_shapes=[(n, k, N), (n, k), (n, k)],
            output_dtypes=[x.dtype, mx.int32, mx.float32], stream=stream)
    h, inds, scores = _in_row_pieces(R, k, launch)
    return h, inds, scores


def moe_route(logits, k, normalize, stream):
    """kernels.moe.route: fp32 logits [R, E] -> (indices int32 [R, k], scores fp32 [R, k])."""
    R, E = logits.shape
    inds, scores = _kernel("moe_route", 0)(
        inputs=[logits], template=[("E", E), ("TOPK", k), ("NORM", bool(normalize))],
        grid=(32 * R, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(R, k), (R, k)], output_dtypes=[mx.int32, mx.float32], stream=stream)
    return inds, scores


# ---------------------------------------------------------------- offline syntax check

def standalone_source(name: str, template: dict, input_dtypes: dict, output_dtypes: dict,
                      shaped: tuple = (), text: str = "inline") -> str:
    """The kernel as MLX would generate it, as a plain .cu file for `nvcc -c` checks.

    Mirrors mlx/backend/cuda/custom_kernel.cpp: header, then in namespace mlx::core::cu a
    __global__ function with one pointer per input (+ `<name>_shape` if used), one per
    output, template arguments as constexpr / using lines, then the body. text="file": the
    header and body as TENSORFOLD_CUDA_TEXT=file passes them (the file written to cache_dir()).
    """
    inputs, outputs, _ = _KERNELS[name]
    kinds = tuple((k, _template_kind(v)) for k, v in template.items()) if text == "file" else None
    header, body = _texts(name, list(outputs), kinds)
    prelude = (
        "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n"
        "#include <cooperative_groups.h>\n"
        "struct Shape { int32_t d[8]; __device__ int32_t operator[](int i) const "
        "{ return d[i]; } };\n"
    )
    src = prelude + header + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
    params = []
    for n in inputs:
        params.append(f"const {_kcache.cuda_type(input_dtypes[n])}* {n}")
        if f"{n}_shape" in body:
            params.append(f"const __grid_constant__ Shape {n}_shape")
    for n in outputs:
        params.append(f"{_kcache.cuda_type(output_dtypes[n])}* {n}")
    src += f"__global__ void custom_kernel_tf_{name}(" + ", ".join(params) + ") {\n"
    src += _kcache.template_lines(template.items())
    src += body + "}\n} // namespace mlx::core::cu\n"
    return src
