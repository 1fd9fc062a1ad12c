"""The device's local OpenAI-compatible HTTP API, on aiohttp.

Local apps talk to `sled device` as they would to OpenAI; every token still comes from the
server's lossless verification (or, opted in, from the drafter alone, marked as not lossless):

    runner, port = await start_api(device, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    await client.completions.create(model=device.model_id, prompt="def add(", max_tokens=16)
    await runner.cleanup()

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with SSE
streaming), GET /health (the device's status; 503 unless ready), GET /metrics (Prometheus).
Extensions beyond OpenAI's fields: top_k, ignore_eos, stop_token_ids, and loose ({"window": W,
"entropy": H}: opt-in loose verification for a greedy request, sled.wire.loose). An answer that is not
the target's own (the two opt-in lossy modes: drafted alone as a fallback, or loosely verified)
carries `"sled": {"lossless": false}` (with `"verification": "loose"` for the second; when not
streamed also the header `X-Sled-Lossless: false`).

Access: with the device's api_key set, every route but /health asks for
`Authorization: Bearer API_KEY` (what the openai client sends from its api_key) and answers 401
without it; a host other than loopback is served only with an api_key, or with api_open.
Browsers: a POST body must be JSON (415 otherwise: a page may post form and text/plain bodies
anywhere without a preflight); with no api_key a request must name a Host this device serves (403
otherwise: DNS rebinding) and may carry an Origin only from api_origins (403 otherwise). An
allowed Origin gets CORS headers and its preflights are answered; any other gets none.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import socket
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from edge_client.daemon import Device, DeviceError, Request
from edge_client.settings import DeviceSettings
from edge_client.stop_strings import check_stops
from edge_client.text import OutputText
from sled.wire.auth import HEADER, bearer_token
from sled.chat_templates import builtin_chat_template, turn_end_ids
from sled.printable import printable
from sled.wire.loose import MAX_ENTROPY, MAX_WINDOW, Loose
from sled.wire.sampling import Sampling
from sled.settings_files import SettingsError

log = logging.getLogger("sled.api")

MAX_BODY_BYTES = 1 << 20
DEVICE_KEY = web.AppKey("device", Device)

# The device's finish reasons in OpenAI's words.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# DeviceError kinds as HTTP statuses and OpenAI error types.
ERROR_STATUS = {"invalid": (400, "invalid_request_error"), "busy": (429, "rate_limit_error"),
                "unavailable": (503, "service_unavailable")}


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)

    @classmethod
    def from_device(cls, error: DeviceError) -> "ApiError":
        status, kind = ERROR_STATUS.get(error.kind, (500, "server_error"))
        return cls(status, error.message, kind=kind, code=error.kind)


# -- request bodies ---------------------------------------------------------------------------
class _Strict(BaseModel):
    # Unknown fields are ignored (clients send many); known ones must have the right type, and
    # numbers must be finite.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# Bounds of what a client chooses, in one place: names echoed into errors are short, and every
# count or id fits the uint32 the wire carries it in (a larger one is a 400 naming it, not a 500).
NAME_CHARS = 256
UINT32_END = 2**32
TokenId = Annotated[int, Field(ge=0, lt=UINT32_END)]


class StreamOptions(_Strict):
    include_usage: bool = False


class LooseBody(_Strict):
    """Opt-in loose verification (sled.wire.loose): NOT lossless; greedy requests only."""
    window: int = Field(2, ge=1, le=MAX_WINDOW)
    entropy: float = Field(0.5, gt=0.0, lt=MAX_ENTROPY)


# Fields OpenAI has that this API cannot honour: accepted only at their neutral value.
UNSUPPORTED = ("logprobs", "top_logprobs", "best_of", "presence_penalty", "frequency_penalty",
               "logit_bias", "suffix", "tools")
NEUTRAL = (None, False, 0, "", [], {})


class GenerationBody(_Strict):
    """What completions and chat completions share."""
    model: str = Field(max_length=NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, lt=UINT32_END)
    temperature: float | None = Field(None, ge=0.0, le=2.0)    # None: OpenAI's default, 1
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=UINT32_END)       # extension; 0 or -1: off
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = Field(None, max_length=NAME_CHARS)       # accepted, ignored
    ignore_eos: bool = False                                    # extension
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=1024)  # extension
    loose: LooseBody | None = None                              # extension: NOT lossless
    logprobs: Any = None
    top_logprobs: Any = None
    best_of: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    suffix: Any = None
    tools: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, value):
        check_stops([value] if isinstance(value, str) else value or [])
        return value

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _neutral(cls, value, info: ValidationInfo):
        if value not in NEUTRAL and not (info.field_name == "best_of" and value == 1):
            raise ValueError("not supported by this server")
        return value

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    # Extra keys (name, tool_calls, ...) go through to the chat template as they are.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatBody(GenerationBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=UINT32_END)


# How a field's value must look, for messages about values of the wrong shape.
SHAPES = {
    "prompt": "a string, a list of token ids, or a list holding one of those",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {role, content} objects with text content",
}


def parse_body(raw: bytes, model: type[GenerationBody]) -> GenerationBody:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> ApiError:
    """The first problem, named after its top-level field."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" or not first["loc"]:
        return ApiError(400, f"the request body must be a JSON object: {first['msg']}")
    param = str(first["loc"][0])
    same_field = [e for e in errors if e["loc"] and e["loc"][0] == param]
    if first["type"] == "missing":
        message = f"{param} is required"
    elif first["type"] != "value_error" and (len(same_field) > 1 or param in SHAPES):
        message = f"{param} must be {SHAPES.get(param, 'of another type')}"
    else:
        message = f"{param}: {first['msg'].removeprefix('Value error, ')}"
    return ApiError(400, message, param=param)


