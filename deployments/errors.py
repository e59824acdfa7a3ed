"""OpenAI-style errors: one exception type at the edge, its JSON body, and the mapping from engine errors.

Deployments below the ingress never raise across a Ray hop for expected failures: they yield an
error event (`error_event`), which the ingress turns back into an `ApiError` (`ApiError.from_event`).
That keeps the HTTP status independent of how Ray wraps remote exceptions.
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.responses import JSONResponse

from runtime.errors import (
    ContextLengthExceededError,
    EngineOverloadedError,
    EngineUnhealthyError,
    InvalidRequestError,
)

RETRY_AFTER_S = 1.0  # Retry-After of a 503 whose caller names none


class ApiError(Exception):
    """An error that becomes an HTTP response `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, kind: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind  # the `kind` tag of the moss_errors metric
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        """A JSON response with the status and, for overload, a Retry-After header (whole seconds)."""
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def to_event(self) -> dict[str, Any]:
        """The error as a stream event (a plain dict crosses Ray hops without custom pickling)."""
        return {"type": "error", "status": self.status, "message": self.message, "kind": self.kind,
                "error_type": self.type, "param": self.param, "code": self.code,
                "retry_after_s": self.retry_after_s}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> ApiError:
        """Inverse of `to_event`."""
        return cls(event["status"], event["message"], kind=event["kind"], type=event["error_type"],
                   param=event["param"], code=event["code"], retry_after_s=event["retry_after_s"])

    @classmethod
    def from_validation(cls, exc: ValidationError, prefix: str = "") -> ApiError:
        """A 400 naming the first offending field, e.g. `top_p: Input should be less than or equal to 1`;
        `prefix`: where the validated object sits in the body (`messages.0.content.1`)."""
        first = exc.errors()[0]
        loc = ".".join([prefix] * bool(prefix) + [str(part) for part in first.get("loc", ())])
        message = first.get("msg", "invalid request")
        message = message.removeprefix("Value error, ")
        return cls(400, f"{loc}: {message}" if loc else message, kind="invalid_request",
                   param=loc or None, code="invalid_value")


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """A 400 `invalid_request_error`."""
    return ApiError(400, message, kind="invalid_request", param=param, code=code)


def overloaded(message: str, retry_after_s: float) -> ApiError:
    """A 503 with Retry-After."""
    return ApiError(503, message, kind="overloaded", type="server_overloaded_error",
                    code="server_overloaded", retry_after_s=retry_after_s)


def timeout_error(message: str) -> ApiError:
    """A 504: the server gave up on a request (deadline or idle stream)."""
    return ApiError(504, message, kind="timeout", type="timeout_error", code="timeout")


def internal_error(message: str) -> ApiError:
    """A 500 for anything unexpected; the message is the exception text only."""
    return ApiError(500, message, kind="internal", type="server_error", code="internal_error")


def serve_over_capacity(exc: BackPressureError | DeploymentUnavailableError, retry_after_s: float) -> ApiError:
    """A 503 for a Serve handle call that Serve itself refused (a full queue, no replica yet): Retry-After is
    the error's own hint where Serve gives one, else `retry_after_s`."""
    hint = getattr(exc, "retry_after_s", None)
    return overloaded(f"server over capacity: {exc}", hint if hint is not None else retry_after_s)


def error_event(exc: BaseException, *, retry_after_s: float = RETRY_AFTER_S,
                prompt_param: str = "input") -> dict[str, Any]:
    """Map an exception raised by the engine, the vocoder or a Serve handle call to an error event.
    `prompt_param`: the request field a too-long prompt came from (speech: input; chat: messages)."""
    if isinstance(exc, ApiError):
        return exc.to_event()
    if isinstance(exc, EngineOverloadedError):
        return overloaded(str(exc), exc.retry_after_s).to_event()
    if isinstance(exc, EngineUnhealthyError):  # this replica is being replaced: another one, or a retry, serves
        return overloaded(f"server unavailable: {exc}", retry_after_s).to_event()
    if isinstance(exc, BackPressureError | DeploymentUnavailableError):  # Serve's own queues are full
        return serve_over_capacity(exc, retry_after_s).to_event()
    if isinstance(exc, ContextLengthExceededError):
        return ApiError(400, str(exc), kind="context_length", code="context_length_exceeded",
                        param=prompt_param).to_event()
    if isinstance(exc, InvalidRequestError):  # not any ValueError: one from a server fault is a 500
        return bad_request(str(exc)).to_event()
    return internal_error(f"{type(exc).__name__}: {exc}").to_event()
