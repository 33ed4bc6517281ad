"""Generation engine. Imports go one way: server -> engine -> models -> kernels."""

from ..errors import RequestError
from .engine import Engine
from .prefill import PrefillMode
from .types import GenerationEvent, GenerationStats, Prompt, SamplingParams

__all__ = ["Engine", "PrefillMode", "GenerationEvent", "GenerationStats", "Prompt", "SamplingParams",
           "RequestError"]