# -- prompts ----------------------------------------------------------------------------------
def _tokenizer(device: Device):
    if device.tokenizer is None:
        raise ApiError(503, f"the device has no tokenizer yet: {device.reason or device.state}",
                       kind="service_unavailable", code="unavailable")
    return device.tokenizer


def completion_prompt(device: Device, prompt) -> list[int]:
    """Token ids of a completion prompt: text, token ids, or a batch of exactly one of those."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > 1:
            raise ApiError(400, f"batches of prompts are not supported: send one prompt per request "
                                f"(got {len(prompt)})", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _tokenizer(device)(prompt).input_ids
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return list(prompt)


def chat_template(device: Device) -> str:
    """The conversation format: the tokenizer's chat template, else the built-in model's (a
    tokenizer fetched from a server before built-in models carried their templates)."""
    template = getattr(_tokenizer(device), "chat_template", None) or _builtin_template(device.model_id)
    if not template:
        raise ApiError(400, f"the model {_name(device.model_id)} has no chat template: use /v1/completions "
                            f"with a prompt you format yourself", param="messages")
    return template


def _builtin_template(model_id: str) -> str | None:
    try:
        return builtin_chat_template(model_id)
    except (ImportError, ValueError, OSError):   # its GGUF is not on this device
        return None


def chat_prompt(device: Device, messages: list[Message], template: str) -> list[int]:
    """Token ids of the conversation through the chat template, ready for the reply."""
    tokenizer = _tokenizer(device)
    conversation = [_template_message(m) for m in messages]
    try:
        encoded = tokenizer.apply_chat_template(conversation, chat_template=template,
                                                add_generation_prompt=True)
    except Exception as exc:  # the template rejects the conversation (raise_exception, bad roles)
        raise ApiError(400, f"the chat template cannot format these messages: {printable(str(exc), 200)}",
                       param="messages") from None
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def _template_message(message: Message) -> dict:
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        data["content"] = "".join(part.text for part in message.content)
    return data


@functools.cache
def _renderer_threads() -> ThreadPoolExecutor:
    """Threads of their own for chat templates, one per rendering process: a rendering waiting
    for its turn waits on the event loop and holds none of the default executor's threads,
    where drafts are made."""
    from edge_client.chat_render import RENDERERS   # jinja2: at the first chat prompt, not at start
    return ThreadPoolExecutor(RENDERERS, thread_name_prefix="sled-chat-render")


async def _rendered(function: Callable, *args):
    """FUNCTION(*ARGS), which renders a chat template, on a renderer thread."""
    return await asyncio.get_running_loop().run_in_executor(_renderer_threads(), function, *args)


# Each tokenizer's last template with the ids that end its turn. Only ids are kept: no ids may
# mean a rendering refused under load as well as a template that writes none, so it is asked again.
_TURN_ENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def chat_turn_end(tokenizer, template: str) -> list[int]:
    """turn_end_ids(TOKENIZER, TEMPLATE), rendered once per tokenizer and template."""
    known = _TURN_ENDS.get(tokenizer)
    if known is not None and known[0] == template:
        return list(known[1])
    ids = await _rendered(turn_end_ids, tokenizer, template)
    if ids:
        _TURN_ENDS[tokenizer] = (template, tuple(ids))
    return ids


def device_request(body: GenerationBody, prompt_ids: list[int], request_id: str,
                   max_tokens: int | None, turn_end: list[int] = ()) -> Request:
    """TURN_END: the ids that end a chat reply besides EOS (stop ids on the wire)."""
    try:
        sampling = Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                            top_k=max(body.top_k or 0, 0),
                            top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    return Request(prompt_ids, max_tokens=max_tokens, sampling=sampling,
                   stop_ids=list(dict.fromkeys([*body.stop_token_ids, *turn_end])),
                   ignore_eos=body.ignore_eos,
                   request_id=request_id,
                   loose=Loose(body.loose.window, body.loose.entropy) if body.loose else None)


# -- output text ------------------------------------------------------------------------------
@dataclass(slots=True)
class Piece:
    """Text ready to send; the last piece has a finish reason."""
    text: str
    finish_reason: str | None
    lossless: bool                    # False once any token came from the drafter alone


async def generate_pieces(device: Device, request: Request, output: OutputText) -> AsyncIterator[Piece]:
    """The request's text as it becomes safe to send. Leaving early (a stop string, a closed
    connection) closes the device's stream, which cancels the generation."""
    lossless, last = True, None
    async with aclosing(device.stream(request)) as chunks:
        async for chunk in chunks:
            lossless = lossless and chunk.lossless
            output.add(chunk.token_ids)
            if chunk.finish_reason is not None:   # the device's stream ends after this chunk
                finish = "stop" if output.stopped else FINISH_REASONS.get(chunk.finish_reason, "stop")
                last = Piece(output.take(final=True), finish, lossless)
            elif output.stopped:
                yield Piece(output.take(final=True), "stop", lossless)
                return
            elif text := output.take():
                yield Piece(text, None, lossless)
    if last is None:
        raise DeviceError("unavailable", "the generation ended without a finish reason")
    yield last


