"""`mlx-spec serve`: an OpenAI-compatible HTTP server with speculative decoding.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both streaming over SSE or not),
`GET /v1/models` and `GET /health`. FastAPI + uvicorn carry the HTTP; all MLX work happens on
one engine thread (`scheduler.py`), which runs up to `max_concurrent` generations at once as
rows of a continuously batched engine (`engine.py`: one target pass per step for all of them,
speculation included), or, where the target or drafter cannot be batched, as solo streams
advanced one round at a time; later requests wait first-in first-out. A request reuses the
caches an earlier one left with a prefix in common (`prompt_cache.py`); the extra field
`"speculative": {"enabled", "drafter", "num_draft"}` chooses speculation per request, and
`usage.speculative` reports it. Tool calls are parsed with mlx-lm's parsers (`tools.py`); the
Anthropic Messages API is served beside the OpenAI one (`anthropic_api.py`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from mlx_spec.api import GenerationChunk, encode_prompt
from mlx_spec.caches.batch import batchable
from mlx_spec.caches.prompt_cache import PromptCache, RowCache
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.decoding import distributed
from mlx_spec.decoding.engine import ALL, BatchEngine, BatchRequest, StepLog
from mlx_spec.decoding.runner import context_limit
from mlx_spec.drafters.base import Drafter, hidden_layer_ids
from mlx_spec.drafters.batch import (
    BatchDFlash,
    BatchDrafter,
    BatchDraftModel,
    BatchEagle3,
    BatchMTP,
    BatchNgram,
)
from mlx_spec.drafters.draft_model import DraftModelDrafter
from mlx_spec.drafters.group import DrafterGroup
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.serving.chat import FALLBACK_STOP, chat_prompt, has_chat_template
from mlx_spec.serving.scheduler import CANCELLED, Engine, Job, QueueFull, ShuttingDown
from mlx_spec.serving.session import Session
from mlx_spec.serving.tools import (
    PlainText,
    ToolCall,
    ToolCallStream,
    supports_tools,
    template_messages,
)

import mlx.core as mx
import mlx.nn as nn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

MAX_NUM_DRAFT = 32
ANTHROPIC_PREFIX = "/v1/messages"
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

    def response(self, path: str = "") -> JSONResponse:
        """The error as JSON; in Anthropic's shape on its routes (`/v1/messages...`)."""
        if path.startswith(ANTHROPIC_PREFIX):
            from mlx_spec.serving.anthropic import error_body

            return JSONResponse(error_body(self.status, self.message), status_code=self.status)
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


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message, sent back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as chat templates read it."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


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
        prompt_cache_bytes: the most bytes the caches of finished requests may keep for reuse
            by later requests sharing a prefix (0: no prompt cache).
        prompt_cache_entries: the most finished requests' caches kept.
        prefill_step: prompts are prefilled in chunks of this many tokens, each followed by a
            step of every other active stream.
        batching: run requests as rows of one continuously batched engine where the target
            and the drafter allow (else each request is a solo stream, advanced in turn).
        max_kv_bytes: cache memory the batch's rows may reserve (prompt + max_tokens each);
            more requests wait, and one that alone needs more is refused. None: 40% of the
            device's memory.
        pace_slack: how far behind plain decoding's pace speculation inside the batch may put
            a request, as a share of its decoding time (`BatchEngine`); None (the default):
            the batch's throughput alone decides.
        trace_steps: a file the batch engine appends each step's trace to, one JSON line a
            step (`StepLog`: rows, drafts, drafters, where its time went, the policy's reason;
            `mlx-spec steps FILE` summarises it). None: no trace.
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
    prompt_cache_bytes: int = 2 << 30
    prompt_cache_entries: int = 32
    prefill_step: int = 256
    batching: bool = True
    max_kv_bytes: int | None = None
    pace_slack: float | None = None
    trace_steps: str | None = None


