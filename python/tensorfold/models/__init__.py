"""Model families on a small shared base. Imports go one way: models -> kernels."""

from __future__ import annotations

from pathlib import Path

from .config import ModelConfig
from .dense import DenseModel
from .loader import load_weights
from .moe import MoEModel

__all__ = ["ModelConfig", "DenseModel", "MoEModel", "load_model"]


def load_model(path) -> DenseModel:
    """Load a checkpoint directory (config validated first, weights mapped lazily).

    Dispatches on model_type: llama / qwen2 / qwen3 -> DenseModel, qwen3_moe -> MoEModel."""
    cfg = ModelConfig.from_dir(Path(path))
    weights = load_weights(cfg.path)
    return MoEModel(cfg, weights) if cfg.is_moe else DenseModel(cfg, weights)