# -- responses --------------------------------------------------------------------------------
@dataclass(slots=True)
class Job:
    """One request being answered: what the two endpoints differ in is in `kind`."""
    kind: Literal["completion", "chat"]
    id: str
    model: str
    created: int
    prompt_tokens: int
    include_usage: bool = False
    loose: bool = False               # asked for loose verification: its answer says so

    def usage(self, output: OutputText) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": output.tokens,
                "total_tokens": self.prompt_tokens + output.tokens}

    def head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def whole(self, text: str, finish: str, lossless: bool, output: OutputText) -> dict:
        """The non-streamed answer."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
            body = self.head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self.head("text_completion")
        return {**body, "choices": [choice], "usage": self.usage(output), **self.sled(lossless)}

    def chunk(self, lossless: bool, *, text: str | None = None, role: bool = False,
              finish: str | None = None) -> dict:
        """One streamed chunk: a role (chat only), some text, or the finish reason."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = self.head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = self.head("text_completion")
        usage = {"usage": None} if self.include_usage else {}
        return {**body, "choices": [choice], **usage, **self.sled(lossless)}

    def usage_chunk(self, output: OutputText) -> dict:
        object_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self.head(object_name), "choices": [], "usage": self.usage(output)}

    def sled(self, lossless: bool) -> dict:
        """The mark of an answer that is not the target's own (nothing on one that is)."""
        if lossless:
            return {}
        return {"sled": {"lossless": False, **({"verification": "loose"} if self.loose else {})}}


