"""Parse and check an HTTP body into the request dict the deployments pass along; touches no model.

Every failure is an `ApiError` with a 4xx status; the ingress answers it without calling a deployment.
"""
from __future__ import annotations

import functools
import json
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from deployments.audio_input import decode_input_audio
from deployments.errors import ApiError, bad_request
from deployments.schemas import ChatCompletionRequest, ChatMessageIn, InputAudioPart, SpeechRequest, TextPart
from runtime.prompts import READ_ALOUD_PROMPT
from vocoder.speech_encoder import INPUT_SAMPLE_RATE

# Commas, brackets and braces a body may hold besides its text's own (text may be commas): bounds the objects
# the parser builds. 8 MiB of `[],` is 2.8 million lists, ~0.7 s of the event loop.
MAX_JSON_ITEMS = 1 << 16


def parse_json_body(body: bytes, schema: type[BaseModel], max_text_chars: int = 0) -> Any:
    """JSON bytes -> schema instance; malformed JSON, non-objects, schema errors and bodies of more than
    `MAX_JSON_ITEMS` + `max_text_chars` (the most text the request may carry) commas, brackets and braces
    become 400s."""
    items, limit = body.count(b",") + body.count(b"[") + body.count(b"{"), MAX_JSON_ITEMS + max_text_chars
    if items > limit:
        raise bad_request(f"request body holds {items} commas, brackets and braces; at most {limit} are accepted",
                          code="request_too_complex")
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
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ApiError.from_validation(exc) from None


def check_unicode(text: str, param: str) -> None:
    """400 for text that is not valid Unicode: a lone UTF-16 surrogate, legal JSON (a "\\ud83d" escape) that the
    tokenizer cannot take. Only the text the model reads is checked (pydantic refuses such a string in some
    fields but not in optional or union ones); fields the schema ignores are never walked: a body of millions of
    ignored values held the event loop for seconds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param}: text holds a lone UTF-16 surrogate (half of an escaped pair)", param=param,
                          code="invalid_value") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed in the request")


class Limits:
    """Server settings the checks need: served model name, known voices and size limits."""

    def __init__(self, *, served_model_name: str, voices: list[str], max_input_chars: int,
                 max_new_tokens_limit: int, default_max_new_tokens: int, max_input_audio_s: float = 120.0) -> None:
        self.served_model_name = served_model_name
        self.voices = voices
        self.max_input_chars = max_input_chars
        self.max_input_audio_s = max_input_audio_s  # 0: speech input is off (no speech encoder)
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

    def max_new_tokens(self, requested: int | None, min_new_tokens: int | None,
                       param: str = "max_new_tokens") -> int:
        """The request's token budget: the client's value within the limit, else the default. `param`: the
        field the client gave it in (chat: max_tokens or max_completion_tokens)."""
        if requested is not None and requested > self.max_new_tokens_limit:
            raise bad_request(f"{param} must be <= {self.max_new_tokens_limit}, got {requested}", param=param)
        value = requested if requested is not None else self.default_max_new_tokens
        if min_new_tokens is not None and min_new_tokens > value:
            raise bad_request(f"min_new_tokens ({min_new_tokens}) must not exceed max_new_tokens ({value})",
                              param="min_new_tokens")
        return value


def speech_request(body: bytes, limits: Limits) -> tuple[SpeechRequest, dict[str, Any]]:
    """`POST /v1/audio/speech` body -> (parsed request, deployment request dict)."""
    req = parse_json_body(body, SpeechRequest, 2 * limits.max_input_chars)  # input and instructions
    limits.check_model(req.model)
    limits.check_text(req.input, "input")
    check_unicode(req.input, "input")  # pydantic refuses it first today; this does not depend on that
    limits.check_voice(req.voice, "voice")
    system = READ_ALOUD_PROMPT if not req.instructions else f"{READ_ALOUD_PROMPT} {req.instructions}"
    if req.instructions:
        limits.check_text(req.instructions, "instructions")
        check_unicode(req.instructions, "instructions")
    return req, {
        "request_id": f"speech-{uuid.uuid4().hex}",
        "messages": [("system", system), ("user", req.input)],
        "output_modality": "audio", "with_audio": True, "voice": req.voice,
        "text_sampling": {}, "audio_sampling": req.sampling_overrides(),
        "max_new_tokens": limits.max_new_tokens(req.max_new_tokens, req.min_new_tokens),
        "min_new_tokens": req.min_new_tokens or 0, "seed": req.seed,
    }


def chat_request(body: bytes, limits: Limits) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """`POST /v1/chat/completions` body -> (parsed request, deployment request dict).

    A message's content in the dict is its text (str) when it has no speech, else a list of parts in order:
    `{"type": "text", "text": ...}` and `{"type": "audio", "samples": float32 16 kHz mono}` (the vocoder
    replica replaces the samples by codes). Speech is decoded here (CPU; the caller runs this off the event
    loop): the request's clips together may last `limits.max_input_audio_s`."""
    req = parse_json_body(body, ChatCompletionRequest, limits.max_input_chars)
    limits.check_model(req.model)
    messages: list[tuple[str, Any]] = []
    texts: list[str] = []
    audio_s = 0.0
    for index, message in enumerate(req.messages):
        parts = _content_parts(message, index)
        texts += [part.text for part in parts if isinstance(part, TextPart)]
        if not any(isinstance(part, InputAudioPart) for part in parts):
            messages.append((message.role, "".join(part.text for part in parts)))
            continue
        content: list[dict[str, Any]] = []
        for number, part in enumerate(parts):
            if isinstance(part, TextPart):
                content.append({"type": "text", "text": part.text})
                continue
            if limits.max_input_audio_s <= 0:
                raise bad_request("speech input is not enabled on this server (speech_encoder: none)",
                                  param=f"messages.{index}.content.{number}", code="unsupported_content")
            # each clip may take what the request's earlier clips left of the limit, so no clip is decoded
            # past it
            samples = decode_input_audio(
                part.input_audio.data, part.input_audio.format,
                param=f"messages.{index}.content.{number}.input_audio.data",
                max_seconds=limits.max_input_audio_s - audio_s,
                too_long=functools.partial(_audio_too_long, audio_s, limits.max_input_audio_s) if audio_s else None)
            audio_s += samples.size / INPUT_SAMPLE_RATE
            if audio_s > limits.max_input_audio_s:  # resampling may add a few samples
                raise _audio_too_long(audio_s, limits.max_input_audio_s, 0.0)
            content.append({"type": "audio", "samples": samples})
        messages.append((message.role, content))
    limits.check_text("".join(texts), "messages")
    voice = req.audio.voice if req.audio is not None else "default"
    if req.wants_audio:
        limits.check_voice(voice, "audio.voice")
    return req, {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "messages": messages,
        "output_modality": "audio" if req.wants_audio else "text", "with_audio": req.wants_audio,
        "voice": voice, "text_sampling": req.sampling_overrides(), "audio_sampling": {},
        "max_new_tokens": limits.max_new_tokens(req.max_new_tokens, req.min_new_tokens, req.max_new_tokens_field),
        "min_new_tokens": req.min_new_tokens or 0, "seed": req.seed, "prompt_param": "messages",
    }


