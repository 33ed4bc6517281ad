"""MoE family (qwen3_moe): prefill == mlx-lm bitwise, row_expert_matmul row-exactness and
accuracy, deterministic top-k, LayerQueue prefill, bounded prefill memory, loading / info.

Drafted == serial and resumed == fresh for this family run in the shared harnesses of
tests/test_engine.py and tests/test_prompt_cache.py (MoE checkpoints added there)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tensorfold import kernels as K
from tensorfold.errors import CheckpointError
from tensorfold.models import MoEModel, load_model
from tensorfold.models.info import describe
from tensorfold.kernels.moe import topk_deterministic
from tensorfold.testing import widened, write_checkpoint

from reference_helpers import mlx_lm_last_row_logits


def _ids(vocab, n, seed=0):
    return mx.array([np.random.default_rng(seed).integers(3, vocab, size=n).tolist()])


def _bits(a):
    a = np.asarray(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


# ---------------------------------------------------------------- prefill == mlx-lm

MLX_LM_CASES = {
    "hf_f32": dict(layout="hf", dtype="float32"),
    "mlx_f32_dense0": dict(layout="mlx", dtype="float32", mlp_only_layers=[0]),
    "mlx_4bit": dict(layout="mlx", bits=4),
    "mlx_4bit_dense1": dict(layout="mlx", bits=4, mlp_only_layers=[1], norm_topk_prob=False),
    "mlx_8bit_f16_step2": dict(layout="mlx", bits=8, dtype="float16", layers=3, decoder_sparse_step=2),
    "mlx_3bit_router4": dict(layout="mlx", bits=3, router_bits=None, num_experts=16, experts_per_tok=4),
    # mlx-lm's qwen3_moe never reads rope_scaling (Qwen's yarn recipe runs unscaled there): ignored
    # here too (it was applied, or refused for yarn)
    "mlx_4bit_yarn_ignored": dict(layout="mlx", bits=4, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "mlx_4bit_linear_ignored": dict(layout="mlx", bits=4, rope_scaling={"type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("case", sorted(MLX_LM_CASES))
def test_prefill_logits_equal_mlx_lm(tmp_path, case):
    """Same ops as mlx-lm's qwen3_moe (gather_qmm / gather_mm, sort/unsort) -> equal bits,
    for prompts below (no sort) and above (sort) SwitchGLU's 64-index threshold."""
    import mlx_lm

    path = write_checkpoint(tmp_path / case, **widened(dict(family="qwen3_moe", seed=len(case), **MLX_LM_CASES[case])))
    ours = load_model(path)
    assert isinstance(ours, MoEModel)
    ref, _ = mlx_lm.load(str(path))
    for n in (5, 41):
        x = _ids(ours.cfg.vocab_size, n, seed=n)
        want = ref(x)[0]
        cache = ours.new_cache()
        rows = ours.forward(x, cache, exact=False, all_logits=True)
        assert cache.offset == n
        assert mx.array_equal(rows, want).item(), (case, n)
        last = ours.forward(x, ours.new_cache(), exact=False)    # the last row alone
        assert mx.array_equal(last, mlx_lm_last_row_logits(ref, x)).item(), (case, n)
        if mx.default_device() == mx.cpu:     # MLX's CPU matmul is row-invariant: row n-1 too
            assert mx.array_equal(last[0], want[-1]).item()


def test_chunked_prefill_matches_mlx_lm_cache(checkpoints):
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    path = checkpoints["qwen3_moe_mlx_4bit"]
    ours = load_model(path)
    ref, _ = mlx_lm.load(str(path))
    ids = _ids(ours.cfg.vocab_size, 150, seed=1)[0].tolist()
    c, rc = ours.new_cache(), make_prompt_cache(ref)
    for s, e in [(0, 64), (64, 128), (128, 150)]:
        a = ours.forward(mx.array([ids[s:e]]), c, exact=False)
        b = mlx_lm_last_row_logits(ref, mx.array([ids[s:e]]), rc)
        assert mx.array_equal(a, b).item()


def test_bf16_float_experts_run_on_cpu(tmp_path):
    """mlx-lm cannot run an unquantized bf16 MoE on MLX's CPU backend (GatherMM is float32
    only); ours upcasts that one op there. Close to the float32 checkpoint of the same seed."""
    a = load_model(write_checkpoint(tmp_path / "bf", family="qwen3_moe", layout="hf", seed=4))
    b = load_model(write_checkpoint(tmp_path / "f32", family="qwen3_moe", layout="hf", seed=4,
                                    dtype="float32"))
    x = _ids(a.cfg.vocab_size, 70, seed=2)
    la = a.forward(x, a.new_cache(), exact=False, all_logits=True).astype(mx.float32)
    lb = b.forward(x, b.new_cache(), exact=False, all_logits=True)
    assert mx.isfinite(la).all().item()
    close = (mx.abs(la - lb).max(axis=-1) < 0.1 * mx.abs(lb).max()).astype(mx.float32).mean().item()
    assert close > 0.8, close      # bf16 routing may flip a near-tie on some rows


DEQUANT_CASES = [dict(bits=4, gs=64, dtype=mx.bfloat16), dict(bits=8, gs=32, dtype=mx.float16),
                 dict(bits=4, gs=128, dtype=mx.float32),
                 dict(bits=4, gs=64, dtype=mx.float32, float_gate=True)]   # gate left unquantized


