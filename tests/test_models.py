"""Checkpoints: our prefill logits equal mlx-lm's; info from config.json alone; bad checkpoints."""

from __future__ import annotations

import gc
import json
import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest

from tensorfold.errors import CheckpointError
from tensorfold.models import load_model
from tensorfold.models.info import describe

from reference_helpers import mlx_lm_last_row_logits


def _prompt(vocab, n, seed=0):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


@pytest.mark.parametrize("name", [
    "qwen3_hf_bf16", "qwen3_mlx_4bit", "qwen3_mlx_8bit", "llama_hf_llama3_rope",
    "qwen2_mlx_4bit_tied", "qwen3_mlx_mixed", "qwen3_hf_sharded"])
def test_prefill_logits_equal_mlx_lm(checkpoints, name):
    """Same ops as mlx-lm's llama/qwen2/qwen3 -> bitwise equal logits (last row and all rows).

    The last-row call sends one row through the LM head, as mlx-lm's generate does: compared
    with reference_helpers.mlx_lm_last_row_logits on every backend, and with the last row of
    mlx-lm's all-rows call where MLX's matmuls are row-invariant (its CPU backend)."""
    import mlx_lm

    path = checkpoints[name]
    ours = load_model(path)
    ref, _ = mlx_lm.load(str(path))
    ids = _prompt(ours.cfg.vocab_size, 37, seed=len(name))
    x = mx.array([ids])
    cache = ours.new_cache()
    last = ours.forward(x, cache, exact=False)
    want = ref(x)[0]
    assert cache.offset == len(ids)
    assert mx.array_equal(last, mlx_lm_last_row_logits(ref, x)).item()
    if mx.default_device().type == mx.cpu:
        assert mx.array_equal(last[0], want[-1]).item()
    cache = ours.new_cache()
    rows = ours.forward(x, cache, exact=False, all_logits=True)
    assert mx.array_equal(rows, want).item()


def test_chunked_prefill_matches_mlx_lm_cache(checkpoints):
    """Our KV cache and mlx-lm's KVCache give the same bits chunk by chunk."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    path = checkpoints["qwen3_mlx_4bit"]
    ours = load_model(path)
    ref, _ = mlx_lm.load(str(path))
    ids = _prompt(ours.cfg.vocab_size, 300, seed=1)
    c, rc = ours.new_cache(), make_prompt_cache(ref)
    for s, e in [(0, 128), (128, 256), (256, 300)]:
        a = ours.forward(mx.array([ids[s:e]]), c, exact=False)
        b = mlx_lm_last_row_logits(ref, mx.array([ids[s:e]]), rc)
        assert mx.array_equal(a, b).item()


def test_exact_decode_close_to_prefill(checkpoints):
    """The row-exact decode path computes the same function (not the same bits) as MLX's ops."""
    for name in ("qwen3_hf_bf16", "qwen3_mlx_4bit", "qwen2_mlx_4bit_tied", "qwen3_mlx_mixed"):
        m = load_model(checkpoints[name])
        ids = _prompt(m.cfg.vocab_size, 20, seed=3)
        a = m.forward(mx.array([ids]), m.new_cache(), exact=False, all_logits=True).astype(mx.float32)
        c = m.new_cache()
        m.forward(mx.array([ids[:12]]), c, exact=False, logits=False)
        b = m.forward(mx.array([ids[12:]]), c, exact=True, all_logits=True).astype(mx.float32)
        err = mx.abs(a[12:] - b).max().item() / (mx.abs(a[12:]).max().item() + 1e-6)
        assert err < 0.05, (name, err)   # bf16 activations; different (exact) kernels


