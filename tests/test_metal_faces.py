"""The Metal faces (metal/*.metal) run: on the CPU emulation of tests/metal_emu.

No Apple GPU exists in this project, so Apple's compiler has never seen these kernels. What can
be checked here is checked: each kernel's text is built the way MLX's mx.fast.metal_kernel
builds it (the same signature from the same launch arguments) and run thread by thread, with
simdgroups of 32 meeting at every shuffle and barrier and every buffer index checked. The
project's own launch code (tensorfold.kernels._metal, _metal_expert_matmul, sparse's Metal
launcher) picks the grids and template arguments, as it would on a Mac.

Then the property tests of the CPU and CUDA faces run against the Metal face unchanged: row i
bit-identical for M = 1..16 and whatever the other rows hold, every split of a verify window,
the KV capacity, the accuracy bound against a float64 reference, rows outside the buffer, bad
expert ids. (The test functions are test_kernels.py's, test_sparse_attention.py's and
test_moe.py's own, called with the Metal face selected.) So does the engine's promise, drafted ==
serial, with every decode kernel on the Metal face (the 4-bit dense, MoE and DeepSeek-V3.2 test
checkpoints); and no kernel's bits change with the order its threads run in between meeting
points (no data race on threadgroup memory).

What this does not prove: that Apple's compiler accepts the text, or the speed. The float
arithmetic is IEEE float32 with fma exact; the contract rests on each row's order of operations,
which the emulation runs as written.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_emu
import tensorfold.kernels as KK
from tensorfold.kernels import _metal
from tensorfold.kernels import sparse as KS

import test_kernels as TK
import test_moe as TM
import test_sparse_attention as TS

CPU = mx.Device(mx.cpu)


def _clear():
    _metal._kernel.cache_clear()
    KS._metal_kernel.cache_clear()
    KK._metal_expert_kernel.cache_clear()


@pytest.fixture
def metal(monkeypatch):
    """The Metal face selected for every row op, its kernels run by the emulation."""
    _clear()
    monkeypatch.setattr(mx.fast, "metal_kernel", metal_emu.metal_kernel)
    monkeypatch.setattr(KK, "backend_face", lambda stream=None: "metal")
    monkeypatch.setattr(KK, "_gpu_stream", lambda stream: None)
    prev = mx.default_device()
    mx.set_default_device(CPU)
    before = metal_emu.LAUNCHES["count"]
    state = {"launches_expected": True}
    yield state
    mx.set_default_device(prev)
    _clear()
    if state["launches_expected"]:
        assert metal_emu.LAUNCHES["count"] > before, "no Metal kernel ran"


def _ids(cases, fmt):
    return [fmt(*c) for c in cases]


# ---------------------------------------------------------------- row_quantized_matmul / row_matmul

@pytest.mark.parametrize("bits_,group_size,dtype", TK.QMM_CASES,
                         ids=_ids(TK.QMM_CASES, lambda b, g, d: f"b{b}-g{g}-{str(d).split('.')[-1]}"))
def test_quantized_matmul(metal, bits_, group_size, dtype):
    TK.test_quantized_matmul_row_exact(CPU, bits_, group_size, dtype)
    TK.test_quantized_matmul_accuracy(CPU, bits_, group_size, dtype)


@pytest.mark.parametrize("N,Kd", [(128, 384), (200, 2048)], ids=["128x384", "200x2048"])
def test_quantized_matmul_model_shapes(metal, N, Kd):
    TK.test_quantized_matmul_row_exact_model_shapes(CPU, N, Kd)


@pytest.mark.parametrize("dtype", TK.DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_quantized_matmul_residual(metal, dtype):
    TK.test_quantized_matmul_residual_is_the_add(CPU, 72, 256, 4, dtype)


@pytest.mark.parametrize("dtype", TK.DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("wdtype", ["same", "float32"])
def test_matmul(metal, dtype, wdtype):
    TK.test_matmul_row_exact(CPU, dtype, wdtype)
    if wdtype == "same":
        TK.test_matmul_accuracy(CPU, dtype)


# ---------------------------------------------------------------- row_attention

ATT = TK.ATT_CASES[:6]   # the two long-context cases (8k / 16k keys) only matter to CUDA's merge


@pytest.mark.parametrize("B,Hq,Hkv,D,offset,dtype", ATT, ids=TK.ATT_IDS[:6])
def test_attention(metal, B, Hq, Hkv, D, offset, dtype):
    TK.test_attention_row_exact(CPU, B, Hq, Hkv, D, offset, dtype)
    TK.test_attention_accuracy(CPU, B, Hq, Hkv, D, offset, dtype)


@pytest.mark.parametrize("B,Hq,Hkv,D,offset,dtype", TK.ATT_CASES[:3], ids=TK.ATT_IDS[:3])
def test_attention_window_splits(metal, B, Hq, Hkv, D, offset, dtype):
    TK.test_attention_window_splits(CPU, B, Hq, Hkv, D, offset, dtype)


def test_attention_rows_outside_buffer_are_nan(metal):
    TK.test_attention_rows_outside_buffer_are_nan(CPU)


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_attention_chunk_of_minus_inf_scores(metal, M, dtype):
    """Also: the Metal sparse attention over every key equals the Metal row_attention bit for
    bit (test_kernels asserts it where the device is the CPU, as here): both take 64-key chunks,
    one a span, in the same order."""
    TK.test_attention_chunk_of_minus_inf_scores_weighs_nothing(CPU, M, dtype)


def test_inputs_refused_or_clipped(metal):
    TK.test_kernel_inputs_refused_or_clipped_not_misread(CPU)


def test_empty_calls(metal):
    """(test_kernels.py's: nothing is launched; the emulation refuses a 0-thread grid.)"""
    metal["launches_expected"] = False
    before = metal_emu.LAUNCHES["count"]
    TK.test_empty_calls(CPU)
    assert metal_emu.LAUNCHES["count"] == before


# ---------------------------------------------------------------- row_expert_matmul

@pytest.mark.parametrize("case", range(len(TM.EXPERT_CASES)))
def test_expert_matmul(metal, case):
    """(Dense experts with K % 32 != 0 are refused, as on CUDA: the kernel had dropped the tail
    of K, a wrong answer found by this emulation.)"""
    bits, _, _, Kd, _, _ = TM.EXPERT_CASES[case]
    metal["launches_expected"] = bits is not None or Kd % 32 == 0
    TM.test_row_expert_matmul_row_exact(case)


def test_expert_matmul_bad_ids(metal):
    TM.test_row_expert_matmul_errors_and_bad_index()


# ---------------------------------------------------------------- sparse_attention

@pytest.mark.parametrize("B,Hq,Hkv,D,offset,dtype", TS.CASES, ids=TS.IDS)
def test_sparse_attention(metal, B, Hq, Hkv, D, offset, dtype):
    TS.test_sparse_accuracy(CPU, B, Hq, Hkv, D, offset, dtype)
    TS.test_full_causal_set_equals_row_attention(CPU, B, Hq, Hkv, D, offset, dtype)
    TS.test_sparse_row_exact(CPU, B, Hq, Hkv, D, offset, dtype)


def test_sparse_attention_edges(metal):
    TS.test_beyond_causal_limit_ignored(CPU)
    TS.test_rows_outside_buffer_and_errors(CPU)
    TS.test_long_lists(CPU)


# ---------------------------------------------------------------- the emulation has teeth

def _toy(source, header="#include <metal_stdlib>\nusing namespace metal;\n"):
    return metal_emu.metal_kernel(name="toy", input_names=["x"], output_names=["out"],
                                  source=source, header=header)


def _launch(kern, n=64):
    x = mx.arange(n, dtype=mx.float32)
    return kern(inputs=[x], output_shapes=[(n,)], output_dtypes=[mx.float32], grid=(n, 1, 1),
                threadgroup=(32, 1, 1))[0]


def test_emulation_runs_simdgroups_and_checks_indices():
    ok = _toy("uint i = thread_position_in_grid.x;\n"
              "float v = simd_shuffle_xor(x[i], (ushort)1) + simd_sum(1.0f);\n"
              "out[i] = v + (float)simd_prefix_exclusive_sum(1u) * 1000.0f;")
    got = np.array(_launch(ok))
    i = np.arange(64)
    assert np.array_equal(got, (i ^ 1) + 32.0 + (i % 32) * 1000.0)
    oob = _toy("uint i = thread_position_in_grid.x; out[i] = x[i + 1];")
    with pytest.raises(metal_emu.EmulatedLaunchError, match="index 64 out of x's 64"):
        _launch(oob)


def test_emulation_refuses_cpp_that_metal_lacks():
    """g++ would take these; Apple's compiler would not: refused before a build, or by g++'s
    -pedantic-errors -Werror=vla."""
    for body in ("double d = x[0]; out[0] = (float)d;", "out[0] = std::max(x[0], 1.0f);",
                 "out[0] = expf(x[0]);"):
        with pytest.raises(NotImplementedError, match="Metal lacks"):
            _launch(_toy(body))
    with pytest.raises(RuntimeError, match="did not compile"):
        _launch(_toy("int n = x_shape[0]; float tmp[n]; tmp[0] = x[0]; out[0] = tmp[0];"))


def test_emulation_catches_divergent_simdgroups():
    """A shuffle some lanes skip, a shuffle in each arm of a branch, and a threadgroup barrier
    some threads return before."""
    half = _toy("uint i = thread_position_in_grid.x; float v = x[i];\n"
                "if (thread_index_in_simdgroup < 16) v = simd_shuffle_xor(v, (ushort)1);\n"
                "out[i] = v;")
    with pytest.raises(metal_emu.EmulatedLaunchError, match="diverged"):
        _launch(half)
    # one shuffle in each arm of a branch: two half-simdgroup shuffles on a GPU, not one
    arms = _toy("uint i = thread_position_in_grid.x; float v = x[i];\n"
                "if (thread_index_in_simdgroup < 16) v = simd_shuffle_xor(v, (ushort)1);\n"
                "else v = simd_shuffle_xor(-v, (ushort)1);\n"
                "out[i] = v;")
    with pytest.raises(metal_emu.EmulatedLaunchError, match="different operations or places"):
        _launch(arms)
    early = _toy("uint i = thread_position_in_grid.x; if (i == 3) return;\n"
                 "threadgroup_barrier(mem_flags::mem_threadgroup); out[i] = x[i];")
    with pytest.raises(metal_emu.EmulatedLaunchError):
        _launch(early)


def test_property_tests_catch_a_metal_kernel_that_is_not_row_exact(metal, monkeypatch):
    """row_qmm with its lane sum's tree reversed when the call has more than 8 rows (an
    M-dependent reduction order, as MLX's own CUDA kernels have): the same property test that
    passes on the real kernel fails. (float32 outputs: a bf16 output's rounding mostly hides a
    sum's last bits.)"""
    real = _metal.sections

    def edited(kind, filename):
        sec = dict(real(kind, filename))
        if filename == "row_ops.metal":
            sec["header"] += ("inline float tf_simd_sum_rev(float v) {\n"
                              "  for (ushort off = 1; off <= 16; off <<= 1) v = v + simd_shuffle_xor(v, off);\n"
                              "  return v;\n}\n")
            body = sec["row_qmm"]
            assert "const float v = tf_simd_sum(acc[m]);" in body
            sec["row_qmm"] = body.replace("const float v = tf_simd_sum(acc[m]);",
                                          "const float v = R > 8 ? tf_simd_sum_rev(acc[m]) : tf_simd_sum(acc[m]);")
        return sec
    monkeypatch.setattr(_metal, "sections", edited)
    _clear()
    with pytest.raises(AssertionError, match="differs at M=9"):
        TK.test_quantized_matmul_row_exact(CPU, 4, 64, mx.float32)


# ---------------------------------------------------------------- the engine on the Metal face

# test_engine.py's cases that draft and accept on this face: q4 2, 17; moe 9, 26, 41; dsa 14, 44
@pytest.mark.parametrize("i", [2, 17, 9, 26, 41, 14, 44], ids=lambda i: f"case{i}")
def test_engine_drafted_equals_serial(metal, checkpoints, monkeypatch, i):
    """The engine's promise with every decode kernel on the Metal face: a reply with drafts equals
    the same request without (test_engine.py's harness and cases; the eager decode step, since
    the emulation reads its inputs back on the host, which mx.compile's tracing cannot)."""
    import test_engine as TE
    from tensorfold.engine import Engine, PrefillMode
    monkeypatch.setenv("TENSORFOLD_COMPILE_DECODE", "0")
    c = TE._case(i)
    model = c.pop("model")
    assert c["proposer"] in ("context", "mix")
    eng = Engine(checkpoints[TE.ENGINE_CHECKPOINTS[model]], prefill_mode=PrefillMode(grid=TE.GRID))
    before = dict(metal_emu.LAUNCHES)
    stats = TE.run_case(eng, None, **c)
    ran = {k for k, n in metal_emu.LAUNCHES.items() if n > before.get(k, 0)}
    # every decode kernel the family has ran on the Metal face
    need = {"tf_row_qmm", "tf_row_attn"}
    if model == "moe":
        need = {"tf_row_qmm", "tf_row_attn", "tf_row_expert_qmm"}
    elif model == "dsa":
        need = {"tf_row_qmm", "tf_sparse_attn"}
    assert need <= ran, ran
    assert stats.drafted > 0 and stats.accepted > 0, stats   # verify windows ran (not serial twice)


def test_emulation_finds_threadgroup_memory_races():
    """Thread 0 writes threadgroup memory that the others read: with no barrier between, a data
    race (in any thread order); with a simdgroup_barrier, the same values in every order. A
    shuffle is no memory barrier; memory no thread of the threadgroup wrote is not readable."""
    racy = _toy("threadgroup float s[1]; uint i = thread_position_in_grid.x;\n"
                "if (thread_index_in_simdgroup == 0) s[0] = x[i];\n"
                "out[i] = s[0];")
    shuffled = _toy("threadgroup float s[1]; uint i = thread_position_in_grid.x;\n"
                    "if (thread_index_in_simdgroup == 0) s[0] = x[i];\n"
                    "float v = simd_shuffle_xor(1.0f, (ushort)1);\n"
                    "out[i] = s[0] + v;")
    fenced = _toy("threadgroup float s[1]; uint i = thread_position_in_grid.x;\n"
                  "if (thread_index_in_simdgroup == 0) s[0] = x[i];\n"
                  "simdgroup_barrier(mem_flags::mem_threadgroup);\n"
                  "out[i] = s[0];")
    unwritten = _toy("threadgroup float s[2]; uint i = thread_position_in_grid.x;\n"
                     "if (thread_position_in_grid.x == 0) s[1] = x[i];\n"
                     "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                     "out[i] = s[1];")
    got = {}
    try:
        for order in (0, 1, 2):
            metal_emu.ORDER["order"] = order
            for k in (racy, shuffled):      # (run last to first, a reader comes before the write)
                with pytest.raises(metal_emu.EmulatedLaunchError, match="data race|no thread"):
                    _launch(k)
            got[order] = np.array(_launch(fenced))
            with pytest.raises(metal_emu.EmulatedLaunchError, match=r"threadgroup \(1, 0, 0\).*no thread"):
                _launch(unwritten)
    finally:
        metal_emu.ORDER["order"] = 0
    assert np.array_equal(got[0], np.repeat([0.0, 32.0], 32))
    for order in (1, 2):
        assert np.array_equal(got[order], got[0])


@pytest.mark.parametrize("kernel", ["row_attn", "sparse_attn"])
def test_a_missing_barrier_in_the_attention_kernels_is_caught(metal, monkeypatch, kernel):
    """The attention kernels' simdgroup_barriers, removed: the softmax weights `es` (and sparse
    attention's kept list `plist`) are then read across threads with nothing ordering them, and
    the emulation says so (the thread-order check alone could not see it: a shuffle lines the
    threads up between the write and the read)."""
    import re

    import tensorfold.kernels._sources as SRC
    real = SRC.sections

    def edited(kind, filename):
        sec = dict(real(kind, filename))
        if kernel in sec:
            sec[kernel] = re.sub(r"simdgroup_barrier\(mem_flags::mem_threadgroup\);", "", sec[kernel])
        return sec
    monkeypatch.setattr(_metal, "sections", edited)     # (sparse.py imports it at each build)
    monkeypatch.setattr(SRC, "sections", edited)
    _clear()
    rng = TK._rng("missing-barrier")
    from kernel_helpers import make_kv, rand
    k, v = make_kv(rng, 1, 1, 150, 64, mx.float32, 150)
    q = rand(rng, (1, 2, 3, 64), mx.float32)
    with pytest.raises(metal_emu.EmulatedLaunchError, match="data race"):
        if kernel == "row_attn":
            mx.eval(KK.row_attention(q, k, v, 140, 0.125))
        else:
            ind = mx.array(np.tile(np.arange(100, dtype=np.int32), (1, 3, 1)))
            mx.eval(KK.sparse_attention(q, k, v, ind, 140, 0.125))


def _one_call_per_kernel(rng):
    """One call of every Metal kernel (each family, several template cases), for the race check."""
    from kernel_helpers import make_kv, make_quantized, rand
    calls = []
    for bits_, gs, dt in ((4, 64, mx.bfloat16), (3, 32, mx.float16), (8, 128, mx.float32)):
        wq, s, b = make_quantized(rng, 40, 256, gs, bits_, dt)
        x = rand(rng, (11, 256), dt)
        calls.append(lambda x=x, wq=wq, s=s, b=b, gs=gs, bits_=bits_:
                     KK.row_quantized_matmul(x, wq, s, b, gs, bits_))
    w, x = rand(rng, (40, 256), mx.bfloat16, 0.05), rand(rng, (7, 256), mx.bfloat16)
    calls.append(lambda: KK.row_matmul(x, w))
    for D, dt, M in ((64, mx.bfloat16, 5), (80, mx.float16, 16), (128, mx.float32, 1)):
        k, v = make_kv(rng, 1, 2, 210, D, dt, 200)
        q = rand(rng, (1, 4, M, D), dt)
        calls.append(lambda q=q, k=k, v=v, D=D, M=M: KK.row_attention(q, k, v, 200 - M, D ** -0.5))
        sel = np.stack([np.sort(rng.choice(200 - M + i + 1, 90, replace=False)) for i in range(M)])
        ind = mx.array(sel[None].astype(np.int32))
        calls.append(lambda q=q, k=k, v=v, D=D, M=M, ind=ind:
                     KK.sparse_attention(q, k, v, ind, 200 - M, D ** -0.5))
    we = mx.array(rng.standard_normal((4, 24, 128)).astype(np.float32) * 0.05)
    wq, s, b = mx.quantize(we, group_size=64, bits=4)
    xe, ie = rand(rng, (6, 128), mx.float32), mx.array(rng.integers(0, 4, (6, 2)).astype(np.int32))
    calls.append(lambda: KK.row_expert_matmul(xe, wq, s, b, ie, 64, 4))
    calls.append(lambda: KK.row_expert_matmul(xe, we, None, None, ie, 64, 0))
    return calls


def test_no_metal_kernel_depends_on_thread_order(metal):
    """Every Metal kernel gives the same bits whichever thread of a simdgroup runs first between
    meeting points (last to first; shuffled every round): no data race on threadgroup memory
    (attention's softmax weights `es`, sparse attention's kept list `plist`)."""
    calls = _one_call_per_kernel(TK._rng("metal-order"))
    try:
        base = [TK.bits(f()) for f in calls]
        for order in (1, 2):
            metal_emu.ORDER["order"] = order
            for i, f in enumerate(calls):
                assert np.array_equal(TK.bits(f()), base[i]), (order, i)
    finally:
        metal_emu.ORDER["order"] = 0
