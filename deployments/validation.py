"""Parse and check an HTTP body into the request dict the deployments pass along; touches no model.

Every failure is an `ApiError` with a 4xx status; the ingress answers it without calling a deployment.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from deployments.errors import ApiError, bad_request
from deployments.schemas import ChatCompletionRequest, SpeechRequest
from runtime.prompts import READ_ALOUD_PROMPT


def parse_json_body(body: bytes, schema: type[BaseModel]) -> Any:
    """JSON bytes -> schema instance; malformed JSON, non-objects and schema errors become 400s."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested thousands deep: the parser's recursion limit
        raise bad_request("request body nests arrays or objects too deeply", code="invalid_json") from None
    except ValueError as exc:  # NaN / Infinity literals
        raise bad_request(str(exc), code="invalid_value") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    where = _lone_surrogate(data)
    if where is not None:  # legal JSON (a "\\ud83d" escape), but no text: the tokenizer cannot take it
        raise bad_request(f"{where or 'a key'}: text holds a lone UTF-16 surrogate (half of an escaped pair)",
                          param=where or None, code="invalid_value")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ApiError.from_validation(exc) from None


def _lone_surrogate(data: Any) -> str | None:
    """The path (`messages.0.content`, as the schema errors name fields) of the first string, key or value,
    that is not valid Unicode text ("" for a key at the top), or None. Iterative: bodies may nest as deep as
    the parser allowed."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_text(key):
                    return path
                todo.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            todo.extend((f"{path}.{i}", item) for i, item in enumerate(value))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed in the request")


class Limits:
    """Server settings the checks need: served model name, known voices and size limits."""

    def __init__(self, *, served_model_name: str, voices: list[str], max_input_chars: int,
                 max_new_tokens_limit: int, default_max_new_tokens: int) -> None:
        self.served_model_name = served_model_name
        self.voices = voices
        self.max_input_chars = max_input_chars
        self.max_new_tokens_limit = max_new_tokens_limit
        self.default_max_new_tokens = default_max_new_tokens

    def check_model(self, model: str) -> None:
        """404 `model_not_found` unless `model` is the served name."""
        if model != self.served_model_name:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", kind="invalid_request", param="model",
                           code="model_not_found")

    def check_voice(self, voice: str, param: str) -> None:
        """400 for a voice the vocoder does not have."""
        if voice not in self.voices:
            raise bad_request(f"unknown voice {voice!r}; available voices: {', '.join(self.voices)}",
                              param=param, code="invalid_voice")

    def check_text(self, text: str, param: str) -> None:
        """400 when the text is longer than `max_input_chars`."""
        if len(text) > self.max_input_chars:
            raise bad_request(f"{param} is {len(text)} characters long; the limit is "
                              f"{self.max_input_chars}", param=param, code="input_too_long")

    def max_new_tokens(self, requested: int | None, min_new_tokens: int | None) -> int:
        """The request's token budget: the client's value within the limit, else the default."""
        if requested is not None and requested > self.max_new_tokens_limit:
            raise bad_request(f"max_new_tokens must be <= {self.max_new_tokens_limit}, got {requested}",
                              param="max_new_tokens")
        value = requested if requested is not None else self.default_max_new_tokens
        if min_new_tokens is not None and min_new_tokens > value:
            raise bad_request(f"min_new_tokens ({min_new_tokens}) must not exceed max_new_tokens ({value})",
                              param="min_new_tokens")
        return value


def speech_request(body: bytes, limits: Limits) -> tuple[SpeechRequest, dict[str, Any]]:
    """`POST /v1/audio/speech` body -> (parsed request, deployment request dict)."""
    req = parse_json_body(body, SpeechRequest)
    limits.check_model(req.model)
    limits.check_text(req.input, "input")
    limits.check_voice(req.voice, "voice")
    system = READ_ALOUD_PROMPT if not req.instructions else f"{READ_ALOUD_PROMPT} {req.instructions}"
    if req.instructions:
        limits.check_text(req.instructions, "instructions")
    return req, {
        "request_id": f"speech-{uuid.uuid4().hex}",
        "messages": [("system", system), ("user", req.input)],
        "output_modality": "audio", "with_audio": True, "voice": req.voice,
        "text_sampling": {}, "audio_sampling": req.sampling_overrides(),
        "max_new_tokens": limits.max_new_tokens(req.max_new_tokens, req.min_new_tokens),
        "min_new_tokens": req.min_new_tokens or 0, "seed": req.seed,
    }


def chat_request(body: bytes, limits: Limits) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """`POST /v1/chat/completions` body -> (parsed request, deployment request dict)."""
    req = parse_json_body(body, ChatCompletionRequest)
    limits.check_model(req.model)
    messages = []
    for index, message in enumerate(req.messages):
        try:
            text = message.text()
        except ValueError as exc:
            raise bad_request(str(exc), param=f"messages.{index}.content",
                              code="unsupported_content") from None
        messages.append((message.role, text))
    limits.check_text("".join(text for _, text in messages), "messages")
    voice = req.audio.voice if req.audio is not None else "default"
    if req.wants_audio:
        limits.check_voice(voice, "audio.voice")
    return req, {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "messages": messages,
        "output_modality": "audio" if req.wants_audio else "text", "with_audio": req.wants_audio,
        "voice": voice, "text_sampling": req.sampling_overrides(), "audio_sampling": {},
        "max_new_tokens": limits.max_new_tokens(req.max_new_tokens, req.min_new_tokens),
        "min_new_tokens": req.min_new_tokens or 0, "seed": req.seed,
    }
