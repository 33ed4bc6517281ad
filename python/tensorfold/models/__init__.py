"""Model families on a small shared base. Imports go one way: models -> kernels."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .config import ModelConfig
from .dense import DenseModel
from .loader import TrackedWeights, load_weights
from .moe import MoEModel
from ..errors import CheckpointError
from .dsa import DSAModel

__all__ = ["ModelConfig", "DenseModel", "MoEModel", "DSAModel", "load_model"]


def load_model(path) -> DenseModel:
    """Load a checkpoint directory (config validated first, then the weights, evaluated).

    Dispatches on model_type: llama / qwen2 / qwen3 -> DenseModel, qwen3_moe -> MoEModel,
    deepseek_v32 -> DSAModel."""
    cfg = ModelConfig.from_dir(Path(path))
    weights = TrackedWeights(load_weights(cfg.path))
    if cfg.is_dsa:
        model = DSAModel(cfg, weights)
    else:
        model = MoEModel(cfg, weights) if cfg.is_moe else DenseModel(cfg, weights)
    unused = weights.unused(cfg)
    if unused:
        # mlx-lm refuses them too ("parameters not in model"): served, they would be a silent
        # other model (a layer past num_hidden_layers, a qwen3's q_norm under model_type llama)
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise CheckpointError(f"{cfg.path}: {len(unused)} tensor(s) not used by a {cfg.family} model "
                              f"with this config.json: {', '.join(unused[:5])}{more}")
    # evaluated here, on the loading thread (as mlx-lm's load does): a weight left as a graph (a
    # lazy load, a slice of a fused projection, a cast) belongs to this thread's stream, and MLX's
    # streams are per thread, so an engine built on one thread failed every request served on
    # another ("There is no Stream(cpu, 0) in current thread": create_app(Engine(...)))
    mx.eval(model.parameters())
    return model
