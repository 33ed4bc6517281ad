"""The "kernels" prefill mode keeps every promise of the default one (and is another cache key)."""

from __future__ import annotations

import numpy as np
import pytest

from tensorfold.engine import Engine, PrefillMode, SamplingParams

MODE = PrefillMode(grid=16, ops="kernels")


def test_mode_is_part_of_the_key(checkpoints):
    a = Engine(checkpoints["qwen3_mlx_4bit"], prefill_mode=PrefillMode(grid=16), drafts=False)
    b = Engine(checkpoints["qwen3_mlx_4bit"], prefill_mode=MODE, drafts=False)
    assert a.cache_key != b.cache_key
    with pytest.raises(ValueError):
        PrefillMode(ops="fast")


@pytest.mark.parametrize("name", ["qwen3_mlx_4bit", "qwen3_hf_bf16", "qwen2_mlx_4bit_tied"])
def test_kernels_prefill_resumed_equals_fresh_and_drafted_equals_serial(checkpoints, name):
    path = checkpoints[name]
    eng = Engine(path, prefill_mode=MODE)
    vocab = eng.model.cfg.vocab_size
    rng = np.random.default_rng(len(name))
    first = rng.integers(3, vocab, size=45).tolist()
    p = SamplingParams(temperature=0.9, seed=4)
    _, reply, _ = eng.generate_text(prompt=first, max_tokens=10, sampling=p)
    second = first + reply + rng.integers(3, vocab, size=13).tolist()
    resumed = eng.generate_text(prompt=second, max_tokens=16, sampling=p)
    serial = eng.generate_text(prompt=second, max_tokens=16, sampling=p, draft=False)
    fresh = Engine(path, prefill_mode=MODE, drafts=False).generate_text(prompt=second, max_tokens=16, sampling=p)
    assert resumed[2].cached_tokens == 32 and fresh[2].cached_tokens == 0   # 45 tokens: last grid point 32
    assert resumed[1] == fresh[1] == serial[1]


def test_kernels_prefill_computes_the_same_function(checkpoints):
    """Same model function as MLX's forward (other bits): the greedy replies agree on most tokens."""
    import mlx.core as mx
    from tensorfold.engine.prefill import prefill
    from tensorfold.models import load_model
    m = load_model(checkpoints["qwen3_mlx_8bit"])
    ids = np.random.default_rng(0).integers(3, m.cfg.vocab_size, size=40).tolist()
    a = prefill(m, m.new_cache(), ids, PrefillMode(grid=16)).astype(mx.float32)
    b = prefill(m, m.new_cache(), ids, MODE).astype(mx.float32)
    assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 0.05


def test_grid_rule_last_token_alone_and_snapshots_only_from_whole_chunks(checkpoints):
    """Chunks on the grid cover ids[:-1]; the last token runs alone. A prompt of exactly 32
    tokens (grid 16) therefore snapshots at 16, never at 32: position 31 was computed by the
    one-token step, not by a grid chunk, so a longer prompt would compute it differently on
    backends that are not row-invariant."""
    from tensorfold.engine.prefill import grid_chunks
    assert grid_chunks(0, 31, 16) == [(0, 16), (16, 31)]
    assert grid_chunks(16, 47, 16) == [(16, 32), (32, 47)]
    with pytest.raises(ValueError):
        grid_chunks(5, 40, 16)
    eng = Engine(checkpoints["qwen3_mlx_4bit"], prefill_mode=PrefillMode(grid=16), drafts=False)
    eng.generate_text(prompt=list(range(3, 35)), max_tokens=2)
    assert [len(e.tokens) for e in eng.snapshots._entries.values()] == [16]
    eng.generate_text(prompt=list(range(3, 36)), max_tokens=2)      # 33 tokens: 32 is a whole chunk
    assert sorted(len(e.tokens) for e in eng.snapshots._entries.values()) == [32]


@pytest.mark.parametrize("ops", ["mlx", "kernels"])
def test_last_prompt_token_is_one_row_exact_step(checkpoints, ops, monkeypatch):
    """The grid chunks run the mode's ops; the prompt's last token is one exact row whatever the
    mode. MLX's own one-row forward is not a function of the values on MLX's CUDA backend (its
    sdpa picks cuDNN or the vector kernel from the K/V buffers' state): on the H200 a prompt
    resumed from a snapshot got other bits there than the same prompt fresh."""
    eng = Engine(checkpoints["qwen3_mlx_4bit"], prefill_mode=PrefillMode(grid=16, ops=ops),
                 drafts=False)
    calls = []
    real = eng.model.forward

    def spy(ids, cache, **kw):
        calls.append((ids.shape[1], kw.get("exact"), kw.get("all_logits", False)))
        return real(ids, cache, **kw)

    monkeypatch.setattr(eng.model, "forward", spy)
    eng.generate_text(prompt=list(range(3, 40)), max_tokens=1)
    assert calls == [(16, ops == "kernels", False), (16, ops == "kernels", False),
                     (4, ops == "kernels", False), (1, True, True)]


