"""Benchmark checkpoints of real model shapes, random weights, written tensor by tensor.

    python bench/shapes.py qwen3-8b-4bit /tmp/q8b       # Qwen3-8B shapes, MLX affine 4-bit g64

Weights are drawn with mx.random on the default device (fast on a GPU) and quantized per tensor,
so peak host memory stays near one tensor. The tokenizer is tensorfold.testing's small BPE; the
config's vocab is the real one (rows past the tokenizer are simply never produced by it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

SHAPES = {
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                     vocab=151936),
    "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                       vocab=151936),
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=32768),
}


def random_linear(shape, std, bits, group_size):
    """A random bf16 weight of `shape`, MLX-affine quantized when `bits` is set."""
    w = (mx.random.normal(shape) * std).astype(mx.bfloat16)
    if not bits:
        return {"weight": w}
    q, sc, b = mx.quantize(w, group_size=group_size, bits=bits)
    return {"weight": q, "scales": sc, "biases": b}


class ShardWriter:
    """Tensors written in ~1 GiB safetensors shards as they are made, plus the index."""

    def __init__(self, out: Path):
        self.out, self.shard, self.n, self.index = Path(out), {}, 0, {}

    def put(self, prefix: str, tensors: dict) -> None:
        for k, v in tensors.items():
            self.shard[f"{prefix}.{k}" if prefix else k] = v
        mx.eval(list(self.shard.values()))

    def flush(self, final: bool = False) -> None:
        if self.shard and (final or sum(a.nbytes for a in self.shard.values()) > 2**30):
            self.n += 1
            fname = f"model-{self.n:05d}.safetensors"
            mx.save_safetensors(str(self.out / fname), self.shard, metadata={"format": "mlx"})
            self.index.update({k: fname for k in self.shard})
            self.shard = {}

    def finish(self, norms: dict) -> None:
        self.put("", norms)
        self.flush(final=True)
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": self.index}))


def layer_norms(p: str, d: int, hd: int) -> dict:
    return {f"{p}.{nm}.weight": mx.ones((size,), mx.bfloat16)
            for nm, size in (("input_layernorm", d), ("post_attention_layernorm", d),
                             ("self_attn.q_norm", hd), ("self_attn.k_norm", hd))}


def write(name: str, out: Path, bits: int | None = 4, group_size: int = 64, seed: int = 0,
          layers: int | None = None) -> Path:
    from tensorfold.testing import write_checkpoint

    s = dict(SHAPES[name])
    if layers:
        s["layers"] = layers
    out = Path(out)
    # tokenizer, template, generation config from the tiny generator; we overwrite config + weights
    write_checkpoint(out, family="qwen3", layout="hf", hidden=64, layers=1, heads=2, kv_heads=1,
                     intermediate=64)
    for f in out.glob("*.safetensors"):
        f.unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
               num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
               intermediate_size=s["intermediate"], vocab_size=s["vocab"], tie_word_embeddings=False,
               max_position_embeddings=131072)
    if bits:
        cfg["quantization"] = cfg["quantization_config"] = {"group_size": group_size, "bits": bits,
                                                            "mode": "affine"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.random.seed(seed)
    d, hd = s["hidden"], s["head_dim"]

    lin = lambda o, i, std: random_linear((o, i), std, bits, group_size)  # noqa: E731
    w = ShardWriter(out)
    w.put("model.embed_tokens", lin(s["vocab"], d, 1.0))
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        w.put(f"{p}.self_attn.q_proj", lin(s["heads"] * hd, d, d ** -0.5))
        w.put(f"{p}.self_attn.k_proj", lin(s["kv_heads"] * hd, d, d ** -0.5))
        w.put(f"{p}.self_attn.v_proj", lin(s["kv_heads"] * hd, d, d ** -0.5))
        w.put(f"{p}.self_attn.o_proj", lin(d, s["heads"] * hd, (s["heads"] * hd) ** -0.5 / 4))
        w.put(f"{p}.mlp.gate_proj", lin(s["intermediate"], d, d ** -0.5))
        w.put(f"{p}.mlp.up_proj", lin(s["intermediate"], d, d ** -0.5))
        w.put(f"{p}.mlp.down_proj", lin(d, s["intermediate"], s["intermediate"] ** -0.5 / 4))
        w.put("", layer_norms(p, d, hd))
        w.flush()
    w.put("lm_head", lin(s["vocab"], d, d ** -0.5 * 4))
    w.finish({"model.norm.weight": mx.ones((d,), mx.bfloat16)})
    return out


def cached(name: str, root: Path = Path("/tmp/tf-ckpt"), layers: int | None = None) -> Path:
    """`name` ("qwen3-8b-4bit", "small-bf16", or a bench_moe.py shape: "qwen3-30b-a3b-4bit",
    "moe-small-4bit") written once under root and reused: benchmark scripts of one device
    session share a checkpoint instead of drawing it again."""
    out = Path(root) / (name + (f"-{layers}l" if layers else ""))
    if not (out / "model.safetensors.index.json").exists():   # written last by ShardWriter.finish
        base = name.removesuffix("-4bit").removesuffix("-bf16")
        if base in SHAPES:
            write(base, out, bits=None if name.endswith("-bf16") else 4, layers=layers)
        else:   # a qwen3_moe shape of bench_moe.py ("qwen3-30b-a3b", "moe-small"), 4-bit
            from bench_moe import write_moe
            write_moe(base.removeprefix("moe-"), out, layers=layers)
    return out


if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    bits = None if name.endswith("-bf16") else 4
    base = name.removesuffix("-bf16").removesuffix("-4bit")
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
    print(write(base, Path(out), bits=bits, layers=layers))