def test_info_reads_config_only(checkpoints, tmp_path):
    path = checkpoints["qwen3_mlx_mixed"]
    text = describe(path)
    for want in ("qwen3", "layers", "KV heads", "4-bit/g64", "8-bit/g64", "6-bit/g32",
                 "parameters", "KV cache, 32k tokens"):
        assert want in text, want
    # config alone: no weights at all still works
    only = tmp_path / "only-config"
    only.mkdir()
    shutil.copy(path / "config.json", only / "config.json")
    assert describe(only) == text.replace(str(path), str(only))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("breakage, message", [
    ("no-config", "no config.json"),
    ("model-type", "unsupported model_type 'mamba'"),
    ("bits", "unsupported quantization bits 7"),
    ("mode", "unsupported quantization mode 'mxfp4'"),
    ("no-weights", "no *.safetensors"),
    ("shape", "has shape"),
    ("missing-tensor", "missing tensor"),
    ("bad-json", "not valid JSON"),
    ("missing-shard", "is missing"),
    ("model-type-list", "unsupported model_type"),
    ("kv-heads-string", "'num_key_value_heads' must be a positive integer"),
    ("head-dim-string", "'head_dim' must be a positive integer"),
    ("max-position-zero", "'max_position_embeddings' must be a positive integer"),
    # corrupt sizes: 10^9 layers made `info` and `serve` list 10^9 layers' shapes (a hang); a 10^30
    # context was served
    ("layers-1e9", "'num_hidden_layers' is 1000000000, past 4,096"),
    ("max-position-1e30", "'max_position_embeddings' is 1e+30, past 2,147,483,647"),
    ("rope-theta-null-string", "'rope_theta' must be a positive number"),
    ("rope-scaling-string", "'rope_scaling' must be an object"),
    ("linear-rope-no-factor", "needs 'factor'"),
    ("tie-string", "'tie_word_embeddings' must be true or false"),
    ("awq", "quant_method 'awq' is not supported; convert"),
    ("index-map-list", "'weight_map' must map"),
    ("stray-bias", "o_proj.bias is not used"),
    # tensors no module reads: config.json describes another model (mlx-lm refuses them too)
    ("fewer-layers", "not used by a qwen3 model with this config.json: model.layers.1."),
    ("qwen3-as-llama", "not used by a llama model with this config.json: model.layers.0.self_attn.k_norm"),
    ("float-biases", "not used by a qwen3 model with this config.json: model.layers.0.mlp.down_proj.biases"),
    ("norm-int", "input_layernorm.weight has unsupported dtype"),
    # sizes the row-exact decode kernels cannot take (every request failed with a 500)
    ("intermediate-not-16", "intermediate_size 136 is not a multiple of 16"),
    ("head-dim-not-16", "head_dim 24 is not a multiple of 16"),
])
def test_bad_checkpoints_give_one_clear_error(checkpoints, tmp_path, breakage, message):
    src = checkpoints["qwen3_hf_sharded" if breakage == "missing-shard" else "qwen3_hf_bf16"]
    d = _copy(src, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    if breakage == "no-config":
        (d / "config.json").unlink()
    elif breakage == "model-type":
        cfg["model_type"] = "mamba"
    elif breakage == "bits":
        cfg["quantization"] = {"group_size": 64, "bits": 7}
    elif breakage == "mode":
        cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "mxfp4"}
    elif breakage == "no-weights":
        for f in d.glob("*.safetensors"):
            f.unlink()
    elif breakage == "shape":
        cfg["intermediate_size"] += 64
    elif breakage == "missing-tensor":
        w = mx.load(str(d / "model.safetensors"))
        del w["model.layers.1.mlp.up_proj.weight"]
        mx.save_safetensors(str(d / "model.safetensors"), w)
    elif breakage == "bad-json":
        (d / "config.json").write_text("{not json")
    elif breakage == "missing-shard":
        sorted(d.glob("model-*.safetensors"))[-1].unlink()
    elif breakage == "model-type-list":
        cfg["model_type"] = ["qwen3"]
    elif breakage == "kv-heads-string":
        cfg["num_key_value_heads"] = "2"
    elif breakage == "head-dim-string":
        cfg["head_dim"] = "16"
    elif breakage == "max-position-zero":
        cfg["max_position_embeddings"] = 0
    elif breakage == "layers-1e9":
        cfg["num_hidden_layers"] = 10 ** 9
    elif breakage == "max-position-1e30":
        cfg["max_position_embeddings"] = 10 ** 30
    elif breakage == "rope-theta-null-string":
        cfg["rope_theta"] = "fast"
    elif breakage == "rope-scaling-string":
        cfg["rope_scaling"] = "linear"
    elif breakage == "linear-rope-no-factor":
        cfg["rope_scaling"] = {"type": "linear"}
    elif breakage == "tie-string":
        cfg["tie_word_embeddings"] = "false"
    elif breakage == "awq":       # AutoAWQ's config (mlx-lm converts it on load): was "missing tensor"
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 64}
    elif breakage == "index-map-list":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    elif breakage == "stray-bias":      # a bias the config does not declare: never dropped silently
        w = mx.load(str(d / "model.safetensors"))
        w["model.layers.0.self_attn.o_proj.bias"] = mx.ones((cfg["hidden_size"],), mx.bfloat16)
        mx.save_safetensors(str(d / "model.safetensors"), w)
    elif breakage == "fewer-layers":    # layer 1's weights are there, the config stops before it
        cfg["num_hidden_layers"] = 1
    elif breakage == "qwen3-as-llama":
        cfg["model_type"] = "llama"
    elif breakage in ("float-biases", "norm-int"):
        w = mx.load(str(d / "model.safetensors"))
        if breakage == "float-biases":
            w["model.layers.0.mlp.down_proj.biases"] = mx.zeros((cfg["hidden_size"], 1), mx.bfloat16)
        else:
            w["model.layers.0.input_layernorm.weight"] = mx.ones((cfg["hidden_size"],), mx.int32)
        mx.save_safetensors(str(d / "model.safetensors"), w)
    elif breakage == "intermediate-not-16":
        cfg["intermediate_size"] = 136
    elif breakage == "head-dim-not-16":
        cfg["head_dim"] = 24
    if breakage not in ("no-config", "bad-json"):
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    if breakage == "layers-1e9":     # `info` reads the config alone: it listed the shapes too
        with pytest.raises(CheckpointError, match="num_hidden_layers"):
            describe(d)


