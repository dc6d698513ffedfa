"""`mlx-spec serve`: a live server on loopback, driven by the official `openai` client and by
raw HTTP; lossless per-request speculation, concurrent streams, limits and every bad request
answered with an OpenAI-style error while the server stays up."""

from __future__ import annotations

import asyncio
import json
import time

import mlx_spec
from mlx_spec.api import encode_prompt
from mlx_spec.serving.chat import FALLBACK_STOP, fallback_prompt
from mlx_spec.serving.server import ServerConfig, create_app, drafter_factories

import httpx
import openai
import pytest
from conftest import serving
from helpers import cli_here, with_eos

MODEL_ID = "tiny"
LIMIT = 480  # max_tokens limit of the test server (the context holds 512)


@pytest.fixture(scope="module")
def target(checkpoints):
    """A separate copy of the llama target and its draft model for the server's engine."""
    target_dir, draft_dir = checkpoints["llama"]
    model, tok = mlx_spec.load(str(target_dir))
    tok = with_eos(tok)  # no EOS: every generation runs to max_tokens
    return model, tok, drafter_factories(model, tok, draft_model=str(draft_dir))


def make_app(target, **config):
    model, tok, drafters = target
    settings = dict(
        model_id=MODEL_ID, max_tokens_limit=LIMIT, default_drafter="draft-model", num_draft=4
    )
    return create_app(model, tok, ServerConfig(**{**settings, **config}), drafters)


@pytest.fixture(scope="module")
def url(target):
    app = make_app(target, max_concurrent=4, max_request_bytes=4096)
    with serving(app) as base:
        base_url = base
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def expected_text(target, prompt_ids, max_tokens, stop=()):
    model, tok, _ = target
    return mlx_spec.generate(model, tok, prompt_ids, max_tokens=max_tokens, stop=stop).text


def health(url) -> dict:
    return httpx.get(f"{url}/health").json()


# --------------------------------------------------------------------- the openai client