def _audio_too_long(earlier_s: float, limit_s: float, seconds: float | None) -> ApiError:
    """The 400 for a request whose clips, `earlier_s` and then one of `seconds` (None: not known, past the
    limit), last longer than `limit_s` in all."""
    message = (f"the request's input audio lasts {earlier_s + seconds:.1f} s in all; the limit is {limit_s:g} s"
               if seconds is not None else
               f"the request's input audio lasts longer than the limit of {limit_s:g} s in all")
    return bad_request(message, param="messages", code="audio_too_long")


def _content_parts(message: ChatMessageIn, index: int) -> list[TextPart | InputAudioPart]:
    """A message's content as parts (a string is one text part); 400s name the part."""
    if message.content is None:
        return []
    if isinstance(message.content, str):
        check_unicode(message.content, f"messages.{index}.content")
        return [TextPart(type="text", text=message.content)]
    parts: list[TextPart | InputAudioPart] = []
    for number, part in enumerate(message.content):
        where = f"messages.{index}.content.{number}"
        kind = part.get("type")
        schema = {"text": TextPart, "input_audio": InputAudioPart}.get(kind) if isinstance(kind, str) else None
        if schema is None:
            raise bad_request(f"{where}: unsupported content part type {kind!r}; use 'text' or 'input_audio'",
                              param=where, code="unsupported_content")
        if schema is InputAudioPart and message.role in ("system", "developer"):
            raise bad_request(f"{where}: a {message.role} message must be text; speech goes in user or "
                              "assistant messages", param=where, code="unsupported_content")
        try:
            parts.append(schema.model_validate(part))
        except ValidationError as exc:
            raise ApiError.from_validation(exc, prefix=where) from None
        if schema is TextPart:
            check_unicode(parts[-1].text, f"{where}.text")
    return parts
