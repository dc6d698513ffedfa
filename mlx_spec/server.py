"""`mlx-spec serve`: an OpenAI-compatible HTTP server with speculative decoding.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both streaming over SSE or not),
`GET /v1/models` and `GET /health`. FastAPI + uvicorn carry the HTTP; all MLX work happens on
one engine thread (models and caches are not shared across threads), which keeps up to
`max_concurrent` generations active and advances them round-robin, one token each, while later
requests wait first-in first-out. Each request has its own caches and drafter; the extra field
`"speculative": {"enabled", "drafter", "num_draft"}` chooses speculation per request, and
`usage.speculative` reports it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Literal

from mlx_spec.api import GenerationChunk, encode_prompt, stream_generate
from mlx_spec.chat import FALLBACK_STOP, chat_prompt, has_chat_template
from mlx_spec.compat import scored_vocab
from mlx_spec.drafters.base import Drafter
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.group import DrafterGroup
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.runner import context_limit
from mlx_spec.stats import SpecStats

import mlx.core as mx
import mlx.nn as nn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

MAX_NUM_DRAFT = 32
MAX_STOP = 4

# ------------------------------------------------------------------------------------ errors

_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        default = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or _ERROR_TYPES.get(status, default)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


# ---------------------------------------------------------------------------------- requests


class SpeculativeOptions(BaseModel):
    """The extra request field that controls speculation."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    drafter: str | None = None
    num_draft: int | str | None = None

    @field_validator("num_draft")
    @classmethod
    def _num_draft(cls, value):
        if value is None or value == "auto":
            return value
        if isinstance(value, int) and 0 <= value <= MAX_NUM_DRAFT:
            return value
        raise ValueError(f"must be 'auto' or an integer in [0, {MAX_NUM_DRAFT}]")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # other OpenAI fields are accepted and ignored
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    speculative: SpeculativeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


# ------------------------------------------------------------------------------------ engine


@dataclass
class Job:
    """One request on the engine: its stream (opened on the engine thread) and the asyncio
    queue its chunks go to."""

    open_stream: Callable[[], Iterator[GenerationChunk]]
    loop: asyncio.AbstractEventLoop
    seed: int | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    stream: Iterator[GenerationChunk] | None = None

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled = True


CANCELLED = object()  # put on a job's queue when the engine drops it


def _rng_seed() -> int:
    hi, lo = mx.random.state[0].tolist()
    return (hi << 32) | lo


