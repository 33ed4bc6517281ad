"""Model families on a small shared base. Imports go one way: models -> kernels."""

from __future__ import annotations

from pathlib import Path

from .config import ModelConfig
from .dense import DenseModel
from .loader import load_weights

__all__ = ["ModelConfig", "DenseModel", "load_model"]


def load_model(path) -> DenseModel:
    """Load a checkpoint directory (config validated first, weights mapped lazily)."""
    cfg = ModelConfig.from_dir(Path(path))
    weights = load_weights(cfg.path)
    return DenseModel(cfg, weights)