async def answer_whole(job: Job, pieces: AsyncIterator[Piece], output: OutputText,
                       prefix: str = "") -> web.Response:
    texts = [prefix]
    async for piece in pieces:
        texts.append(piece.text)
    body = job.whole("".join(texts), piece.finish_reason, piece.lossless, output)
    headers = {} if piece.lossless else {"X-Sled-Lossless": "false"}
    return web.json_response(body, headers=headers)


async def answer_stream(request: web.Request, job: Job, pieces: AsyncIterator[Piece],
                        output: OutputText, prefix: str = "") -> web.StreamResponse:
    """Server-sent events in OpenAI's wire format, ending with `data: [DONE]`. The headers wait
    for the first text, so a request the device refuses still gets its HTTP error status."""
    piece = await anext(pieces)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    send = _sender(response)
    try:
        if job.kind == "chat":
            await send(job.chunk(piece.lossless, role=True))
        if prefix:
            await send(job.chunk(piece.lossless, text=prefix))
        await _send_pieces(send, job, piece, pieces)
        if job.include_usage:
            await send(job.usage_chunk(output))
    except DeviceError as exc:   # after the headers: the error goes as an event
        await send(ApiError.from_device(exc).body())
    except ConnectionResetError:  # the client left; closing `pieces` cancels the generation
        return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send_pieces(send, job: Job, piece: Piece, pieces: AsyncIterator[Piece]) -> None:
    while True:
        if piece.text:
            await send(job.chunk(piece.lossless, text=piece.text))
        if piece.finish_reason is not None:
            await send(job.chunk(piece.lossless, finish=piece.finish_reason))
            return
        piece = await anext(pieces)


def _sender(response: web.StreamResponse) -> Callable:
    async def send(data: dict) -> None:
        await response.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")
    return send


# -- handlers ---------------------------------------------------------------------------------
async def _read_body(request: web.Request, model: type[GenerationBody]) -> GenerationBody:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise _too_large()
    return parse_body(await request.read(), model)


def _too_large() -> ApiError:
    return ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                    code="request_too_large")


def _check_model(device: Device, model: str) -> None:
    # A device still waiting for its first server has no model id yet: it answers 503 later.
    if device.model_id and model != device.model_id:
        raise ApiError(404, f"the model {_name(model)} does not exist: this device serves "
                            f"{_name(device.model_id)}", param="model", code="model_not_found")


def _name(text: str) -> str:
    """A model name for a message: quoted, escaped, cut short (clients and servers choose it)."""
    return f"'{printable(text, 64)}'"


async def completions(request: web.Request) -> web.StreamResponse:
    device = request.app[DEVICE_KEY]
    body: CompletionBody = await _read_body(request, CompletionBody)
    _check_model(device, body.model)
    prompt_ids = completion_prompt(device, body.prompt)
    echo = _echo_text(device, body.prompt, prompt_ids) if body.echo else ""
    job = Job("completion", f"cmpl-{uuid.uuid4().hex}", body.model, int(time.time()),
              len(prompt_ids), body.include_usage)
    return await _answer(request, device, body, job, prompt_ids, body.max_tokens, echo)