class Engine:
    """The one thread that runs the model: round-robin over active jobs, FIFO for the rest.

    Args:
        max_concurrent: generations advanced together; later ones wait.
        max_queued: waiting requests at most (more are refused with 429).
    """

    def __init__(self, max_concurrent: int = 8, max_queued: int = 256):
        if max_concurrent < 1 or max_queued < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queued >= 0")
        self.max_concurrent, self.max_queued = max_concurrent, max_queued
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._closed = False
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "peak_active": 0}
        self._thread = threading.Thread(target=self._run, name="mlx-spec-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) >= self.max_queued:
                raise APIError(429, "too many requests are waiting; retry later", code="queue_full")
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client left): its stream is closed and its caches dropped."""
        job.cancelled = True
        with self._cond:
            self._cond.notify()

    def status(self) -> dict:
        with self._cond:
            return {"active": len(self._active), "queued": len(self._waiting), **self.counts}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._active or self._waiting):
                    self._cond.wait()
                if self._closed:
                    break
                while self._waiting and len(self._active) < self.max_concurrent:
                    job = self._waiting.popleft()
                    if job.cancelled:
                        self.counts["cancelled"] += 1
                        job.put(CANCELLED)
                    else:
                        self._active.append(job)
                peak = max(self.counts["peak_active"], len(self._active))
                self.counts["peak_active"] = peak
                turn = list(self._active)
            for job in turn:
                self._step(job)
        for job in self._active + list(self._waiting):
            self._finish(job, "cancelled")

    def _step(self, job: Job) -> None:
        """Advance one job by one chunk (its first step also prefills)."""
        if job.cancelled:
            self._finish(job, "cancelled")
            return
        try:
            with self._own_rng(job):
                if job.stream is None:
                    job.stream = job.open_stream()
                chunk = next(job.stream)
        except Exception as exc:  # reported to the request; the engine goes on
            job.put(exc)
            self._finish(job, "failed")
            return
        job.put(chunk)
        if chunk.token is None:
            self._finish(job, "completed")

    def _finish(self, job: Job, outcome: str) -> None:
        if job.stream is not None:
            job.stream.close()  # settles the rounds; the caches go with the stream
            job.stream = None
        if outcome == "cancelled":
            job.put(CANCELLED)
        with self._cond:
            if job in self._active:
                self._active.remove(job)
                self.counts[outcome] += 1

    @staticmethod
    @contextmanager
    def _own_rng(job: Job):
        """A seeded job draws from its own random stream, whatever runs in between."""
        if job.seed is None:
            yield
            return
        shared = _rng_seed()
        mx.random.seed(job.seed)
        try:
            yield
        finally:
            job.seed = _rng_seed()
            mx.random.seed(shared)


# --------------------------------------------------------------------------------- the app


@dataclass
class ServerConfig:
    """Limits and defaults of a server.

    Attributes:
        model_id: the name clients use in `model` (the model directory's name by default).
        api_key: if set, `/v1/*` needs `Authorization: Bearer <key>`.
        max_tokens_limit: the largest `max_tokens` accepted (also the default).
        max_request_bytes: the largest request body accepted.
        max_concurrent: generations advanced together.
        max_queued: requests waiting at most.
        default_drafter: drafter used when a request does not say (None: plain decoding).
        num_draft: "auto" or draft tokens per round, unless a request says otherwise.
        max_draft: the longest draft "auto" considers.
    """

    model_id: str = "model"
    api_key: str | None = None
    max_tokens_limit: int = 4096
    max_request_bytes: int = 1 << 20
    max_concurrent: int = 8
    max_queued: int = 256
    default_drafter: str | None = None
    num_draft: int | str = "auto"
    max_draft: int = 8


class _BodyLimit:
    """Refuse request bodies over `limit` bytes (413), declared or streamed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large().response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body exceeds {self.limit} bytes", code="request_too_large"
        )