@pytest.mark.parametrize("value", ["auto", ["bfloat16"], "float"])
def test_unknown_torch_dtype_only_warns(checkpoints, tmp_path, caplog, value):
    """torch_dtype is read only for `info`'s estimates (the model computes in its weights'
    dtypes): a value it does not name ("auto") is a warning, not a refusal of the checkpoint."""
    import logging
    d = _with(checkpoints["qwen3_hf_bf16"], tmp_path / "m", lambda c: c.update(torch_dtype=value))
    with caplog.at_level(logging.WARNING, logger="tensorfold"):
        assert load_model(d).dtype == mx.bfloat16
    assert "torch_dtype" in caplog.text


def test_unknown_path():
    with pytest.raises(CheckpointError, match="not found"):
        load_model("/nonexistent/model")


@pytest.mark.parametrize("name", ["qwen3_mlx_4bit", "qwen3_hf_bf16", "qwen2_mlx_4bit_tied"])
def test_decode_fuses_qkv_and_gate_up_without_a_second_copy(checkpoints, name, monkeypatch):
    """One row-exact launch for q/k/v and one for gate/up per layer; q, k, v, gate, up are row
    views of the fused weights (the checkpoint's values, no second copy kept)."""
    from tensorfold.models.loader import Linear, load_weights
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model = load_model(checkpoints[name])
    mx.eval(model.parameters())
    held = mx.get_active_memory() - before       # what this model keeps (other tests' objects aside)
    if name == "qwen3_mlx_4bit":   # (the bf16 checkpoints' tensors can stay file-backed: not counted)
        assert held <= sum(p.nbytes for p in model.parameters()) + 4096   # copies would add 35%
    raw = load_weights(checkpoints[name])
    ly = model.layers[0]
    assert ly.qkv is not None and ly.gate_up is not None
    for lin, tname in ((ly.q, "q_proj"), (ly.k, "k_proj"), (ly.v, "v_proj")):
        assert bool(mx.array_equal(lin.weight, raw[f"model.layers.0.self_attn.{tname}.weight"]).item())
    n = ly.q.shape[0]
    assert bool(mx.array_equal(ly.qkv.weight[:n], ly.q.weight).item())
    calls = []
    real = Linear.exact
    monkeypatch.setattr(Linear, "exact", lambda self, x, residual=None:
                        (calls.append(self), real(self, x, residual))[1])
    model.compiled_decode = False
    c = model.new_cache()
    mx.eval(model.forward(mx.array([[5, 6, 7]]), c, exact=True, all_logits=True))
    assert len(calls) == 4 * model.cfg.num_layers + 1      # qkv, o, gate_up, down per layer; LM head


