"""TensorFold: an exact, fast LLM server on MLX."""

__version__ = "0.1.0"
