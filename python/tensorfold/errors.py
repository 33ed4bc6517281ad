"""Errors that carry an OpenAI-style shape (message, type, param, code)."""

from __future__ import annotations


class TensorFoldError(Exception):
    """Base class: a clear, one-line error a user can act on."""


class CheckpointError(TensorFoldError):
    """A model directory that cannot be loaded (missing file, shape mismatch, unsupported)."""


class RequestError(TensorFoldError):
    """A request that cannot be served as asked; maps to an HTTP 4xx."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        # a 400 naming its parameter without a code of its own (the engine's argument checks) has the
        # code the request parser gives such errors, so one error does not come in two shapes
        self.code = "invalid_value" if code is None and param is not None and status == 400 else code
        self.type = type
        self.status = status

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}