@pytest.mark.parametrize("case", range(len(DEQUANT_CASES)))
def test_dequantized_prefill_experts_close_to_fp32(case):
    """The dequantized grouped-GEMM prefill path (Experts.gather_dequantized, the CUDA face's
    default from DEQUANT_MIN_PAIRS routed pairs) computes the routed SwiGLU MLP of expert-sorted
    rows within bf16 rounding of a float32 reference built from the same dequantized weights
    (stated tolerance: 1% of the output's max magnitude), and no further from it than 1% + MLX's
    own gather_qmm path is."""
    from tensorfold.models.dense import swiglu
    from tensorfold.models.moe import Experts, _gather_sort, _scatter_unsort

    c = DEQUANT_CASES[case]
    E, F, D, k, T = 8, 128, 256, 2, 48
    mx.random.seed(case)

    def experts(shape, quantized=True):
        w = (mx.random.normal(shape) * 0.05).astype(c["dtype"])
        if not quantized:
            return Experts(w)
        wq, s, b = mx.quantize(w, group_size=c["gs"], bits=c["bits"])
        return Experts(wq, s, b, c["gs"], c["bits"])

    g = experts((E, F, D), not c.get("float_gate"))
    u, d = experts((E, F, D)), experts((E, D, F))
    x = (mx.random.normal((1, T, D)) * 0.5).astype(c["dtype"])
    inds = mx.argpartition(mx.random.normal((1, T, E)), kth=-k, axis=-1)[..., -k:]

    def mlp(call, xin):
        xe, idx, inv = _gather_sort(mx.expand_dims(xin, (-2, -3)), inds)
        return _scatter_unsort(call(d, swiglu(call(g, xe, idx), call(u, xe, idx)), idx),
                               inv, inds.shape).squeeze(-2).astype(mx.float32)

    def fp32(e):
        if not e.quantized:
            return Experts(e.weight.astype(mx.float32))
        return Experts(mx.dequantize(e.weight, e.scales, e.biases, group_size=c["gs"], bits=c["bits"],
                                     dtype=mx.float32))

    G, U, Dn = fp32(g), fp32(u), fp32(d)
    ref = mlp(lambda e, a, i: {id(g): G, id(u): U, id(d): Dn}[id(e)].gather(a, i, True), x.astype(mx.float32))
    deq = mlp(lambda e, a, i: e.gather_dequantized(a, i), x)
    qmm = mlp(lambda e, a, i: e.gather(a, i, True), x)
    scale = mx.abs(ref).max().item()
    err_d = mx.abs(deq - ref).max().item() / scale
    err_q = mx.abs(qmm - ref).max().item() / scale
    assert deq.dtype == mx.float32 and deq.shape == ref.shape
    assert err_d <= 0.01 + (err_q if c["dtype"] != mx.float32 else 0.0), (err_d, err_q)


def test_dequantized_prefill_rule_and_model_logits(checkpoints, monkeypatch):
    """dequantized_prefill: forced either way by TENSORFOLD_MOE_PREFILL, else the CUDA face from
    DEQUANT_MIN_PAIRS pairs (a function of the chunk's length: the grid fixes it by position).
    Forced on, the model's prefill logits stay close to mlx-lm's path (same routing, products
    within bf16 rounding) and are deterministic."""
    from tensorfold.models import moe

    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "gather_qmm")
    assert not moe.dequantized_prefill(10**6)
    m = load_model(checkpoints["qwen3_moe_mlx_4bit"])
    x = _ids(m.cfg.vocab_size, 90, seed=7)
    a = m.forward(x, m.new_cache(), exact=False, all_logits=True).astype(mx.float32)
    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "dequant")
    assert moe.dequantized_prefill(1)
    b = m.forward(x, m.new_cache(), exact=False, all_logits=True).astype(mx.float32)
    b2 = m.forward(x, m.new_cache(), exact=False, all_logits=True).astype(mx.float32)
    assert mx.array_equal(b, b2).item()
    assert not mx.array_equal(a, b).item()         # the other path did run
    close = (mx.abs(a - b).max(axis=-1) < 0.05 * mx.abs(a).max()).astype(mx.float32).mean().item()
    assert close > 0.9, close                      # a near-tie in routing may flip on a row
    monkeypatch.delenv("TENSORFOLD_MOE_PREFILL")
    want = moe.DEQUANT_MIN_PAIRS <= 10**6 and K.backend_face() == "cuda"
    assert moe.dequantized_prefill(10**6) == want
    assert not moe.dequantized_prefill(moe.DEQUANT_MIN_PAIRS - 1)


def test_exact_decode_close_to_prefill(checkpoints):
    """float32 checkpoint: the row-exact decode path computes the same function (to fp32
    rounding; routing ties aside)."""
    m = load_model(checkpoints["qwen3_moe_hf_f32"])
    x = _ids(m.cfg.vocab_size, 24, seed=3)
    a = m.forward(x, m.new_cache(), exact=False, all_logits=True)
    c = m.new_cache()
    m.forward(x[:, :14], c, exact=False, logits=False)
    b = m.forward(x[:, 14:], c, exact=True, all_logits=True)
    err = (mx.abs(a[14:] - b).max() / mx.abs(a).max()).item()
    assert err < 1e-4, err


# ---------------------------------------------------------------- row_expert_matmul

def _experts(rng, E, N, Kd, bits, wdtype, gs=64):
    w = mx.array(rng.standard_normal((E, N, Kd), dtype=np.float32) / np.sqrt(Kd)).astype(wdtype)
    if bits is None:
        return w, None, None, w
    wq, s, b = mx.quantize(w, gs, bits)
    return wq, s, b, mx.dequantize(wq, s, b, gs, bits)


EXPERT_CASES = [  # (bits, weight / scale dtype, x dtype, K, N, group)
    (4, mx.bfloat16, mx.bfloat16, 128, 48, 64),
    (3, mx.bfloat16, mx.bfloat16, 256, 40, 64),
    (8, mx.float16, mx.float16, 96, 33, 32),
    (6, mx.bfloat16, mx.float32, 128, 20, 128),
    (None, mx.bfloat16, mx.bfloat16, 80, 24, 64),
    (None, mx.float32, mx.float32, 1040, 17, 64),    # K > the 512-wide chunk, ragged N
    (None, mx.bfloat16, mx.bfloat16, 96, 24, 64),     # dense with K % 32 == 0: what the GPU
    (None, mx.float32, mx.float32, 1056, 17, 64),     # faces take (they refuse the two above)
]


