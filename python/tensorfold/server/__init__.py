"""OpenAI-compatible HTTP server: `create_app(engine, ...)` and the engine worker thread.

Loaded when first named, so that the server's pure parts (protocol, responses, choices) import
without the web stack: a GPU image without fastapi can still run the tests that use them."""

__all__ = ["create_app", "EngineWorker"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "EngineWorker":
        from .worker import EngineWorker
        return EngineWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
