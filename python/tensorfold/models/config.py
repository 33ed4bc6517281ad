"""Model configuration read from a checkpoint's config.json, validated before any weight is touched."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError

DENSE_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_BITS = {2, 3, 4, 5, 6, 8}
SUPPORTED_GROUPS = {32, 64, 128}
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class ModelConfig:
    path: Path
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: str
    quantization: dict | None          # {"group_size", "bits", <module path>: {...} | False}
    raw: dict = field(repr=False, default_factory=dict)

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"model directory not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: no config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{cfg_file}: expected a JSON object")
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, path: Path) -> "ModelConfig":
        mt = raw.get("model_type")
        if mt not in DENSE_FAMILIES:
            raise CheckpointError(
                f"unsupported model_type {mt!r} (supported: {', '.join(sorted(DENSE_FAMILIES))})")

        def need(key, typ=int):
            if key not in raw:
                raise CheckpointError(f"config.json: missing {key!r}")
            v = raw[key]
            if typ is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise CheckpointError(f"config.json: {key!r} must be a positive integer, got {v!r}")
            return v

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = raw.get("head_dim") or hidden // heads
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling") or (rope_params if rope_params else None)
        if rope_scaling:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype not in ("default", "linear", "llama3"):
                raise CheckpointError(f"unsupported rope_scaling type {rtype!r}")
            if rtype == "default":
                rope_scaling = None
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        if dtype not in DTYPES:
            raise CheckpointError(f"unsupported dtype {dtype!r}")
        quant = raw.get("quantization")
        if quant is not None:
            cls._check_quant(quant)
        family = DENSE_FAMILIES[mt]
        return cls(
            path=path, family=family, hidden_size=hidden, num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            rope_scaling=rope_scaling, max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", family != "llama" and False)),
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3", dtype=dtype, quantization=quant, raw=raw)

    @staticmethod
    def _check_quant(q):
        if not isinstance(q, dict):
            raise CheckpointError("config.json: 'quantization' must be an object")
        mode = q.get("mode", "affine")
        if mode != "affine":
            raise CheckpointError(f"unsupported quantization mode {mode!r} (only MLX affine)")
        entries = [("default", q)] + [(k, v) for k, v in q.items() if isinstance(v, dict)]
        for name, e in entries:
            bits, gs = e.get("bits"), e.get("group_size")
            if bits not in SUPPORTED_BITS:
                raise CheckpointError(f"unsupported quantization bits {bits!r} for {name}")
            if gs not in SUPPORTED_GROUPS:
                raise CheckpointError(f"unsupported quantization group_size {gs!r} for {name}")

    def quant_for(self, module: str):
        """(group_size, bits) for a module path like 'model.layers.0.mlp.down_proj', or None."""
        q = self.quantization
        if not q:
            return None
        own = q.get(module)
        if own is False:
            return None
        if isinstance(own, dict):
            return own["group_size"], own["bits"]
        return q["group_size"], q["bits"]

    # ---- module inventory (shapes as stored before quantization) -------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Every matmul weight as (out, in), by module path."""
        d, hd = self.hidden_size, self.head_dim
        out = {}
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            out[f"{p}.self_attn.q_proj"] = (self.num_heads * hd, d)
            out[f"{p}.self_attn.k_proj"] = (self.num_kv_heads * hd, d)
            out[f"{p}.self_attn.v_proj"] = (self.num_kv_heads * hd, d)
            out[f"{p}.self_attn.o_proj"] = (d, self.num_heads * hd)
            out[f"{p}.mlp.gate_proj"] = (self.intermediate_size, d)
            out[f"{p}.mlp.up_proj"] = (self.intermediate_size, d)
            out[f"{p}.mlp.down_proj"] = (d, self.intermediate_size)
        out["model.embed_tokens"] = (self.vocab_size, d)
        if not self.tie_embeddings:
            out["lm_head"] = (self.vocab_size, d)
        return out

    def param_count(self) -> int:
        n = sum(a * b for a, b in self.linear_shapes().values())
        n += self.num_layers * 2 * self.hidden_size + self.hidden_size
        if self.attention_bias:
            n += self.num_layers * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.qk_norm:
            n += self.num_layers * 2 * self.head_dim
        return n

    def weight_bytes(self) -> int:
        elt = DTYPES[self.dtype]
        total = 0
        for name, (o, i) in self.linear_shapes().items():
            q = self.quant_for(name)
            if q is None:
                total += o * i * elt
            else:
                gs, bits = q
                total += o * i * bits // 8 + 2 * (o * (i // gs)) * elt
        return total + (self.param_count() - sum(a * b for a, b in self.linear_shapes().values())) * elt

    def kv_bytes(self, tokens: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * tokens * DTYPES[self.dtype]