class _APIKey:
    """Refuse `/v1/*` requests without the API key (401)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                error = APIError(
                    401, "missing or invalid API key (Authorization: Bearer ...)",
                    code="invalid_api_key",
                )  # fmt: skip
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(
    model: nn.Module,
    tokenizer,
    config: ServerConfig | None = None,
    drafters: dict[str, Callable[[], Drafter]] | None = None,
) -> FastAPI:
    """The FastAPI app serving `model`.

    Args:
        model, tokenizer: the target, from `mlx_spec.load`.
        config: limits and defaults.
        drafters: {name: factory of a fresh drafter} that requests may choose from; "ngram" is
            always offered.
    Returns:
        The app; run it with uvicorn. Its engine thread stops when the app shuts down.
    """
    config = config or ServerConfig()
    drafters = {"ngram": _ngram, **(drafters or {})}
    if config.default_drafter is not None and config.default_drafter not in drafters:
        raise ValueError(f"default drafter {config.default_drafter!r} is not offered")
    engine = Engine(config.max_concurrent, config.max_queued)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="mlx-spec", lifespan=lifespan)
    app.state.engine, app.state.config = engine, config
    server = _Server(model, tokenizer, config, drafters, engine)
    app.add_middleware(_BodyLimit, limit=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(_APIKey, key=config.api_key)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return APIError(exc.status_code, str(exc.detail), code=code.get(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_id, **engine.status()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        server.check_model(model_id)
        return server.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await server.handle(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.handle(body, request, chat=False)

    return app


def _ngram() -> Drafter:
    return NgramDrafter()


def drafter_factories(
    model: nn.Module,
    tokenizer,
    *,
    draft_model: str | None = None,
    mtp: str | None = None,
    assistant: str | None = None,
) -> dict[str, Callable[[], Drafter]]:
    """{drafter name: factory of a fresh drafter}: weights are loaded (and checked against the
    target) once, and every request gets its own drafter state over them.

    Args:
        model, tokenizer: the target.
        draft_model: a draft model directory or hub id.
        mtp: an MTP drafter directory, or the converted target directory holding `mtp/`.
        assistant: a Gemma 4 assistant directory.
    Returns:
        One factory per drafter given (n-gram lookup always), and "all": a `DrafterGroup` of
        them, when there are two or more.
    """
    from mlx_spec.api import load, load_mtp_drafter
    from mlx_spec.drafters.gemma4_assistant import (
        Gemma4AssistantDrafter,
        load_gemma4_assistant,
    )

    vocab = scored_vocab(model, tokenizer)
    out: dict[str, Callable[[], Drafter]] = {"ngram": _ngram}
    if draft_model is not None:
        small, small_tok = load(draft_model)
        DraftModelDrafter(small, small_tok).check_compatible(model, tokenizer, vocab)
        out["draft-model"] = lambda: DraftModelDrafter(small, small_tok)
    if mtp is not None:
        head = load_mtp_drafter(mtp, model)
        out["mtp"] = lambda: MTPDrafter(head.module, model)
    if assistant is not None:
        loaded = load_gemma4_assistant(assistant, model)
        loaded.check_compatible(model, tokenizer, vocab)
        out["gemma4-assistant"] = lambda: Gemma4AssistantDrafter(loaded.assistant, model)
    if len(out) > 1:  # every drafter at once: the policy picks one each round
        makers = list(out.values())
        out["all"] = lambda: DrafterGroup([make() for make in makers])
    return out


@dataclass
class _Plan:
    """What one request asks for, checked."""

    ids: list[int]
    max_tokens: int
    drafter: Callable[[], Drafter] | None
    num_draft: int | str
    stops: list[str]


class _Server:
    def __init__(self, model, tokenizer, config: ServerConfig, drafters, engine: Engine):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.drafters, self.engine = drafters, engine
        self.vocab = scored_vocab(model, tokenizer)
        self.context = context_limit(model)
        self.created = int(time.time())
        self.templated = has_chat_template(tokenizer)

    def model_card(self) -> dict:
        return {
            "id": self.config.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "mlx-spec",
            "drafters": sorted(self.drafters),
        }

    def check_model(self, name: str) -> None:
        if name != self.config.model_id:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.config.model_id!r}",
                param="model",
                code="model_not_found",
            )

    # ------------------------------------------------------------------ request -> plan

    def plan(self, body: _Request, chat: bool) -> _Plan:
        self.check_model(body.model)
        stops = list(body.stop or [])
        if chat:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                text = chat_prompt(self.tokenizer, messages)
            except Exception as exc:  # the template's own checks (jinja raises many types)
                raise APIError(
                    400, f"the chat template cannot render these messages: {exc}",
                    param="messages",
                ) from exc  # fmt: skip
            ids = encode_prompt(self.tokenizer, text)
            if not self.templated:
                stops.append(FALLBACK_STOP)
            requested = body.max_completion_tokens or body.max_tokens
        else:
            ids = self._completion_ids(body)
            requested = body.max_tokens
        if self.context is not None and len(ids) >= self.context:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the model's context holds {self.context}",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        limit = self.config.max_tokens_limit
        if requested is not None and requested > limit:
            raise APIError(
                400, f"max_tokens is {requested}; this server allows at most {limit}",
                param="max_tokens", code="max_tokens_exceeded",
            )  # fmt: skip
        drafter, num_draft = self._speculation(body.speculative)
        return _Plan(ids, requested or limit, drafter, num_draft, stops)

    def _completion_ids(self, body: CompletionRequest) -> list[int]:
        for name in ("echo", "logprobs", "suffix"):
            if getattr(body, name) not in (None, False):
                raise APIError(400, f"{name} is not supported", param=name)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        ids = encode_prompt(self.tokenizer, prompt)
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary", param="prompt")
        return ids

    def _speculation(self, options: SpeculativeOptions | None):
        name = self.config.default_drafter
        enabled = name is not None
        num_draft = self.config.num_draft
        if options is not None:
            enabled = options.enabled
            name = options.drafter or name or "ngram"
            if options.num_draft is not None:
                num_draft = options.num_draft
        if name is not None and name not in self.drafters:
            raise APIError(
                400,
                f"unknown drafter {name!r}; this server offers {', '.join(sorted(self.drafters))}",
                param="speculative.drafter",
                code="unknown_drafter",
            )
        if not enabled or num_draft == 0:
            return None, 0
        return self.drafters[name], num_draft

    # ------------------------------------------------------------------ plan -> response

    async def handle(self, body: _Request, request: Request, chat: bool):
        plan = self.plan(body, chat)

        def open_stream():
            return stream_generate(
                self.model,
                self.tokenizer,
                plan.ids,
                drafter=None if plan.drafter is None else plan.drafter(),
                num_draft=plan.num_draft,
                max_draft=self.config.max_draft,
                temperature=body.temperature,
                top_p=body.top_p,
                max_tokens=plan.max_tokens,
                stop=tuple(plan.stops),
            )

        job = Job(open_stream, asyncio.get_running_loop(), seed=body.seed)
        self.engine.submit(job)
        watcher = asyncio.create_task(self._watch(request, job))
        try:
            first = await self._next(job)
        except BaseException:
            watcher.cancel()
            self.engine.cancel(job)
            raise
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            "created": int(time.time()),
            "model": self.config.model_id,
            "prompt_tokens": len(plan.ids),
        }
        if body.stream:  # from here on the response watches the connection itself
            watcher.cancel()
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._events(job, first, meta, chat, include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            return await self._collect(job, first, meta, chat)
        finally:
            watcher.cancel()
            self.engine.cancel(job)

    async def _watch(self, request: Request, job: Job) -> None:
        """Cancel the job as soon as its client disconnects."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the connection failed in some other way: the client is gone too
            pass
        self.engine.cancel(job)

    async def _next(self, job: Job) -> GenerationChunk:
        """The job's next chunk; raises its error, or APIError(499) if it was cancelled."""
        item = await job.queue.get()
        if item is CANCELLED:
            raise APIError(499, "the client closed the request", code="client_closed")
        if isinstance(item, ValueError):
            raise APIError(400, str(item))
        if isinstance(item, Exception):
            raise APIError(500, f"generation failed: {type(item).__name__}: {item}")
        return item

    async def _collect(self, job, chunk, meta, chat) -> dict:
        pieces = []
        while chunk.token is not None:
            pieces.append(chunk.text)
            chunk = await self._next(job)
        pieces.append(chunk.text)
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": chunk.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": meta["id"],
            "object": "chat.completion" if chat else "text_completion",
            "created": meta["created"],
            "model": meta["model"],
            "choices": [choice],
            "usage": usage(chunk.stats, meta["prompt_tokens"]),
        }

    async def _events(self, job, chunk, meta, chat, include_usage) -> AsyncIterator[str]:
        base = {
            "id": meta["id"],
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": meta["created"],
            "model": meta["model"],
        }

        def event(text: str | None, finish: str | None = None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
                choice["logprobs"] = None
            return _sse({**base, "choices": [choice]})

        try:
            if chat:
                yield event("", role=True)
            while chunk.token is not None:
                if chunk.text:
                    yield event(chunk.text)
                chunk = await self._next(job)
            if chunk.text:
                yield event(chunk.text)
            yield event(None if chat else "", finish=chunk.finish_reason)
            if include_usage:
                yield _sse(
                    {**base, "choices": [], "usage": usage(chunk.stats, meta["prompt_tokens"])}
                )
            yield "data: [DONE]\n\n"
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            self.engine.cancel(job)  # a client that left mid-stream frees its work


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(stats: SpecStats, prompt_tokens: int) -> dict:
    """OpenAI usage plus a `speculative` object."""
    completion = stats.generated_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "speculative": {
            "enabled": stats.drafter != "none",
            "drafter": None if stats.drafter == "none" else stats.drafter,
            "num_draft": stats.num_draft if stats.drafter != "none" else 0,
            "k_histogram": {str(k): n for k, n in sorted(stats.k_histogram.items())},
            "drafted_tokens": stats.drafted,
            "accepted_tokens": stats.accepted,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            "target_passes": stats.target_passes,
            "decode_tokens_per_sec": stats.decode_tokens_per_sec,
        },
    }
