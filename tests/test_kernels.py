"""Property tests of the row-exact kernels (tensorfold.kernels), on the default device.

Run as is on CPU (CI); run with a GPU default device to test the CUDA face:
    python -c "import mlx.core as mx" && pytest tests/test_kernels.py
(on a CUDA machine MLX's default device is the GPU.)

Row-exact: row i of the output is bit-identical whether the call holds 1 row or M rows
(M = 1..16), whatever the other rows hold, and (attention) whatever the KV capacity is and
however a verify window is split into consecutive calls. Accuracy: error vs a float64
numpy reference no worse than a small factor of MLX's own op on the same inputs.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from tensorfold import kernels as K

from kernel_helpers import (  # noqa: F401  (device: pytest fixture)
    DEVICES, _rng, bits, decode_kernel_cases, device, f64, garbage, make_kv, make_quantized, out_eps,
    poison, rand, run, with_capacity,
)

DTYPES = [mx.bfloat16, mx.float16, mx.float32]
MAX_M = 16


# ---------------------------------------------------------------- helpers
# (shared ones: tests/kernel_helpers.py)

def assert_rows_exact(op, x_all: mx.array, rng, n_out_rows_axis=-2):
    """x_all [16, K]: for M = 1..16, op(x[:M]) rows == op(single row); garbage rows; batch."""
    singles = [bits(run(op, x_all[i:i + 1])) for i in range(MAX_M)]
    for M in range(1, MAX_M + 1):
        got = bits(run(op, x_all[:M]))
        for i in range(M):
            assert np.array_equal(got[i:i + 1], singles[i]), f"row {i} differs at M={M}"
    # Other rows hold garbage (large values): row i unchanged.
    for i in (0, 5, MAX_M - 1):
        g = garbage(rng, x_all.shape, x_all.dtype)
        mixed = mx.concatenate([g[:i], x_all[i:i + 1], g[i + 1:]], axis=0)
        got = bits(run(op, mixed))
        assert np.array_equal(got[i:i + 1], singles[i]), f"row {i} depends on other rows"
    # Leading batch dims flatten into rows.
    got = bits(run(op, x_all.reshape(2, MAX_M // 2, x_all.shape[-1])))
    got = got.reshape(MAX_M, -1)
    for i in range(MAX_M):
        assert np.array_equal(got[i:i + 1], singles[i]), f"row {i} differs in a batch"


# ---------------------------------------------------------------- quantized matmul

QMM_CASES = [(b, g, d) for b in (4, 8) for g in (32, 64, 128) for d in DTYPES] + [
    (b, 64, mx.bfloat16) for b in (2, 3, 5, 6)
]


@pytest.mark.parametrize("bits_,group_size,dtype", QMM_CASES,
                         ids=[f"b{b}-g{g}-{str(d).split('.')[-1]}" for b, g, d in QMM_CASES])
def test_quantized_matmul_row_exact(device, bits_, group_size, dtype):
    rng = _rng("qmm", bits_, group_size, str(dtype))
    N, Kd = 72, 256  # N not a multiple of the column tiles
    wq, s, b = make_quantized(rng, N, Kd, group_size, bits_, dtype)
    x = rand(rng, (MAX_M, Kd), dtype)
    op = lambda xx: K.row_quantized_matmul(xx, wq, s, b, group_size, bits_)  # noqa: E731
    assert op(x).shape == (MAX_M, N) and op(x).dtype == dtype
    assert_rows_exact(op, x, rng)


@pytest.mark.parametrize("bits_,group_size,dtype", QMM_CASES,
                         ids=[f"b{b}-g{g}-{str(d).split('.')[-1]}" for b, g, d in QMM_CASES])
def test_quantized_matmul_accuracy(device, bits_, group_size, dtype):
    rng = _rng("qmm-acc", bits_, group_size, str(dtype))
    N, Kd, M = 64, 512, 5
    wq, s, b = make_quantized(rng, N, Kd, group_size, bits_, dtype)
    x = rand(rng, (M, Kd), dtype)
    w_hat = f64(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                              group_size=group_size, bits=bits_))
    ref = f64(x) @ w_hat.T
    ours = run(K.row_quantized_matmul, x, wq, s, b, group_size, bits_)
    theirs = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group_size, bits=bits_)
    assert ours.dtype == dtype
    e_ours = np.abs(f64(ours) - ref).max()
    e_mlx = np.abs(f64(theirs) - ref).max()
    assert np.isfinite(e_ours)
    assert e_ours <= 2.0 * e_mlx + out_eps(dtype) * np.abs(ref).max(), (e_ours, e_mlx)


@pytest.mark.parametrize("N,Kd", [(128, 384), (1024, 384), (384, 1024), (8192, 384), (200, 2048),
                                  (512, 8192), (32768, 384)],
                         ids=["128x384", "1024x384", "384x1024", "8192x384", "200x2048", "512x8192",
                              "32768x384"])
def test_quantized_matmul_row_exact_model_shapes(device, N, Kd):
    """Model-like shapes: on CUDA these take other tensor-core plans (split 3, 8, ...) than the
    small case above (tinycode's hidden size is 384); 512 x 8192 past 8 rows the staging with two
    chunks a loop turn (UR 2); 32768 x 384 (wider than CP_XS_MAX_N, like an LM head) one row
    without x staged once, and so without C0."""
    rng = _rng("qmm-shapes", N, Kd)
    wq, s, b = make_quantized(rng, N, Kd, 64, 4, mx.bfloat16)
    x = rand(rng, (MAX_M, Kd), mx.bfloat16)
    op = lambda xx: K.row_quantized_matmul(xx, wq, s, b, 64, 4)  # noqa: E731
    assert_rows_exact(op, x, rng)


@pytest.mark.parametrize("N,Kd,bits_", [(1152, 384, 4), (72, 256, 4), (64, 256, 8)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32], ids=lambda d: str(d).split(".")[-1])
def test_quantized_matmul_residual_is_the_add(device, N, Kd, bits_, dtype):
    """residual=r gives the bits of row_quantized_matmul(x) + r (on CUDA the 4-bit kernel adds r
    in its store: T(T(acc) + r), which equals MLX's add of two T values), row-exact."""
    rng = _rng("qmm-res", N, Kd, bits_, str(dtype))
    wq, s, b = make_quantized(rng, N, Kd, 64, bits_, dtype)
    x = rand(rng, (MAX_M, Kd), dtype)
    r = rand(rng, (MAX_M, N), dtype, 4.0)
    op = lambda xx, rr: K.row_quantized_matmul(xx, wq, s, b, 64, bits_, residual=rr)  # noqa: E731
    fused = bits(run(op, x, r))
    plain = bits(run(lambda: K.row_quantized_matmul(x, wq, s, b, 64, bits_) + r))
    assert np.array_equal(fused, plain)
    for M in (1, 5, 9, 16):
        assert np.array_equal(bits(run(op, x[:M], r[:M])), fused[:M]), M
    got = bits(run(op, x.reshape(2, MAX_M // 2, Kd), r.reshape(2, MAX_M // 2, N)))
    assert np.array_equal(got.reshape(MAX_M, N), fused)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="a CUDA-only launch fusion")
@pytest.mark.parametrize("hd,norm,dtype", [(128, True, mx.bfloat16), (64, False, mx.float16),
                                           (256, True, mx.float32)])
def test_cuda_fused_qk_norm_rope(hd, norm, dtype):
    """fused_qk_norm_rope (CUDA): row-exact (row l of a 16-row call has the bits of the 1-row
    call at position offset + l, whatever the other rows hold) and MLX's rms_norm + rope to
    within the dtype's rounding."""
    H, Hk, L, off, eps = 8, 2, MAX_M, 1000, 1e-6
    rng = _rng("qk-rope", hd, norm, str(dtype))
    qkv = rand(rng, (1, L, (H + 2 * Hk) * hd), dtype, 2.0)
    qn, kn = (rand(rng, (hd,), dtype), rand(rng, (hd,), dtype)) if norm else (None, None)
    inv = mx.array([10000.0 ** (-i / hd) for i in range(0, hd, 2)], dtype=mx.float32)
    op = lambda t, o: K.fused_qk_norm_rope(t, H, Hk, qn, kn, eps, inv, 1.0, o)  # noqa: E731
    q, k = op(qkv, off)
    assert q.shape == (1, H, L, hd) and k.shape == (1, Hk, L, hd) and q.dtype == dtype
    for l in (0, 7, L - 1):
        g = garbage(rng, qkv.shape, dtype)
        mixed = mx.concatenate([g[:, :l], qkv[:, l:l + 1], g[:, l + 1:]], axis=1)
        for full in (op(qkv, off), op(mixed, off)):
            one = op(qkv[:, l:l + 1], off + l)
            assert np.array_equal(bits(full[0][:, :, l:l + 1]), bits(one[0])), l
            assert np.array_equal(bits(full[1][:, :, l:l + 1]), bits(one[1])), l
    # reference: MLX's ops in float32
    x = qkv.astype(mx.float32).reshape(1, L, H + 2 * Hk, hd)
    rq, rk = x[:, :, :H], x[:, :, H:H + Hk]
    if norm:
        rq = mx.fast.rms_norm(rq, qn.astype(mx.float32), eps)
        rk = mx.fast.rms_norm(rk, kn.astype(mx.float32), eps)
    rq = mx.fast.rope(rq.transpose(0, 2, 1, 3), hd, traditional=False, base=10000.0, scale=1.0, offset=off)
    rk = mx.fast.rope(rk.transpose(0, 2, 1, 3), hd, traditional=False, base=10000.0, scale=1.0, offset=off)
    tol = {mx.bfloat16: 3e-2, mx.float16: 4e-3, mx.float32: 1e-4}[dtype]
    for got, ref in ((q, rq), (k, rk)):
        err = np.abs(f64(got) - f64(ref)).max() / (np.abs(f64(ref)).max() + 1e-9)
        assert err < tol, err


@pytest.mark.skipif(not mx.cuda.is_available(), reason="a CUDA-only launch fusion")
@pytest.mark.parametrize("hd,norm,dtype", [(128, True, mx.bfloat16), (64, False, mx.float16)])
def test_cuda_fused_qk_norm_rope_writes_kv_in_place(hd, norm, dtype):
    """fused_qk_norm_rope(kv=...) (the compiled decode step's cache write): q has the bits of the
    unfused call; the cache buffers gain exactly the unfused call's k rows and qkv's v rows at
    rows offset.., every other row unchanged; rows past the capacity are not written."""
    H, Hk, L, eps, cap = 8, 2, 5, 1e-6, 64
    rng = _rng("qk-rope-kv", hd, norm, str(dtype))
    qkv = rand(rng, (1, L, (H + 2 * Hk) * hd), dtype, 2.0)
    qn, kn = (rand(rng, (hd,), dtype), rand(rng, (hd,), dtype)) if norm else (None, None)
    inv = mx.array([10000.0 ** (-i / hd) for i in range(0, hd, 2)], dtype=mx.float32)
    v_rows = qkv.reshape(1, L, H + 2 * Hk, hd)[:, :, H + Hk:].transpose(0, 2, 1, 3)
    for off in (0, 17, cap - 3):
        kc, vc = rand(rng, (1, Hk, cap, hd), dtype), rand(rng, (1, Hk, cap, hd), dtype)
        mx.eval(kc, vc)
        want_k, want_v = np.array(bits(kc)), np.array(bits(vc))     # copies, taken before
        q_ref, k_ref = K.fused_qk_norm_rope(qkv, H, Hk, qn, kn, eps, inv, 1.0, off)
        q = K.fused_qk_norm_rope(qkv, H, Hk, qn, kn, eps, inv, 1.0, off, kv=(kc, vc))
        mx.eval(q)
        assert np.array_equal(bits(q), bits(q_ref))
        n = min(L, cap - off)
        want_k[:, :, off:off + n] = bits(k_ref)[:, :, :n]
        want_v[:, :, off:off + n] = bits(v_rows)[:, :, :n]
        assert np.array_equal(bits(kc), want_k), off
        assert np.array_equal(bits(vc), want_v), off


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the CUDA face's two 4-bit kernels")
@pytest.mark.parametrize("N,Kd,group_size", [(72, 256, 32), (72, 256, 64), (1152, 384, 64),
                                             (384, 1152, 64), (4096, 4096, 128), (20000, 2048, 64),
                                             (12288, 4096, 64), (6144, 4096, 64), (4096, 12288, 64)])
def test_cuda_cp_pipeline_equals_register_kernel(N, Kd, group_size):
    """row_qmm_cp (4-bit weights through a cp.async pipeline, the default) computes row_qmm_tc's
    arithmetic: the same bits for every M and every staging (CB, NS, XE, NT) the plan allows,
    with either copy addressing (CA), with one, two or four chunks a loop turn (UR), and with the
    first weight stage copied before the scales (PRO), at one row with and without the ONE
    variant (odd groups' X from the even groups' X mmas), with x staged once (XS) and with and
    without the fold of column 0 alone (C0), with the second tile constant (F2), and with three
    weight tiles a block; at 20 rows too (the second block's second tile has no rows)."""
    from tensorfold.kernels import _cuda
    rng = _rng("qmm-cp", N, Kd, group_size)
    wq, s, b = make_quantized(rng, N, Kd, group_size, 4, mx.bfloat16)
    x = rand(rng, (20, Kd), mx.bfloat16)
    st = mx.default_stream(mx.gpu)
    tc = _cuda.tc_plan(N, Kd, group_size, 4)
    # (CB, NS, XE, NT): every staging the plan allows; every x-load timing and tile count on
    # two of the shapes, the defaults' (up to 8 rows and past 8) on the others (each variant is
    # one more NVRTC build); 20000 x 2048 takes the wide default (CB 8, XE 1, NT 2)
    more = [(xe, nt) for xe in (0, 1, 2) for nt in (1, 2)] if N in (72, 1152) else \
        sorted({_cuda.cp_staging(N, Kd, group_size, two)[2:4] for two in (False, True)})
    stagings = [(cb, ns, xe, nt) for cb in (4, 8) for ns in (2, 3) for xe, nt in more
                if (_cuda.cp_plan(N, Kd, group_size, 4, cb, ns, nt) or (0, 0))[:2] == (cb, ns)]
    assert stagings and _cuda.cp_plan(N, Kd, group_size, 4) is not None
    first, last = stagings[0], stagings[-1]
    # the first weight stage copied before the scales, in wide copies (PRO 1), on the first and
    # the last staging
    stagings += [(*st, 0, None, 1, 1) for st in (first, last)]
    # a stage's copies from per-copy pointers and from one pointer with constant offsets (CA; the
    # default call takes it from CB 8 where every block is full), each with two and four chunks a
    # loop turn (UR 2, 4) too
    stagings += [(*first, 0, ca, ur) for ca in (0, 1) for ur in (1, 2, 4)]
    # one row runs the ONE variant wherever a stage holds an even number of groups (every
    # staging above, at M = 1): the first and the last staging without it too
    stagings += [(*st, 0, None, 1, 0, 0) for st in (first, last)]
    # XS: one row's x slice staged once in shared memory (with and without ONE; at more rows
    # the same launch without it)
    stagings += [(*st, 0, None, 1, 0, one, 1) for st in (first, last) for one in (None, 0)]
    # one row folds column 0 only (C0, the default where x is staged once): the first staging
    # without it too, and without XS with C0's default (off there) and with C0
    stagings += [(*first, 0, None, 1, 0, None, None, 0)]
    stagings += [(*first, 0, None, 1, 0, None, 0, c0) for c0 in (None, 1)]
    # F2 (9..16 rows: the second tile's branches constant) on the first and the last staging
    stagings += [(*st, 0, None, 1, 0, None, None, None, 1) for st in (first, last)]
    # three weight tiles a block (24576 x 4096's default past 8 rows), with F2 at 9..16 rows
    if _cuda.cp_plan(N, Kd, group_size, 4, 8, 2, 3) is not None:
        stagings += [(8, 2, 1, 3, 0, None, 1, 0, None, None, None, 1)]
    for M in (1, 3, 9, 16, 20):
        ref = bits(run(_cuda.quantized_matmul, x[:M], wq, s, b, group_size, 4, st, plan=tc))
        assert np.array_equal(bits(run(_cuda.quantized_matmul, x[:M], wq, s, b, group_size, 4, st)), ref)
        for plan in stagings:
            got = bits(run(_cuda.quantized_matmul, x[:M], wq, s, b, group_size, 4, st,
                           plan=("cp", *plan)))
            assert np.array_equal(got, ref), (M, plan)


# weight shapes (N, K) of real checkpoints: Qwen3-8B (q+k+v, o, gate+up, down, LM head),
# Qwen3-30B-A3B (attention, experts' gate+up / down, router), Qwen3-0.6B, and the tests' own
REAL_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (12288, 4096), (4096, 12288),
               (151936, 4096), (5120, 2048), (2048, 4096), (1536, 2048), (2048, 768), (128, 2048),
               (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
               (1152, 384), (384, 1152), (72, 256)]


def test_cuda_default_plans_apply_to_real_shapes():
    """The CUDA face's default plans are valid for real weight shapes (pure Python, runs in CI):
    a 4-bit default staging that did not fit would silently fall back to row_qmm_tc on a GPU.
    row_qmm_cp applies to every shape at group 64 (mlx-lm's default); at other group sizes
    where a K slice holds an odd number of groups (group 128 from K <= 3072 here) it does not
    (4-byte scale copies), and row_qmm_tc runs, by design."""
    from tensorfold.kernels import _cuda
    for N, Kd in REAL_SHAPES:
        NT, CB, SPLIT, DB = _cuda.tc_plan(N, Kd)
        assert 1 <= SPLIT <= _cuda.TC_MAX_SPLIT and (Kd // 32 // CB) % SPLIT == 0, (N, Kd)
        for gs in (32, 64, 128):
            if Kd % gs or (Kd // gs) % 2:
                continue
            q = _cuda.tc_plan(N, Kd, gs, 4)
            assert (Kd // 32 // q[1]) % q[2] == 0, (N, Kd, gs)
            if _cuda.cp_plan(N, Kd, gs, 4) is None:
                assert gs != 64, (N, Kd)
                continue
            for two in (False, True):
                cb, ns, xe, nt, ur, pro, f2 = _cuda.cp_staging(N, Kd, gs, two)
                plan = _cuda.cp_plan(N, Kd, gs, 4, cb, ns, nt)
                assert plan is not None and plan[:2] == (cb, ns), (N, Kd, gs, two)
                assert plan[2] == q[2] and plan[3] <= _cuda.CP_SMEM_LIMIT, (N, Kd, gs, two)
                assert xe in (0, 1, 2) and nt in (1, 2, 3) and ur in (1, 2, 4) and pro in (0, 1)
                assert f2 in (0, 1) and (two or not f2), (N, Kd, gs)
                # one row stages x once (XS) up to CP_XS_MAX_N columns: its slice must fit
                if not two and _cuda.cp_xs(N, 1):
                    xs = _cuda.cp_plan(N, Kd, gs, 4, cb, ns, nt, xs=True)
                    assert xs is not None and xs[3] == plan[3] + 2 * Kd, (N, Kd, gs)
                    assert xs[3] <= max(_cuda.CP_SMEM_LIMIT, _cuda.CP_XS_SMEM_LIMIT), (N, Kd, gs)
        # the dense default: row_mm_cp applies to every real shape (else row_mm_tc, slower)
        staging = _cuda.mm_cp_staging(N, Kd)
        assert _cuda.mm_cp_plan(N, Kd, staging[0], staging[1], staging[3]) is not None, (N, Kd)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the CUDA face's two dense kernels")
@pytest.mark.parametrize("N,Kd,dtype", [(72, 256, mx.bfloat16), (1152, 384, mx.bfloat16),
                                        (1152, 384, mx.float16), (4096, 4096, mx.bfloat16),
                                        (20000, 2048, mx.bfloat16), (4096, 12288, mx.bfloat16)])
def test_cuda_mm_cp_pipeline_equals_register_kernel(N, Kd, dtype):
    """row_mm_cp (dense weights through a cp.async pipeline) computes row_mm_tc's arithmetic:
    the same bits for every M and every staging (CB, NS, XE, NT) that fits (on the small shapes;
    on the large ones, the stagings bench/gpu_run.sh s16d sweeps first)."""
    from tensorfold.kernels import _cuda
    rng = _rng("mm-cp", N, Kd, str(dtype))
    w = rand(rng, (N, Kd), dtype, 0.05)
    x = rand(rng, (MAX_M, Kd), dtype)
    st = mx.default_stream(mx.gpu)
    every = [(cb, ns, xe, nt) for cb in (1, 2, 4) for ns in (2, 3, 4) for xe in (0, 1) for nt in (1, 2)]
    if N > 2000:
        every = [(2, 3, 1, 1), (4, 2, 1, 1), (2, 4, 1, 1), (1, 3, 0, 2), (4, 4, 1, 2)]
    stagings = [p for p in every if _cuda.mm_cp_plan(N, Kd, p[0], p[1], p[3]) is not None]
    assert stagings
    tc = _cuda.tc_plan(N, Kd)
    for M in (1, 3, 9, 16):
        ref = bits(run(_cuda.matmul, x[:M], w, st, plan=tc))
        assert np.array_equal(bits(run(_cuda.matmul, x[:M], w, st)), ref)
        for plan in stagings:
            got = bits(run(_cuda.matmul, x[:M], w, st, plan=("cp", *plan)))
            assert np.array_equal(got, ref), (M, plan)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the CUDA face's merge launch")
@pytest.mark.parametrize("D,dtype", [(128, mx.bfloat16), (80, mx.float16), (64, mx.float32),
                                     (256, mx.bfloat16)])
def test_cuda_attention_merge_columns_split_is_bit_identical(D, dtype, monkeypatch):
    """row_attn_merge spread over blocks of 32 or 64 columns (64: calls of 32+ query rows on
    small caches, ATTN_MERGE_COLS_WIDE) gives the bits of one block per row: every block folds the
    same (m, l) sequence, each column only its own partials."""
    from tensorfold.kernels import _cuda
    rng = _rng("attn-merge-cols", D, str(dtype))
    Hq, Hkv, cap = 8, 2, 5000
    k, v = rand(rng, (1, Hkv, cap, D), dtype), rand(rng, (1, Hkv, cap, D), dtype)
    st = mx.default_stream(mx.gpu)
    for M, off in ((1, 0), (1, 4095), (5, 1234), (16, cap - 16)):
        q = rand(rng, (1, Hq, M, D), dtype)
        monkeypatch.setattr(_cuda, "ATTN_MERGE_COLS", None)
        ref = bits(K.row_attention(q, k, v, off, D ** -0.5, stream=st))
        monkeypatch.setattr(_cuda, "ATTN_MERGE_COLS", 32)
        for wide in (None, (1, cap, 64)):       # 32 columns a block; 64 (the wide rule, forced)
            monkeypatch.setattr(_cuda, "ATTN_MERGE_COLS_WIDE", wide)
            got = bits(K.row_attention(q, k, v, off, D ** -0.5, stream=st))
            assert np.array_equal(got, ref), (M, off, wide)


@pytest.mark.skipif(not mx.cuda.is_available(),
                    reason="compares two forms of the CUDA face's texts (no CUDA texts run on the CPU; "
                           "their machine code: test_cuda_compiles.py::test_file_mode_gives_the_same_machine_code)")
def test_cuda_text_file_mode_gives_the_same_bits(tmp_path, monkeypatch):
    """TENSORFOLD_CUDA_TEXT=file (each kernel's body in a file its short text includes) compiles the
    same operations: every decode kernel family gives the inline texts' bits -- 4- and 8-bit GEMMs
    (tensor-core and cp.async faces, 1 / 8 / 16 rows), dense GEMMs, attention (tensor-core and
    CUDA-core partials, the merge), the fused q/k norm + RoPE, routed experts, sparse attention."""
    from tensorfold.kernels import _cuda
    cases = decode_kernel_cases(_rng("text-file"), mx.default_stream(mx.gpu))

    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path))
    outs = {}
    try:
        for mode in ("inline", "file"):
            monkeypatch.setenv("TENSORFOLD_CUDA_TEXT", mode)
            _cuda.clear_kernel_caches()
            outs[mode] = [bits(run(lambda f=f: f())) for f in cases]
    finally:
        _cuda.clear_kernel_caches()
    assert list(tmp_path.rglob("*.cuh"))                 # file mode did make its files
    for i, (a, b) in enumerate(zip(outs["inline"], outs["file"])):
        assert np.array_equal(a, b), i


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the CUDA face's attention launch plans")
@pytest.mark.parametrize("B,Hq,Hkv,D,dtype", [(1, 32, 8, 128, mx.bfloat16), (2, 12, 4, 80, mx.float16),
                                              (1, 8, 1, 64, mx.bfloat16)])
def test_cuda_attention_group_blocks_are_bit_identical(B, Hq, Hkv, D, dtype, monkeypatch):
    """row_attn_tcg (a block folds half a group, 8 spans, itself, for 8..64 query rows) gives every
    row the bits of row_attn_tc's span blocks + the merge's fold: whatever the plan (two warps an
    8-row tile, "k", included: their maxima exchanged, the weights summed from shared memory, odd
    d-tile counts split 3 + 2; buffer counts over groups of odd span counts too), the row count,
    where the rows sit against span and group edges, or the capacity. So does row_attn_tcr ("t":
    the mma's sides swapped, 16 query rows a warp on its M side, the weights kept in registers):
    the same dot products in the same k16 steps, the weight sum's tree taken in another layout. And
    so does row_attn_wg ("w": tcr's arithmetic on Hopper's warpgroup MMA, 64 rows a warpgroup; at
    head sizes other than 64 and 128 the plan runs tcr)."""
    from tensorfold.kernels import _cuda
    rng = _rng("attn-tcg", B, Hq, Hkv, D, str(dtype))
    cap = 3 * 1024 + 300
    k, v = rand(rng, (B, Hkv, cap, D), dtype), rand(rng, (B, Hkv, cap, D), dtype)
    st = mx.default_stream(mx.gpu)
    n = 0
    for M, off in ((1, 0), (1, 1023), (1, 1024), (2, 1022), (3, 2047), (5, 64 * 20 - 2), (2, 511),
                   (16, 1024 - 8), (16, cap - 16), (7, cap - 7 - 100), (4, 1536 - 2)):
        q = rand(rng, (B, Hq, M, D), dtype)
        monkeypatch.setattr(_cuda, "attn_impl", "span")
        ref = bits(K.row_attention(q, k, v, off, D ** -0.5, stream=st))
        for plan in ("g1", "g2", "g4.3", "g8", "s1", "s2.3", "s4", "s8", "g1k", "g4k", "g8k.3", "s1k",
                     "s4k", "g2kk", "s1kk.3", "tg1", "tg2", "tg4.3", "ts1", "ts2", "ts4.3", "wg4", "ws4",
                     "wg4.3", "ws4.3", "wd4", None):
            monkeypatch.setattr(_cuda, "attn_impl", plan)
            got = bits(K.row_attention(q, k, v, off, D ** -0.5, stream=st))
            assert np.array_equal(got, ref), (M, off, plan)
            n += 1
        monkeypatch.setattr(_cuda, "ATTN_MERGE_WARPS_PRE", 4)   # halves / groups merged side by side
        for plan in ("g4k", "tg2", "wg4", "wd4"):
            monkeypatch.setattr(_cuda, "attn_impl", plan)
            got = bits(K.row_attention(q, k, v, off, D ** -0.5, stream=st))
            assert np.array_equal(got, ref), (M, off, plan, "MW 4")
            n += 1
        monkeypatch.setattr(_cuda, "ATTN_MERGE_WARPS_PRE", 1)
    assert n == 341


# ---------------------------------------------------------------- dense matmul

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("wdtype", ["same", "float32"])
def test_matmul_row_exact(device, dtype, wdtype):
    rng = _rng("mm", str(dtype), wdtype)
    N, Kd = 72, 256
    w = rand(rng, (N, Kd), dtype if wdtype == "same" else mx.float32, 0.05)
    x = rand(rng, (MAX_M, Kd), dtype)
    op = lambda xx: K.row_matmul(xx, w)  # noqa: E731
    # fp32 weights beside 16-bit x: fp32 out, as MLX's matmul promotes (kernels.promoted)
    assert op(x).shape == (MAX_M, N) and op(x).dtype == (dtype if wdtype == "same" else mx.float32)
    assert_rows_exact(op, x, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_matmul_accuracy(device, dtype):
    rng = _rng("mm-acc", str(dtype))
    N, Kd, M = 96, 1024, 7
    w = rand(rng, (N, Kd), dtype, 0.05)
    x = rand(rng, (M, Kd), dtype)
    ref = f64(x) @ f64(w).T
    ours = run(K.row_matmul, x, w)
    theirs = x @ w.T
    e_ours = np.abs(f64(ours) - ref).max()
    e_mlx = np.abs(f64(theirs) - ref).max()
    assert e_ours <= 2.0 * e_mlx + out_eps(dtype) * np.abs(ref).max(), (e_ours, e_mlx)


# ---------------------------------------------------------------- attention

ATT_CASES = [
    # (B, Hq, Hkv, D, offset, dtype)
    (1, 4, 2, 64, 300, mx.bfloat16),
    (2, 4, 1, 80, 129, mx.float16),
    (1, 2, 2, 128, 255, mx.float32),
    (1, 4, 2, 96, 0, mx.bfloat16),
    (1, 2, 1, 256, 70, mx.bfloat16),
    (1, 6, 2, 64, 250, mx.bfloat16),   # tinycode's heads; the window crosses a 256-key span
    # long contexts: on CUDA the merge then runs more than one batch of span groups
    # (16 groups of 16 spans: 16384 keys with the tensor-core partials, 8192 at D = 256)
    (1, 4, 1, 64, 16500, mx.bfloat16),
    (1, 2, 1, 256, 8300, mx.float16),
]
ATT_IDS = [f"B{c[0]}-hq{c[1]}-hkv{c[2]}-d{c[3]}-off{c[4]}-{str(c[5]).split('.')[-1]}"
           for c in ATT_CASES]


@pytest.mark.parametrize("B,Hq,Hkv,D,offset,dtype", ATT_CASES, ids=ATT_IDS)
def test_attention_row_exact(device, B, Hq, Hkv, D, offset, dtype):
    rng = _rng("att", B, Hq, Hkv, D, offset, str(dtype))
    scale = D ** -0.5
    cap = offset + MAX_M + 40
    k, v = make_kv(rng, B, Hkv, cap, D, dtype, offset + MAX_M)
    q = rand(rng, (B, Hq, MAX_M, D), dtype)

    def att(qq, off, kk=k, vv=v):
        return run(K.row_attention, qq, kk, vv, off, scale)

    singles = [bits(att(q[:, :, i:i + 1], offset + i)) for i in range(MAX_M)]
    # M = 1..16 rows in one call, starting at row 0 and at row 16-M.
    for M in range(1, MAX_M + 1):
        for start in sorted({0, MAX_M - M}):
            got = bits(att(q[:, :, start:start + M], offset + start))
            for i in range(M):
                assert np.array_equal(got[:, :, i:i + 1], singles[start + i]), (M, start, i)
    # Other query rows hold garbage.
    for i in (0, 7, MAX_M - 1):
        g = garbage(rng, q.shape, dtype)
        mixed = mx.concatenate([g[:, :, :i], q[:, :, i:i + 1], g[:, :, i + 1:]], axis=2)
        got = bits(att(mixed, offset))
        assert np.array_equal(got[:, :, i:i + 1], singles[i]), f"row {i} depends on other rows"
    # Capacity of the KV buffers does not matter (tight, larger, much larger; filled
    # with NaN or with huge values beyond the valid keys).
    full = bits(att(q, offset))
    for extra, fill in ((0, np.nan), (1, 1e4), (517, np.nan), (1000, -3e4)):
        c2 = offset + MAX_M + extra
        k2 = with_capacity(k, offset + MAX_M, c2, fill)
        v2 = with_capacity(v, offset + MAX_M, c2, fill)
        assert np.array_equal(bits(att(q, offset, k2, v2)), full), f"capacity {c2}"
    # offset as an int32 scalar array == offset as an int.
    assert np.array_equal(bits(att(q, mx.array(offset, dtype=mx.int32))), full)


@pytest.mark.parametrize("B,Hq,Hkv,D,offset,dtype", ATT_CASES[:3], ids=ATT_IDS[:3])
def test_attention_window_splits(device, B, Hq, Hkv, D, offset, dtype):
    """A verify window of W rows == every split of it into consecutive calls."""
    rng = _rng("att-split", B, Hq, Hkv, D, offset, str(dtype))
    W = 5
    k, v = make_kv(rng, B, Hkv, offset + W + 3, D, dtype, offset + W)
    q = rand(rng, (B, Hq, W, D), dtype)
    whole = bits(run(K.row_attention, q, k, v, offset, D ** -0.5))
    n_splits = 0
    for cuts in itertools.product([0, 1], repeat=W - 1):
        bounds = [0] + [j + 1 for j, c in enumerate(cuts) if c] + [W]
        parts = [run(K.row_attention, q[:, :, a:b], k, v, offset + a, D ** -0.5)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        got = bits(mx.concatenate(parts, axis=2))
        assert np.array_equal(got, whole), f"split {bounds}"
        n_splits += 1
    assert n_splits == 2 ** (W - 1)


def attention_ref(q, k, v, offset, scale):
    """float64 reference: row i attends to keys 0..offset+i (GQA)."""
    q, k, v = f64(q), f64(k), f64(v)
    B, Hq, M, D = q.shape
    G = Hq // k.shape[1]
    out = np.zeros_like(q)
    for h in range(Hq):
        kk, vv = k[:, h // G], v[:, h // G]
        for i in range(M):
            n = offset + i + 1
            s = np.einsum("bd,bnd->bn", q[:, h, i], kk[:, :n]) * scale
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, h, i] = np.einsum("bn,bnd->bd", s, vv[:, :n]) / s.sum(-1, keepdims=True)
    return out


@pytest.mark.parametrize("B,Hq,Hkv,D,offset,dtype", ATT_CASES, ids=ATT_IDS)
def test_attention_accuracy(device, B, Hq, Hkv, D, offset, dtype):
    rng = _rng("att-acc", B, Hq, Hkv, D, offset, str(dtype))
    M = 6
    scale = D ** -0.5
    k, v = make_kv(rng, B, Hkv, offset + M + 9, D, dtype, offset + M)
    q = rand(rng, (B, Hq, M, D), dtype)
    ref = attention_ref(q, k, v, offset, scale)
    ours = run(K.row_attention, q, k, v, offset, scale)
    assert ours.shape == q.shape and ours.dtype == dtype
    L = offset + M
    mask = mx.array(np.arange(L)[None, :] <= (offset + np.arange(M))[:, None])
    theirs = mx.fast.scaled_dot_product_attention(
        q, k[:, :, :L], v[:, :, :L], scale=scale, mask=mask)
    e_ours = np.abs(f64(ours) - ref).max()
    e_mlx = np.abs(f64(theirs) - ref).max()
    assert np.isfinite(e_ours)
    assert e_ours <= 2.0 * e_mlx + out_eps(dtype), (e_ours, e_mlx)


def test_attention_rows_outside_buffer_are_nan(device):
    rng = _rng("att-nan")
    k, v = make_kv(rng, 1, 1, 20, 64, mx.float32, 20)
    q = rand(rng, (1, 1, 4, 64), mx.float32)
    out = np.array(K.row_attention(q, k, v, mx.array(18, dtype=mx.int32), 0.125))
    assert np.isfinite(out[:, :, :2]).all() and np.isnan(out[:, :, 2:]).all()
    with pytest.raises(ValueError):
        K.row_attention(q, k, v, 18, 0.125)


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_attention_chunk_of_minus_inf_scores_weighs_nothing(device, M, dtype):
    """Keys 0..127 (one whole 128-key CPU chunk, two 64-key CUDA spans) whose scores are -inf:
    each row is the softmax over the other keys it sees, as a float64 reference gives (the CPU
    face returned NaN: exp(-inf - -inf); so did the CUDA merges before tf_zmax). M > 1 and bf16
    reach the CUDA face's tensor-core paths. sparse_attention shares the chunk step: bit for bit
    equal on the CPU, finite and as close on every face."""
    rng = _rng(f"att-neginf-{M}")
    D, off = 64, 200
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    k, v = make_kv(rng, 1, 1, off + 1, D, mx.float32, off + 1)
    q = rand(rng, (1, 1, M, D), mx.float32)
    qn, kn = np.array(q), np.array(k)
    # keys 0..127 get an infinity in dimension d, of the sign that makes every row's q . k = -inf
    d = int(np.argmax(np.abs(qn[0, 0]).min(axis=0)))
    qn[0, 0, :, d] = np.abs(qn[0, 0, :, d]) + 0.5
    kn[:, :, :128, d] = -np.inf
    q, k, v = mx.array(qn).astype(dtype), mx.array(kn).astype(dtype), v.astype(dtype)
    start = off - M + 1
    out = np.array(K.row_attention(q, k, v, mx.array(start, dtype=mx.int32), 0.125).astype(mx.float32))
    q64, k64, v64 = (np.array(a.astype(mx.float32), np.float64)[0, 0] for a in (q, k, v))
    assert np.isfinite(out).all()
    for i in range(M):
        s = (q64[i] @ k64[128:start + i + 1].T) * 0.125
        w = np.exp(s - s.max())
        ref = (w / w.sum()) @ v64[128:start + i + 1]
        assert np.abs(out[0, 0, i] - ref).max() < tol, i
    from tensorfold.kernels import sparse_attention
    ids = mx.broadcast_to(mx.arange(off + 1, dtype=mx.int32), (1, M, off + 1))
    sp = np.array(sparse_attention(q, k, v, ids, start, 0.125).astype(mx.float32))
    assert np.isfinite(sp).all() and np.abs(sp - out).max() < tol
    if device.type == mx.cpu:
        assert np.array_equal(sp, out)


def test_kernel_inputs_refused_or_clipped_not_misread(device):
    """K = 0 is refused (the output came back unwritten); float ids are refused and ids or
    offsets past int32 stay out of range (they were truncated or wrapped into range)."""
    x0, w0 = mx.zeros((2, 0)), mx.zeros((4, 0))
    with pytest.raises(ValueError):
        K.row_matmul(x0, w0)
    wq, sc, bi = mx.quantize(mx.ones((32, 64)), group_size=64, bits=4)
    with pytest.raises(ValueError):
        K.row_quantized_matmul(mx.zeros((1, 0)), wq[:, :0], sc[:, :0], bi[:, :0], 64, 4)
    assert np.array(K.as_int32(mx.array([2**32 + 1, -5, 7], dtype=mx.int64), "ids")).tolist() == \
        [2**31 - 1, -1, 7]
    with pytest.raises(ValueError):
        K.as_int32(mx.array([1.9]), "ids")
    x = rand(_rng("ids"), (2, 64), mx.float32)
    w = rand(_rng("w"), (3, 32, 64), mx.float32)
    y = np.array(K.row_expert_matmul(x, w, None, None, mx.array([[1], [2**32 + 1]], dtype=mx.int64)))
    assert np.isfinite(y[0]).all()
    if device.type == mx.cpu:
        assert np.isnan(y[1]).all()                          # not expert 1
    with pytest.raises(ValueError):
        K.row_expert_matmul(x, w, None, None, mx.array([[0.5], [1.0]]))


def test_kernel_wrappers_refuse_other_types_and_scales(device):
    """Operands must be mlx arrays of f32 / bf16 / f16 (float64 and int32 x had been cast to fp32 without
    a word, numpy arrays failed inside the dtype promotion), an attention's scale a finite number (NaN
    made every row NaN; "0.125" was parsed), and the expert op's bits / group size integers from the
    allowed sets, checked first (bits 7 was reported as a column count, 4.0 failed in nanobind)."""
    rng = _rng("refuse")
    x, w = rand(rng, (2, 64), mx.float32), rand(rng, (8, 64), mx.float32)
    # float64 made on the CPU stream: MLX's GPU backends have no float64 (astype there raises)
    for bad in (x.astype(mx.float64, stream=mx.cpu), x.astype(mx.int32), np.array(x)):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            K.row_matmul(bad, w)
    with pytest.raises(ValueError, match="uint32 mlx array"):
        K.row_quantized_matmul(x, np.zeros((8, 8), np.uint32), mx.ones((8, 1)), mx.ones((8, 1)), 64, 4)
    q, kv = rand(rng, (1, 2, 1, 64), mx.float32), rand(rng, (1, 1, 8, 64), mx.float32)
    for bad in (float("nan"), float("inf"), "0.125", True):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            K.row_attention(q, kv, kv, 3, bad)
        with pytest.raises(ValueError, match="scale must be a finite number"):
            K.sparse_attention(q, kv, kv, mx.zeros((1, 1, 2), dtype=mx.int32), 3, bad)
    assert np.array_equal(np.array(K.row_attention(q, kv, kv, 3, mx.array(0.125))),
                          np.array(K.row_attention(q, kv, kv, 3, 0.125)))
    with pytest.raises(ValueError, match="indices must be an mlx array"):
        K.sparse_attention(q, kv, kv, np.zeros((1, 1, 2), np.int32), 3, 0.125)
    we = mx.zeros((3, 8, 64 * 4 // 32), dtype=mx.uint32)
    sc = mx.ones((3, 8, 1))
    for bits, gs, msg in ((7, 64, "bits must be one of"), (0, 64, "bits must be one of"),
                          (4.0, 64, "integers"), (4, 64.0, "integers")):
        with pytest.raises(ValueError, match=msg):
            K.row_expert_matmul(x, we, sc, sc, mx.zeros((2, 1), dtype=mx.int32), gs, bits)


def test_mixed_dtypes_promote_as_mlx_does(device):
    """Operands of two float types: the result has the type MLX's own op gives (bf16 x with fp32
    weights: fp32), and equals the op on x cast to that type (an exact cast). The kernels rounded
    it to x's type, 10^3 times MLX's error (a kernel audit)."""
    rng = _rng("promote")
    x = rand(rng, (3, 128), mx.bfloat16)
    w = rand(rng, (24, 128), mx.float32)
    wq, sc, bi = mx.quantize(w, group_size=64, bits=4)
    x32 = x.astype(mx.float32)
    for got, want, ref in [
        (K.row_matmul(x, w), K.row_matmul(x32, w), x @ w.T),
        (K.row_matmul(x, w.astype(mx.float16)), K.row_matmul(x32, w.astype(mx.float16)),
         x @ w.astype(mx.float16).T),
        (K.row_quantized_matmul(x, wq, sc, bi, 64, 4), K.row_quantized_matmul(x32, wq, sc, bi, 64, 4),
         mx.quantized_matmul(x, wq, sc, bi, group_size=64, bits=4)),
        (K.row_expert_matmul(x, wq[None], sc[None], bi[None], mx.zeros((3, 1), mx.int32), 64, 4)[:, 0],
         K.row_quantized_matmul(x32, wq, sc, bi, 64, 4), None),
    ]:
        assert got.dtype == want.dtype == mx.float32
        assert ref is None or ref.dtype == got.dtype
        assert np.array_equal(bits(got), bits(want))
    same = K.row_matmul(x, w.astype(mx.bfloat16))          # one type: unchanged
    assert same.dtype == mx.bfloat16
    k, v = make_kv(rng, 1, 1, 16, 64, mx.float32, 16)
    q = rand(rng, (1, 2, 2, 64), mx.bfloat16)
    got = K.row_attention(q, k, v, 14, 0.125)
    assert got.dtype == mx.float32
    assert np.array_equal(bits(got), bits(K.row_attention(q.astype(mx.float32), k, v, 14, 0.125)))
    idx = mx.array([[[0, 3, 9], [1, 2, 15]]], dtype=mx.int32)
    got = K.sparse_attention(q, k, v, idx, 14, 0.125)
    assert got.dtype == mx.float32
    assert np.array_equal(bits(got), bits(K.sparse_attention(q.astype(mx.float32), k, v, idx, 14, 0.125)))


def test_wrong_argument_types_are_value_errors():
    """A quantized call without biases, or with float bits / group size, is a ValueError naming
    them (an AttributeError, and nanobind's 'incompatible function arguments', before); k and v
    of two dtypes are refused (the CUDA face staged V as K's type: garbage, no error); the
    native ops take int32 offsets and indices only (a cast there read 2^32 + 5 as 5)."""
    from tensorfold import _ext
    wq, sc, bi = mx.quantize(mx.ones((8, 64)), group_size=64, bits=4)
    x = mx.ones((1, 64))
    with pytest.raises(ValueError, match="biases"):
        K.row_quantized_matmul(x, wq, sc, None, 64, 4)
    with pytest.raises(ValueError, match="integers"):
        K.row_quantized_matmul(x, wq, sc, bi, 64.0, 4)
    with pytest.raises(ValueError, match="integers"):
        K.row_quantized_matmul(x, wq, sc, bi, 64, 4.0)
    q, kv = mx.ones((1, 1, 1, 64)), mx.ones((1, 1, 8, 64))
    for op in (lambda k, v: K.row_attention(q, k, v, 3, 0.1),
               lambda k, v: K.sparse_attention(q, k, v, mx.zeros((1, 1, 2), mx.int32), 3, 0.1)):
        with pytest.raises(ValueError, match="same dtype"):   # the CUDA face read V as K's type
            op(kv.astype(mx.bfloat16), kv.astype(mx.float16))
    for off in (mx.array([2**32 + 5], dtype=mx.int64), mx.array([5.9])):
        with pytest.raises(ValueError, match="int32"):
            _ext.row_attention(q, kv, kv, off, 0.1)
        with pytest.raises(ValueError, match="int32"):
            _ext.sparse_attention(q, kv, kv, mx.zeros((1, 1, 2), mx.int32), off, 0.1)
    with pytest.raises(ValueError, match="int32"):
        _ext.sparse_attention(q, kv, kv, mx.array([[[2**32 + 3]]], dtype=mx.int64),
                              mx.array([5], dtype=mx.int32), 0.1)


def test_fused_qk_norm_rope_arguments_checked():
    """fused_qk_norm_rope's CUDA launch reads its arguments unchecked (qkv's row stride from H, Hk
    and hd; the kv buffers as [B, Hk, cap, hd] of qkv's type; offset as int32): the wrapper's
    check_fused_qk refuses what would be misread. Face-independent, so tested here."""
    H, Hk, hd, L, cap = 4, 2, 64, 3, 32
    qkv = mx.ones((1, L, (H + 2 * Hk) * hd), mx.bfloat16)
    n, inv = mx.ones((hd,), mx.bfloat16), mx.ones((hd // 2,), mx.float32)
    kc = mx.zeros((1, Hk, cap, hd), mx.bfloat16)
    chk = K.check_fused_qk
    off = chk(qkv, H, Hk, n, n, inv, 5, (kc, kc))
    assert off.dtype == mx.int32 and off.tolist() == [5]
    assert chk(qkv, H, Hk, None, None, inv, mx.array([7], mx.int64)).dtype == mx.int32
    assert chk(qkv, H, Hk, n, n, inv, cap - 1, (kc, kc)).tolist() == [cap - 1]   # rows past cap: unwritten
    bad = [
        (dict(qkv=mx.ones((1, L, (H + 2 * Hk) * hd + 2), mx.bfloat16)), "last axis"),
        (dict(heads=3), "multiple"),
        (dict(heads=4.0), "integer"),
        (dict(q_norm=None), "both"),
        (dict(k_norm=mx.ones((hd + 1,), mx.bfloat16)), "both"),
        (dict(inv_freq=mx.ones((hd // 2,), mx.bfloat16)), "float32"),
        (dict(inv_freq=mx.ones((hd,), mx.float32)), "float32"),
        (dict(offset=-1), "offset"),
        (dict(offset=2.5), "integer"),
        (dict(offset=mx.array([1.5])), "integers"),
        (dict(offset=mx.array([1, 2], mx.int32)), "scalar"),
        (dict(kv=(kc, kc.astype(mx.float16))), "kv buffers"),
        (dict(kv=(kc[:, :1], kc[:, :1])), "kv buffers"),
        (dict(kv=(kc, kc[:, :, :8])), "kv buffers"),
        (dict(kv=(kc[..., :32], kc[..., :32])), "kv buffers"),
        (dict(kv=(kc,)), "kv must be"),
    ]
    for change, msg in bad:
        args = dict(qkv=qkv, heads=H, kv_heads=Hk, q_norm=n, k_norm=n, inv_freq=inv, offset=5,
                    kv=(kc, kc))
        args.update(change)
        with pytest.raises(ValueError, match=msg):
            chk(**args)
    # 2^32 + 5 is clipped, never read as 5
    assert chk(qkv, H, Hk, n, n, inv, mx.array([2**32 + 5], mx.int64)).tolist() == [2**31 - 1]


def test_empty_calls(device):
    """No row (or no column): the shapes of the product, zeros, and nothing launched (a GPU grid
    of 0 threads: CUDA refuses the launch, MLX would hand Metal a threadgroup of 0 threads)."""
    wq, s, b = mx.quantize(mx.ones((8, 64)), group_size=64, bits=4)
    x = mx.zeros((0, 64), mx.float32)
    assert K.row_quantized_matmul(x, wq, s, b, 64, 4).shape == (0, 8)
    assert K.row_quantized_matmul(x.reshape(2, 0, 64), wq, s, b, 64, 4, residual=mx.zeros((2, 0, 8))).shape == \
        (2, 0, 8)
    assert K.row_matmul(x, mx.ones((8, 64))).shape == (0, 8)
    assert K.row_matmul(mx.ones((3, 64)), mx.ones((0, 64))).shape == (3, 0)
    q, kk = mx.zeros((1, 2, 0, 64)), mx.zeros((1, 1, 8, 64))
    assert K.row_attention(q, kk, kk, 0, 0.1).shape == (1, 2, 0, 64)
    assert K.sparse_attention(q, kk, kk, mx.zeros((1, 0, 4), mx.int32), 0, 0.1).shape == (1, 2, 0, 64)
    we = (wq.reshape(1, 8, -1), s.reshape(1, 8, -1), b.reshape(1, 8, -1))
    assert K.row_expert_matmul(x, *we, mx.zeros((0, 2), mx.int32), 64, 4).shape == (0, 2, 8)
    assert K.row_expert_matmul(mx.ones((3, 64)), *we, mx.zeros((3, 0), mx.int32), 64, 4).shape == (3, 0, 8)


def test_cpu_face_routes_to_the_native_ops():
    """On the CPU the wrappers run tensorfold._ext's primitives, bit for bit. MLX's own CPU ops are
    row-invariant too, so the row-exact tests above could not tell a wrapper that fell back to
    them (a test-strength review swapped each op for MLX's and those tests passed)."""
    from tensorfold import _ext
    rng = _rng("route")
    x = rand(rng, (5, 256), mx.bfloat16)
    w = rand(rng, (48, 256), mx.bfloat16)
    assert np.array_equal(bits(K.row_matmul(x, w, stream=mx.cpu)), bits(_ext.row_matmul(x, w)))
    wq, sc, bi = mx.quantize(rand(rng, (48, 256), mx.float32), group_size=64, bits=4)
    sc, bi = sc.astype(mx.bfloat16), bi.astype(mx.bfloat16)
    assert np.array_equal(bits(K.row_quantized_matmul(x, wq, sc, bi, 64, 4, stream=mx.cpu)),
                          bits(_ext.row_quantized_matmul(x, wq, sc, bi, 64, 4)))
    k, v = make_kv(rng, 1, 2, 40, 64, mx.bfloat16, 40)
    q = rand(rng, (1, 4, 3, 64), mx.bfloat16)
    off = mx.array([30], dtype=mx.int32)
    assert np.array_equal(bits(K.row_attention(q, k, v, off, 0.125, stream=mx.cpu)),
                          bits(_ext.row_attention(q, k, v, off, 0.125)))


def test_layer_queue_shared_by_threads():
    """push / drain run without the GIL: a queue shared by Python threads crashed (SIGSEGV)."""
    import subprocess
    import sys
    code = """
import threading, mlx.core as mx
from tensorfold._ext import LayerQueue
q = LayerQueue(1)
def work(i):
    for j in range(1500):
        q.push([mx.array(i * j) + 1])
        if j % 7 == 0:
            q.drain()
ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
q.drain()
assert q.pushed == 6000, q.pushed
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-1000:])


# ---------------------------------------------------------------- API

def test_api(device):
    face = K.backend_face()
    assert face in ("cpu", "cuda", "metal")
    if device.type == mx.cpu:
        assert face == "cpu"
    elif hasattr(mx, "cuda") and mx.cuda.is_available():
        assert face == "cuda"
    assert K.backend_face(mx.cpu) == "cpu"
    ops = K.row_check_ops()
    assert set(ops) == {"row_quantized_matmul", "row_matmul", "row_attention"}
    assert all(callable(f) for f in ops.values())


# ---------------------------------------------------------------- MLX's own ops

def _row_invariance_failures(op, x_all):
    singles = [bits(op(x_all[i:i + 1])) for i in range(x_all.shape[0])]
    bad = []
    for M in range(2, x_all.shape[0] + 1):
        got = bits(op(x_all[:M]))
        if any(not np.array_equal(got[i:i + 1], singles[i]) for i in range(M)):
            bad.append(M)
    return bad


def test_mlx_own_ops_row_invariance_report(device, capsys):
    """Same property for MLX's own ops. On CUDA they must FAIL somewhere (teeth: the
    property tests above would catch a kernel that is not row-exact); elsewhere record."""
    rng = _rng("mlx-own")
    on_cuda = device.type == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()
    N, Kd = (1024, 2048) if on_cuda else (64, 256)
    dtype = mx.bfloat16
    wq, s, b = make_quantized(rng, N, Kd, 64, 4, dtype)
    w = rand(rng, (N, Kd), dtype, 0.05)
    x = rand(rng, (MAX_M, Kd), dtype)
    report = {
        "quantized_matmul": _row_invariance_failures(
            lambda xx: mx.quantized_matmul(xx, wq, s, b, transpose=True, group_size=64, bits=4), x),
        "matmul": _row_invariance_failures(lambda xx: xx @ w.T, x),
    }
    D, Hq, Hkv, off = 128, 8, 2, 1000 if on_cuda else 100
    kk, vv = make_kv(rng, 1, Hkv, off + MAX_M, D, dtype, off + MAX_M)
    q = rand(rng, (1, Hq, MAX_M, D), dtype)

    def sdpa_rows(M, start):
        L = off + start + M
        mask = mx.array(np.arange(L)[None, :] <= (off + start + np.arange(M))[:, None])
        return bits(mx.fast.scaled_dot_product_attention(
            q[:, :, start:start + M], kk[:, :, :L], vv[:, :, :L], scale=D ** -0.5, mask=mask))

    singles = [sdpa_rows(1, i) for i in range(MAX_M)]
    report["sdpa"] = [M for M in range(2, MAX_M + 1)
                      if any(not np.array_equal(sdpa_rows(M, 0)[:, :, i:i + 1], singles[i])
                             for i in range(M))]
    with capsys.disabled():
        print(f"\n[{device}] MLX own ops, M values where some row differs from its "
              f"single-row result: {report}")
    if on_cuda:
        assert any(report.values()), "expected MLX's own CUDA ops to break row invariance"


def test_gpu_faces_refuse_what_the_cpu_spec_refuses(monkeypatch):
    """Shapes the CPU primitives refuse are refused before a face is chosen: the CUDA face's
    wrappers had launched them (x narrower than w's K read past x; group size 16 used one scale a
    32-column chunk; Hq = 28 over Hkv = 8 left heads 24..27 unwritten; k / v capacities or
    batches that differ read past v). Here the faces are recorders that must never be called."""
    import sys
    import tensorfold.kernels as KK
    from tensorfold.kernels import sparse as KS
    called = []

    class Recorder:
        def __getattr__(self, name):
            def record(*a, **k):
                called.append(name)
                return mx.zeros((1,))
            return record
    for face in ("cuda", "metal"):
        monkeypatch.setattr(KK, "backend_face", lambda stream=None, face=face: face)
        monkeypatch.setattr(KK, "_gpu_stream", lambda stream: None)
        for mod in ("_cuda", "_metal"):
            monkeypatch.setattr(KK, mod, Recorder(), raising=False)
            monkeypatch.setitem(sys.modules, f"tensorfold.kernels.{mod}", getattr(KK, mod))
        monkeypatch.setattr(KS, "_metal_sparse_attention", Recorder().sparse)
        rng = _rng("refuse")
        w, s, b = mx.quantize(rand(rng, (64, 256), mx.float32), group_size=64, bits=4)
        x = rand(rng, (2, 256), mx.bfloat16)
        bad_q = [
            dict(x=x[:, :128]),                                   # K 128 against w's 256
            dict(group_size=16, scales=mx.repeat(s, 4, axis=1), biases=mx.repeat(b, 4, axis=1)),
            dict(group_size=256),
            dict(scales=s[:, :2], biases=b[:, :2]),               # [N, K / 128] at group 64
            dict(bits=7),
        ]
        for bad in bad_q:
            a = {**dict(x=x, w=w, scales=s, biases=b, group_size=64, bits=4), **bad}
            with pytest.raises(ValueError):
                KK.row_quantized_matmul(**a)
        with pytest.raises(ValueError):
            KK.row_matmul(x[:, :128], rand(rng, (64, 256), mx.bfloat16))
        q = rand(rng, (1, 28, 1, 64), mx.float32)
        k = rand(rng, (1, 8, 16, 64), mx.float32)
        bad_att = [
            (q, k, k),                                            # 28 q heads over 8 KV heads
            (rand(rng, (2, 32, 1, 64), mx.float32), k, k),        # q batch 2, KV batch 1
            (q[:, :24], k, k[:, :, :8]),                          # v capacity 8, k 16
            (q[:, :24, :, :32], k, k),                            # head size 32 against 64
        ]
        for qq, kk, vv in bad_att:
            with pytest.raises(ValueError):
                KK.row_attention(qq, kk, vv, 3, 0.125)
            with pytest.raises(ValueError):
                KK.sparse_attention(qq, kk, vv, mx.zeros((qq.shape[0], qq.shape[2], 4), mx.int32), 3, 0.125)
        we, se, be = (mx.stack([a, a]) for a in (w, s, b))
        with pytest.raises(ValueError):      # expert ops at group size 16
            KK.row_expert_matmul(x, we, mx.repeat(se, 4, axis=2), mx.repeat(be, 4, axis=2),
                                 mx.zeros((2, 1), mx.int32), 16, 4)
        # what the recorders take when the shapes are right: they are reached
        KK.row_quantized_matmul(x, w, s, b, 64, 4)
        KK.row_attention(q[:, :24], k, k, 3, 0.125)
    assert called == ["quantized_matmul", "attention"] * 2
