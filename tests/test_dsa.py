"""deepseek_v32 (models/dsa.py) against mlx-lm 0.32.2's deepseek_v32 on the same checkpoints.

Checkpoints (tensorfold.testing.DEFAULT_SET, and two yarn-RoPE ones written below): ``deepseek_v32_mlx_4bit`` (mlx-lm's converted
layout, 4-bit group 32, bf16) and ``deepseek_v32_hf_f32`` (HF layout: kv_b_proj and per-expert
tensors, float32), both with index_topk 20, so prompts past 20 tokens use the sparse path.

What is bitwise and what is a tolerance:
* while a chunk sees <= index_topk keys (``use_sparse`` false) our prefill runs mlx-lm's ops:
  logits equal bit for bit (both checkpoints, whole prompts and chunked against mlx-lm's cache).
* past that, mlx-lm builds a dense L x S mask from argpartition and runs a bf16 / f32 sdpa
  with an additive rope-score mask (non-absorbed for L > 1); we run ``sparse_attention`` over
  ``select_topk``'s keys in the absorbed form with an fp32 online softmax. Different arithmetic,
  so: float32 checkpoint, relative error < 1e-5 on every row (observed ~1e-6). In bf16 the
  indexer's scores tie often (8-bit mantissa) and argpartition breaks ties arbitrarily, and a
  different key set or a flipped bf16 routing near-tie moves a row by O(1): there we compare one
  attention layer against mlx-lm's given the same selection (bf16 rounding), and whole-model
  logits by the share of rows that agree (as tests/test_moe.py does for bf16 routing).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tensorfold import kernels
from tensorfold.errors import CheckpointError
from tensorfold.models import DSAModel, load_model
from tensorfold.testing import widened, write_checkpoint

from reference_helpers import mlx_lm_last_row_logits

Q4, F32 = "deepseek_v32_mlx_4bit", "deepseek_v32_hf_f32"


def _ids(vocab, n, seed):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


@pytest.fixture(scope="module")
def pair(checkpoints):
    import mlx_lm
    out = {}
    for name in (Q4, F32):
        ref, _ = mlx_lm.load(str(checkpoints[name]))
        out[name] = (load_model(checkpoints[name]), ref)
    return out


def test_dispatch_and_mlx_lm_loads(pair):
    for name, (ours, ref) in pair.items():
        assert isinstance(ours, DSAModel) and ours.cfg.family == "deepseek_v32"
        assert type(ref).__module__.endswith("deepseek_v32")
        y = ref(mx.array([_ids(ours.cfg.vocab_size, 30, 0)]))
        assert y.shape[-1] == ours.cfg.vocab_size and mx.isfinite(y).all().item(), name


@pytest.mark.parametrize("name", [Q4, F32])
def test_dense_prefill_bitwise(pair, name):
    """<= index_topk keys: mlx-lm's ops, every row, whole prompt and chunked (L = 1 included)."""
    from mlx_lm.models.cache import make_prompt_cache
    ours, ref = pair[name]
    ids = _ids(ours.cfg.vocab_size, ours.cfg.index_topk, 1)
    want = ref(mx.array([ids]), cache=make_prompt_cache(ref))[0]
    got = ours.forward(mx.array([ids]), ours.new_cache(), exact=False, all_logits=True)
    assert mx.array_equal(got, want).item()
    c, rc = ours.new_cache(), make_prompt_cache(ref)
    for s, e in [(0, 8), (8, 16), (16, 17), (17, 20)]:
        a = ours.forward(mx.array([ids[s:e]]), c, exact=False)
        b = mlx_lm_last_row_logits(ref, mx.array([ids[s:e]]), rc)
        assert mx.array_equal(a, b).item(), (s, e)


def test_sparse_prefill_f32_close_to_mlx_lm(pair, monkeypatch):
    """float32, sparse path on every layer. Against mlx-lm as is where its argpartition meets
    no tie (n = 48), and against mlx-lm with ties to the lower position (n = 90: the indexer's
    ReLU makes exact-zero scores, and one zero tie at the top-k boundary of one row changes
    that row's keys and, through its latent, later rows)."""
    ours, ref = pair[F32]
    calls = []
    real = kernels.sparse_attention
    monkeypatch.setattr(kernels, "sparse_attention", lambda *a, **k: calls.append(1) or real(*a, **k))

    def check(n):
        ids = _ids(ours.cfg.vocab_size, n, n)
        want = ref(mx.array([ids]))[0]
        got = ours.forward(mx.array([ids]), ours.new_cache(), exact=False, all_logits=True)
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert err < 1e-5, (n, err)
    check(48)
    _ties_low_indexer(monkeypatch)
    check(48)
    check(90)
    assert len(calls) == 3 * ours.cfg.num_layers          # the sparse path ran, once per layer