def test_mlx_cuda_qmm_overreads_names_the_short_k_modules(tmp_path):
    """The modules whose prefill products reach MLX's CUDA quantized-matmul over-read (K <= 2 x
    its K tile where N % 128 == 0; loader.mlx_cuda_qmm_overreads): the engine warns about them on
    CUDA. hidden 64 (this suite's default): gate/up (128 x 64), experts' gate/up (128 x 64) and
    the LM head (512 x 64); q/k/v/o and down are 64 rows wide, where MLX takes another kernel.
    hidden 256 (what gpu_run.sh sets on the H200): none."""
    from tensorfold.models.config import ModelConfig
    from tensorfold.models.loader import mlx_cuda_qmm_overreads
    from tensorfold.testing import write_checkpoint

    small = load_model(write_checkpoint(tmp_path / "s", family="qwen3_moe", layout="mlx", bits=4,
                                        mlp_only_layers=[1], moe_intermediate=128, seed=1)).cfg
    assert mlx_cuda_qmm_overreads(small) == [
        "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "lm_head",
        "model.layers.0.mlp.switch_mlp.gate_proj", "model.layers.0.mlp.switch_mlp.up_proj"]
    tied = load_model(write_checkpoint(tmp_path / "t", layout="mlx", bits=4, tie_embeddings=True)).cfg
    assert mlx_cuda_qmm_overreads(tied)[-1] == "model.embed_tokens"       # the head, tied
    wide = load_model(write_checkpoint(tmp_path / "w", family="qwen3_moe", layout="mlx", bits=4,
                                       hidden=256, intermediate=512, moe_intermediate=256)).cfg
    assert mlx_cuda_qmm_overreads(wide) == []
    assert mlx_cuda_qmm_overreads(load_model(write_checkpoint(tmp_path / "f")).cfg) == []  # float
    # a real checkpoint: DeepSeek-V3.2's config (mlx-community 4-bit) has embed_q per head 512 x 128,
    # the absorbed q of its sparse prefill: K = 128 at group 64, in every layer; nothing else
    raw = {"model_type": "deepseek_v32", "hidden_size": 7168, "num_hidden_layers": 61,
           "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "qk_nope_head_dim": 128, "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128,
           "index_topk": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
           "moe_intermediate_size": 2048, "intermediate_size": 18432, "n_group": 8, "topk_group": 4,
           "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
           "vocab_size": 129280, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "quantization": {"group_size": 64, "bits": 4}}
    v32 = ModelConfig.from_dict(raw, tmp_path)
    assert mlx_cuda_qmm_overreads(v32) == [f"model.layers.{i}.self_attn.embed_q" for i in range(61)]