def _echo_text(device: Device, prompt, prompt_ids: list[int]) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else _tokenizer(device).decode(prompt_ids)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    device = request.app[DEVICE_KEY]
    body: ChatBody = await _read_body(request, ChatBody)
    _check_model(device, body.model)
    template = chat_template(device)
    # a template renders within its own budget (edge_client.chat_render), off the event loop
    prompt_ids = await _rendered(chat_prompt, device, body.messages, template)
    # the reply ends with its turn, like an EOS (the model's own EOS may be another token)
    turn_end = [] if body.ignore_eos else await chat_turn_end(_tokenizer(device), template)
    job = Job("chat", f"chatcmpl-{uuid.uuid4().hex}", body.model, int(time.time()),
              len(prompt_ids), body.include_usage)
    return await _answer(request, device, body, job, prompt_ids,
                         body.max_completion_tokens or body.max_tokens, turn_end=turn_end)


async def _answer(request: web.Request, device: Device, body: GenerationBody, job: Job,
                  prompt_ids: list[int], max_tokens: int | None, prefix: str = "",
                  turn_end: list[int] = ()) -> web.StreamResponse:
    job.loose = body.loose is not None
    end_ids = set(body.stop_token_ids) | set(turn_end) | (set() if body.ignore_eos else set(device.eos_ids))
    output = OutputText(_tokenizer(device), body.stops, end_ids)
    generation = generate_pieces(device, device_request(body, prompt_ids, job.id, max_tokens, turn_end),
                                 output)
    async with aclosing(generation) as pieces:
        if body.stream:
            return await answer_stream(request, job, pieces, output, prefix)
        return await answer_whole(job, pieces, output, prefix)


async def list_models(request: web.Request) -> web.Response:
    device = request.app[DEVICE_KEY]
    models = [_model_card(device)] if device.model_id else []
    return web.json_response({"object": "list", "data": models})


async def get_model(request: web.Request) -> web.Response:
    device = request.app[DEVICE_KEY]
    name = request.match_info["model"]
    if not device.model_id or name != device.model_id:
        raise ApiError(404, f"the model {_name(name)} does not exist", param="model",
                       code="model_not_found")
    return web.json_response(_model_card(device))


def _model_card(device: Device) -> dict:
    created = int(time.time() - (time.monotonic() - device.started))
    return {"id": device.model_id, "object": "model", "created": created, "owned_by": "sled"}


async def health(request: web.Request) -> web.Response:
    device = request.app[DEVICE_KEY]
    status = 200 if device.state == "ready" else 503
    return web.json_response(device.status(), status=status, dumps=lambda d: json.dumps(d, default=str))


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[DEVICE_KEY].metrics.registry
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- middleware -------------------------------------------------------------------------------
@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure in OpenAI's error shape."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except DeviceError as exc:
        return ApiError.from_device(exc).response()
    except web.HTTPRequestEntityTooLarge:
        return _too_large().response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.text or exc.reason, kind=_http_kind(exc.status)).response()
    except Exception:
        log.exception("local API: %s %s failed", request.method, printable(request.path))
        return ApiError(500, "internal error", kind="server_error").response()


def _http_kind(status: int) -> str:
    return "not_found_error" if status == 404 else "invalid_request_error"


class HttpMetrics:
    """Request counts and latency by route, in the device's registry (once per registry)."""
    _by_registry: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, registry) -> None:
        self.requests = Counter("sled_device_http_requests", "Local API requests",
                                ["route", "method", "status"], registry=registry)
        self.latency = Histogram("sled_device_http_request_seconds",
                                 "Local API request time (whole stream when streamed)", ["route"],
                                 registry=registry)

    @classmethod
    def of(cls, registry) -> "HttpMetrics":
        if registry not in cls._by_registry:
            cls._by_registry[registry] = cls(registry)
        return cls._by_registry[registry]


