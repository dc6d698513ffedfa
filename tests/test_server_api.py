"""The server's agent-facing side, live on loopback: OpenAI tool calls (through the official
`openai` client, streaming and not), the Anthropic Messages API (through the official
`anthropic` client), and the prompt cache across requests (a conversation's next turn prefills
only its new tokens and answers as from scratch)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import mlx_spec
from mlx_spec.serving.chat import fallback_prompt
from mlx_spec.serving.scheduler import Engine, Job
from mlx_spec.serving.server import ServerConfig, create_app, drafter_factories
from mlx_spec.serving.session import PREFILLING, Session

import anthropic
import httpx
import openai
import pytest
import tinymodels as tm
from conftest import serving
from helpers import with_eos

MODEL_ID = "tiny-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "weather in paris"}]


@pytest.fixture(scope="module")
def tool_url(tmp_path_factory):
    """A server on the checkpoint whose template supports tools (it always calls get_weather
    after "<|assistant|>" and answers "done" after a tool result), drafting with the n-gram
    lookup and the model itself (every draft right), under an API key."""
    path = tm.write_tool_checkpoint(tmp_path_factory.mktemp("tools") / "model")
    model, tok = mlx_spec.load(str(path))
    drafters = drafter_factories(model, tok, draft_model=str(path))
    config = ServerConfig(model_id=MODEL_ID, default_drafter="all", api_key="sk-test")
    with serving(create_app(model, tok, config, drafters)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(tool_url):
    return openai.OpenAI(base_url=f"{tool_url}/v1", api_key="sk-test", max_retries=0)


@pytest.fixture(scope="module")
def claude(tool_url):
    return anthropic.Anthropic(base_url=tool_url, api_key="sk-test", max_retries=0)


# ------------------------------------------------------------------------ OpenAI tool calls


def test_tool_call_non_streaming(oai):
    reply = oai.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_streaming_matches(oai):
    stream = oai.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER], stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == len(calls)
            calls.append(call)
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_tool_results_in_the_history(oai):
    """The assistant's call and the tool's result go back through the template: the model
    answers in text."""
    first = oai.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    reply = oai.chat.completions.create(model=MODEL_ID, messages=history, tools=[WEATHER])
    assert reply.choices[0].message.content == tm.TOOL_REPLY
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_tool_choice(oai, tool_url):
    # none: the tools are not offered, the text is returned as it is.
    reply = oai.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.tool_calls is None
    assert tm.TOOL_CALL_TEXT in reply.choices[0].message.content
    # a named function (and "required"): the prompt starts the call, which is parsed.
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        reply = oai.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=[WEATHER, OTHER], tool_choice=choice
        )
        assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    for body, param in [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ]:  # fmt: skip
        response = httpx.post(
            f"{tool_url}/v1/chat/completions",
            json={"model": MODEL_ID, "messages": ASK, **body},
            headers={"Authorization": "Bearer sk-test"},
        )
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


def test_tools_on_a_model_without_tool_support(checkpoints):
    """A template-less model refuses tools with a clear 400 (not silence)."""
    model, tok = mlx_spec.load(str(checkpoints["llama"][0]))
    with serving(create_app(model, tok, ServerConfig(model_id="plain"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="plain", messages=ASK, tools=[WEATHER])
        assert caught.value.code == "tools_not_supported"
        assert "tool" in caught.value.message
        reply = client.chat.completions.create(  # tool_choice none: the tools are ignored
            model="plain", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=3
        )
        assert reply.choices[0].finish_reason in ("length", "stop")


# ------------------------------------------------------------------ Anthropic Messages API

CLAUDE_TOOL = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_anthropic_tool_use(claude):
    message = claude.messages.create(
        model=MODEL_ID,
        max_tokens=32,
        system="be useful",
        messages=[{"role": "user", "content": "weather in paris"}],
        tools=[CLAUDE_TOOL],
    )
    assert message.stop_reason == "tool_use" and message.role == "assistant"
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and block.input == {"city": "Paris"}
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0
    history = [
        {"role": "user", "content": "weather in paris"},
        {"role": "assistant", "content": [block.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}],
        },
    ]
    answer = claude.messages.create(
        model=MODEL_ID, max_tokens=32, messages=history, tools=[CLAUDE_TOOL]
    )
    assert answer.stop_reason == "end_turn"
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == tm.TOOL_REPLY


def test_anthropic_streaming_equals_non_streaming(claude):
    kwargs = dict(
        model=MODEL_ID,
        max_tokens=32,
        messages=[{"role": "user", "content": "weather in paris"}],
        tools=[CLAUDE_TOOL],
    )
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        (b.type, b.name, b.input) for b in whole.content
    ]
    # Text, with a stop sequence and a token limit.
    text = claude.messages.create(
        model=MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert text.stop_reason == "max_tokens" and text.usage.output_tokens == 2
    with claude.messages.stream(
        model=MODEL_ID, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        assert stream.get_final_text() == text.content[0].text


def test_anthropic_stop_sequence_and_count_tokens(claude):
    history = [
        {"role": "user", "content": "weather"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]  # fmt: skip
    message = claude.messages.create(
        model=MODEL_ID, max_tokens=32, messages=history, stop_sequences=["n"]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "n"
    assert message.content[0].text == "do"
    count = claude.messages.count_tokens(model=MODEL_ID, messages=history, tools=[CLAUDE_TOOL])
    assert count.input_tokens > 10


def test_anthropic_errors(claude, tool_url):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(
            model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL_ID, max_tokens=0, messages=[])
    assert caught.value.body["type"] == "error"
    wrong = anthropic.Anthropic(base_url=tool_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(
            model=MODEL_ID, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    response = httpx.post(
        f"{tool_url}/v1/messages",
        json={"model": MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]},
        headers={"x-api-key": "sk-test"},
    )  # fmt: skip
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------- prompt cache


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("drafter", [None, "draft-model"])
def test_conversation_turns_reuse_the_cache(checkpoints, family, drafter):
    """Four turns of a growing conversation: from the second on, the whole earlier transcript
    comes from the prompt cache (`cached_tokens`), and every reply is the greedy reply from
    scratch; a request between the turns (another conversation) does not disturb it."""
    target_dir, draft_dir = checkpoints[family]
    model, tok = mlx_spec.load(str(target_dir))
    tok = with_eos(tok)
    drafters = drafter_factories(model, tok, draft_model=str(draft_dir))
    config = ServerConfig(model_id="t", default_drafter=drafter, num_draft=3)
    with serving(create_app(model, tok, config, drafters)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages, cached, prompts = [], [], []
        for turn in range(4):
            messages.append({"role": "user", "content": "abc"[: turn + 1] + " mop"})
            reply = client.chat.completions.create(
                model="t", messages=messages, max_tokens=6, temperature=0
            )
            text = reply.choices[0].message.content
            expected = mlx_spec.generate(model, tok, fallback_prompt(messages), max_tokens=6)
            assert text == expected.text, turn
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            prompts.append(reply.usage.prompt_tokens)
            messages.append({"role": "assistant", "content": text})
            client.completions.create(model="t", prompt="ponm", max_tokens=3)  # interleaved
        assert cached[0] == 0
        # Each turn reuses at least the prompt of the turn before (all but its last token,
        # which is fed with the first pass), and on KV caches most of the reply too.
        assert all(cached[t] >= prompts[t - 1] - 1 for t in range(1, 4)), (cached, prompts)
        health = httpx.get(f"{url}/health").json()
        status = health["prompt_cache"]
        assert status["hits"] >= 3 and status["entries"] >= 1 and status["bytes"] > 0
        # The hybrid target's recurrent state cannot be rolled back per row in a batch: its
        # requests are solo streams (the same answers, the same prompt cache).
        assert health["batching"] is (family != "qwen3_5")


# ------------------------------------------------------------------------ chunked prefill


async def _tokens_of(engine: Engine, jobs: list[Job]) -> list[list[int]]:
    """Submit the jobs, read each one's tokens to its end, close the engine."""
    for job in jobs:
        engine.submit(job)
    outputs = []
    for job in jobs:
        tokens = []
        while (chunk := await job.queue.get()).token is not None:
            tokens.append(chunk.token)
        outputs.append(tokens)
    engine.close()
    return outputs


