"""The compiled exact step (DenseModel._exact_step, the CPU default): one trace per (rows, KV
capacity) serves every position, it runs for serial steps and verify calls alike, and it gives the
eager exact forward's logits and KV, bit for bit (the same ops)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tensorfold.models import load_model

FAMILIES = ["qwen3_mlx_4bit", "qwen3_hf_bf16", "qwen2_mlx_4bit_tied", "qwen3_moe_mlx_4bit"]


def _decode(model, ids, steps, block=1):
    """Prefill ids, then feed `steps` tokens `block` at a time through the exact forward."""
    c = model.new_cache()
    model.forward(mx.array([ids]), c, exact=False, logits=False)
    rows = []
    for s in range(0, len(steps), block):
        rows.append(model.forward(mx.array([steps[s: s + block]]), c, exact=True, all_logits=True))
    mx.eval(rows, c.arrays())
    return mx.concatenate(rows, axis=0), c


class _Traces(list):
    """The traced row shapes; .seen says what each trace was given (a failure's message)."""
    def __init__(self):
        super().__init__()
        self.seen = []


def _count_traces(model, monkeypatch) -> list:
    """The row shapes the compiled step is traced with (mx.compile calls the body per trace)."""
    traces = _Traces()
    body = model._exact_body

    def counted(*a):
        traces.append(a[0].shape)
        fences = None if len(a) < 5 else sorted({(str(f.dtype), f.shape) for f in a[4]})
        traces.seen.append((a[0].shape, "capacity", a[2][0].shape[2], "fences", fences))
        return body(*a)

    monkeypatch.setattr(model, "_exact_body", counted)
    return traces


@pytest.mark.parametrize("name", FAMILIES)
def test_one_trace_serves_every_position(checkpoints, name, monkeypatch):
    model = load_model(checkpoints[name])
    model.compiled_decode = True          # the default; forced so an env override cannot skip it
    traces = _count_traces(model, monkeypatch)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, model.cfg.vocab_size, 20).tolist()
    steps = rng.integers(3, model.cfg.vocab_size, 24).tolist()
    _decode(model, ids, steps)                 # 24 one-row steps, one capacity (256)
    assert traces == [(1, 1)], traces.seen
    _decode(model, ids, steps, block=4)        # 6 four-row calls: one more trace
    assert traces == [(1, 1), (1, 4)], traces.seen


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_equals_eager_and_rows(checkpoints, name, monkeypatch):
    model = load_model(checkpoints[name])
    model.compiled_decode = True
    rng = np.random.default_rng(2)
    ids = rng.integers(3, model.cfg.vocab_size, 250).tolist()   # crosses the 256 capacity step
    steps = rng.integers(3, model.cfg.vocab_size, 12).tolist()
    serial, c1 = _decode(model, ids, steps)
    block, c2 = _decode(model, ids, steps, block=4)
    assert bool(mx.array_equal(serial, block).item())           # row-exact through the step
    monkeypatch.setattr(model, "compiled_decode", False)
    eager, c3 = _decode(model, ids, steps)
    assert bool(mx.array_equal(serial, eager).item())
    for a, b in zip(c1.keys + c1.values, c3.keys + c3.values):
        assert bool(mx.array_equal(a[..., : c1.offset, :], b[..., : c3.offset, :]).item())


def test_compiled_step_is_the_default(checkpoints, monkeypatch):
    monkeypatch.delenv("TENSORFOLD_COMPILE_DECODE", raising=False)
    model = load_model(checkpoints["qwen3_mlx_4bit"])
    assert model.uses_compiled_step()
    monkeypatch.setenv("TENSORFOLD_COMPILE_DECODE", "0")
    assert not model.uses_compiled_step()
    monkeypatch.delenv("TENSORFOLD_COMPILE_DECODE")
    assert not load_model(checkpoints["deepseek_v32_mlx_4bit"]).uses_compiled_step()


@pytest.mark.parametrize("name", FAMILIES)
def test_in_place_kv_writes_are_fenced(checkpoints, name, monkeypatch):
    """The in-place KV write (StepCache.in_place, the default; TENSORFOLD_INPLACE_KV=0 gives the
    reference): on CUDA the fused q/k kernel writes the KV rows into the cache buffers itself,
    which MLX's CUDA graphs cannot see, so each layer's write takes a fence (the previous step's attention output). _decode queues all its steps lazily
    before one eval, the case that broke without fences, and crosses a capacity step (the
    growth copy reads the buffers: KVCache._settle): serial steps must equal 4-row calls and
    the default path, bit for bit, KV included. On the CPU the fused kernel does not exist
    and this checks the fence plumbing: one fence per layer returned by every step, one trace
    per (row count, capacity)."""
    model = load_model(checkpoints[name])
    model.compiled_decode = True
    rng = np.random.default_rng(3)
    ids = rng.integers(3, model.cfg.vocab_size, 250).tolist()   # the steps cross the 256 capacity
    steps = rng.integers(3, model.cfg.vocab_size, 12).tolist()
    monkeypatch.setenv("TENSORFOLD_INPLACE_KV", "0")
    ref, c0 = _decode(model, ids, steps)
    monkeypatch.setenv("TENSORFOLD_INPLACE_KV", "1")
    model.__dict__.pop("_exact_step")             # compile again, with fences
    traces = _count_traces(model, monkeypatch)
    serial, c1 = _decode(model, ids, steps)
    block, c2 = _decode(model, ids, steps, block=4)
    assert traces == [(1, 1), (1, 1), (1, 4), (1, 4)], traces.seen   # one per (rows, capacity 256 / 512)
    assert len(c1.fences) == model.cfg.num_layers and all(f.size == 1 for f in c1.fences)
    # the first step's fences have the dtype of the ones a step returns on CUDA (the attention
    # output's, the KV's), or CUDA traces twice per capacity (session 46); on the CPU the fences
    # pass through unchanged, so this is where the CPU sees it
    assert all(s[-1] == [(str(c1.keys[0].dtype), (1,))] for s in traces.seen), traces.seen
    assert bool(mx.array_equal(serial, ref).item()) and bool(mx.array_equal(block, ref).item())
    for c in (c1, c2):
        for a, b in zip(c.keys + c.values, c0.keys + c0.values):
            assert bool(mx.array_equal(a[..., : c.offset, :], b[..., : c0.offset, :]).item())
