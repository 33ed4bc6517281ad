"""Model families on a small shared base. Imports go one way: models -> kernels."""

from __future__ import annotations

from pathlib import Path

from .config import ModelConfig
from .dense import DenseModel
from .loader import load_weights
from .moe import MoEModel
from .dsa import DSAModel

__all__ = ["ModelConfig", "DenseModel", "MoEModel", "DSAModel", "load_model"]


def load_model(path) -> DenseModel:
    """Load a checkpoint directory (config validated first, weights mapped lazily).

    Dispatches on model_type: llama / qwen2 / qwen3 -> DenseModel, qwen3_moe -> MoEModel,
    deepseek_v32 -> DSAModel."""
    cfg = ModelConfig.from_dir(Path(path))
    weights = load_weights(cfg.path)
    if cfg.is_dsa:
        return DSAModel(cfg, weights)
    return MoEModel(cfg, weights) if cfg.is_moe else DenseModel(cfg, weights)