@pytest.mark.parametrize("case", range(len(EXPERT_CASES)))
def test_row_expert_matmul_row_exact(case):
    bits, wdt, xdt, Kd, N, gs = EXPERT_CASES[case]
    rng = np.random.default_rng(100 + case)
    E, k = 6, 3
    w, s, b, w_hat = _experts(rng, E, N, Kd, bits, wdt, gs)
    x = mx.array(rng.standard_normal((16, Kd), dtype=np.float32)).astype(xdt)
    idx = rng.integers(0, E, size=(16, k)).astype(np.int32)
    idx[3] = [2, 2, 2]                      # repeats within a row
    idx[7] = [5, 0, 5]
    ind = mx.array(idx)
    if bits is None and Kd % 32 and K.backend_face() in ("cuda", "metal"):
        # documented limit of the GPU dense faces (row_mm / row_expert_mm): K % 32 == 0
        with pytest.raises(ValueError, match="multiple of 32"):
            K.row_expert_matmul(x, w, s, b, ind, gs, 0)
        return
    full = K.row_expert_matmul(x, w, s, b, ind, gs, bits or 0)
    mx.eval(full)
    assert full.shape == (16, k, N) and full.dtype == xdt
    alone = [K.row_expert_matmul(x[i:i + 1], w, s, b, ind[i:i + 1], gs, bits or 0) for i in range(16)]
    # the same bits as the 2-D row-exact kernel on that expert's weight, where both take the
    # same arithmetic (everywhere on the CPU; on CUDA the 2-D op has a tensor-core face for
    # bf16 / fp16 with 4 / 8 bits or same-dtype dense weights, the expert op does not)
    same = K.backend_face() != "cuda" or not K.uses_tensor_cores(x, w, s, gs, bits or 0)
    for i in ((0, 3, 7, 15) if same else ()):
        for j in range(k):
            e = int(idx[i, j])
            ref = (K.row_quantized_matmul(x[i:i + 1], w[e], s[e], b[e], gs, bits) if bits
                   else K.row_matmul(x[i:i + 1], w[e]))
            assert np.array_equal(_bits(full[i, j]), _bits(ref[0]))
    for M in range(1, 17):
        # other rows: huge garbage, other (random) expert choices
        xg = mx.array(rng.standard_normal((M, Kd), dtype=np.float32) * 1e4).astype(xdt)
        ig = rng.integers(0, E, size=(M, k)).astype(np.int32)
        pos = int(rng.integers(0, M))
        i = int(rng.integers(0, 16))
        xg[pos] = x[i]
        ig[pos] = idx[i]
        got = K.row_expert_matmul(xg, w, s, b, mx.array(ig), gs, bits or 0)
        assert np.array_equal(_bits(got[pos]), _bits(alone[i][0])), (M, pos, i)
    for i in range(16):
        assert np.array_equal(_bits(full[i]), _bits(alone[i][0]))
    # accuracy vs float64, against MLX's own gather op on the same inputs
    x64 = np.asarray(x.astype(mx.float32), dtype=np.float64)
    wh = np.asarray(w_hat.astype(mx.float32), dtype=np.float64)
    ref64 = np.einsum("rk,rjnk->rjn", x64, wh[idx])
    xe = mx.expand_dims(x, (-2, -3))
    if bits:
        own = mx.gather_qmm(xe, w, s, b, rhs_indices=ind, transpose=True, group_size=gs, bits=bits)
    else:
        own = mx.gather_mm(xe.astype(mx.float32), w.swapaxes(-1, -2).astype(mx.float32),
                           rhs_indices=ind).astype(xdt)
    own = np.asarray(own.squeeze(-2).astype(mx.float32), dtype=np.float64)
    ours = np.asarray(full.astype(mx.float32), dtype=np.float64)
    ulp = {mx.float32: 2.0 ** -23, mx.bfloat16: 2.0 ** -8, mx.float16: 2.0 ** -11}[xdt]
    rounding = ulp * np.abs(ref64).max()
    err_ours, err_own = np.abs(ours - ref64).max(), np.abs(own - ref64).max()
    assert err_ours <= 2 * err_own + rounding, (err_ours, err_own, rounding)


def test_row_expert_matmul_errors_and_bad_index():
    rng = np.random.default_rng(0)
    w, s, b, _ = _experts(rng, 4, 16, 64, 4, mx.bfloat16)
    x = mx.ones((2, 64), mx.bfloat16)
    out = K.row_expert_matmul(x, w, s, b, mx.array([[0, 9], [3, -1]], dtype=mx.int32), 64, 4)
    o = np.asarray(out.astype(mx.float32))
    assert np.isfinite(o[0, 0]).all() and np.isnan(o[0, 1]).all() and np.isnan(o[1, 1]).all()
    with pytest.raises(ValueError):
        K.row_expert_matmul(mx.ones((2, 32), mx.bfloat16), w, s, b, mx.zeros((2, 1), mx.int32), 64, 4)
    with pytest.raises(ValueError):
        K.row_expert_matmul(x, w, s, b, mx.zeros((3, 1), mx.int32), 64, 4)
    with pytest.raises(ValueError):
        K.row_expert_matmul(x, w[0], s[0], b[0], mx.zeros((2, 1), mx.int32), 64, 4)


# ---------------------------------------------------------------- route / expert_glu / expert_sum

from tensorfold.kernels import moe as KM  # noqa: E402

MOE_OP_CASES = [  # (bits, weight / scale dtype, x dtype, D, F, group, E, k); D, F multiples of 32
    # (the CUDA dense expert faces' limit), so every case runs on every face
    (4, mx.bfloat16, mx.bfloat16, 128, 192, 64, 16, 4),
    (8, mx.float16, mx.float16, 64, 64, 32, 12, 3),
    (3, mx.bfloat16, mx.bfloat16, 256, 64, 64, 8, 8),
    (None, mx.bfloat16, mx.bfloat16, 96, 64, 64, 10, 2),
    (None, mx.float32, mx.float32, 64, 32, 64, 6, 5),
]


def _moe_op_inputs(case, R, seed):
    bits, wdt, xdt, D, F, gs, E, k = MOE_OP_CASES[case]
    rng = np.random.default_rng(seed)
    gate, up = (_experts(rng, E, F, D, bits, wdt, gs)[:3] + (gs, bits or 0) for _ in range(2))
    down = _experts(rng, E, D, F, bits, wdt, gs)[:3] + (gs, bits or 0)
    x = mx.array(rng.standard_normal((R, D), dtype=np.float32)).astype(xdt)
    logits = mx.array(rng.standard_normal((R, E), dtype=np.float32) * 3)
    res = mx.array(rng.standard_normal((R, D), dtype=np.float32)).astype(xdt)
    return gate, up, down, x, logits, res, gs, bits or 0, k


def _moe_ops(gate, up, down, x, logits, res, gs, bits, k, normalize=True):
    inds, scores = KM.route(logits, k, normalize)
    h = KM.expert_glu(x, gate, up, inds)
    return inds, scores, h, KM.expert_sum(h, down, inds, scores, res)


