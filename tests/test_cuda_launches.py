"""The CUDA faces' Python wrappers launch what their kernels declare, checked without a GPU:
`_cuda._kernel` is replaced by a stub that records each launch (and returns zeros), the face is
forced to "cuda", and every launch of the decode step's ops (GEMMs, attention, q/k norm + RoPE,
the MoE ops) must pass one input per declared input name of its kernel (`_cuda._KERNELS`), with
the integer / fp32 / packed-weight dtypes it reads them as, and ask for the declared outputs;
the MoE kernels' template names must be ones their bodies use. CI has no GPU; a wrapper that drifted
from its kernel would otherwise be found only on the H200."""
from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

import tensorfold.kernels as K
from tensorfold.kernels import _cuda
from tensorfold.kernels import moe as KM
from tensorfold.kernels._sources import kernel_text


@pytest.fixture
def launches(monkeypatch):
    seen = []

    class Stub:
        def __init__(self, name, unused_out=False):
            self.name, self.unused_out = name, unused_out

        def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes,
                     stream=None):
            seen.append(dict(name=self.name, inputs=inputs, template=template, grid=grid,
                             threadgroup=threadgroup, output_shapes=output_shapes,
                             output_dtypes=output_dtypes, unused_out=self.unused_out))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    # the launch plans (_qmm_cp_call and the other lru_caches) keep the kernel they were made
    # with: a plan an earlier test of this process made would launch the real kernel past the
    # stub (on the H200, session 51: no row_qmm launch seen, when the suite dealt the tests so)
    _cuda.clear_kernel_caches()
    monkeypatch.setattr(_cuda, "_kernel", lambda name, smem, unused_out=False: Stub(name, unused_out))
    monkeypatch.setattr(K, "backend_face", lambda stream=None: "cuda")
    monkeypatch.setattr(K, "_gpu_stream", lambda s: None)
    yield seen
    _cuda.clear_kernel_caches()         # and no later test launches a plan holding a stub


# inputs a kernel takes and never reads, by design: the in-place KV write's fence orders it
# after the previous step's attention in MLX's CUDA graph (dense.StepCache.in_place)
NEVER_READ = {("qk_norm_rope_kv", "fence")}


def _check(launch):
    name = launch["name"]
    inputs, outputs, filename = _cuda._KERNELS[name]
    assert len(launch["inputs"]) == len(inputs), (name, len(launch["inputs"]), inputs)
    assert len(launch["output_shapes"]) == len(outputs) == len(launch["output_dtypes"]), name
    header, body = kernel_text("cuda", filename, name)
    for key, _ in launch["template"]:
        # every template argument of the MoE kernels is used (the GEMMs pass S as a type name)
        assert re.search(rf"\b{key}\b", body) or not name.startswith(("row_expert", "moe_")), (name, key)
    for arr, nm in zip(launch["inputs"], inputs):
        assert re.search(rf"\b{nm}(_shape|_strides|_ndim)?\b", body) or (name, nm) in NEVER_READ, (name, nm)
        want = {"indices": mx.int32, "scores": mx.float32, "logits": mx.float32, "offset": mx.int32,
                "scale_f": mx.float32, "inv_freq": mx.float32, "params": mx.float32}.get(nm)
        if nm in ("w", "wg", "wu") and "qmm" in name:
            want = mx.uint32
        assert want is None or arr.dtype == want, (name, nm, arr.dtype)
    tx, ty, tz = launch["threadgroup"]
    assert tx * ty * tz <= 1024 and tx % 32 == 0, name