def test_a_long_prefill_interleaves_with_other_streams(loaded):
    """A long prompt is prefilled one chunk per engine turn: the stream already running gets
    tokens between its chunks; both outputs equal their single-stream greedy outputs."""
    model, tok, _, _ = loaded["llama"]
    tok = with_eos(tok)
    log = []

    def opener(name, prompt, step):
        def open_stream():
            for chunk in Session(model, tok, num_draft=0).stream(
                prompt, max_tokens=12, prefill_step=step
            ):
                log.append((name, chunk is PREFILLING))
                yield chunk

        return open_stream

    short, long = [5, 6, 7], [3 + (i * 7) % 17 for i in range(300)]

    async def run():
        loop = asyncio.get_running_loop()
        engine = Engine(max_concurrent=2)
        jobs = [Job(opener("a", short, 16), loop), Job(opener("b", long, 16), loop)]
        return await _tokens_of(engine, jobs)

    outputs = asyncio.run(run())
    for prompt, tokens in zip((short, long), outputs, strict=True):
        assert tokens == mlx_spec.generate(model, tok, prompt, max_tokens=12).tokens
    chunks = [i for i, (name, marker) in enumerate(log) if name == "b" and marker]
    assert len(chunks) == (len(long) - 1 + 15) // 16 - 1  # all chunks but the last
    between = [name for name, _ in log[chunks[0] : chunks[-1]]]
    assert between.count("a") >= min(len(chunks) - 1, 12)  # "a" decoded meanwhile


def test_a_batch_steps_chunks_reach_the_event_loop_together():
    """The chunks one step of the batch engine puts on its rows' queues are handed to the event
    loop in one call (not one per row), each queue's in order; a job's first chunk at once."""

    class Steps:  # a batch engine's surface: every row gets a token per step, 4 in all
        threads = None

        def __init__(self):
            self.rows = []

        @property
        def busy(self):
            return any(left for _, left in self.rows)

        def add(self, emit):
            self.rows.append([emit, 4])
            return len(self.rows) - 1

        def step(self):
            for row in self.rows:
                emit, left = row
                if left:
                    emit(SimpleNamespace(token=10 * left))
                    row[1] = left - 1
                    if not row[1]:
                        emit(SimpleNamespace(token=None))

    async def run():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(a) or real(*a)
        engine = Engine(max_concurrent=3, batch=Steps())
        jobs = [Job(None, loop, batch=lambda emit: emit) for _ in range(3)]
        return await _tokens_of(engine, jobs), calls

    outputs, calls = asyncio.run(run())
    assert outputs == [[40, 30, 20, 10]] * 3
    # each job's first chunk at once (the time to first token), then one call per step (4 a
    # job, at most 6 in all: jobs admitted over up to three turns), against 15 chunks
    firsts = [c for c in calls if getattr(c[0], "__name__", "") == "put_nowait"]
    assert len(firsts) == 3
    assert len(calls) - len(firsts) <= 6