@pytest.mark.parametrize("case", range(len(MOE_OP_CASES)))
def test_moe_decode_ops_row_exact(case):
    """route, expert_glu and expert_sum: row i is bit-identical alone, inside 16 rows, and
    inside M-row calls whose other rows hold huge garbage and choose other experts."""
    gate, up, down, x, logits, res, gs, bits, k = _moe_op_inputs(case, 16, 200 + case)
    full = _moe_ops(gate, up, down, x, logits, res, gs, bits, k)
    mx.eval(full)
    assert full[0].dtype == mx.int32 and full[1].dtype == mx.float32
    assert full[2].shape == (16, k, gate[0].shape[1]) and full[3].shape == x.shape
    assert full[2].dtype == x.dtype and full[3].dtype == x.dtype
    rng = np.random.default_rng(7)
    for i in (0, 5, 15):
        alone = _moe_ops(gate, up, down, x[i:i + 1], logits[i:i + 1], res[i:i + 1], gs, bits, k)
        for a, b in zip(alone, full):
            assert np.array_equal(_bits(a[0]), _bits(b[i])), i
    for M in (2, 3, 8, 16):
        _, _, _, xg, lg, rg, *_ = _moe_op_inputs(case, M, 300 + M)
        xg, lg = xg * 1000, lg[:, ::-1] * 5                 # garbage rows, other experts
        pos, i = int(rng.integers(0, M)), int(rng.integers(0, 16))
        xg[pos], lg[pos], rg[pos] = x[i], logits[i], res[i]
        got = _moe_ops(gate, up, down, xg, lg, rg, gs, bits, k)
        for a, b in zip(got, full):
            assert np.array_equal(_bits(a[pos]), _bits(b[i])), (M, pos, i)


def test_moe_ops_past_the_cuda_grid_limit():
    """65,600 rows at top-5: 328,000 (row, expert) pairs and 65,600 rows, past the 65,535 blocks a
    CUDA grid's y dimension holds (the expert kernels launch a block per pair, expert_sum one per
    row). The CUDA face launches such calls in row pieces; every row, at a piece's edges too,
    keeps the bits it has in a call of its own (on the CPU: the contract at a large M)."""
    gate, up, down, x, logits, res, gs, bits, k = _moe_op_inputs(4, 65600, 12)
    full = _moe_ops(gate, up, down, x, logits, res, gs, bits, k)
    routed = KM.route_glu(x, logits, gate, up, k, True)
    mx.eval(full, routed)
    rows = [0, 13106, 13107, 65534, 65535, 65599]      # 13,107 rows x 5 = one grid's 65,535
    sel = mx.array(rows)
    alone = _moe_ops(gate, up, down, x[sel], logits[sel], res[sel], gs, bits, k)
    for a, b in zip(alone, full):
        assert np.array_equal(_bits(a), _bits(b[sel]))
    for a, b in zip(KM.route_glu(x[sel], logits[sel], gate, up, k, True), routed):
        assert np.array_equal(_bits(a), _bits(b[sel]))


@pytest.mark.parametrize("case", range(len(MOE_OP_CASES)))
def test_moe_decode_ops_equal_their_definition(case):
    """expert_glu and expert_sum equal their definitions in row_expert_matmul and MLX ops, bit
    for bit on every face (on CUDA: the fused kernels against the separate kernels and MLX's
    fp32 elementwise ops); route's experts equal a float64 reference where no two
    probabilities are within 1e-6, and its scores are within fp32 rounding."""
    gate, up, down, x, logits, res, gs, bits, k = _moe_op_inputs(case, 16, 400 + case)
    for normalize in (True, False):
        inds, scores = KM.route(logits, k, normalize)
        l64 = np.asarray(logits, dtype=np.float64)
        p64 = np.exp(l64 - l64.max(-1, keepdims=True))
        p64 /= p64.sum(-1, keepdims=True)
        for r in range(16):
            order = np.lexsort((np.arange(p64.shape[1]), -p64[r]))
            gaps = np.abs(np.diff(np.sort(p64[r])))
            if gaps.min() > 1e-6:
                assert np.asarray(inds[r]).tolist() == order[:k].tolist()
            want = p64[r, order[:k]]
            want = want / want.sum() if normalize else want
            np.testing.assert_allclose(np.asarray(scores[r]), want, rtol=2e-6, atol=0)
    inds, scores = KM.route(logits, k, True)
    g = K.row_expert_matmul(x, *gate[:3], inds, *gate[3:])
    u = K.row_expert_matmul(x, *up[:3], inds, *up[3:])
    h = KM.expert_glu(x, gate, up, inds)
    assert np.array_equal(_bits(h), _bits(KM.glu_f32(g, u)))
    R, F = x.shape[0], h.shape[-1]
    y = K.row_expert_matmul(h.reshape(R * k, F), *down[:3], inds.reshape(R * k, 1), *down[3:]).reshape(R, k, -1)
    acc = y[:, 0].astype(mx.float32) * scores[:, 0:1]
    for j in range(1, k):
        acc = acc + y[:, j].astype(mx.float32) * scores[:, j:j + 1]
    for r in (None, res):
        want = acc.astype(x.dtype) if r is None else r + acc.astype(x.dtype)
        got = KM.expert_sum(h, down, inds, scores, r)
        assert np.array_equal(_bits(got), _bits(want)), "residual" if r is not None else "plain"


GATE_CASES = [  # (router bits (None: unquantized), weight dtype, x dtype, D, E, k, group)
    (8, mx.bfloat16, mx.bfloat16, 256, 128, 8, 64),
    (4, mx.float16, mx.float16, 128, 60, 4, 32),
    (None, mx.bfloat16, mx.bfloat16, 128, 64, 6, 64),
    (None, mx.float32, mx.float32, 64, 16, 2, 64),
]


@pytest.mark.parametrize("case", range(len(GATE_CASES)))
def test_router_logits_equal_the_fp32_router_matmul(case):
    """router_logits == the router's row-exact matmul of x.astype(float32), bit for bit (on CUDA:
    the router kernel reading x as it is and writing fp32, against the kernel on an fp32 copy),
    and row-exact."""
    bits, wdt, xdt, D, E, k, gs = GATE_CASES[case]
    rng = np.random.default_rng(500 + case)
    w = mx.array(rng.standard_normal((E, D), dtype=np.float32) / np.sqrt(D)).astype(wdt)
    router = (w, None, None, gs, 0) if bits is None else tuple(mx.quantize(w, gs, bits)) + (gs, bits)
    x = mx.array(rng.standard_normal((16, D), dtype=np.float32) * 4).astype(xdt)
    logits = KM.router_logits(x, router)
    x32 = x.astype(mx.float32)
    want = K.row_matmul(x32, w) if bits is None else K.row_quantized_matmul(x32, *router[:3], gs, bits)
    assert logits.dtype == mx.float32 and logits.shape == (16, E)
    assert np.array_equal(_bits(logits), _bits(want))
    for M in (1, 3, 16):
        xg = mx.array(rng.standard_normal((M, D), dtype=np.float32) * 1e3).astype(xdt)
        pos, i = int(rng.integers(0, M)), int(rng.integers(0, 16))
        xg[pos] = x[i]
        assert np.array_equal(_bits(KM.router_logits(xg, router)[pos]), _bits(logits[i]))
    with pytest.raises(ValueError):
        KM.router_logits(x[:, :-32], router)
    with pytest.raises(ValueError):
        KM.router_logits(x[0], router)