@pytest.mark.parametrize("name", ["qwen3_mlx_4bit", "qwen3_moe_mlx_4bit"])
def test_prefill_bits_do_not_depend_on_the_cache_capacity(checkpoints, name, monkeypatch):
    """prefill reserves the whole prompt's KV rows before its first chunk (one allocation
    instead of a re-copy of every cached row per chunk). The bits must not depend on that:
    logits and KV rows equal with the cache grown chunk by chunk (TENSORFOLD_RESERVE_PROMPT=0)
    and with a cache reserved far past the prompt (on MLX's CUDA backend, sdpa treats a key
    buffer of >= 256 rows as a slice of a KV cache: another code path than a contiguous one)."""
    import mlx.core as mx
    from tensorfold.engine.prefill import prefill
    from tensorfold.models import load_model
    m = load_model(checkpoints[name])
    ids = np.random.default_rng(5).integers(3, m.cfg.vocab_size, size=300).tolist()
    mode = PrefillMode(grid=128)     # chunks end at 128, 256, 299: growing, the cache holds 256 rows, then 512
    runs = []
    for setting, extra in (("1", 0), ("0", 0), ("1", 2048)):
        monkeypatch.setenv("TENSORFOLD_RESERVE_PROMPT", setting)
        c = m.new_cache()
        if extra:
            c.reserve(extra)
        logits = prefill(m, c, ids, mode)
        mx.eval(logits)
        runs.append((logits, [a[..., : len(ids), :] for a in c.arrays()], c.capacity))
    assert runs[0][2] == runs[1][2] == 512 and runs[2][2] == 2048
    for logits, kv, _ in runs[1:]:
        assert mx.array_equal(logits, runs[0][0]).item()
        assert all(mx.array_equal(a, b).item() for a, b in zip(kv, runs[0][1]))


def test_cache_growth_holds_one_layer_twice_at_most():
    """Growing a filled cache copies its rows into larger buffers. Queued lazily for every layer
    at once, all old and new buffers can be alive together until the device finishes (on the
    H200 a CUDA graph batches up to 1 GB of inputs): KVCache.reserve settles one layer at a time,
    so the transient above the new cache is at most one layer's old buffers."""
    import mlx.core as mx
    from tensorfold.models.kv import KVCache

    layers, heads, dim, n = 8, 2, 64, 1024
    cache = KVCache(layers, heads, dim, mx.bfloat16)
    cache.reserve(n)
    for i in range(layers):
        cache.keys[i][..., :n, :] = mx.random.normal((1, heads, n, dim)).astype(mx.bfloat16)
        cache.values[i][..., :n, :] = mx.random.normal((1, heads, n, dim)).astype(mx.bfloat16)
    mx.eval(cache.arrays())
    cache.offset = n
    ref = [(np.array(k[..., :n, :].astype(mx.float32)), np.array(v[..., :n, :].astype(mx.float32)))
           for k, v in zip(cache.keys, cache.values)]
    layer_bytes = 2 * heads * n * dim * 2
    mx.clear_cache()
    before = mx.get_active_memory()          # the old cache
    mx.reset_peak_memory()
    cache.reserve(4 * n)
    mx.eval(cache.arrays())
    old_total, new_total = layers * layer_bytes, 4 * layers * layer_bytes
    peak = mx.get_peak_memory() - before + old_total
    assert peak <= new_total + 3 * layer_bytes, (peak / layer_bytes, new_total / layer_bytes)
    for (k, v), (rk, rv) in zip(zip(cache.keys, cache.values), ref):
        assert np.array_equal(np.array(k[..., :n, :].astype(mx.float32)), rk)
        assert np.array_equal(np.array(v[..., :n, :].astype(mx.float32)), rv)


def test_reply_rows_are_reserved_with_the_prompt(checkpoints, monkeypatch):
    """The cache grows neither during a reply that fits the reserve (prompt + max_tokens, up to
    REPLY_ROWS) nor more than O(log n) times past it: a growth copies every cached row and
    retraces the compiled exact step at the new capacity. The reply's tokens do not depend on
    the reserve (drafted == serial and the capacity test cover the bits)."""
    from tensorfold.engine import prefill as pf
    from tensorfold.models.kv import KVCache

    eng = Engine(checkpoints["qwen3_mlx_4bit"], drafts=False)
    growths = []
    inner = KVCache.reserve

    def reserve(self, n):
        if self.offset and n > self.capacity:
            growths.append((self.offset, self.capacity))
        inner(self, n)

    monkeypatch.setattr(KVCache, "reserve", reserve)
    prompt = np.random.default_rng(9).integers(3, eng.model.cfg.vocab_size, size=300).tolist()
    greedy = SamplingParams(temperature=0.0)
    _, short, _ = eng.generate_text(prompt=prompt, max_tokens=60, ignore_eos=True, sampling=greedy)
    assert len(short) == 60 and growths == []
    monkeypatch.setattr(pf, "REPLY_ROWS", 16)
    _, long, _ = eng.generate_text(prompt=prompt, max_tokens=700, ignore_eos=True, sampling=greedy)
    assert len(long) == 700 and 1 <= len(growths) <= 4, growths
    assert long[:60] == short
    monkeypatch.setenv("TENSORFOLD_RESERVE_PROMPT", "0")
    growths.clear()
    _, grown, _ = eng.generate_text(prompt=prompt, max_tokens=60, ignore_eos=True, sampling=greedy)
    assert grown == short
