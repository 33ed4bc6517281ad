"""TensorFold: an exact, fast LLM server on MLX."""

import mlx.core as _mx  # noqa: F401  (loads libmlx before the native extension)

__version__ = "0.1.0"