@pytest.mark.parametrize("case", range(len(MOE_OP_CASES)))
def test_route_glu_equals_route_then_expert_glu(case):
    """route_glu == route, then expert_glu on its experts: h, indices and scores bit for bit (on
    CUDA: the one-kernel form against moe_route + row_expert_*_glu), for both normalizations,
    and row-exact; bad shapes raise."""
    gate, up, down, x, logits, res, gs, bits, k = _moe_op_inputs(case, 16, 600 + case)
    for normalize in (True, False):
        h, inds, scores = KM.route_glu(x, logits, gate, up, k, normalize)
        wi, ws = KM.route(logits, k, normalize)
        wh = KM.expert_glu(x, gate, up, wi)
        assert inds.dtype == mx.int32 and scores.dtype == mx.float32 and h.dtype == x.dtype
        assert np.array_equal(np.asarray(inds), np.asarray(wi))
        assert np.array_equal(_bits(scores), _bits(ws))
        assert np.array_equal(_bits(h), _bits(wh))
    rng = np.random.default_rng(11)
    for M in (1, 3, 16):
        _, _, _, xg, lg, _, *_ = _moe_op_inputs(case, M, 700 + M)
        xg, lg = xg * 1000, lg[:, ::-1] * 5
        pos, i = int(rng.integers(0, M)), int(rng.integers(0, 16))
        xg[pos], lg[pos] = x[i], logits[i]
        got = KM.route_glu(xg, lg, gate, up, k, False)
        for a, b in zip(got, (h, inds, scores)):
            assert np.array_equal(_bits(a[pos]), _bits(b[i])), (M, pos, i)
    E = logits.shape[1]
    for bad in (lambda: KM.route_glu(x, logits[:, :-1], gate, up, k, True),      # E != experts
                lambda: KM.route_glu(x, logits.astype(mx.float16), gate, up, k, True),
                lambda: KM.route_glu(x[:3], logits, gate, up, k, True),          # rows differ
                lambda: KM.route_glu(x, logits, gate, up, E + 1, True),
                lambda: KM.route_glu(x[:, :-32], logits, gate, up, k, True)):
        with pytest.raises(ValueError):
            bad()


def test_route_ties_nan_and_errors():
    lg = mx.array([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0], [1.0] * 6, [0.0, float("nan"), 3.0, 1.0, 0.0, 0.0]],
                  dtype=mx.float32)
    inds, scores = KM.route(lg, 3, True)
    assert np.asarray(inds[:2]).tolist() == [[1, 2, 4], [0, 1, 2]]
    assert np.array_equal(np.asarray(scores[1]), np.full(3, np.float32(1) / np.float32(3)))
    # a NaN logit makes the row's probabilities NaN, which rank below every number: the
    # lowest ids, never an id out of range
    assert np.asarray(inds[2]).tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        KM.route(lg.astype(mx.bfloat16), 2, True)
    with pytest.raises(ValueError):
        KM.route(lg, 7, True)
    rng = np.random.default_rng(0)
    w = _experts(rng, 4, 32, 64, 4, mx.bfloat16)[:3] + (64, 4)
    with pytest.raises(ValueError):
        KM.expert_glu(mx.ones((2, 64), mx.bfloat16), w, w, mx.zeros((3, 1), mx.int32))
    with pytest.raises(ValueError):
        KM.expert_glu(mx.ones((2, 64), mx.bfloat16), w, w[:3] + (32, 4), mx.zeros((2, 1), mx.int32))
    with pytest.raises(ValueError):
        KM.expert_sum(mx.ones((2, 1, 32), mx.bfloat16), w, mx.zeros((2, 1), mx.int32),
                      mx.ones((2, 2), mx.float32))
    with pytest.raises(ValueError):
        KM.expert_sum(mx.ones((2, 1, 64), mx.bfloat16), _experts(rng, 4, 64, 64, 4, mx.bfloat16)[:3] + (64, 4),
                      mx.zeros((2, 1), mx.int32), mx.ones((2, 1), mx.float32), mx.ones((3, 64), mx.bfloat16))


def test_expert_glu_with_gate_and_up_quantized_differently():
    """A mixed-precision checkpoint may quantize gate and up differently: expert_glu then runs
    its definition in separate calls, each with its own weights' quantization."""
    rng = np.random.default_rng(1)
    gate = _experts(rng, 6, 64, 128, 4, mx.bfloat16, 64)[:3] + (64, 4)
    up = _experts(rng, 6, 64, 128, 8, mx.bfloat16, 32)[:3] + (32, 8)
    x = mx.array(rng.standard_normal((5, 128), dtype=np.float32)).astype(mx.bfloat16)
    ind = mx.array(rng.integers(0, 6, size=(5, 2)).astype(np.int32))
    want = KM.glu_f32(K.row_expert_matmul(x, *gate[:3], ind, *gate[3:]),
                      K.row_expert_matmul(x, *up[:3], ind, *up[3:]))
    assert np.array_equal(_bits(KM.expert_glu(x, gate, up, ind)), _bits(want))


# ---------------------------------------------------------------- top-k

def test_topk_deterministic_ties():
    s = mx.array([[0.1, 0.3, 0.3, 0.2, 0.3], [0.5, 0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.9, 0.0, 0.1]])
    assert topk_deterministic(s, 3).tolist() == [[1, 2, 4], [0, 1, 2], [2, 4, 0]]
    rng = np.random.default_rng(0)
    v = rng.integers(0, 6, size=(64, 32)).astype(np.float32) / 8     # many ties
    got = np.asarray(topk_deterministic(mx.array(v), 8))
    for r in range(64):
        want = np.lexsort((np.arange(32), -v[r]))[:8]          # score desc, then id asc
        assert got[r].tolist() == want.tolist()
    # a row's answer does not depend on the other rows
    one = np.asarray(topk_deterministic(mx.array(v[5:6]), 8))
    assert one[0].tolist() == got[5].tolist()