class _BodyLimit:
    """Refuse request bodies over `limit` bytes (413), declared or streamed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large().response(scope["path"])(scope, receive, send)
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
            given = given or headers.get(b"x-api-key", b"").strip()  # Anthropic's header
            if not hmac.compare_digest(given, self.key):
                error = APIError(
                    401, "missing or invalid API key (Authorization: Bearer ... or x-api-key)",
                    code="invalid_api_key",
                )  # fmt: skip
                return await error.response(scope["path"])(scope, receive, send)
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
    server = _serving(model, tokenizer, config, drafters)
    engine, batch = server.engine, server.engine.batch

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="mlx-spec", lifespan=lifespan)
    app.state.engine, app.state.config = engine, config
    app.add_middleware(_BodyLimit, limit=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(_APIKey, key=config.api_key)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        error = APIError(exc.status_code, str(exc.detail), code=code.get(exc.status_code))
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}").response(request.url.path)

    @app.get("/health")
    async def health():
        status = {"status": "ok", "model": config.model_id, **engine.status()}
        cache = server.prompt_cache if batch is None else batch.row_cache
        status["batching"] = batch is not None
        sharding = distributed.sharding_of(model)
        status["world_size"] = 1 if sharding is None else sharding.size
        return {**status, "prompt_cache": cache.status()}

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

    from mlx_spec.serving import (
        anthropic as anthropic_api,  # imports this module: loaded once it is complete
    )

    anthropic_api.add_routes(app, server)

    return app


def _serving(model, tokenizer, config: ServerConfig, drafters, follow: bool = False) -> _Server:
    """The server's state and its engine (started). On a sharded target rank 0's engine shares
    its turns and the other ranks' engines (`follow`) replay them; every rank builds the same
    engine in the same order, since building it runs the target (collectives included)."""
    drafters = {"ngram": DrafterFactory(_ngram, BatchNgram), **(drafters or {})}
    if config.default_drafter is not None and config.default_drafter not in drafters:
        raise ValueError(f"default drafter {config.default_drafter!r} is not offered")
    check_sharded_drafters(model, drafters)
    batch = batch_engine(model, tokenizer, config, drafters)
    sharding = distributed.sharding_of(model)
    lockstep = None if sharding is None else distributed.Lockstep(sharding)
    servers: list[_Server] = []  # the follower's engine builds jobs with the server below
    engine = Engine(
        config.max_concurrent,
        config.max_queued,
        batch,
        lockstep=lockstep,
        build=(lambda spec: servers[0].job(spec, None)) if follow else None,
    )
    server = _Server(model, tokenizer, config, drafters, engine)
    if sharding is not None:  # the prompt caches keep and evict alike on every rank
        agree = functools.partial(distributed.agreed_bytes, sharding.group)
        server.prompt_cache.agree = agree
        if batch is not None and batch.row_cache is not None:
            batch.row_cache.agree = agree
    servers.append(server)
    return server


def follow(model, tokenizer, config: ServerConfig, drafters=None) -> None:
    """A rank other than 0 of a sharded target: run rank 0's server turns until it stops."""
    _serving(model, tokenizer, config, drafters, follow=True).engine.wait()


def check_sharded_drafters(model: nn.Module, drafters: dict) -> None:
    """On a sharded target: refuse a drafter it cannot serve (`distributed.check_drafter`)."""
    if distributed.sharding_of(model) is None:
        return
    for name, make in drafters.items():
        if name != ALL:
            drafter = make()
            distributed.check_drafter(model, drafter, hidden_layer_ids(drafter))


def _ngram() -> Drafter:
    return NgramDrafter()


@dataclass
class DrafterFactory:
    """Makes a fresh drafter per request (`__call__`), and, where the drafter can run inside
    the batch engine, its batched form (`batch`)."""

    make: Callable[[], Drafter]
    batch: Callable[[], BatchDrafter] | None = None

    def __call__(self) -> Drafter:
        return self.make()


