"""`tensorfold info`: describe a checkpoint from its config.json alone."""

from __future__ import annotations

from collections import OrderedDict

from .config import ModelConfig


def _kind(module: str) -> str:
    if module == "model.embed_tokens":
        return "embedding"
    if module == "lm_head":
        return "lm_head"
    if ".switch_mlp." in module:
        return "experts"
    if module.endswith(".mlp.gate"):
        return "router"
    if ".indexer." in module:
        return "indexer"
    return "attention" if ".self_attn." in module else "mlp"


def quant_summary(cfg: ModelConfig) -> "OrderedDict[str, str]":
    kinds: "OrderedDict[str, set]" = OrderedDict()
    for name in list(cfg.linear_shapes()) + list(cfg.expert_shapes()) + list(cfg.multilinear_shapes()):
        q = cfg.quant_for(name)
        kinds.setdefault(_kind(name), set()).add(
            f"{q[1]}-bit/g{q[0]}" if q else cfg.dtype)
    return OrderedDict((k, ", ".join(sorted(v))) for k, v in kinds.items())


def _count(n: int) -> str:
    return f"{n:,} ({n / 1e9:.2f}B)" if n >= 1e8 else f"{n:,}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def describe(path) -> str:
    """A human-readable description; raises CheckpointError for what we cannot serve."""
    cfg = ModelConfig.from_dir(path)
    rows = [
        ("path", str(cfg.path)),
        ("family", cfg.family),
        ("layers", cfg.num_layers),
        ("hidden size", cfg.hidden_size),
        ("attention heads", cfg.num_heads),
        ("KV heads", "1 (MLA latent)" if cfg.is_dsa else cfg.num_kv_heads),
        ("head dim", cfg.head_dim),
        ("intermediate size", cfg.intermediate_size),
    ]
    if cfg.is_dsa:
        rows += [
            ("MLA", f"q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, nope {cfg.qk_nope_head_dim} "
                    f"+ rope {cfg.qk_rope_head_dim}, v {cfg.v_head_dim}"),
            ("indexer", f"{cfg.index_n_heads} heads x {cfg.index_head_dim}, top-{cfg.index_topk} keys "
                        "(sparse attention past that)"),
        ]
        if cfg.is_moe:
            rows += [("routing", f"sigmoid + correction bias, {cfg.topk_group} of {cfg.n_group} groups, "
                                 f"scale {cfg.routed_scaling_factor}, {cfg.n_shared_experts} shared expert(s)")]
    if cfg.is_moe:
        moe = [i for i in range(cfg.num_layers) if cfg.moe_layer(i)]
        rows += [
            ("experts", f"{cfg.num_experts} ({cfg.num_experts_per_tok} per token)"),
            ("active experts", f"{cfg.num_experts_per_tok} of {cfg.num_experts}"
                               f"{', renormalised' if cfg.norm_topk_prob else ''}"),
            ("expert intermediate size", cfg.moe_intermediate_size),
            ("MoE layers", f"{len(moe)} of {cfg.num_layers}"
                           + (f" (dense MLP: {', '.join(str(i) for i in range(cfg.num_layers) if i not in moe)})"
                              if len(moe) < cfg.num_layers else "")),
        ]
    rows += [
        ("vocab", cfg.vocab_size),
        ("max positions", cfg.max_position),
        ("tied embeddings", "yes" if cfg.tie_embeddings else "no"),
        ("dtype", cfg.dtype),
    ]
    for kind, q in quant_summary(cfg).items():
        rows.append((f"weights: {kind}", q))
    params = cfg.param_count()
    rows.append(("parameters", _count(params)))
    if cfg.is_moe:
        active = cfg.active_param_count()
        rows.append(("active parameters", f"{_count(active)} per token"))
    rows += [
        ("memory: weights", _gib(cfg.weight_bytes())),
        ("memory: KV cache, 32k tokens", _gib(cfg.kv_bytes(32768))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