# ---------------------------------------------------------------- LayerQueue + memory

def test_layer_queue_prefill_bounded_and_equal(checkpoints, monkeypatch):
    m = load_model(checkpoints["qwen3_moe_mlx_4bit"])
    x = _ids(m.cfg.vocab_size, 90, seed=5)
    a = m.forward(x, m.new_cache(), exact=False, all_logits=True)
    q = m.last_queue
    assert q.depth == 2 and q.max_in_flight <= 2 and q.pushed == m.cfg.num_layers
    monkeypatch.setattr(m, "_layer_done", lambda *a: None)       # the plain path: one graph
    b = m.forward(x, m.new_cache(), exact=False, all_logits=True)
    assert mx.array_equal(a, b).item()
    before = m.last_queue
    m.forward(x[:, :3], m.new_cache(), exact=True)                 # decode: no queue
    assert m.last_queue is before
    monkeypatch.undo()
    monkeypatch.setenv("TENSORFOLD_QUEUE_DEPTH", "1")             # the bench's knob: same bits
    c = m.forward(x, m.new_cache(), exact=False, all_logits=True)
    assert m.last_queue.depth == 1 and m.last_queue.max_in_flight <= 1
    assert mx.array_equal(a, c).item()
    monkeypatch.setenv("TENSORFOLD_QUEUE_DEPTH", "0")
    with pytest.raises(ValueError, match="positive integer"):
        m.forward(x, m.new_cache(), exact=False)


def test_dequantized_prefill_queues_each_projection(checkpoints, monkeypatch):
    """The dequantized path pushes each expert projection's product to the LayerQueue (one
    piece each, so at most two projections' dequantized copies are queued ahead of the device);
    the bits are those of the same path evaluated as one graph."""
    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "dequant")
    m = load_model(checkpoints["qwen3_moe_mlx_4bit"])
    x = _ids(m.cfg.vocab_size, 90, seed=6)
    a = m.forward(x, m.new_cache(), exact=False, all_logits=True)
    q = m.last_queue
    n_moe = sum(m.cfg.moe_layer(i) for i in range(m.cfg.num_layers))
    assert n_moe > 0
    assert q.pushed == m.cfg.num_layers + 3 * n_moe and q.max_in_flight <= 2
    monkeypatch.setattr(m, "_layer_done", lambda *a: None)
    monkeypatch.setattr(m, "_piece_done", lambda *a: None)        # one graph, nothing queued
    b = m.forward(x, m.new_cache(), exact=False, all_logits=True)
    assert mx.array_equal(a, b).item()
    monkeypatch.undo()
    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "gather_qmm")     # mlx-lm's op: no pieces
    m.forward(x, m.new_cache(), exact=False)
    assert m.last_queue.pushed == m.cfg.num_layers
    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "dequant")        # unquantized experts: no copy,
    f = load_model(checkpoints["qwen3_moe_hf_f32"])                # so no pieces either
    f.forward(x % f.cfg.vocab_size, f.new_cache(), exact=False)
    assert f.last_queue.pushed == f.cfg.num_layers


def test_dequantized_prefill_peak_one_projection_at_a_time(tmp_path, monkeypatch):
    """Pushing each projection's product (test above) lowers the dequantized path's peak: the
    host waits for the piece two pushes back before it dequantizes the next projection, instead
    of building up to two whole layers' copies ahead. Measured here on 8 layers, E = 32, one
    256-token chunk: 118.5 MiB above weights + KV with the pieces, 149.0 without (the same
    on every run); each projection's transient is ~24 MiB (bf16 copy + the fp32 copy MLX's CPU
    gather_mm needs). On CUDA only the bound is asserted (below). The H200 figure (0.4 GB a
    projection): docs/benchmarks.md, "Session 14"."""
    from tensorfold.engine.prefill import PrefillMode, prefill

    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", "dequant")
    E, F, D = 32, 512, 256
    m = load_model(write_checkpoint(tmp_path / "moe", family="qwen3_moe", layout="mlx", bits=4,
                                    dtype="bfloat16", layers=8, hidden=D, heads=4, kv_heads=1,
                                    head_dim=64, seed=1, num_experts=E, experts_per_tok=4,
                                    moe_intermediate=F))
    mx.eval(m.parameters())
    ids = np.random.default_rng(1).integers(3, m.cfg.vocab_size, 256).tolist()

    def peak():
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        c = m.new_cache()
        logits = prefill(m, c, ids, PrefillMode(grid=256))
        mx.eval(logits)
        return mx.get_peak_memory() - base - sum(a.nbytes for a in c.arrays()), logits

    with_pieces, a = peak()
    monkeypatch.setattr(m, "_piece_done", lambda *a: None)
    without, b = peak()
    assert mx.array_equal(a, b).item()
    if mx.default_device() == mx.cpu:
        projection = E * F * D * (2 + 4)
        assert with_pieces <= without - projection, (with_pieces / 2**20, without / 2**20)
    else:
        # On CUDA, whether the host runs ahead of the device (what the pieces stop) depends on
        # timing at these sizes: the H200 gave 29.3 MiB with pieces and 28.9 without in one run
        # (s45a, nine other test processes on the GPU), 44.3 / 28.7 under compute-sanitizer,
        # and passed the CPU's inequality in s44b. What holds there is the bound: at most two
        # layers' bf16 copies (the layer queue's depth) with the pieces. The effect at real size
        # is measured by bench/gpu_moe_mem_trace.py (docs/benchmarks.md, "Session 14").
        two_layers = 2 * 3 * E * F * D * 2
        assert with_pieces <= two_layers, (with_pieces / 2**20, without / 2**20)


