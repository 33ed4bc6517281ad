"""Checkpoints: our prefill logits equal mlx-lm's; info from config.json alone; bad checkpoints."""

from __future__ import annotations

import gc
import json
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
    if breakage not in ("no-config", "bad-json"):
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


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