def _experts(E, N, K_, bits, dtype=mx.bfloat16, gs=64):
    w = mx.random.normal((E, N, K_)).astype(dtype)
    if not bits:
        return (w, None, None, gs, 0)
    return tuple(mx.quantize(w, gs, bits)) + (gs, bits)


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_moe_decode_launches_match_their_kernels(launches, bits):
    R, D, F, E, k = 3, 128, 64, 16, 4
    x = mx.ones((R, D), mx.bfloat16)
    router = _experts(1, E, D, 8 if bits else 0)
    router = (router[0][0],) + tuple(a[0] if a is not None else None for a in router[1:3]) + router[3:]
    logits = KM.router_logits(x, router)
    gate, up = _experts(E, F, D, bits), _experts(E, F, D, bits)
    h, inds, scores = KM.route_glu(x, logits, gate, up, k, True)
    KM.route(logits, k, True)
    KM.expert_glu(x, gate, up, inds)
    down = _experts(E, D, F, bits)
    KM.expert_sum(h, down, inds, scores, x)
    KM.expert_sum(h, down, inds, scores)
    K.row_expert_matmul(x, *gate[:3], inds, *gate[3:])
    names = [lc["name"] for lc in launches]
    q = "qmm" if bits else "mm"
    assert names[0] == f"row_{q}" and names[1] == f"row_expert_{q}_glu_route", names
    # the router reads x as it is (bf16) and writes the fp32 logits: no copy of x
    assert launches[0]["inputs"][0].dtype == mx.bfloat16 and launches[0]["output_dtypes"] == [mx.float32]
    assert launches[1]["output_dtypes"] == [mx.bfloat16, mx.int32, mx.float32]
    # h in its callers' shape [R, k, F] (no reshape node): the row_expert kernels read no shapes
    assert launches[1]["output_shapes"] == [(R, k, F), (R, k), (R, k)]
    for lc in launches:
        if lc["name"].startswith("row_expert"):
            body = kernel_text("cuda", _cuda._KERNELS[lc["name"]][2], lc["name"])[1]
            assert not re.search(r"\w_(shape|strides|ndim)\b", body), lc["name"]
    assert {"moe_route", f"row_expert_{q}_glu", f"row_expert_{q}_sum", f"row_expert_{q}"} <= set(names), names
    for lc in launches:
        _check(lc)
    sums = [lc for lc in launches if lc["name"].endswith("_sum")]
    assert [dict(lc["template"])["RES"] for lc in sums] == [True, False]
    for lc in sums:
        assert lc["threadgroup"][0] == 32 * k and lc["output_shapes"] == [(R, D)]


def test_moe_launches_keep_the_grid_within_cuda_limits(launches):
    """Past 65,535 (row, expert) pairs (expert kernels) or rows (expert_sum) a call is launched in
    row pieces, each grid's y within CUDA's 65,535, the pieces covering every row once; a call
    that fits stays one launch with its arrays as they are."""
    R, D, F, E, k = 13108, 64, 64, 8, 5          # 65,540 pairs: two pieces of <= 13,107 rows
    x = mx.ones((R, D), mx.bfloat16)
    gate, up, down = _experts(E, F, D, 4), _experts(E, F, D, 4), _experts(E, D, F, 4)
    logits = mx.zeros((R, E), mx.float32)
    inds = mx.zeros((R, k), mx.int32)
    h, i2, s2 = KM.route_glu(x, logits, gate, up, k, True)
    assert h.shape == (R, k, F) and i2.shape == (R, k) and s2.shape == (R, k)
    assert KM.expert_glu(x, gate, up, inds).shape == (R, k, F)
    assert K.row_expert_matmul(x, *gate[:3], inds, *gate[3:]).shape == (R, k, F)
    big = 65540
    hs = mx.ones((big, 1, F), mx.bfloat16)
    assert KM.expert_sum(hs, down, mx.zeros((big, 1), mx.int32), mx.ones((big, 1)),
                         mx.ones((big, D), mx.bfloat16)).shape == (big, D)
    by = {}
    for lc in launches:
        assert lc["grid"][1] <= 65535 and lc["grid"][2] <= 65535, (lc["name"], lc["grid"])
        by.setdefault(lc["name"], []).append(lc)
    for name in ("row_expert_qmm_glu_route", "row_expert_qmm_glu", "row_expert_qmm"):
        assert len(by[name]) == 2 and sum(lc["grid"][1] for lc in by[name]) == R * k, name
        _check(by[name][0])
    assert len(by["row_expert_qmm_sum"]) == 2
    assert sum(lc["output_shapes"][0][0] for lc in by["row_expert_qmm_sum"]) == big
    assert [lc["inputs"][-1].shape for lc in by["row_expert_qmm_sum"]] == [(65535, D), (5, D)]
    launches.clear()
    KM.expert_glu(x[:16], gate, up, inds[:16])       # fits: one launch, x itself
    assert len(launches) == 1 and launches[0]["inputs"][0].shape == (16, D)