def counting(http: HttpMetrics):
    @web.middleware
    async def count(request: web.Request, handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = _route(request)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            http.requests.labels(route, request.method, str(status)).inc()
            http.latency.labels(route).observe(time.perf_counter() - started)
    return count


def _route(request: web.Request) -> str:
    """The route's pattern ("/v1/models/{model}"), or "other" for a path no route has."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


# -- access -----------------------------------------------------------------------------------
# Routes anyone may call with a key set: load balancers and the lab's runner read /health.
OPEN_ROUTES = {"/health"}
AUTH_HEADERS = {"WWW-Authenticate": "Bearer"}


def requiring_key(api_key: str):
    """Every route but OPEN_ROUTES answers 401 unless the request carries
    `Authorization: Bearer API_KEY` (the key is fixed when the app is made)."""
    expected = api_key.encode("utf-8")

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if _route(request) not in OPEN_ROUTES:
            check_bearer(request.headers.get("Authorization", ""), expected)
        return await handler(request)
    return check_key


def check_bearer(authorization: str, expected: bytes) -> None:
    """Raise a 401 unless AUTHORIZATION is `Bearer <EXPECTED>`, compared in constant time."""
    token = bearer_token([(HEADER, authorization)])
    if token is None:
        raise _unauthorized("this device's API needs a key: send the header `Authorization: Bearer KEY` "
                            "(the openai client's api_key) with the key set as the device's api_key")
    if not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), expected):
        raise _unauthorized("the API key is not this device's: send the key set as the device's "
                            "api_key (`Authorization: Bearer KEY`)")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers=AUTH_HEADERS)


def check_exposure(host: str, settings: DeviceSettings) -> bool:
    """Refuse (SettingsError) to serve HOST beyond this machine without an api_key, unless
    settings.api_open says to. True when the API will be open to the network with no key."""
    if settings.api_key.get_secret_value() or is_loopback(host):
        return False
    if not settings.api_open:
        raise SettingsError(f"the local API would listen on {printable(host)!r}, which is not a "
                            f"loopback address, with no api_key: set api_key (clients then send "
                            f"`Authorization: Bearer KEY`), or api_open = true to serve it "
                            f"unauthenticated")
    return True


def is_loopback(host: str) -> bool:
    """Whether HOST keeps the API on this machine: "localhost", 127.0.0.0/8, ::1, or a name
    that resolves to those alone. "", "0.0.0.0" and "::" (every interface) are not."""
    if host == "localhost":
        return True
    if not host:
        return False
    try:
        found = socket.getaddrinfo(host.removeprefix("[").removesuffix("]"), None)
    except (OSError, UnicodeError):     # a name that does not resolve cannot be vouched for
        return False
    return all(_loopback_address(info[4][0]) for info in found)


def _loopback_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.partition("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)     # ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


# -- browsers ---------------------------------------------------------------------------------
# Names a request's Host may carry besides IP literals, the bind host and api_hosts. A DNS
# rebinding page sends its own domain as Host, never an IP literal or these.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})
JSON_TYPE = "application/json"
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
EXPOSED_HEADERS = "X-Sled-Lossless"
PREFLIGHT_MAX_AGE_S = "600"


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """Which Host names and browser Origins the API answers (fixed when the app is made).
    `keyed`: an api_key guards it, so Host and Origin are not restricted (a page cannot know the
    key); CORS headers still go to allowed origins alone."""
    hosts: frozenset[str]
    origins: frozenset[str]
    keyed: bool

    @classmethod
    def of(cls, settings: DeviceSettings, bind_host: str) -> "BrowserPolicy":
        hosts = {*LOOPBACK_NAMES, host_name(bind_host), *(host_name(h) for h in settings.api_hosts)}
        return cls(frozenset(hosts - {""}), frozenset(origin_of(o) for o in settings.api_origins),
                   bool(settings.api_key.get_secret_value()))

    def serves_host(self, header: str | None) -> bool:
        """Whether a Host header names this device: an IP literal, a loopback name, the bind
        host or one of api_hosts (no header: not a browser, which always sends one)."""
        if header is None:
            return True
        name = host_name(header)
        return name in self.hosts or _ip_literal(name)

    def allows_origin(self, origin: str) -> bool:
        return origin_of(origin) in self.origins


def host_name(host: str) -> str:
    """HOST (a Host header, a bind host) without its port, lower-cased: "[::1]:8000" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    if colon and ":" not in name and port.isdigit():
        host = name
    return host.rstrip(".")


def origin_of(origin: str) -> str:
    """An Origin as compared: lower-cased, no trailing slash."""
    return origin.strip().lower().rstrip("/")


def _ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.partition("%")[0])
    except ValueError:
        return False
    return True