def test_chat_stream_equals_non_stream(target, client):
    """Chat completions through the openai client at temperature 0: the streamed text equals
    the non-streamed text, and both equal the library's greedy output on the same transcript;
    usage has the token counts and the speculation stats."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]
    whole = client.chat.completions.create(
        model=MODEL_ID, messages=messages, temperature=0, max_tokens=24
    )
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=messages, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    text = whole.choices[0].message.content
    assert "".join(pieces) == text
    ids = encode_prompt(target[1], fallback_prompt(messages))
    assert text == expected_text(target, ids, 24, (FALLBACK_STOP,))
    assert finish == whole.choices[0].finish_reason and whole.model == MODEL_ID
    for u in (whole.usage, usage):
        assert u.prompt_tokens == len(ids) and u.total_tokens == len(ids) + u.completion_tokens
        spec = u.model_extra["speculative"]
        assert spec["enabled"] and spec["drafter"] == "draft-model" and spec["num_draft"] == 4
        assert spec["drafted_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1
        assert spec["mean_accepted_length"] >= 1 and spec["decode_tokens_per_sec"] > 0


SPECULATION = {  # request's "speculative" field: the drafter that should run
    "default": (None, "draft-model"),
    "off": ({"enabled": False}, None),
    "ngram-k2": ({"drafter": "ngram", "num_draft": 2}, "ngram"),
    "k0": ({"num_draft": 0}, None),
    "draft-k6": ({"drafter": "draft-model", "num_draft": 6}, "draft-model"),
    "auto": ({"drafter": "ngram", "num_draft": "auto"}, "ngram"),
    "all": ({"drafter": "all", "num_draft": "auto"}, "ngram+draft-model"),
}


@pytest.mark.parametrize("case", SPECULATION)
def test_completions_per_request_speculation(target, client, case):
    """Completions, streamed and not, with speculation on, off or another drafter per request:
    greedy text is the same every time (lossless); usage says what ran."""
    speculative, drafter = SPECULATION[case]
    extra = {} if speculative is None else {"extra_body": {"speculative": speculative}}
    kwargs = dict(model=MODEL_ID, prompt="abcab cab", temperature=0, max_tokens=30, **extra)
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    model, tok, _ = target
    expected = mlx_spec.generate(model, tok, "abcab cab", max_tokens=30)
    assert whole.choices[0].text == streamed == expected.text
    assert whole.usage.completion_tokens == len(expected.tokens)
    spec = whole.usage.model_extra["speculative"]
    assert spec["drafter"] == drafter and spec["enabled"] == (drafter is not None)
    if drafter is not None:
        assert spec["num_draft"] == (speculative or {}).get("num_draft", 4)
        assert sum(spec["k_histogram"].values()) == spec["target_passes"]
        assert spec["drafted_tokens"] > 0 or spec["num_draft"] == "auto"


def test_token_id_prompt_and_stop(target, client):
    """A prompt of token ids; a stop string ends the text before it (finish_reason stop)."""
    ids = [1, 3, 4, 5, 3, 4]
    full = client.completions.create(model=MODEL_ID, prompt=ids, temperature=0, max_tokens=20)
    text = full.choices[0].text
    assert text == expected_text(target, ids, 20)
    stop = text[5:7]
    cut = client.completions.create(
        model=MODEL_ID, prompt=ids, temperature=0, max_tokens=20, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_under_interleaving(client, url):
    """A seeded request at temperature 1 with a fixed k gives the same output alone and
    interleaved with other sampled requests (each row draws from its own random stream)."""
    for num_draft in (4, 0):
        kwargs = dict(
            model=MODEL_ID, prompt="abc", temperature=1.0, max_tokens=20,
            extra_body={"speculative": {"drafter": "ngram", "num_draft": num_draft}},
        )  # fmt: skip
        alone = client.completions.create(seed=7, **kwargs).choices[0].text

        async def run(kwargs=kwargs):
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
                calls = [
                    c.completions.create(seed=None if i % 2 else 7, **kwargs) for i in range(4)
                ]
                return await asyncio.gather(*calls)

        results = asyncio.run(run())
        assert [r.choices[0].text for r in results[::2]] == [alone, alone]
        assert results[1].choices[0].text != alone or results[3].choices[0].text != alone


def test_models_and_health(client, url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    status = health(url)
    assert status["status"] == "ok" and status["model"] == MODEL_ID
    assert {"active", "queued", "completed", "cancelled", "failed"} <= set(status)


# ------------------------------------------------------------------------------ concurrency


@pytest.mark.parametrize(
    "speculative",
    [None, {"drafter": "ngram", "num_draft": 3}, {"drafter": "draft-model"}, {"drafter": "all"}],
    ids=["default", "ngram-k3", "draft-model-auto", "all-auto"],
)
def test_eight_concurrent_streams(target, url, speculative):
    """8 streaming clients at once against max_concurrent=4, with speculation on: every stream
    completes without error and carries exactly its own single-stream greedy text; four rows
    were batched together."""
    prompts = ["abc", "mad", "pop", "olio", "lame", "ink", "fog", "nap"]
    extra = {} if speculative is None else {"extra_body": {"speculative": speculative}}

    async def one(c, prompt):
        stream = await c.completions.create(
            model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=40, stream=True, **extra
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    before = health(url)
    texts = asyncio.run(run())
    assert texts == [expected_text(target, p, 40) for p in prompts]
    after = health(url)
    assert after["completed"] - before["completed"] == 8
    assert after["failed"] == before["failed"] and after["peak_active"] == 4
    assert after["batching"] is True


def test_disconnect_mid_stream_frees_the_work(url):
    """A streaming client that leaves after a few events: its generation is cancelled (not run
    to max_tokens) and the server serves the next request."""
    before = health(url)
    body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": LIMIT, "stream": True,
            "temperature": 0}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break
    _wait_for(lambda: health(url)["cancelled"] == before["cancelled"] + 1, url)
    assert health(url)["completed"] == before["completed"] and health(url)["active"] == 0
    ok = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 3})
    assert ok.status_code == 200


def test_disconnect_while_waiting_for_a_whole_reply(url):
    """A non-streaming client that times out and leaves: its generation is cancelled too."""
    before = health(url)
    body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": LIMIT, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.2)
    _wait_for(lambda: health(url)["cancelled"] == before["cancelled"] + 1, url)
    assert health(url)["active"] == 0


def _wait_for(condition, url, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, health(url)
        time.sleep(0.05)


def test_queue_limit_answers_429(target):
    """With one active generation and one queued, a third request is refused with 429 (and the
    first two complete)."""
    app = make_app(target, max_concurrent=1, max_queued=1)
    body = {"model": MODEL_ID, "prompt": "abc", "max_tokens": 150, "temperature": 0}

    async def run(base):
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            await _until(lambda: app.state.engine.status()["active"] == 1)
            second = asyncio.create_task(c.post("/v1/completions", json=body))
            await _until(lambda: app.state.engine.status()["queued"] == 1)
            third = await c.post("/v1/completions", json=body)
            return await first, await second, third

    with serving(app) as base:
        first, second, third = asyncio.run(run(base))
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert third.json()["error"]["code"] == "queue_full"


async def _until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------- bad requests

CHAT = "/v1/chat/completions"
DONE = "/v1/completions"
OK_CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
OK_DONE = {"model": MODEL_ID, "prompt": "abc", "max_tokens": 4}

BAD = {  # name: (path, body (dict, or raw bytes), status, param, code)
    "malformed-json": (CHAT, b'{"model": "tiny", "messages": [', 400, None, "invalid_json"),
    "not-an-object": (CHAT, b"[1, 2]", 400, None, None),
    "empty-body": (CHAT, b"", 400, None, None),
    "no-model": (CHAT, {"messages": OK_CHAT["messages"]}, 400, "model", None),
    "unknown-model": (CHAT, {**OK_CHAT, "model": "gpt-4"}, 404, "model", "model_not_found"),
    "no-messages": (CHAT, {"model": MODEL_ID}, 400, "messages", None),
    "empty-messages": (CHAT, {**OK_CHAT, "messages": []}, 400, "messages", None),
    "bad-role": (
        CHAT,
        {**OK_CHAT, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages.0.role",
        None,
    ),  # fmt: skip
    "temperature-type": (CHAT, {**OK_CHAT, "temperature": "hot"}, 400, "temperature", None),
    "temperature-range": (CHAT, {**OK_CHAT, "temperature": 3}, 400, "temperature", None),
    "top-p-zero": (CHAT, {**OK_CHAT, "top_p": 0}, 400, "top_p", None),
    "max-tokens-zero": (CHAT, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    "max-tokens-over-limit": (
        CHAT,
        {**OK_CHAT, "max_tokens": LIMIT + 1},
        400,
        "max_tokens",
        "max_tokens_exceeded",
    ),  # fmt: skip
    "n-2": (CHAT, {**OK_CHAT, "n": 2}, 400, "n", None),
    "five-stops": (CHAT, {**OK_CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    "negative-seed": (CHAT, {**OK_CHAT, "seed": -1}, 400, "seed", None),
    "unknown-drafter": (
        CHAT,
        {**OK_CHAT, "speculative": {"drafter": "eagle"}},
        400,
        "speculative.drafter",
        "unknown_drafter",
    ),  # fmt: skip
    "num-draft-negative": (
        CHAT,
        {**OK_CHAT, "speculative": {"num_draft": -1}},
        400,
        "speculative.num_draft",
        None,
    ),  # fmt: skip
    "num-draft-huge": (
        CHAT,
        {**OK_CHAT, "speculative": {"num_draft": 1000}},
        400,
        "speculative.num_draft",
        None,
    ),  # fmt: skip
    "num-draft-word": (
        CHAT,
        {**OK_CHAT, "speculative": {"num_draft": "fast"}},
        400,
        "speculative.num_draft",
        None,
    ),  # fmt: skip
    "speculative-unknown-key": (
        CHAT,
        {**OK_CHAT, "speculative": {"k": 3}},
        400,
        "speculative.k",
        None,
    ),  # fmt: skip
    "echo": (DONE, {**OK_DONE, "echo": True}, 400, "echo", None),
    "two-prompts": (DONE, {**OK_DONE, "prompt": ["ab", "cd"]}, 400, "prompt", None),
    "empty-prompt": (DONE, {**OK_DONE, "prompt": ""}, 400, "prompt", None),
    "token-outside-vocab": (DONE, {**OK_DONE, "prompt": [1, 99999]}, 400, "prompt", None),
    "prompt-over-context": (
        DONE,
        {**OK_DONE, "prompt": "a" * 600},
        400,
        "prompt",
        "context_length_exceeded",
    ),  # fmt: skip
    "body-too-large": (DONE, {**OK_DONE, "prompt": "a" * 5000}, 413, None, "request_too_large"),
}


def check_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    assert error["param"] == param and error["code"] == code, error


@pytest.mark.parametrize("case", BAD)
def test_bad_request(url, case):
    """Each bad request gets its 4xx status and an OpenAI-style error naming the culprit; the
    server keeps serving."""
    path, body, status, param, code = BAD[case]
    if isinstance(body, bytes):
        response = httpx.post(
            url + path, content=body, headers={"content-type": "application/json"}
        )
    else:
        response = httpx.post(url + path, json=body)
    check_error(response, status, param, code)
    assert httpx.post(url + DONE, json=OK_DONE).status_code == 200


def test_streamed_body_over_the_limit(url):
    """A body sent in chunks (no Content-Length) is cut off at the limit too."""

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    response = httpx.post(
        url + DONE, content=chunks(), headers={"content-type": "application/json"}
    )
    check_error(response, 413, None, "request_too_large")


def test_unknown_route_and_method(url):
    check_error(httpx.get(url + "/v1/nothing"), 404, None, "not_found")
    check_error(httpx.get(url + DONE), 405, None, "method_not_allowed")
    check_error(httpx.get(url + "/v1/models/gpt-4"), 404, "model", "model_not_found")


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="abc", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt="abc", max_tokens=LIMIT + 1)
    assert info.value.body["param"] == "max_tokens"


def test_api_key(target):
    """With an API key, /v1 needs it (401 otherwise); /health does not."""
    with serving(make_app(target, api_key="sesame")) as base:
        check_error(httpx.post(base + DONE, json=OK_DONE), 401, None, "invalid_api_key")
        wrong = {"Authorization": "Bearer open"}
        check_error(httpx.post(base + DONE, json=OK_DONE, headers=wrong), 401, None,
                    "invalid_api_key")  # fmt: skip
        assert httpx.get(base + "/health").status_code == 200
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=MODEL_ID, prompt="abc", max_tokens=3).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="open", max_retries=0).models.list()


def test_serve_cli_errors(checkpoints):
    """`serve` with a bad limit or a missing model: one error line, exit code 2."""
    target = str(checkpoints["llama"][0])
    for args in (["--model", target, "--max-concurrent", "0"], ["--model", "/nonexistent"]):
        proc = cli_here("serve", *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "mlx-spec: error:" in proc.stderr


def test_serve_pace_slack_reaches_the_engine(target):
    """`--pace-slack` (a share, or 'off') is parsed and handed to the batch engine; a value
    outside [0, 1) is refused by the parser with its reason."""
    from mlx_spec.cli import build_parser
    from mlx_spec.serving.server import ServerConfig, batch_engine

    parser = build_parser()
    assert parser.parse_args(["serve"]).pace_slack is None
    assert parser.parse_args(["serve", "--pace-slack", "0.05"]).pace_slack == 0.05
    assert parser.parse_args(["serve", "--pace-slack", "off"]).pace_slack is None
    for bad in ("1.5", "-0.1", "fast"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--pace-slack", bad])
    model, tok, _ = target
    for slack in (0.05, None):
        engine = batch_engine(model, tok, ServerConfig(pace_slack=slack), {})
        assert engine.pace_slack == slack


def test_serve_trace_steps_reaches_the_engine(target, tmp_path):
    """`--trace-steps FILE` gives the batch engine a `StepLog` on FILE; a file that cannot be
    written, or the flag with --no-batching, is a clear error before the model loads."""
    from mlx_spec.cli import build_parser, main
    from mlx_spec.cli.serve import trace_file
    from mlx_spec.decoding.engine import StepLog
    from mlx_spec.serving.server import ServerConfig, batch_engine

    path = str(tmp_path / "steps.jsonl")
    assert build_parser().parse_args(["serve", "--trace-steps", path]).trace_steps == path
    assert trace_file(None, False) is None and trace_file(path, False) == path
    with pytest.raises(ValueError, match="no-batching"):
        trace_file(path, True)
    with pytest.raises(ValueError, match="cannot write"):
        trace_file(str(tmp_path / "missing" / "steps.jsonl"), False)
    assert main(["serve", "--trace-steps", str(tmp_path / "missing" / "x.jsonl")]) != 0
    model, tok, _ = target
    engine = batch_engine(model, tok, ServerConfig(trace_steps=path), {})
    assert isinstance(engine.trace, StepLog) and engine.trace.file.name == path
    assert batch_engine(model, tok, ServerConfig(), {}).trace is None


def test_waiting_tokens_go_out_as_one_piece():
    """`Server.output`: the token chunks already queued behind a chunk (a speculative step's
    tokens, or a reader behind the engine) come out as one string; the last chunk, or an
    error, still comes after the text before it; a token arriving later is a piece of its
    own."""
    from types import SimpleNamespace

    from mlx_spec.api import GenerationChunk
    from mlx_spec.serving.jobs import Server
    from mlx_spec.serving.scheduler import CANCELLED
    from mlx_spec.serving.server import APIError

    server = object.__new__(Server)  # output() reads nothing of the server's state
    splitter = SimpleNamespace(feed=lambda text: [text] if text else [], finish=lambda: [])

    async def run(later, *queued):
        job = SimpleNamespace(queue=asyncio.Queue())
        for item in queued:
            job.queue.put_nowait(item)

        async def feed():
            await asyncio.sleep(0.01)
            for item in later:
                job.queue.put_nowait(item)

        task = asyncio.ensure_future(feed())
        out = [item async for item in server.output(job, GenerationChunk("a", 1), splitter)]
        await task
        return out

    final = GenerationChunk("", None, finish_reason="length")
    tokens = [GenerationChunk(t, i) for i, t in enumerate("bcd", start=2)]
    out = asyncio.run(run([], *tokens, final))
    assert out == ["abcd", final]
    out = asyncio.run(run([GenerationChunk("e", 9), final], *tokens))
    assert out == ["abcd", "e", final]
    for error, status in ((CANCELLED, 499), (RuntimeError("boom"), 500)):
        seen = []

        async def collect(error=error, seen=seen):
            job = SimpleNamespace(queue=asyncio.Queue())
            for item in [*tokens, error]:
                job.queue.put_nowait(item)
            async for item in server.output(job, GenerationChunk("a", 1), splitter):
                seen.append(item)

        with pytest.raises(APIError) as caught:
            asyncio.run(collect())
        assert seen == ["abcd"] and caught.value.status == status


def test_sse_format(url):
    """Raw SSE: `data: {json}` events, a role-only first chat delta, `data: [DONE]` last."""
    body = {**OK_CHAT, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + CHAT, json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_serve_keeps_what_it_loaded_out_of_the_collector(checkpoints, monkeypatch):
    """`serve` freezes what it loaded (the model, the libraries) before it serves: the
    garbage collector's full passes then scan only what the requests leave, not a pause of
    every stream for all of it."""
    import gc

    from mlx_spec.cli import main

    import uvicorn

    frozen = []

    def run(app, **kwargs):
        frozen.append(gc.get_freeze_count())
        app.state.engine.close()

    monkeypatch.setattr(uvicorn, "run", run)
    assert gc.get_freeze_count() == 0
    try:
        assert main(["serve", "--model", str(checkpoints["llama"][0])]) == 0
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000
