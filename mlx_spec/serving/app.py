"""`create_app`: the FastAPI app of `mlx-spec serve`, with the OpenAI and Anthropic routes."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from mlx_spec.decoding import distributed
from mlx_spec.drafters.base import Drafter
from mlx_spec.serving import anthropic, openai_api
from mlx_spec.serving.config import ServerConfig
from mlx_spec.serving.errors import add_error_handlers
from mlx_spec.serving.jobs import Server
from mlx_spec.serving.middleware import APIKey, BodyLimit
from mlx_spec.serving.page import add_page_routes
from mlx_spec.serving.planning import Planner
from mlx_spec.serving.startup import build_server

import mlx.nn as nn
from fastapi import FastAPI


def create_app(
    model: nn.Module,
    tokenizer,
    config: ServerConfig | None = None,
    drafters: dict[str, Callable[[], Drafter]] | None = None,
) -> FastAPI:
    """The FastAPI app serving `model`.

    Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both streaming over SSE or
    not), `GET /v1/models`, `GET /health`, Anthropic's `POST /v1/messages`, and the chat page
    at `/` (unless `config.ui` is off). All MLX work
    happens on one engine thread (`scheduler.py`), which runs up to `max_concurrent`
    generations at once as rows of a continuously batched engine (one target pass per step for
    all of them, speculation included), or, where the target or drafter cannot be batched, as
    solo streams advanced one round at a time; later requests wait first-in first-out. A
    request reuses the caches an earlier one left with a prefix in common; the extra field
    `"speculative": {"enabled", "drafter", "num_draft"}` chooses speculation per request, and
    `usage.speculative` reports it.

    Args:
        model, tokenizer: the target, from `mlx_spec.load`.
        config: limits and defaults.
        drafters: {name: factory of a fresh drafter} that requests may choose from; "ngram" is
            always offered.
    Returns:
        The app; run it with uvicorn. Its engine thread stops when the app shuts down.
    """
    config = config or ServerConfig()
    server = build_server(model, tokenizer, config, drafters)
    planner = Planner(model, tokenizer, config, server.drafters)
    engine = server.engine

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="mlx-spec", lifespan=lifespan)
    app.state.engine, app.state.config = engine, config
    app.add_middleware(BodyLimit, limit=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(APIKey, key=config.api_key)
    add_error_handlers(app)
    add_info_routes(app, server, planner)
    openai_api.add_routes(app, server, planner)
    anthropic.add_routes(app, server, planner)
    if config.ui:
        add_page_routes(app)
    return app


def add_info_routes(app: FastAPI, server: Server, planner: Planner) -> None:
    """`GET /health`, `/v1/models` and `/v1/models/{id}`."""
    created = int(time.time())

    @app.get("/health")
    async def health():
        return health_status(server)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_info(server, created)]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        planner.check_model(model_id)
        return model_info(server, created)


def health_status(server: Server) -> dict:
    """The engine's state, whether it batches, the world size and the prompt cache's use."""
    engine, config = server.engine, server.config
    status = {"status": "ok", "model": config.model_id, **engine.status()}
    batch = engine.batch
    cache = server.prompt_cache if batch is None else batch.row_cache
    status["batching"] = batch is not None
    sharding = distributed.sharding_of(server.model)
    status["world_size"] = 1 if sharding is None else sharding.size
    return {**status, "prompt_cache": cache.status()}


def model_info(server: Server, created: int) -> dict:
    """The model's card, with the drafters offered."""
    return {
        "id": server.config.model_id,
        "object": "model",
        "created": created,
        "owned_by": "mlx-spec",
        "drafters": sorted(server.drafters),
    }