def _with(src, dst, edit_cfg=None, edit_weights=None):
    """A copy of checkpoint `src` with its config.json and / or its (single-file) weights edited."""
    d = _copy(src, dst)
    if edit_cfg is not None:
        cfg = json.loads((d / "config.json").read_text())
        edit_cfg(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if edit_weights is not None:
        f = d / "model.safetensors"
        w = dict(mx.load(str(f)))
        edit_weights(w)
        mx.save_safetensors(str(f), w, metadata={"format": "mlx"})
    return d


def _exact_decode_close(ours, rows, n=29, split=20) -> list[int]:
    """The row-exact decode of tokens split..n-1 after a prefill of the first `split` stays
    within 5% (of the largest logit) of the prefill's rows `rows` (from _equal_mlx_lm's prompt);
    returns that prompt."""
    ids = _prompt(ours.cfg.vocab_size, n, seed=n)
    c = ours.new_cache()
    ours.forward(mx.array([ids[:split]]), c, exact=False, logits=False)
    b = ours.forward(mx.array([ids[split:]]), c, exact=True, all_logits=True).astype(mx.float32)
    a = rows[split:].astype(mx.float32)
    assert mx.abs(a - b).max().item() / mx.abs(a).max().item() < 0.05
    return ids


def _equal_mlx_lm(path, n=29):
    import mlx_lm
    ours = load_model(path)
    ref, _ = mlx_lm.load(str(path))
    x = mx.array([_prompt(ours.cfg.vocab_size, n, seed=n)])
    last = ours.forward(x, ours.new_cache(), exact=False)
    assert mx.array_equal(last, mlx_lm_last_row_logits(ref, x)).item()
    rows = ours.forward(x, ours.new_cache(), exact=False, all_logits=True)
    if mx.default_device().type == mx.cpu:
        assert mx.array_equal(rows, ref(x)[0]).item()
    return ours, rows


@pytest.mark.parametrize("src", ["llama_hf_llama3_rope", "qwen3_mlx_4bit"])
def test_llama_attention_and_mlp_biases_equal_mlx_lm(checkpoints, tmp_path, src):
    """llama's attention_bias covers q, k, v and o; its mlp_bias gate, up and down (mlx-lm's
    llama). An o_proj bias used to be dropped silently (logits off by up to 7 against mlx-lm).
    The row-exact decode path carries the biases too."""
    rng = np.random.default_rng(4)

    def cfg(c):
        c.update(model_type="llama", attention_bias=True, mlp_bias=True)
        c.pop("head_dim", None) if c.get("head_dim") == c["hidden_size"] // c["num_attention_heads"] else None

    def weights(w):
        for name in [k[: -len(".weight")] for k in w if k.endswith("_proj.weight")]:
            rows = w[f"{name}.scales"].shape[0] if f"{name}.scales" in w else w[f"{name}.weight"].shape[0]
            dt = w[f"{name}.scales"].dtype if f"{name}.scales" in w else w[f"{name}.weight"].dtype
            w[f"{name}.bias"] = mx.array(rng.normal(size=rows).astype(np.float32) * 0.5).astype(dt)
        for k in [k for k in w if "q_norm" in k or "k_norm" in k]:
            del w[k]                                          # qwen3's, not llama's

    d = _with(checkpoints[src], tmp_path / "biased", cfg, weights)
    ours, rows = _equal_mlx_lm(d)
    assert ours.layers[0].o.bias is not None and ours.layers[0].down.bias is not None
    ids = _exact_decode_close(ours, rows)
    # without the biases the logits are far off: the test would catch them dropped
    bare = _with(checkpoints[src], tmp_path / "bare", cfg, lambda w: [w.pop(k) for k in
                 [k for k in w if "q_norm" in k or "k_norm" in k]])
    json_ = json.loads((bare / "config.json").read_text())
    json_.update(attention_bias=False, mlp_bias=False)
    (bare / "config.json").write_text(json.dumps(json_))
    x = mx.array([ids])
    far = load_model(bare).forward(x, load_model(bare).new_cache(), exact=False, all_logits=True)
    assert mx.abs(far.astype(mx.float32) - rows.astype(mx.float32)).max().item() > 0.1


@pytest.mark.parametrize("src", ["llama_hf_llama3_rope", "qwen2_mlx_4bit_tied"])
def test_tie_word_embeddings_absent_follows_the_weights(checkpoints, tmp_path, src, caplog):
    """Where config.json does not say, the head is tied exactly when there is no lm_head.weight:
    mlx-lm ties those (its llama / qwen2 default), and a checkpoint that has an lm_head uses it."""
    def no_key(c):
        c.pop("tie_word_embeddings", None)

    def no_head(w):
        for k in [k for k in w if k.startswith("lm_head.")]:
            del w[k]
    tied = _with(checkpoints[src], tmp_path / "tied", no_key, no_head)
    ours, _ = _equal_mlx_lm(tied)
    assert ours.cfg.tie_embeddings and ours.lm_head is ours.embed
    if src == "llama_hf_llama3_rope":          # has an lm_head: kept, untied, with a warning
        kept = _with(checkpoints[src], tmp_path / "kept", no_key)   # (mlx-lm 0.32 ties it)
        with caplog.at_level(logging.WARNING, logger="tensorfold"):
            m = load_model(kept)
        assert not m.cfg.tie_embeddings and m.lm_head is not m.embed
        assert any("tie_word_embeddings" in r.message for r in caplog.records)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("src,edit", [
    ("llama_hf_llama3_rope", dict(rope_traditional=True)),
    ("qwen2_mlx_4bit_tied", dict(rope_traditional=True)),
    ("qwen2_mlx_4bit_tied", dict(rope_theta=None)),                  # mlx-lm's qwen2 default: 1e6
    ("llama_hf_llama3_rope", dict(rope_scaling={"type": "linear", "rope_type": "llama3", "factor": 2.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16})),
    ("qwen3_mlx_4bit", dict(rope_scaling=YARN)),
    ("qwen2_mlx_4bit_tied", dict(rope_traditional=True, rope_scaling={
        "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 16})),
    ("llama_hf_llama3_rope", dict(rope_scaling=dict(YARN, mscale=0.7, mscale_all_dim=0.3))),
], ids=["llama-traditional", "qwen2-traditional", "qwen2-no-theta", "type-before-rope_type",
        "qwen3-yarn", "qwen2-yarn-traditional", "llama-yarn-mscale"])
def test_rope_variants_equal_mlx_lm(checkpoints, tmp_path, src, edit):
    """RoPE keys mlx-lm reads and TensorFold had not (each gave other logits with no error):
    rope_traditional (llama, qwen2), qwen2's rope_theta default (1e6), "type" read before
    "rope_type"; and yarn for the dense families (Qwen's long-context recipe; it was refused).
    Prefill equals mlx-lm bit for bit, the row-exact decode stays close, and each edit moves
    the logits (the test would see it ignored)."""
    def cfg(c):
        for k, v in edit.items():
            c.pop(k, None) if v is None else c.update({k: v})
    d = _with(checkpoints[src], tmp_path / "edited", cfg)
    ours, rows = _equal_mlx_lm(d)
    ids = _exact_decode_close(ours, rows)
    base = load_model(checkpoints[src])
    plain = base.forward(mx.array([ids]), base.new_cache(), exact=False, all_logits=True)
    assert mx.abs(plain.astype(mx.float32) - rows.astype(mx.float32)).max().item() > 0.01


MIXED_DTYPE_CASES = {   # checkpoint, which of its float tensors are stored as float32
    "llama norms": ("llama_hf_llama3_rope", lambda k: "norm" in k),
    "qwen3 4-bit q/k norms": ("qwen3_mlx_4bit", lambda k: "q_norm" in k or "k_norm" in k),
    "llama v_proj": ("llama_hf_llama3_rope", lambda k: "v_proj" in k),
    "qwen3_moe 4-bit norms": ("qwen3_moe_mlx_4bit", lambda k: "norm" in k),
}


@pytest.mark.parametrize("case", list(MIXED_DTYPE_CASES))
def test_mixed_float_dtypes_equal_mlx_lm(checkpoints, tmp_path, case):
    """A bf16 checkpoint with some float32 tensors (norms, as a transformers-5 checkpoint that
    mlx_lm.convert did not cast keeps them): MLX's ops promote q, k, v and the residual stream to
    float32, and mlx-lm's cache keeps them so. The cache was the embedding's bf16, which rounded
    them (logits up to 0.07 off, no error). Prefill equals mlx-lm bit for bit; the row-exact
    decode stays close."""
    src, pick = MIXED_DTYPE_CASES[case]

    def weights(w):
        for k in list(w):
            if pick(k) and w[k].dtype == mx.bfloat16:
                w[k] = w[k].astype(mx.float32)
    d = _with(checkpoints[src], tmp_path / "mixed", edit_weights=weights)
    ours, rows = _equal_mlx_lm(d)
    assert ours.dtype == mx.float32 and load_model(checkpoints[src]).dtype == mx.bfloat16
    _exact_decode_close(ours, rows)


def test_llama_sliding_window_layers_are_refused(checkpoints, tmp_path):
    """mlx-lm's llama masks "sliding_attention" layers to sliding_window; here every layer saw
    the whole context (other logits, no error). Refused until supported; all-full layer_types load."""
    src = checkpoints["llama_hf_llama3_rope"]
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    bad = _with(src, tmp_path / "sliding", lambda c: c.update(
        layer_types=["sliding_attention"] + ["full_attention"] * (n - 1), sliding_window=8))
    with pytest.raises(CheckpointError, match="sliding"):
        load_model(bad)
    _equal_mlx_lm(_with(src, tmp_path / "full", lambda c: c.update(layer_types=["full_attention"] * n)))


def test_mixed_recipe_null_group_sizes_load_as_mlx_lm_does(checkpoints, tmp_path):
    """mlx-lm's mixed recipes (convert --quant-predicate mixed_3_6) write each layer's entry as
    {"group_size": null, "bits": b, "mode": "affine"}: null is MLX affine's default group, 64."""
    def cfg(c):
        for key in ("quantization", "quantization_config"):
            q = c.get(key)
            if isinstance(q, dict):
                for v in q.values():
                    if isinstance(v, dict) and v.get("group_size") == 64:
                        v.update(group_size=None, mode="affine")
    d = _with(checkpoints["qwen3_mlx_mixed"], tmp_path / "nulls", cfg)
    q = json.loads((d / "config.json").read_text())["quantization"]
    assert q["model.layers.0.mlp.down_proj"]["group_size"] is None
    ours, _ = _equal_mlx_lm(d)
    assert ours.cfg.quant_for("model.layers.0.mlp.down_proj") == (64, 8)
    bad = _with(checkpoints["qwen3_mlx_mixed"], tmp_path / "mx", lambda c: c["quantization"][
        "model.layers.0.mlp.down_proj"].update(mode="mxfp4"))
    with pytest.raises(CheckpointError, match="mode 'mxfp4' for model.layers.0.mlp.down_proj"):
        load_model(bad)


def test_quantized_module_without_its_own_entry_reads_its_tensors(checkpoints, tmp_path):
    """A 4-bit group-64 checkpoint whose lm_head is 8-bit group 32 with no lm_head entry in
    config.json: mlx-lm 0.32 takes such a module's bits and group size from its tensors
    (infer_quant_config), and so does the loader now (it refused the checkpoint). Tensors of no
    supported quantization are still refused."""
    src = checkpoints["qwen3_mlx_4bit"]
    q = json.loads((src / "config.json").read_text())["quantization"]
    assert "lm_head" not in q and (q["group_size"], q["bits"]) == (64, 4)

    def head8(w):
        full = mx.dequantize(w["lm_head.weight"], w["lm_head.scales"], w["lm_head.biases"], 64, 4)
        w["lm_head.weight"], w["lm_head.scales"], w["lm_head.biases"] = mx.quantize(full, 32, 8)
    d = _with(src, tmp_path / "head8", edit_weights=head8)
    ours, _ = _equal_mlx_lm(d)
    assert (ours.lm_head.group_size, ours.lm_head.bits) == (32, 8)

    def head7(w):          # 7-bit widths (no such MLX affine quantization)
        w["lm_head.weight"] = mx.zeros((w["lm_head.weight"].shape[0], ours.cfg.hidden_size * 7 // 32), mx.uint32)
    with pytest.raises(CheckpointError, match="no supported quantization"):
        load_model(_with(src, tmp_path / "head7", edit_weights=head7))


def test_info_leaves_modules_nn_quantize_skips_unquantized(tmp_path):
    """mlx-lm's convert quantizes a module only where its input width is a multiple of the group
    size (nn.quantize's rule) and writes no entry for the others: `info` reports them as float."""
    from tensorfold.models.config import ModelConfig
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 1, "intermediate_size": 256, "vocab_size": 512,
        "tie_word_embeddings": False, "quantization": {"group_size": 128, "bits": 4}}))
    cfg = ModelConfig.from_dir(d)
    assert cfg.quant_for("model.layers.0.self_attn.q_proj") is None          # K = 64
    assert cfg.quant_for("model.layers.0.mlp.down_proj") == (128, 4)         # K = 256
    rows = dict((line[:30].strip(), line[30:].strip())
                for line in describe(d).splitlines())
    assert rows["weights: attention"] == "bfloat16"
    assert rows["weights: mlp"] == "4-bit/g128, bfloat16"                     # down; gate / up


def test_what_mlx_lm_drops_is_not_refused(checkpoints, tmp_path):
    """Unused tensors are refused (test_bad_checkpoints_give_one_clear_error), less what mlx-lm's
    sanitize drops before its strict load: precomputed RoPE frequencies and a tied model's
    lm_head. With both added the checkpoint loads and equals mlx-lm."""
    def add(w):
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
        w["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,), mx.float32)
    _equal_mlx_lm(_with(checkpoints["qwen2_mlx_4bit_tied"], tmp_path / "m", edit_weights=add))


def _logits(path, n=17):
    m = load_model(path)
    return m.forward(mx.array([_prompt(m.cfg.vocab_size, n, seed=3)]), m.new_cache(), exact=False,
                     all_logits=True)


@pytest.mark.parametrize("src, scaling, nulls", [
    ("qwen3_mlx_4bit", dict(type="yarn", factor=4.0, original_max_position_embeddings=16),
     ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")),
    ("llama_hf_llama3_rope", None, ("low_freq_factor", "high_freq_factor")),
], ids=["yarn", "llama3"])
def test_null_rope_scaling_keys_read_as_absent(checkpoints, tmp_path, src, scaling, nulls):
    """A rope_scaling key set to null is the key left out (transformers reads `get(key) or
    default`): yarn's beta_fast / mscale and llama3's factors were compared and multiplied as
    None, a TypeError at load ("'>' not supported between 'NoneType' and 'int'")."""
    if scaling is None:
        scaling = json.loads((checkpoints[src] / "config.json").read_text())["rope_scaling"]
    plain = {k: v for k, v in scaling.items() if k not in nulls}
    a = _with(checkpoints[src], tmp_path / "a", lambda c: c.update(rope_scaling=plain))
    b = _with(checkpoints[src], tmp_path / "b",
              lambda c: c.update(rope_scaling=dict(plain, **{k: None for k in nulls})))
    assert mx.array_equal(_logits(a), _logits(b)).item()


def test_rope_parameters_mlx_lm_ignores_are_said(checkpoints, tmp_path, caplog):
    """transformers 5 writes RoPE under rope_parameters and may keep rope_theta at the top level
    (tinycode's config.json has both). mlx-lm 0.32's llama reads only the top-level keys, so a
    llama3 scaling under rope_parameters is read here (the checkpoint's RoPE) and said, with
    rope_theta at the top level too (the warning needed both absent); qwen3, whose mlx-lm reads
    rope_parameters, gets no warning."""
    def nest(c):
        c["rope_parameters"] = dict(c.pop("rope_scaling"), rope_theta=c["rope_theta"])
    d = _with(checkpoints["llama_hf_llama3_rope"], tmp_path / "llama", nest)
    with caplog.at_level(logging.WARNING, logger="tensorfold"):
        assert mx.array_equal(_logits(d), _logits(checkpoints["llama_hf_llama3_rope"])).item()
    assert "rope_parameters (mlx-lm 0.32's llama ignores it" in caplog.text
    caplog.clear()
    q = _with(checkpoints["qwen3_mlx_4bit"], tmp_path / "qwen3",
              lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}))
    with caplog.at_level(logging.WARNING, logger="tensorfold"):
        load_model(q)
    assert "rope_parameters" not in caplog.text