@pytest.mark.parametrize("experts_path", ["gather_qmm", "dequant"])
def test_prefill_peak_memory_flat(tmp_path, monkeypatch, experts_path):
    """Peak memory of the engine's grid prefill, prompts of 1, 2 and 4 grid cells (and 8 on CUDA), with the
    experts through mlx-lm's gather_qmm and through the dequantized grouped GEMM (the CUDA
    face's path for long chunks: one transient dequantized copy per layer, not per chunk).

    On MLX's CPU backend scaled_dot_product_attention is the unfused fallback: it
    materialises the [H, L, offset+L] score matrix of the chunk, which grows with the prompt
    for ANY family (the dense one included) -- a property of MLX's CPU attention, not of the
    MLP. So the measure is differential: (peak - weights - KV) of the MoE model minus the same
    quantity for a dense qwen3 model with the identical attention (same seed, shapes, grid).
    That difference must stay flat: within 2 MiB from 2 to 4 cells, and no more at 1 (one
    chunk's MoE activations are ~2-4 MiB here and a per-chunk leak would add >= 2 of them;
    measured drift on the CPU is ~0.5 MiB, allocator rounding). grid=1024 instead of 2048 keeps the CPU time
    down (the quadratic CPU attention dominates); the memory structure is the same."""
    from tensorfold.engine.prefill import PrefillMode, prefill

    monkeypatch.setenv("TENSORFOLD_MOE_PREFILL", experts_path)
    grid = 1024
    # hidden 64, intermediate 128, experts' 64 (write_checkpoint's defaults), or wider where
    # $TF_TEST_HIDDEN says (the H200: MLX's CUDA quantized matmul reads past K <= 128, testing.widened)
    # float32 on the CPU; bf16 on CUDA, whose float32 attention is MLX's unfused fallback (a
    # score matrix per layer, growing with the prompt: the MoE model's two layers in flight hold
    # two, the dense model's one, so the difference grew 32 -> 61 MiB over 1 -> 4 cells on the
    # H200, session 52) and whose bf16 attention is fused, as a real checkpoint's
    cuda = K.backend_face() == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    kw = dict(layout="mlx", bits=4, dtype=dtype, layers=2, heads=2, kv_heads=1, head_dim=32, seed=1,
              max_position=16384)
    moe = load_model(write_checkpoint(tmp_path / "moe", **widened(dict(family="qwen3_moe", num_experts=8,
                                                                       experts_per_tok=2, **kw))))
    dense = load_model(write_checkpoint(tmp_path / "dense", **widened(dict(family="qwen3", **kw))))
    # CUDA: how far the host runs ahead of the device decides how many layers' buffers are live at
    # the peak, up to the layer queue's two. Each chunk is a chance to reach that, so the peak is a
    # maximum over chunks that a longer prompt reaches more often: the MoE excess at 4 cells was
    # 16.39 MB in all three runs seen (H200 session 52, H100 session 56 twice), at 2 cells 9.3, 10.5
    # or 16.4, at 1 cell 9.5-13.8 (one layer's ~7 MB more or less). So there the test is the bound:
    # the worst of three prefills at 8 cells no more than the worst seen at 1-4 cells (+2 MiB); a
    # per-chunk leak would add >= 8 MiB from 4 to 8 cells.
    cells_list, repeats = ((1, 2, 4, 8), 3) if cuda else ((1, 2, 4), 1)
    excess = {}
    for name, m in (("moe", moe), ("dense", dense)):
        mx.eval(m.parameters())
        if cuda:
            # one untimed prefill first, so that what a backend allocates once per shape (cuDNN's
            # attention plans and workspaces) is held before the measures (session 55: cold, a
            # one-off allocation in the dense model's 2-cell prefill)
            warm = np.random.default_rng(9).integers(3, m.cfg.vocab_size, grid * 4).tolist()
            mx.eval(prefill(m, m.new_cache(), warm, PrefillMode(grid=grid)))
        for cells in cells_list:
            ids = np.random.default_rng(cells).integers(3, m.cfg.vocab_size, grid * cells).tolist()
            seen = []
            for _ in range(repeats):
                mx.clear_cache()
                base = mx.get_active_memory()        # the weights (and nothing else) are live here
                mx.reset_peak_memory()
                c = m.new_cache()
                mx.eval(prefill(m, c, ids, PrefillMode(grid=grid)))
                kv = sum(a.nbytes for a in c.arrays())
                seen.append(mx.get_peak_memory() - base - kv)
                del c
            excess[name, cells] = max(seen)
        if name == "moe":
            assert m.last_queue.max_in_flight <= 2
    diff = {c: (excess["moe", c] - excess["dense", c]) / 2**20 for c in cells_list}
    if cuda:
        assert diff[8] < max(diff[c] for c in (1, 2, 4)) + 2.0, (diff, excess)
    else:
        # flat with the prompt's length: 4 cells within 2 MiB of 2, and 1 cell not above them (a
        # one-chunk prompt has no next chunk's layers in flight beside its last ones)
        assert abs(diff[4] - diff[2]) < 2.0 and diff[1] < diff[2] + 2.0, (diff, excess)


# ---------------------------------------------------------------- loading, config, info

def test_hf_and_mlx_layouts_load_the_same(tmp_path):
    a = load_model(write_checkpoint(tmp_path / "hf", family="qwen3_moe", layout="hf", dtype="float32", seed=3))
    b = load_model(write_checkpoint(tmp_path / "mlx", family="qwen3_moe", layout="mlx", dtype="float32", seed=3))
    x = _ids(a.cfg.vocab_size, 9)
    assert mx.array_equal(a.forward(x, a.new_cache(), exact=True, all_logits=True),
                          b.forward(x, b.new_cache(), exact=True, all_logits=True)).item()
    assert sum(p.size for p in a.parameters()) == a.cfg.param_count()