def drafter_factories(
    model: nn.Module,
    tokenizer,
    *,
    draft_model: str | None = None,
    mtp: str | None = None,
    assistant: str | None = None,
    eagle: str | None = None,
    dflash: str | None = None,
) -> dict[str, Callable[[], Drafter]]:
    """{drafter name: factory of a fresh drafter}: weights are loaded (and checked against the
    target) once, and every request gets its own drafter state over them.

    Args:
        model, tokenizer: the target.
        draft_model: a draft model directory or hub id.
        mtp: an MTP drafter directory, or the converted target directory holding `mtp/`.
        assistant: a Gemma 4 assistant directory.
        eagle: an EAGLE-3 head directory.
        dflash: a DFlash drafter directory.
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
    out: dict[str, DrafterFactory] = {"ngram": DrafterFactory(_ngram, BatchNgram)}
    if draft_model is not None:
        small, small_tok = load(draft_model)
        DraftModelDrafter(small, small_tok).check_compatible(model, tokenizer, vocab)
        out["draft-model"] = DrafterFactory(
            lambda: DraftModelDrafter(small, small_tok), lambda: BatchDraftModel(small)
        )
    if mtp is not None:
        head = load_mtp_drafter(mtp, model)
        out["mtp"] = DrafterFactory(
            lambda: MTPDrafter(head.module, model), lambda: BatchMTP(head.module)
        )
    if assistant is not None:
        loaded = load_gemma4_assistant(assistant, model)
        loaded.check_compatible(model, tokenizer, vocab)
        out["gemma4-assistant"] = DrafterFactory(
            lambda: Gemma4AssistantDrafter(loaded.assistant, model)
        )
    if eagle is not None:
        from mlx_spec.drafters.eagle3 import Eagle3Drafter, load_eagle3_drafter

        eagle_head = load_eagle3_drafter(eagle, model).module
        out["eagle3"] = DrafterFactory(
            lambda: Eagle3Drafter(eagle_head, model), lambda: BatchEagle3(eagle_head)
        )
    if dflash is not None:
        from mlx_spec.drafters.dflash import DFlashDrafter, load_dflash_drafter

        block = load_dflash_drafter(dflash, model).model
        out["dflash"] = DrafterFactory(
            lambda: DFlashDrafter(block, model), lambda: BatchDFlash(block)
        )
    if len(out) > 1:  # every drafter at once: the policy picks one each round
        makers = list(out.values())
        readers = [name for name in ("mtp", "eagle3", "dflash") if name in out]
        for name in readers[1:]:  # they read different target features: the first joins
            makers.remove(out[name])
        out[ALL] = DrafterFactory(lambda: DrafterGroup([make() for make in makers]))
    return out


def batch_engine(
    model: nn.Module, tokenizer, config: ServerConfig, drafters: dict
) -> BatchEngine | None:
    """The continuous-batching engine for the target and the drafters that can be batched, or
    None when the target cannot be (recurrent layers) or batching is off."""
    if not config.batching or not batchable(model):
        return None
    batched = {
        name: factory.batch()
        for name, factory in drafters.items()
        if name != ALL and getattr(factory, "batch", None) is not None
    }
    engine = BatchEngine(
        model,
        tokenizer,
        scored_vocab(model, tokenizer),
        batched,
        max_batch=config.max_concurrent,
        max_draft=config.max_draft,
        prefill_step=config.prefill_step,
        row_cache=RowCache(config.prompt_cache_bytes, config.prompt_cache_entries),
        max_kv_bytes=config.max_kv_bytes or int(0.4 * device_memory()),
        pace_slack=config.pace_slack,
    )
    if config.trace_steps:
        engine.trace = StepLog(config.trace_steps)
    return engine


def device_memory() -> int:
    """Bytes of memory the default device has (the machine's RAM for the CPU)."""
    try:
        info = mx.device_info()
        if info.get("memory_size"):
            return int(info["memory_size"])
    except (AttributeError, RuntimeError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class _Plan:
    """What one request asks for, checked."""

    ids: list[int]
    max_tokens: int
    drafter_name: str | None  # None: plain decoding
    num_draft: int | str
    stops: list[str]
    tools: list[dict] | None = None  # the tools the template was given: parse calls
    forced_call: bool = False  # the prompt ends with the tool-call start marker

    def splitter(self, tokenizer) -> ToolCallStream | PlainText:
        """What turns the output text into content and tool calls."""
        if self.tools is None:
            return PlainText()
        return ToolCallStream(
            tokenizer.tool_call_start,
            tokenizer.tool_call_end or "",
            tokenizer.tool_parser,
            self.tools,
            in_call=self.forced_call,
        )


class _Server:
    def __init__(self, model, tokenizer, config: ServerConfig, drafters, engine: Engine):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.drafters, self.engine = drafters, engine
        self.vocab = scored_vocab(model, tokenizer)
        self.context = context_limit(model)
        self.created = int(time.time())
        self.templated = has_chat_template(tokenizer)
        # Used on the engine thread only.
        self.prompt_cache = PromptCache(config.prompt_cache_bytes, config.prompt_cache_entries)

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
        tools, forced = None, False
        if chat:
            messages = [m.template_dict() for m in body.messages]
            specs = [t.model_dump(exclude_none=True) for t in body.tools or []]
            ids, tools, forced = self.chat_ids(messages, specs, body.tool_choice)
            if not self.templated:
                stops.append(FALLBACK_STOP)
            requested = body.max_completion_tokens or body.max_tokens
        else:
            ids = self._completion_ids(body)
            requested = body.max_tokens
        plan = self.check_plan(ids, requested, stops, body.speculative, chat)
        plan.tools, plan.forced_call = tools, forced
        return plan

    def chat_ids(
        self, messages: list[dict], tools: list[dict], tool_choice
    ) -> tuple[list[int], list[dict] | None, bool]:
        """Prompt ids for a chat, with the tools the template was given (None: no tool calls
        are parsed) and whether the prompt forces a call (tool_choice "required" or a named
        function: the prompt ends with the start marker)."""
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        named = None if isinstance(choice, str) else choice.function.name
        if choice != "none" and not tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if named is not None:
            tools = [t for t in tools if t["function"]["name"] == named]
            if not tools:
                raise APIError(
                    400, f"tool_choice names {named!r}, which is not among the tools",
                    param="tool_choice",
                )  # fmt: skip
        given = tools if choice != "none" else None
        if given and not (self.templated and supports_tools(self.tokenizer)):
            raise APIError(
                400,
                "this model's chat template does not support tool calls",
                param="tools",
                code="tools_not_supported",
            )
        try:
            text = chat_prompt(self.tokenizer, template_messages(messages), given)
        except Exception as exc:  # the template's own checks (jinja raises many types)
            raise APIError(
                400, f"the chat template cannot render these messages: {exc}",
                param="messages",
            ) from exc  # fmt: skip
        forced = bool(given) and choice != "auto"
        if forced:
            text += self.tokenizer.tool_call_start
        return encode_prompt(self.tokenizer, text), given, forced

    def check_plan(self, ids, requested, stops, speculative, chat: bool) -> _Plan:
        """The plan for prompt `ids`, or APIError when it does not fit the limits."""
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
        drafter_name, num_draft = self._speculation(speculative)
        return _Plan(ids, requested or limit, drafter_name, num_draft, stops)

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
        return name, num_draft

    # ------------------------------------------------------------------ plan -> response

    def _session(self, name: str | None, spec: dict) -> Session:
        """A fresh session (caches and drafter state) for the drafter `name`."""
        make = None if name is None else self.drafters[name]
        return Session(
            self.model,
            self.tokenizer,
            drafter=None if make is None else make(),
            num_draft=spec["num_draft"],
            max_draft=self.config.max_draft,
            check=False,  # the factories checked the drafters' weights once
        )

    async def handle(self, body: _Request, request: Request, chat: bool):
        plan = self.plan(body, chat)
        job, first, watcher = await self.start(
            plan, body.temperature, body.top_p, body.seed, request
        )
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            "created": int(time.time()),
            "model": self.config.model_id,
            "prompt_tokens": len(plan.ids),
        }
        splitter = plan.splitter(self.tokenizer)
        if body.stream:  # from here on the response watches the connection itself
            watcher.cancel()
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._events(job, first, splitter, meta, chat, include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            return await self._collect(job, first, splitter, meta, chat)
        finally:
            watcher.cancel()
            self.engine.cancel(job)

    async def start(
        self, plan: _Plan, temperature: float, top_p: float, seed, request: Request, top_k: int = 0
    ):
        """Queue the plan on the engine: (job, its first chunk, the task that cancels the job
        when the client disconnects). The first chunk comes after the prefill."""
        if seed is None and self.engine.lockstep is not None:  # the ranks must draw alike
            seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        spec = {
            "ids": plan.ids,
            "max_tokens": plan.max_tokens,
            "stops": list(plan.stops),
            "drafter": plan.drafter_name,
            "num_draft": plan.num_draft,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
        }
        job = self.job(spec, asyncio.get_running_loop())
        try:
            self.engine.submit(job)
        except QueueFull as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), code="shutting_down") from None
        watcher = asyncio.create_task(self._watch(request, job))
        try:
            first = await self.next_chunk(job)
        except BaseException:
            watcher.cancel()
            self.engine.cancel(job)
            raise
        return job, first, watcher

    def job(self, spec: dict, loop) -> Job:
        """The engine job for a request's `spec` (a JSON-able dict: every rank of a sharded
        target builds the same job from it); `loop`: where its chunks go (None: nowhere)."""
        seed, name = spec["seed"], spec["drafter"]
        if self._batched(name):
            sampling = SamplingConfig(
                temperature=spec["temperature"], top_k=spec["top_k"], top_p=spec["top_p"]
            )

            def batch_request(emit) -> BatchRequest:  # on the engine thread
                return BatchRequest(
                    spec["ids"],
                    sampling,
                    spec["max_tokens"],
                    emit,
                    stop=tuple(spec["stops"]),
                    drafter=name,
                    num_draft=spec["num_draft"],
                    seed=seed,
                )

            return Job(None, loop, seed=seed, batch=batch_request, spec=spec)
        taken: list[Session] = []

        def open_stream():  # on the engine thread
            session = self.prompt_cache.take(name, spec["ids"], lambda: self._session(name, spec))
            taken.append(session)
            return session.stream(
                spec["ids"],
                num_draft=spec["num_draft"],
                max_draft=self.config.max_draft,
                temperature=spec["temperature"],
                top_p=spec["top_p"],
                top_k=spec["top_k"],
                max_tokens=spec["max_tokens"],
                stop=tuple(spec["stops"]),
                prefill_step=self.config.prefill_step,
            )

        def release(outcome: str) -> None:  # on the engine thread, after the stream closed
            if taken and outcome != "failed":
                self.prompt_cache.put(name, taken[0])

        return Job(open_stream, loop, seed=seed, release=release, spec=spec)

    def _batched(self, name: str | None) -> bool:
        """Whether requests drafting with `name` run as rows of the batch engine (its drafter
        can be batched)."""
        batch = self.engine.batch
        return batch is not None and (name is None or name == ALL or name in batch.drafters)

    async def _watch(self, request: Request, job: Job) -> None:
        """Cancel the job as soon as its client disconnects."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the connection failed in some other way: the client is gone too
            pass
        self.engine.cancel(job)

    async def next_chunk(self, job: Job) -> GenerationChunk:
        """The job's next chunk; raises its error, or APIError(499) if it was cancelled."""
        return self._chunk(await job.queue.get())

    @staticmethod
    def _chunk(item) -> GenerationChunk:
        """A queue's item as a chunk, or its error raised as an `APIError`."""
        if item is CANCELLED:
            raise APIError(499, "the client closed the request", code="client_closed")
        if isinstance(item, ValueError):
            raise APIError(400, str(item))
        if isinstance(item, ShuttingDown):
            raise APIError(503, str(item), code="shutting_down")
        if isinstance(item, Exception):
            raise APIError(500, f"generation failed: {type(item).__name__}: {item}")
        return item

    async def output(self, job: Job, chunk: GenerationChunk, splitter):
        """The job's output as content strings and `ToolCall`s, in order, then its last chunk
        (finish reason and stats). The tokens already waiting behind a chunk go out with it
        as one piece: a speculative step's accepted tokens, or whatever piled up while the
        event loop served other streams, cost one event each time, not one per token (each
        event is a few hundred microseconds of this thread's Python, taken from the engine's
        thread on a GPU whose step of a small model is a few milliseconds)."""
        while chunk.token is not None:
            pieces, ahead = [chunk.text], None
            while ahead is None and not job.queue.empty():
                item = job.queue.get_nowait()
                if isinstance(item, GenerationChunk) and item.token is not None:
                    pieces.append(item.text)
                else:  # the last chunk, or an error: after the text before it
                    ahead = item
            for item in splitter.feed("".join(pieces)):
                yield item
            chunk = await self.next_chunk(job) if ahead is None else self._chunk(ahead)
        for item in splitter.feed(chunk.text) + splitter.finish():
            yield item
        yield chunk

    async def _collect(self, job, chunk, splitter, meta, chat) -> dict:
        pieces, calls = [], []
        async for item in self.output(job, chunk, splitter):
            if isinstance(item, str):
                pieces.append(item)
            elif isinstance(item, ToolCall):
                calls.append(item.openai())
            else:
                chunk = item
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": finish_reason(chunk, calls), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                choice["message"]["tool_calls"] = calls
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

    async def _events(self, job, chunk, splitter, meta, chat, include_usage) -> AsyncIterator[str]:
        base = {
            "id": meta["id"],
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": meta["created"],
            "model": meta["model"],
        }

        def event(delta: dict | str, finish: str | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            return _sse({**base, "choices": [choice]})

        calls = 0
        try:
            if chat:
                yield event({"role": "assistant", "content": ""})
            async for item in self.output(job, chunk, splitter):
                if isinstance(item, str):
                    yield event({"content": item} if chat else item)
                elif isinstance(item, ToolCall):
                    yield event({"tool_calls": [item.openai(index=calls)]})
                    calls += 1
                else:
                    chunk = item
            yield event({} if chat else "", finish=finish_reason(chunk, splitter.calls))
            if include_usage:
                yield _sse(
                    {**base, "choices": [], "usage": usage(chunk.stats, meta["prompt_tokens"])}
                )
            yield "data: [DONE]\n\n"
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            self.engine.cancel(job)  # a client that left mid-stream frees its work


def finish_reason(last: GenerationChunk, calls) -> str:
    """ "tool_calls" when the model stopped after calling tools, else the chunk's reason."""
    return "tool_calls" if calls and last.finish_reason == "stop" else last.finish_reason


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(stats: SpecStats, prompt_tokens: int) -> dict:
    """OpenAI usage plus a `speculative` object."""
    completion = stats.generated_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
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
            "world_size": stats.world_size,
        },
    }
