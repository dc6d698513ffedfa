"""The OpenAI endpoints `POST /v1/chat/completions` and `/v1/completions`, as JSON or SSE."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from mlx_spec.api import GenerationChunk, encode_prompt
from mlx_spec.serving.chat import FALLBACK_STOP
from mlx_spec.serving.errors import APIError
from mlx_spec.serving.jobs import Server
from mlx_spec.serving.openai_schemas import ChatRequest, CompletionRequest, RequestBase
from mlx_spec.serving.planning import Plan, Planner
from mlx_spec.serving.tools import ToolCall
from mlx_spec.serving.trace import final_field, tokens_field
from mlx_spec.serving.usage import usage

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def add_routes(app: FastAPI, server: Server, planner: Planner) -> None:
    """`/v1/chat/completions` and `/v1/completions` on the app of `server`."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await handle(server, planner, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handle(server, planner, body, request, chat=False)


def plan(planner: Planner, body: RequestBase, chat: bool) -> Plan:
    """The plan of a chat (`chat`) or completion request."""
    planner.check_model(body.model)
    stops = list(body.stop or [])
    tools, forced = None, False
    if chat:
        messages = [m.template_dict() for m in body.messages]
        specs = [t.model_dump(exclude_none=True) for t in body.tools or []]
        ids, tools, forced = planner.chat_ids(messages, specs, body.tool_choice)
        if not planner.templated:
            stops.append(FALLBACK_STOP)
        requested = body.max_completion_tokens or body.max_tokens
    else:
        ids = completion_ids(planner, body)
        requested = body.max_tokens
    result = planner.check_plan(ids, requested, stops, body.speculative, chat)
    result.tools, result.forced_call = tools, forced
    return result


def completion_ids(planner: Planner, body: CompletionRequest) -> list[int]:
    """The prompt ids of a completion request: one prompt, text or token ids."""
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
    ids = encode_prompt(planner.tokenizer, prompt)
    bad = next((t for t in ids if not 0 <= t < planner.vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary", param="prompt")
    return ids


async def handle(server: Server, planner: Planner, body: RequestBase, request: Request, chat):
    """Plan the request, start it, and answer: a JSON body, or an SSE stream."""
    the_plan = plan(planner, body, chat)
    job, first, watcher = await server.start(
        the_plan, body.temperature, body.top_p, body.seed, request, body.top_k, body.min_p
    )
    meta = {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        "created": int(time.time()),
        "model": server.config.model_id,
        "prompt_tokens": len(the_plan.ids),
    }
    splitter = the_plan.splitter(server.tokenizer)
    if body.stream:  # from here on the response watches the connection itself
        watcher.cancel()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        traced = [] if body.speculative is not None and body.speculative.trace else None
        events = stream(server, job, first, splitter, meta, chat, include_usage, traced)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        return await collect(server, job, first, splitter, meta, chat)
    finally:
        watcher.cancel()
        server.engine.cancel(job)


async def collect(server: Server, job, chunk, splitter, meta, chat) -> dict:
    """The whole response as one JSON body."""
    pieces, calls = [], []
    async for item in server.output(job, chunk, splitter):
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


async def stream(
    server: Server, job, chunk, splitter, meta, chat, include_usage, traced=None
) -> AsyncIterator[str]:
    """The response as server-sent events, `data: [DONE]` last (or an error event). With
    `traced` (a list), every chunk carries the `speculative` field of `trace.py`."""
    base = {
        "id": meta["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": meta["created"],
        "model": meta["model"],
    }

    def event(delta: dict | str, finish: str | None = None, last=None) -> str:
        key = "delta" if chat else "text"
        choice = {"index": 0, key: delta, "finish_reason": finish, "logprobs": None}
        payload = {**base, "choices": [choice]}
        if traced is not None:
            payload["speculative"] = (
                tokens_field(traced) if last is None else final_field(traced, last.stats)
            )
        return sse(payload)

    calls = 0
    try:
        if chat:
            yield event({"role": "assistant", "content": ""})
        async for item in server.output(job, chunk, splitter, traced):
            if isinstance(item, str):
                yield event({"content": item} if chat else item)
            elif isinstance(item, ToolCall):
                yield event({"tool_calls": [item.openai(index=calls)]})
                calls += 1
            else:
                chunk = item
        finish = finish_reason(chunk, splitter.calls)
        yield event({} if chat else "", finish=finish, last=chunk)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(chunk.stats, meta["prompt_tokens"])})
        yield "data: [DONE]\n\n"
    except APIError as exc:
        yield sse(exc.body())
    finally:
        server.engine.cancel(job)  # a client that left mid-stream frees its work


def finish_reason(last: GenerationChunk, calls) -> str:
    """ "tool_calls" when the model stopped after calling tools, else the chunk's reason."""
    return "tool_calls" if calls and last.finish_reason == "stop" else last.finish_reason


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"