def test_bad_moe_checkpoints(tmp_path):
    import shutil

    p = write_checkpoint(tmp_path / "m", family="qwen3_moe", layout="mlx", bits=4, seed=1)
    bad = tmp_path / "bad"
    shutil.copytree(p, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_intermediate_size"] = 128            # weights are 64 wide
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="switch_mlp"):
        load_model(bad)
    for key, val in (("num_experts_per_tok", 99), ("mlp_only_layers", [7]), ("num_experts", 0),
                     ("decoder_sparse_step", 0)):
        c2 = dict(cfg, moe_intermediate_size=64, **{key: val})
        (bad / "config.json").write_text(json.dumps(c2))
        with pytest.raises(CheckpointError):
            load_model(bad)
    hf = write_checkpoint(tmp_path / "hf", family="qwen3_moe", layout="hf", seed=1)
    w = mx.load(str(hf / "model.safetensors"))
    del w["model.layers.1.mlp.experts.3.up_proj.weight"]
    mx.save_safetensors(str(hf / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match=r"missing for experts \[3\]"):
        load_model(hf)


def test_info_describes_moe(checkpoints):
    text = describe(checkpoints["qwen3_moe_mlx_4bit"])
    for want in ("qwen3_moe", "experts", "active experts", "8 (2 per token)", "active parameters",
                 "weights: experts", "4-bit/g64", "weights: router", "8-bit/g64", "KV cache, 32k tokens"):
        assert want in text, (want, text)
    from tensorfold.models.config import ModelConfig
    cfg = ModelConfig.from_dir(checkpoints["qwen3_moe_mlx_4bit"])
    m = load_model(checkpoints["qwen3_moe_mlx_4bit"])
    assert cfg.weight_bytes() == sum(p.nbytes for p in m.parameters())


def test_qwen3_30b_a3b_shape_counts(tmp_path):
    """The real model's config.json: 30.5B parameters, 3.3B active (Qwen's published numbers)."""
    from tensorfold.models.config import ModelConfig
    raw = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
           "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "norm_topk_prob": True, "vocab_size": 151936, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 40960,
           "torch_dtype": "bfloat16"}
    cfg = ModelConfig.from_dict(raw, tmp_path)
    assert 30.4e9 < cfg.param_count() < 30.6e9
    assert 3.2e9 < cfg.active_param_count() < 3.4e9


def test_engine_row_check_passes_drafting_on(checkpoints):
    """The engine's start-up row_check (k single decode steps vs one k-row call) holds for
    both MoE checkpoints, so drafting stays on for this family."""
    from tensorfold.engine import Engine
    from tensorfold.engine.rowcheck import row_check

    for name in ("qwen3_moe_mlx_4bit", "qwen3_moe_hf_f32"):
        eng = Engine(checkpoints[name])
        assert eng.row_exact is True and eng.drafts_enabled, name
        assert row_check(eng.model, k=16, prompt_len=40, seed=3)


def test_moe_helpers_read_ids_and_residuals_as_row_expert_matmul_does():
    """expert_glu / expert_sum cast ids with astype(int32): an int64 id past int32 wrapped into a
    valid expert (2**32 + 1 read as expert 1) and a float id was truncated, where
    row_expert_matmul gives a NaN row / a ValueError. expert_sum took a residual of [D, R] (the
    same size) and mixed other rows' residuals into each row. Float offsets / k of the
    attention ops were truncated (2.7 read as 2)."""
    from tensorfold import kernels as K
    from tensorfold.kernels import moe as KM
    rng = np.random.default_rng(0)
    E, D, F, R = 4, 64, 64, 4

    def experts(N, Kd):             # (weight, scales, biases, group_size, bits), kernels/moe.py's Weights
        return _experts(rng, E, N, Kd, 4, mx.float32)[:3] + (64, 4)
    gate, up, down = experts(F, D), experts(F, D), experts(D, F)
    x = mx.array(rng.standard_normal((1, D)).astype(np.float32))
    bad = mx.array([[2**32 + 1]], dtype=mx.int64)
    assert np.isnan(np.array(KM.expert_glu(x, gate, up, bad))).all()
    assert np.isnan(np.array(KM.expert_sum(mx.ones((1, 1, F)), down, bad, mx.ones((1, 1))))).all()
    for call in (lambda: KM.expert_glu(x, gate, up, mx.array([[1.9]])),
                 lambda: KM.expert_sum(mx.ones((1, 1, F)), down, mx.array([[1.9]]), mx.ones((1, 1)))):
        with pytest.raises(ValueError):
            call()
    h = mx.array(rng.standard_normal((R, 1, F)).astype(np.float32))
    res = mx.array(rng.standard_normal((R, D)).astype(np.float32))
    KM.expert_sum(h, down, mx.zeros((R, 1), mx.int32), mx.ones((R, 1)), res)
    with pytest.raises(ValueError):
        KM.expert_sum(h, down, mx.zeros((R, 1), mx.int32), mx.ones((R, 1)), res.T)
    q = mx.ones((1, 2, 1, 64))
    kv = mx.ones((1, 1, 8, 64))
    for call in (lambda: K.row_attention(q, kv, kv, 2.7, 0.1),
                 lambda: K.sparse_attention(q, kv, kv, mx.zeros((1, 1, 2), mx.int32), 2.7, 0.1),
                 lambda: K.select_topk(mx.ones((1, 1, 8)), 2.7, 1),
                 lambda: K.select_topk(mx.ones((1, 1, 8)), 2, 1.9)):
        with pytest.raises(ValueError):
            call()
    assert np.array_equal(np.array(K.row_attention(q, kv, kv, np.int64(2), 0.1)),
                          np.array(K.row_attention(q, kv, kv, 2, 0.1)))


def test_moe_ops_on_no_rows():
    """No row (or no expert a row): the shapes, zeros (plus the residual), nothing launched. The
    CUDA paths launched a grid of 0 blocks, which CUDA refuses, and expert_sum's other faces
    indexed y[:, 0] of an empty k (a static audit of the CUDA face)."""
    from tensorfold.kernels import moe as km
    rng = np.random.default_rng(0)
    wq, s, b, _ = _experts(rng, 4, 32, 64, 4, mx.bfloat16)
    gate = up = (wq, s, b, 64, 4)
    down = _experts(rng, 4, 64, 32, 4, mx.bfloat16, gs=32)[:3] + (32, 4)
    x = mx.zeros((0, 64), mx.bfloat16)
    logits = km.router_logits(x, (mx.zeros((4, 64), mx.bfloat16), None, None, None, None))
    assert logits.shape == (0, 4) and logits.dtype == mx.float32
    inds, scores = km.route(logits, 2, True)
    assert inds.shape == scores.shape == (0, 2)
    assert km.expert_glu(x, gate, up, inds).shape == (0, 2, 32)
    h, i2, s2 = km.route_glu(x, logits, gate, up, 2, True)
    assert h.shape == (0, 2, 32) and i2.shape == s2.shape == (0, 2)
    assert km.expert_sum(h, down, i2, s2).shape == (0, 64)
    # k = 0: a sum of nothing, the residual through
    h0 = mx.zeros((3, 0, 32), mx.bfloat16)
    res = mx.ones((3, 64), mx.bfloat16)
    out = km.expert_sum(h0, down, mx.zeros((3, 0), mx.int32), mx.zeros((3, 0)), res)
    assert out.shape == (3, 64) and np.array_equal(np.array(out.astype(mx.float32)), np.ones((3, 64)))