def guarding_browsers(policy: BrowserPolicy):
    """403 for a foreign Host or Origin (unless keyed), preflights of allowed origins answered."""
    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin is not None:
            return preflight(policy, origin)
        if not policy.keyed:
            check_host(policy, request.headers.get("Host"))
            if origin is not None and not policy.allows_origin(origin):
                raise _foreign_origin(origin)
        return await handler(request)
    return guard


def check_host(policy: BrowserPolicy, header: str | None) -> None:
    if not policy.serves_host(header):
        raise ApiError(403, f"the Host {printable(header or '', 64)!r} is not one this device serves: "
                            f"add the name to the device's api_hosts (or use 127.0.0.1)",
                       kind="permission_error", code="host_not_allowed")


def _foreign_origin(origin: str) -> ApiError:
    return ApiError(403, f"the origin {printable(origin, 64)!r} may not call this device's API: add "
                         f"it to the device's api_origins to allow that page",
                    kind="permission_error", code="origin_not_allowed")


def preflight(policy: BrowserPolicy, origin: str) -> web.Response:
    """A CORS preflight: 204 with what an allowed origin may send; 403 for any other."""
    if not policy.allows_origin(origin):
        raise _foreign_origin(origin)
    return web.Response(status=204, headers={"Access-Control-Allow-Methods": CORS_METHODS,
                                             "Access-Control-Allow-Headers": CORS_HEADERS,
                                             "Access-Control-Max-Age": PREFLIGHT_MAX_AGE_S})


def cors_headers(policy: BrowserPolicy):
    """Signal handler: an allowed Origin may read the answer (streams and errors too)."""
    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and policy.allows_origin(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response.headers.add("Vary", "Origin")
    return add


@web.middleware
async def json_bodies(request: web.Request, handler) -> web.StreamResponse:
    """415 for a POST whose body is not declared JSON (a page can send text/plain and form
    bodies to any address without a preflight)."""
    if request.method == "POST" and request.content_type != JSON_TYPE:
        shown = printable(request.headers.get("Content-Type", "none"), 64)
        raise ApiError(415, f"the request body must be JSON: send the header `Content-Type: "
                            f"{JSON_TYPE}` (got {shown!r})", code="unsupported_media_type")
    return await handler(request)


# -- the app ----------------------------------------------------------------------------------
def make_app(device: Device, host: str | None = None) -> web.Application:
    """The routes, with the device's api_key (when set) required on all but /health; HOST: the
    address it listens on (default: the device's host setting), a Host it answers to."""
    http = HttpMetrics.of(device.metrics.registry)
    policy = BrowserPolicy.of(device.settings, device.settings.host if host is None else host)
    middlewares = [counting(http), openai_errors, guarding_browsers(policy)]
    if api_key := device.settings.api_key.get_secret_value():
        middlewares.append(requiring_key(api_key))
    middlewares.append(json_bodies)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app.on_response_prepare.append(cors_headers(policy))
    app[DEVICE_KEY] = device
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_api(device: Device, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve the API on host:port (0: any free port); returns the runner (stop it with
    `await runner.cleanup()`) and the port it listens on. A client that disconnects cancels
    its handler, and with it the generation. A host beyond loopback needs the device's api_key or
    api_open (SettingsError otherwise; with api_open and no key, one WARNING line)."""
    if await asyncio.to_thread(check_exposure, host, device.settings):
        log.warning("the local API on %s is open to the network with no api_key (api_open = true): "
                    "anyone who can reach it can generate", printable(host))
    runner = web.AppRunner(make_app(device, host), handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
