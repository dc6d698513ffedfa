"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) beside OpenAI's."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from mlx_spec.api import GenerationChunk
from mlx_spec.serving.chat import FALLBACK_STOP
from mlx_spec.serving.errors import APIError, anthropic_error_body
from mlx_spec.serving.jobs import Server
from mlx_spec.serving.openai_schemas import NamedToolChoice, SpeculativeOptions
from mlx_spec.serving.planning import Plan, Planner
from mlx_spec.serving.tools import ToolCall
from mlx_spec.serving.usage import usage

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict = Field(default_factory=dict)


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content


Block = TextBlock | ToolUseBlock | ToolResultBlock


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control and the like are ignored
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, thinking, service_tier: ignored
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # mlx-spec's own field, as on the OpenAI endpoints.
    speculative: dict | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value):
        if value and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        if value and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict]:
    """The request as OpenAI-shaped chat messages (system, user, assistant with tool_calls,
    tool), the form chat templates read."""
    out = []
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else "".join(b.text for b in system)
        out.append({"role": "system", "content": text})
    for message in body.messages:
        blocks = message.content
        if isinstance(blocks, str):
            out.append({"role": message.role, "content": blocks})
            continue
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        for result in results:  # tool results answer the assistant's calls: they come first
            out.append(
                {"role": "tool", "tool_call_id": result.tool_use_id, "content": result.text()}
            )
        if message.role == "assistant":
            entry = {"role": "assistant", "content": text}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif text or not results:
            out.append({"role": "user", "content": text})
    return out


def openai_tools(tools: list[Tool] | None) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema,
            },
        }
        for t in tools or []
    ]


def openai_tool_choice(choice: ToolChoice | None):
    """Anthropic's tool_choice as the OpenAI value `Planner.chat_ids` takes."""
    if choice is None or choice.type == "auto":
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice")
        return NamedToolChoice(type="function", function={"name": choice.name})
    return {"any": "required", "none": "none"}[choice.type]


def stop_reason(last: GenerationChunk, calls: list) -> str:
    if last.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if last.stop_sequence else "end_turn"


def _usage(last: GenerationChunk, prompt_tokens: int) -> dict:
    openai = usage(last.stats, prompt_tokens)
    return {
        "input_tokens": prompt_tokens - last.stats.cached_tokens,
        "cache_read_input_tokens": last.stats.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": last.stats.generated_tokens,
        "speculative": openai["speculative"],
    }


def add_routes(app: FastAPI, server: Server, planner: Planner) -> None:
    """`/v1/messages` and `/v1/messages/count_tokens` on the app of `server`. Requests are
    turned into the same chat messages and tool definitions as OpenAI chat requests (one chat
    template, one engine, one prompt cache); replies come back as Anthropic content blocks
    (`text`, `tool_use`) or, streaming, as its events (`message_start`, `content_block_*`,
    `message_delta`, `message_stop`)."""

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return {"input_tokens": len(prompt_ids(planner, body)[0])}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await handle(server, planner, body, request)


def prompt_ids(planner: Planner, body: MessagesRequest | CountTokensRequest):
    """The request's prompt ids, the tools given and whether a call is forced
    (`Planner.chat_ids`)."""
    planner.check_model(body.model)
    tools = openai_tools(body.tools)
    choice = openai_tool_choice(body.tool_choice) if tools else None
    return planner.chat_ids(chat_messages(body), tools, choice)


def plan(planner: Planner, body: MessagesRequest) -> Plan:
    ids, given, forced = prompt_ids(planner, body)
    stops = list(body.stop_sequences or [])
    if not planner.templated:
        stops.append(FALLBACK_STOP)
    options = None if body.speculative is None else SpeculativeOptions(**body.speculative)
    result = planner.check_plan(ids, body.max_tokens, stops, options, True)
    result.tools, result.forced_call = given, forced
    return result


async def handle(server: Server, planner: Planner, body: MessagesRequest, request: Request):
    """Plan the request, start it, and answer: a message, or its stream of events."""
    try:
        the_plan = plan(planner, body)
    except ValueError as exc:  # the speculative field's own checks
        raise APIError(400, str(exc), param="speculative") from exc
    job, first, watcher = await server.start(
        the_plan, body.temperature, body.top_p, None, request, top_k=body.top_k
    )
    splitter = the_plan.splitter(server.tokenizer)
    splitter.id_prefix = "toolu_"
    meta = {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "model": server.config.model_id,
        "prompt_tokens": len(the_plan.ids),
    }
    if body.stream:
        watcher.cancel()
        events = _events(server, job, first, splitter, meta)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        return await _collect(server, job, first, splitter, meta)
    finally:
        watcher.cancel()
        server.engine.cancel(job)


def _message(meta: dict, content: list, reason, sequence, usage: dict) -> dict:
    return {
        "id": meta["id"],
        "type": "message",
        "role": "assistant",
        "model": meta["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


async def _collect(server, job, chunk, splitter, meta) -> dict:
    content: list[dict] = []
    async for item in server.output(job, chunk, splitter):
        if isinstance(item, str):
            if content and content[-1]["type"] == "text":
                content[-1]["text"] += item
            else:
                content.append({"type": "text", "text": item})
        elif isinstance(item, ToolCall):
            content.append(_tool_use(item))
        else:
            chunk = item
    reason = stop_reason(chunk, splitter.calls)
    sequence = chunk.stop_sequence if reason == "stop_sequence" else None
    return _message(meta, content, reason, sequence, _usage(chunk, meta["prompt_tokens"]))


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input()}


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


async def _events(server, job, chunk, splitter, meta) -> AsyncIterator[str]:
    start_usage = {"input_tokens": meta["prompt_tokens"], "output_tokens": 0}
    yield _event("message_start", {"message": _message(meta, [], None, None, start_usage)})
    yield _event("ping", {})
    index, open_text = 0, False
    try:
        async for item in server.output(job, chunk, splitter):
            if isinstance(item, str):
                if not open_text:
                    block = {"type": "text", "text": ""}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                    open_text = True
                delta = {"type": "text_delta", "text": item}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            elif isinstance(item, ToolCall):
                if open_text:
                    yield _event("content_block_stop", {"index": index})
                    index, open_text = index + 1, False
                block = {**_tool_use(item), "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(item.input())}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
                index += 1
            else:
                chunk = item
        if open_text:
            yield _event("content_block_stop", {"index": index})
        reason = stop_reason(chunk, splitter.calls)
        sequence = chunk.stop_sequence if reason == "stop_sequence" else None
        usage = _usage(chunk, meta["prompt_tokens"])
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield _event("message_delta", {"delta": delta, "usage": usage})
        yield _event("message_stop", {})
    except APIError as exc:
        error = anthropic_error_body(exc.status, exc.message)["error"]
        yield _event("error", {"error": error})
    finally:
        server.engine.cancel(job)
