"""Typed errors the engine raises for bad or unservable requests.

The Serve edge maps them to HTTP: `InvalidRequestError` (and its subclass
`ContextLengthExceededError`) -> 400, `EngineOverloadedError` and `EngineUnhealthyError` -> 503 with
`Retry-After`.
"""
from __future__ import annotations

import torch


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is malformed (bad ids, bad sampling values, duplicate id, ...)."""


class ContextLengthExceededError(InvalidRequestError):
    """The request needs more positions than `max_model_len` or than the whole KV cache holds."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the caller should retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnhealthyError(EngineError):
    """The engine can serve no more requests (`Engine.check_health` says why): its step thread stopped, a step
    failed with a device error, too many steps failed in a row, or one step has run past its timeout. Serve's
    health check raises it, and Serve replaces the replica."""


def is_device_error(exc: BaseException) -> bool:
    """A failure of the device itself: a CUDA error (torch.AcceleratorError, or a Triton launch that reports
    one), after which the process's CUDA context is unusable and every later call would fail too. Running
    out of memory is not one: the next step may fit."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    text = str(exc)
    return isinstance(exc, torch.AcceleratorError) or "CUDA error" in text or "Triton Error [CUDA]" in text
