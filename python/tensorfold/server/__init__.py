"""OpenAI-compatible HTTP server: `create_app(engine, ...)` and the engine worker thread."""

from .app import create_app
from .worker import EngineWorker

__all__ = ["create_app", "EngineWorker"]