def test_sparse_used_only_past_topk(pair, monkeypatch):
    ours, _ = pair[Q4]
    calls = []
    real = kernels.sparse_attention
    monkeypatch.setattr(kernels, "sparse_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = _ids(ours.cfg.vocab_size, 40, 2)
    c = ours.new_cache()
    ours.forward(mx.array([ids[:16]]), c, exact=False)                  # chunk end 16 <= 20
    assert calls == []
    ours.forward(mx.array([ids[16:32]]), c, exact=False)                # chunk end 32 > 20
    assert len(calls) == ours.cfg.num_layers
    ours.forward(mx.array([ids[32:33]]), c, exact=True)                 # decode, sparse
    assert len(calls) == 2 * ours.cfg.num_layers


def test_exact_rows_take_their_own_kernel_across_topk(pair, monkeypatch):
    """An exact call whose rows cross index_topk sends each row to the kernel its one-row step
    uses (row_attention while p + 1 <= topk, sparse_attention after): on CUDA the two kernels'
    bits differ, so choosing per call would break drafted == serial at the switch. The CPU
    face's bits agree either way, so this checks the routing itself."""
    ours, _ = pair[Q4]
    topk, seen = ours.cfg.index_topk, []
    real_dense, real_sparse = kernels.row_attention, kernels.sparse_attention

    def dense(q, k, v, off, *a, **kw):
        seen.append(("dense", int(off), q.shape[2]))
        return real_dense(q, k, v, off, *a, **kw)

    def sparse(q, k, v, idx, off, *a, **kw):
        seen.append(("sparse", int(off), q.shape[2]))
        return real_sparse(q, k, v, idx, off, *a, **kw)

    monkeypatch.setattr(kernels, "row_attention", dense)
    monkeypatch.setattr(kernels, "sparse_attention", sparse)
    ids = _ids(ours.cfg.vocab_size, 30, 5)
    c = ours.new_cache()
    ours.forward(mx.array([ids[:16]]), c, exact=False, logits=False)     # dense prefill (mlx-lm's ops)
    seen.clear()
    ours.forward(mx.array([ids[16:24]]), c, exact=True)                   # positions 16..23
    per_layer = seen[: len(seen) // ours.cfg.num_layers]
    assert per_layer == [("dense", 16, topk - 16), ("sparse", topk, 24 - topk)], per_layer
    for p in (topk - 1, topk):                                            # one-row steps either side
        c1 = ours.new_cache()
        ours.forward(mx.array([ids[:p]]), c1, exact=False, logits=False)
        seen.clear()
        ours.forward(mx.array([ids[p:p + 1]]), c1, exact=True)
        assert seen[0] == ("dense" if p + 1 <= topk else "sparse", p, 1), (p, seen[0])


def _ties_low_indexer(monkeypatch):
    """mlx-lm's Indexer with its argpartition replaced by select_topk (ties to the lower
    position): the same key set as ours, so only the attention arithmetic differs."""
    from mlx_lm.models import deepseek_v32 as dv

    def call(self, x, qr, mask, cache=None):
        b, s, _ = x.shape
        q = self.wq_b(qr).reshape(b, s, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = mx.reshape(self.k_norm(self.wk(x)), (b, 1, s, self.head_dim))
        off = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=off), self.rope(k, offset=off)
        if cache is not None:
            k, _ = cache.update_and_fetch(k, k)
        if k.shape[2] <= self.index_topk:
            return None
        scores = mx.maximum(q @ k.swapaxes(-1, -2), 0)
        w = self.weights_proj(x) * (self.n_heads ** -0.5 * self.softmax_scale)
        scores = scores * w.swapaxes(-1, -2)[..., None]
        scores = sum(scores[:, h: h + 1] for h in range(scores.shape[1]))
        sel = kernels.select_topk(scores[:, 0], self.index_topk, k.shape[2] - s)
        return mx.maximum(sel, 0)[:, None]      # -1 padding -> key 0 (always visible)

    monkeypatch.setattr(dv.Indexer, "__call__", call)


def test_sparse_attention_layer_matches_masked_mlx_lm(pair, monkeypatch):
    """bf16 4-bit, one attention layer, same input, same selection: our sparse_attention
    (prefill and row-exact decode) vs mlx-lm's dense-with-mask sdpa, within bf16 rounding."""
    from mlx_lm.models.base import create_causal_mask
    _ties_low_indexer(monkeypatch)
    ours, ref = pair[Q4]
    L = 48
    x = mx.array(np.random.default_rng(5).standard_normal((1, L, ours.cfg.hidden_size)).astype(np.float32))
    x = x.astype(mx.bfloat16)
    want = ref.model.layers[0].self_attn(x, create_causal_mask(L), None).astype(mx.float32)
    scale = mx.abs(want).max()
    sels = []
    real = kernels.select_topk
    monkeypatch.setattr(kernels, "select_topk", lambda *a, **k: sels.append(real(*a, **k)) or sels[-1])
    errs = []
    for exact in (False, True):
        c = ours.new_cache()
        c.reserve(L)
        got = ours._attention(ours.layers[0], 0, x, c, exact).astype(mx.float32)
        errs.append(np.array(mx.abs(got - want).max(axis=-1)[0] / scale))
    assert errs[0].max() < 0.03, errs[0].max()          # prefill: every row
    # decode computes its own bf16 indexer scores (row_matmul): where a bf16 near-tie at the
    # top-k boundary orders differently the key set differs; every other row agrees
    same = np.array([mx.array_equal(sels[0][0, i], sels[-1][0, i]).item() for i in range(L)])
    assert same.mean() > 0.7, same.mean()
    assert errs[1][same].max() < 0.03, errs[1][same].max()


def test_bf16_whole_model_rows_agree_with_mlx_lm(pair):
    ours, ref = pair[Q4]
    ids = _ids(ours.cfg.vocab_size, 64, 3)
    want = ref(mx.array([ids]))[0].astype(mx.float32)
    got = ours.forward(mx.array([ids]), ours.new_cache(), exact=False, all_logits=True).astype(mx.float32)
    assert mx.isfinite(got).all().item()
    close = (mx.abs(got - want).max(axis=-1) < 0.1 * mx.abs(want).max()).astype(mx.float32).mean().item()
    assert close > 0.8, close      # bf16 indexer ties / routing near-ties flip a few rows


def test_exact_decode_close_to_prefill(pair):
    """float32: the row-exact decode path (sparse) computes prefill's function to fp32 rounding."""
    ours, _ = pair[F32]
    ids = mx.array([_ids(ours.cfg.vocab_size, 44, 4)])
    a = ours.forward(ids, ours.new_cache(), exact=False, all_logits=True)
    c = ours.new_cache()
    ours.forward(ids[:, :30], c, exact=False, logits=False)
    b = ours.forward(ids[:, 30:], c, exact=True, all_logits=True)
    err = (mx.abs(a[30:] - b).max() / mx.abs(a).max()).item()
    assert err < 1e-4, err
    one = ours.new_cache()                              # a single exact call from scratch too
    e = ours.forward(ids[:, :12], one, exact=True, all_logits=True)
    assert (mx.abs(a[:12] - e).max() / mx.abs(a).max()).item() < 1e-4


def test_decode_rows_are_row_exact(pair):
    """k single exact steps == one k-row exact call, bit for bit, across the sparse switch."""
    from tensorfold.engine.rowcheck import row_check
    ours, _ = pair[Q4]
    assert row_check(ours, k=8, prompt_len=16)      # positions 16..23 cross index_topk = 20
    assert row_check(ours, k=6, prompt_len=40)


def test_indexer_keys_snapshot_restore(pair):
    """The indexer's keys are cache state: a restored snapshot continues with the same bits."""
    ours, _ = pair[Q4]
    ids = _ids(ours.cfg.vocab_size, 60, 6)
    c = ours.new_cache()
    ours.forward(mx.array([ids[:32]]), c, exact=False, logits=False)
    assert c.values[0].shape[-1] == ours.cfg.index_head_dim
    assert mx.abs(c.values[0][..., :32, :]).max().item() > 0
    snap = c.snapshot(32)
    want = ours.forward(mx.array([ids[32:]]), c, exact=False, all_logits=True)
    r = ours.new_cache()
    r.restore(snap, 32)
    got = ours.forward(mx.array([ids[32:]]), r, exact=False, all_logits=True)
    assert mx.array_equal(got, want).item()


def test_checkpoint_errors(tmp_path):
    import json
    p = write_checkpoint(tmp_path / "d", family="deepseek_v32", layout="mlx", bits=4, group_size=32, seed=1)
    w = mx.load(str(p / "model.safetensors"))

    def with_weights(name, ws):
        d = tmp_path / name
        d.mkdir()
        for f in p.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        mx.save_safetensors(str(d / "model.safetensors"), ws)
        return d

    missing = dict(w)
    del missing["model.layers.1.self_attn.indexer.wk.weight"]
    with pytest.raises(CheckpointError, match="indexer.wk"):
        load_model(with_weights("missing", missing))
    bad = dict(w)
    bad["model.layers.0.self_attn.embed_q.scales"] = bad["model.layers.0.self_attn.embed_q.scales"][:, :1]
    with pytest.raises(CheckpointError, match="embed_q"):
        load_model(with_weights("shape", bad))
    fp8 = dict(w)
    fp8["model.layers.0.self_attn.o_proj.weight_scale_inv"] = mx.ones((1, 1))
    with pytest.raises(CheckpointError, match="FP8"):
        load_model(with_weights("fp8", fp8))
    # layers past num_hidden_layers are DeepSeek's multi-token prediction layers, which mlx-lm's
    # sanitize drops: loaded without them; any other tensor no module reads is refused
    mtp = with_weights("mtp", dict(w))
    cfg = json.loads((mtp / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    (mtp / "config.json").write_text(json.dumps(cfg))
    assert load_model(mtp).cfg.num_layers == cfg["num_hidden_layers"]
    stray = dict(w)
    stray["model.layers.0.self_attn.extra.weight"] = mx.ones((4, 4))
    with pytest.raises(CheckpointError, match="not used by a deepseek_v32 model.*self_attn.extra.weight"):
        load_model(with_weights("stray", stray))
    cfg = json.loads((p / "config.json").read_text())
    for bad in ({"type": "dynamic", "factor": 2.0}, {"type": "yarn"}, {"type": "yarn", "factor": "40"},
                {"type": "yarn", "factor": 40.0, "beta_fast": -1.0}):
        cfg["rope_scaling"] = bad
        (p / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match="rope_scaling"):
            load_model(p)
    cfg["rope_scaling"] = {"type": "yarn", "factor": 40.0}            # mlx-lm's YarnRoPE defaults
    (p / "config.json").write_text(json.dumps(cfg))
    assert load_model(p).cfg.rope_scaling["type"] == "yarn"
    # the MoE keys, by name: routed_scaling_factor "x" failed in float() naming nothing, "yes" was
    # read as true, first_k_dense_replace -1 passed `info` and failed at load as a missing tensor
    for key, bad, what in (("routed_scaling_factor", "x", "positive number"), ("norm_topk_prob", "yes", "true or false"),
                           ("first_k_dense_replace", -1, "integer >= 0"), ("n_group", 2.5, "integer"),
                           ("indexer_rope_interleave", 1, "true or false")):
        (p / "config.json").write_text(json.dumps(dict(cfg, **{key: bad})))
        with pytest.raises(CheckpointError, match=f"'{key}' must be (a |an )?{what}"):
            load_model(p)
    (p / "config.json").write_text(json.dumps(cfg))
    # deepseek_v32 keeps its own lm_head whatever tie_word_embeddings says (mlx-lm's has no such
    # field): tied, the head silently became the embedding
    cfg["tie_word_embeddings"] = True
    (p / "config.json").write_text(json.dumps(cfg))
    m = load_model(p)
    assert not m.cfg.tie_embeddings and m.lm_head is not m.embed
    # shared-expert tensors that n_shared_experts 0 / null would drop: refused, as mlx-lm refuses
    d = with_weights("shared", dict(w))
    cfg2 = json.loads((d / "config.json").read_text())
    if cfg2.get("n_shared_experts"):
        cfg2["n_shared_experts"] = None
        (d / "config.json").write_text(json.dumps(cfg2))
        with pytest.raises(CheckpointError, match="shared_experts"):
            load_model(d)


def test_info(checkpoints):
    from tensorfold.models.info import describe
    text = describe(checkpoints[Q4])
    for want in ("deepseek_v32", "MLA", "indexer", "top-20", "4-bit/g32", "routing"):
        assert want in text, want
    assert "router" in text and "weights: router               bfloat16" in text
    from tensorfold.models.config import ModelConfig
    for name in (Q4, F32):      # the float32 router biases at 4 bytes
        on_disk = sum(v.nbytes for f in checkpoints[name].glob("*.safetensors")
                      for v in mx.load(str(f)).values())
        assert ModelConfig.from_dir(checkpoints[name]).weight_bytes() == on_disk, name


# ---- yarn / deepseek_yarn RoPE (DeepSeek-V3.2's real configs) -------------------------------
YQ4, YF32 = "yarn_mlx_4bit", "yarn_hf_f32"


@pytest.fixture(scope="module")
def yarn(tmp_path_factory):
    """Two yarn checkpoints and mlx-lm's models of them: the 4-bit one with the "deepseek_yarn"
    spelling and mscale != mscale_all_dim (YarnRoPE scales its input), the float32 one as
    DeepSeek-V3.2's config.json has it (type "yarn", factor 40, mscale = mscale_all_dim = 1)."""
    import mlx_lm
    from tensorfold.testing import yarn_rope_scaling
    root = tmp_path_factory.mktemp("yarn")
    specs = {
        YQ4: dict(layout="mlx", bits=4, group_size=32, seed=31, max_position=4096,
                  rope_scaling=yarn_rope_scaling(factor=16.0, original=256, mscale=1.0,
                                                 mscale_all_dim=0.707, rope_type="deepseek_yarn")),
        YF32: dict(layout="hf", dtype="float32", seed=32, max_position=163840,
                   rope_scaling=yarn_rope_scaling()),
    }
    out = {}
    for name, kw in specs.items():
        p = write_checkpoint(root / name, **widened(dict(family="deepseek_v32", **kw)))
        ref, _ = mlx_lm.load(str(p))
        out[name] = (load_model(p), ref, p)
    return out


@pytest.mark.parametrize("traditional", [True, False])
def test_yarn_rope_equals_mlx_lm(traditional):
    """make_dsa_rope == mlx-lm's initialize_rope(...) bit for bit (rope dims only and wider
    inputs, as the indexer's), and yarn really changes the result."""
    from mlx_lm.models.rope_utils import initialize_rope
    from tensorfold.models.config import ModelConfig
    from tensorfold.models.dsa import make_dsa_rope
    from tensorfold.testing import yarn_rope_scaling
    rd = 16
    for sc in (yarn_rope_scaling(), yarn_rope_scaling(factor=8.0, original=64, beta_fast=16.0, beta_slow=2.0,
                                                        mscale=0.8, mscale_all_dim=0.5, rope_type="deepseek_yarn"),
               {"type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0}):
        cfg = ModelConfig._yarn_rope_scaling(sc)
        mc = ModelConfig(path=None, family="deepseek_v32", hidden_size=0, num_layers=0, num_heads=0,
                         num_kv_heads=0, head_dim=0, intermediate_size=0, vocab_size=0, rms_norm_eps=0,
                         rope_theta=10000.0, rope_scaling=cfg, max_position=0, tie_embeddings=False,
                         attention_bias=False, qk_norm=False, dtype="bfloat16", quantization=None,
                         qk_rope_head_dim=rd)
        ours = make_dsa_rope(mc, traditional)
        ref = initialize_rope(rd, 10000.0, traditional, scaling_config=sc, max_position_embeddings=4096)
        for dt in (mx.bfloat16, mx.float32):
            for width in (rd, 64):
                x = mx.array(np.random.default_rng(width).standard_normal((1, 2, 9, width)).astype(np.float32)).astype(dt)
                for off in (0, 37, 5000):
                    assert mx.array_equal(ours(x, off), ref(x, offset=off)).item(), (sc, dt, width, off)
                plain = mx.fast.rope(x, rd, traditional=traditional, base=10000.0, scale=1.0, offset=37)
                assert not mx.array_equal(ours(x, 37), plain).item()


@pytest.mark.parametrize("name", [YQ4, YF32])
def test_yarn_dense_prefill_bitwise(yarn, name):
    from mlx_lm.models.cache import make_prompt_cache
    ours, ref, _ = yarn[name]
    assert ours.scale == ref.model.layers[0].self_attn.scale
    ids = _ids(ours.cfg.vocab_size, ours.cfg.index_topk, 7)
    want = ref(mx.array([ids]), cache=make_prompt_cache(ref))[0]
    got = ours.forward(mx.array([ids]), ours.new_cache(), exact=False, all_logits=True)
    assert mx.array_equal(got, want).item()
    c, rc = ours.new_cache(), make_prompt_cache(ref)
    for s, e in [(0, 7), (7, 16), (16, 17), (17, 20)]:
        a = ours.forward(mx.array([ids[s:e]]), c, exact=False)
        b = mlx_lm_last_row_logits(ref, mx.array([ids[s:e]]), rc)
        assert mx.array_equal(a, b).item(), (s, e)


def test_yarn_sparse_prefill_f32_close_to_mlx_lm(yarn, monkeypatch):
    ours, ref, _ = yarn[YF32]
    _ties_low_indexer(monkeypatch)
    for n in (48, 90):
        ids = _ids(ours.cfg.vocab_size, n, n + 1)
        want = ref(mx.array([ids]))[0]
        got = ours.forward(mx.array([ids]), ours.new_cache(), exact=False, all_logits=True)
        err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        assert err < 1e-5, (n, err)


def test_yarn_exact_decode_close_to_prefill(yarn):
    ours, _, _ = yarn[YF32]
    ids = mx.array([_ids(ours.cfg.vocab_size, 44, 8)])
    a = ours.forward(ids, ours.new_cache(), exact=False, all_logits=True)
    c = ours.new_cache()
    ours.forward(ids[:, :30], c, exact=False, logits=False)
    b = ours.forward(ids[:, 30:], c, exact=True, all_logits=True)
    assert (mx.abs(a[30:] - b).max() / mx.abs(a).max()).item() < 1e-4
    one = ours.new_cache()
    e = ours.forward(ids[:, :12], one, exact=True, all_logits=True)
    assert (mx.abs(a[:12] - e).max() / mx.abs(a).max()).item() < 1e-4


def test_yarn_decode_rows_are_row_exact(yarn):
    from tensorfold.engine.rowcheck import row_check
    ours, _, _ = yarn[YQ4]
    assert row_check(ours, k=8, prompt_len=16)


@pytest.mark.parametrize("i", range(4))
def test_yarn_engine_drafted_equals_serial(yarn, i):
    from tensorfold.engine import Engine, PrefillMode, SamplingParams
    from tensorfold.engine.proposers import ContextCopy
    from test_engine import MixProposer
    if "engine" not in yarn:
        yarn["engine"] = Engine(yarn[YQ4][2], prefill_mode=PrefillMode(grid=16))
    eng = yarn["engine"]
    vocab = eng.model.cfg.vocab_size
    plen = [5, 17, 33, 47][i]
    prompt = np.random.default_rng(50 + i).integers(3, vocab, size=plen).tolist()
    p = SamplingParams(temperature=[0.0, 0.9, 1.3, 0.5][i], top_p=[1.0, 0.9, 1.0, 0.6][i], seed=100 + i)
    text, serial, st = eng.generate_text(prompt=prompt, max_tokens=30, sampling=p, draft=False)
    props = [MixProposer(plen, serial, vocab, i)] if i % 2 == 0 else [ContextCopy()]
    dtext, drafted, dst = eng.generate_text(prompt=prompt, max_tokens=30, sampling=p, draft=True,
                                            proposers=props)
    assert drafted == serial and dtext == text and dst.token_hash == st.token_hash
    if i % 2 == 0 and st.completion_tokens > 3:
        assert dst.drafted > 0


# ---- LayerQueue in prefill ------------------------------------------------------------------
@pytest.mark.parametrize("name", [Q4, F32])
def test_layer_queue_prefill_bounded_and_equal(pair, monkeypatch, name):
    """Each prefill layer's hidden state and cache writes go to LayerQueue(2): bounded in-flight
    layers, and the same logits / cache bits as the plain one-graph forward (dense and sparse)."""
    ours, _ = pair[name]
    ids = mx.array([_ids(ours.cfg.vocab_size, 60, 9)])
    runs = []
    for queued in (True, False):
        if not queued:
            monkeypatch.setattr(ours, "_layer_done", lambda *a: None)
        c = ours.new_cache()
        out = [ours.forward(ids[:, :16], c, exact=False, all_logits=True)]    # <= index_topk
        q = ours.last_queue
        if queued:
            assert q.depth == 2 and 0 < q.max_in_flight <= 2 and q.pushed == ours.cfg.num_layers
        out.append(ours.forward(ids[:, 16:], c, exact=False, all_logits=True))   # sparse
        runs.append((out, [c.keys[i][..., :60, :] for i in range(ours.cfg.num_layers)]
                     + [c.values[i][..., :60, :] for i in range(ours.cfg.num_layers)]))
    (a, ca), (b, cb) = runs
    assert all(mx.array_equal(x, y).item() for x, y in zip(a + ca, b + cb))
    monkeypatch.undo()
    before = ours.last_queue
    ours.forward(ids[:, :3], ours.new_cache(), exact=True)                  # decode: no queue
    assert ours.last_queue is before


def test_layer_queue_yarn_equals_mlx_lm(yarn):
    """The queued prefill of the yarn checkpoint still equals mlx-lm bit for bit."""
    from mlx_lm.models.cache import make_prompt_cache
    ours, ref, _ = yarn[YQ4]
    ids = _ids(ours.cfg.vocab_size, ours.cfg.index_topk, 10)
    got = ours.forward(mx.array([ids]), ours.new_cache(), exact=False, all_logits=True)
    assert ours.last_queue.pushed == ours.cfg.num_layers and ours.last_queue.max_in_flight <= 2
    assert mx.array_equal(got, ref(mx.array([ids]), cache=make_prompt_cache(ref))[0]).item()


def test_layer_queue_bounds_deep_model(tmp_path, monkeypatch):
    """5 layers: the queue really caps in-flight layers at 2, and changes no bit."""
    m = load_model(write_checkpoint(tmp_path / "deep", **widened(dict(
        family="deepseek_v32", layout="mlx", bits=4, group_size=32, layers=5, seed=33))))
    ids = mx.array([_ids(m.cfg.vocab_size, 40, 11)])
    a = m.forward(ids, m.new_cache(), exact=False, all_logits=True)
    assert m.last_queue == (2, 2, 5)
    monkeypatch.setattr(m, "_layer_done", lambda *a: None)
    assert mx.array_equal(a, m.forward(ids, m.new_cache(), exact=False, all_logits=True)).item()


@pytest.mark.parametrize("name", [Q4, F32])
def test_sparse_prefill_row_blocks_give_one_blocks_bits(pair, name, monkeypatch):
    """A sparse prefill chunk is indexed and attended INDEX_ROWS rows at a time: every row gets
    the bits the whole chunk as one block gives (on the CPU; on any backend the blocks sit at
    fixed offsets of the chunk, so fresh and resumed prompts cut them alike)."""
    ours, _ = pair[name]
    ids = mx.array([np.random.default_rng(7).integers(3, ours.cfg.vocab_size, size=300).tolist()])
    assert ours.cfg.index_topk < 300
    got = {}
    for rows in (10**6, 128, 37):
        monkeypatch.setattr(type(ours), "INDEX_ROWS", rows)
        got[rows] = ours.forward(ids, ours.new_cache(), exact=False, all_logits=True)
    assert mx.array_equal(got[128], got[10**6]).item() and mx.array_equal(got[37], got[10**6]).item()


def test_sparse_prefill_memory_does_not_scale_with_index_heads(tmp_path):
    """The indexer's transient memory: rows x keys per block, not index heads x chunk rows x keys
    (mlx-lm's [Hi, L, S]; an audit measured 46 / 94 MiB more per 1k prompt tokens with 8 / 32
    index heads, ~5 after)."""
    from tensorfold.engine.prefill import PrefillMode, prefill
    # qk_nope_head_dim 64, not the defaults' 32: embed_q's K (the absorbed q, per head) at 32 has
    # no kernel in MLX 0.32's CUDA quantized_matmul past 7 rows ("No implementation for problem
    # shape", H200, session 55); real checkpoints have 128
    p = write_checkpoint(tmp_path / "m", family="deepseek_v32", layout="mlx", bits=4, group_size=32,
                         seed=1, layers=2, dsa=dict(index_topk=256, index_n_heads=32, qk_nope_head_dim=64))
    m = load_model(p)
    mx.eval(m.parameters())
    extra = []
    for n in (1024, 4096):
        ids = np.random.default_rng(n).integers(3, m.cfg.vocab_size, n).tolist()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        c = m.new_cache()
        mx.eval(prefill(m, c, ids, PrefillMode(grid=1024)))
        extra.append((mx.get_peak_memory() - base - sum(a.nbytes for a in c.arrays())) / 2**20)
        del c
    assert (extra[1] - extra[0]) / 3 < 20, extra          # MiB more per 1k tokens (was ~93)