def test_moe_ops_take_the_composition_where_the_kernels_do_not_fit(launches):
    """k > 32 experts per token (route, expert_sum) or gate and up quantized differently
    (expert_glu): the CUDA face runs the ops' definitions instead of a kernel that cannot hold them."""
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((2, 64), dtype=np.float32))
    KM.route(logits, 40, True)
    assert "moe_route" not in [lc["name"] for lc in launches]
    x = mx.ones((2, 128), mx.bfloat16)
    ind = mx.zeros((2, 2), mx.int32)
    KM.expert_glu(x, _experts(4, 64, 128, 4), _experts(4, 64, 128, 8, gs=32), ind)
    names = [lc["name"] for lc in launches]
    assert "row_expert_qmm_glu" not in names and names.count("row_expert_qmm") == 2


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_decode_step_launches_match_their_kernels(launches, dtype, monkeypatch):
    """The dense decode step's CUDA wrappers (GEMMs with and without the residual, attention,
    q/k norm + RoPE with and without the in-place KV write): the same checks, across the plans
    the wrappers pick for a tensor-core dtype and for fp32."""
    x = mx.ones((1, 2, 256), dtype)
    w = mx.random.normal((512, 256)).astype(dtype)
    wq, s, b = mx.quantize(w, 64, 4)
    K.row_quantized_matmul(x, wq, s, b, 64, 4)
    K.row_quantized_matmul(x[..., :256], mx.quantize(mx.random.normal((256, 256)).astype(dtype), 64, 4)[0],
                           *mx.quantize(mx.random.normal((256, 256)).astype(dtype), 64, 4)[1:], 64, 4,
                           residual=x)
    K.row_matmul(x, w)
    H, Hk, hd, cap = 4, 2, 64, 256
    q = mx.ones((1, H, 2, hd), dtype)
    kc, vc = mx.zeros((1, Hk, cap, hd), dtype), mx.zeros((1, Hk, cap, hd), dtype)
    monkeypatch.setattr(_cuda, "wgmma_device", lambda: True)    # row_attn_wg's launches (Hopper)
    monkeypatch.setattr(_cuda, "attn_impl", "span")     # row_attn_tc (the default takes row_attn_tcg)
    K.row_attention(q, kc, vc, 5, hd ** -0.5)
    for plan in ("g4", "s2", "tg2", "ts1", "wg4", "ws4.3"):   # tcg's, tcr's, wg's group and span blocks
        monkeypatch.setattr(_cuda, "attn_impl", plan)
        K.row_attention(mx.ones((1, H, 16, hd), dtype), kc, vc, 5, hd ** -0.5)
    monkeypatch.setattr(_cuda, "attn_impl", None)
    qkv = mx.ones((1, 2, (H + 2 * Hk) * hd), dtype)
    inv = mx.ones((hd // 2,), mx.float32)
    norm = mx.ones((hd,), dtype)
    off = mx.array([5, 0, 0, 0], dtype=mx.int32)[:1]
    K.fused_qk_norm_rope(qkv, H, Hk, norm, norm, 1e-6, inv, 1.0, off)
    K.fused_qk_norm_rope(qkv, H, Hk, norm, norm, 1e-6, inv, 1.0, off, kv=(kc, vc, mx.zeros((1,))))
    names = {lc["name"] for lc in launches}
    assert {"qk_norm_rope", "qk_norm_rope_kv"} <= names, names
    assert any(n.startswith("row_attn") for n in names) and any(n.startswith("row_qmm") for n in names)
    if dtype == mx.bfloat16:        # tensor-core attention: row_attn_tc, and row_attn_tcg where asked
        assert {"row_attn_tc", "row_attn_tcg"} <= names, names
        tcg = [lc for lc in launches if lc["name"] == "row_attn_tcg"]
        assert [dict(lc["template"])["SPB"] for lc in tcg] == [8, 1]
        tcr = [lc for lc in launches if lc["name"] == "row_attn_tcr"]
        assert [(dict(lc["template"])["SPB"], lc["threadgroup"][0]) for lc in tcr] == [(8, 64), (1, 32)]
        wg = [lc for lc in launches if lc["name"] == "row_attn_wg"]
        assert [(dict(lc["template"])["SPB"], dict(lc["template"])["NB"], lc["threadgroup"][0]) for lc in wg] == \
            [(8, 2, 128), (1, 3, 128)]
        merges = [dict(lc["template"]) for lc in launches if lc["name"] == "row_attn_merge"]
        assert [m["E"] for m in merges] == [1, 8, 1, 8, 1, 8, 1]
    for lc in launches:
        _check(lc)


def test_attention_without_merge_is_one_launch_for_benchmarks(launches, monkeypatch):
    """ATTN_NO_MERGE (bench_engine.py --no-merge-too, timing only): the partials kernel alone, with
    one more output of q's shape (the kernel variant that declares it), and no merge launch."""
    q = mx.ones((1, 4, 1, 64), mx.bfloat16)
    kc = mx.zeros((1, 2, 256, 64), mx.bfloat16)
    monkeypatch.setattr(_cuda, "ATTN_NO_MERGE", True)
    out = K.row_attention(q, kc, kc, 5, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert len(launches) == 1 and launches[0]["name"].startswith("row_attn") and launches[0]["unused_out"]
    assert launches[0]["output_shapes"][1] == q.shape


def test_attention_merge_columns_follow_rows_and_capacity(launches):
    """The merge's columns a block (launch shape only, the same bits): 64 for calls of at least 32
    query rows on caches up to 8k keys, else 32 (sessions 41-42's H200 times)."""
    def merge(M, cap, Hq=32, Hkv=8, D=128):
        launches.clear()
        q = mx.ones((1, Hq, M, D), mx.bfloat16)
        kc = mx.zeros((1, Hkv, cap, D), mx.bfloat16)
        K.row_attention(q, kc, kc, cap - M, D ** -0.5)
        lc = next(lc for lc in launches if lc["name"] == "row_attn_merge")
        dc = dict(lc["template"])["DC"]
        assert lc["grid"][0] == 1 * Hq * M * -(-D // dc) * lc["threadgroup"][0], lc
        return dc
    assert [merge(M, cap) for M in (1, 8, 16) for cap in (1024, 8192)] == [64] * 6
    assert merge(1, 8193) == 32 and merge(16, 32768) == 32
    assert merge(16, 1024, D=64) == 64 and merge(1, 1024, Hq=8, Hkv=2) == 32     # 8 query rows
    assert merge(4, 2048, Hq=8, Hkv=2) == 64                                     # 32


def test_attention_launch_plan_follows_the_measurements(monkeypatch):
    """Where row_attn_wg runs (Hopper, sessions 37-38's H200 times): a group a block (wd4) from 384
    halves of 8 spans (24k keys at 8 KV heads) and past 32 rows a KV head from 256; half blocks from
    128 halves, wgmma's warpgroup (wg4) past 16 rows a KV head, 4 row tiles of two warps (g4k) below;
    below 128 halves g4k from 128 of its blocks, 2-tile blocks (g2k) from 128 by 16-row tiles, span
    blocks (SPB 1, 4 warps) below those. Elsewhere (off Hopper, D 80)
    session 36's rule in halves: 4-tile half blocks of two warps a tile from about a block an SM,
    row_attn_tcr's warps of 16 rows at 64 rows a KV head past 768 such blocks, 2-tile blocks where
    those reach 256, span blocks below. Any plan gives the same bits
    (test_cuda_attention_group_blocks_are_bit_identical), so this pins speed only."""
    monkeypatch.setattr(_cuda, "attn_impl", None)
    plan = lambda M, cap, wg=True: _cuda.attn_tcg_plan(4 * M, cap, 8, wg)  # noqa: E731  32 q / 8 KV heads
    nb = _cuda.ATTN_TCG_BUFFERS
    s4, g2k, g4k, wg4, wd4 = (1, 4, nb, 1), (8, 2, nb, 2), (8, 4, nb, 2), (8, 4, nb, -1), (16, 4, nb, -1)
    assert plan(1, 1024) == plan(8, 1024) == plan(16, 1024) == plan(1, 4096) == s4          # span blocks
    assert plan(8, 2048) == plan(1, 2048) == s4
    assert plan(16, 2048) == plan(8, 4096) == g2k                                           # half blocks
    assert plan(16, 4096) == plan(1, 8192) == plan(4, 8192) == plan(1, 16384) == plan(4, 16384) == g4k
    assert plan(5, 8192) == plan(8, 8192) == plan(16, 8192) == plan(8, 16384) == plan(8, 20480) == wg4
    assert plan(9, 16384) == plan(16, 16384) == wd4                                         # a group a block
    assert plan(1, 24576) == plan(8, 24576) == plan(16, 24576) == wd4
    assert plan(1, 32768) == plan(8, 32768) == plan(16, 32768) == plan(1, 65536) == wd4
    no = False                                              # row_attn_wg does not run (off Hopper, D 80)
    assert plan(1, 32768, no) == plan(4, 32768, no) == plan(8, 32768, no) == plan(16, 8192, no) == g4k
    assert plan(16, 32768, no) == wg4                       # tcr's tg4 where wg does not run
    assert plan(8, 8192, no) == (8, 2, nb, 2) and plan(1, 8192, no) == s4
    monkeypatch.setattr(_cuda, "attn_impl", "s2.3")
    assert plan(1, 1024) == (1, 2, 3, 1)
    monkeypatch.setattr(_cuda, "attn_impl", "g4k")      # two warps an 8-row tile
    assert plan(1, 1024) == (8, 4, nb, 2)
    monkeypatch.setattr(_cuda, "attn_impl", "s8k.3")
    assert plan(1, 1024) == (1, 8, 3, 2)
    monkeypatch.setattr(_cuda, "attn_impl", "tg4.3")    # row_attn_tcr: KW 0
    assert plan(1, 1024) == (8, 4, 3, 0)
    monkeypatch.setattr(_cuda, "attn_impl", "g2kk")     # four warps an 8-row tile
    assert plan(1, 1024) == (8, 2, nb, 4)
    monkeypatch.setattr(_cuda, "attn_impl", "wg4.3")    # row_attn_wg: KW -1
    assert plan(1, 1024) == (8, 4, 3, -1)
    # what the kernels' static_asserts refuse, and removed plans (pg4: session 35's row_attn_wgp, 3b817f5)
    monkeypatch.setattr(_cuda, "attn_impl", "wd4.3")    # row_attn_wg, a group a block
    assert plan(1, 1024) == (16, 4, 3, -1)
    for bad in ("s9", "g4.1", "x4", "g4w", "g0k", "tg4k", "t4", "g4kkk", "wg2", "wg4k", "wg4z", "tg4.3o", "pg4",
                "d4", "td4", "wd2", "wd4k"):
        monkeypatch.setattr(_cuda, "attn_impl", bad)
        with pytest.raises(ValueError, match="row_attn_tcg plan"):
            plan(1, 1024)
