"""The speculation trace of a stream (`"speculative": {"trace": true}`), live on loopback, in the
batch engine and in solo streams: greedy output unchanged, one entry per token whose kinds add
up to the stats, ignored by the openai client; and `top_k` / `min_p` on the OpenAI endpoints."""

from __future__ import annotations

import json
from collections import Counter

import mlx_spec
from mlx_spec.serving.server import ServerConfig, create_app, drafter_factories

import httpx
import openai
import pytest
from conftest import serving
from helpers import with_eos

MODEL_ID = "tiny"
PROMPT = "abcab cab abcab"
SPECULATION = {
    "off": {"enabled": False},
    "ngram-k2": {"drafter": "ngram", "num_draft": 2},
    "draft-k4": {"drafter": "draft-model", "num_draft": 4},
    "all-auto": {"drafter": "all", "num_draft": "auto"},
}
TARGET_KINDS = ("recovered", "bonus", "plain")


@pytest.fixture(scope="module")
def target(checkpoints):
    target_dir, draft_dir = checkpoints["llama"]
    model, tok = mlx_spec.load(str(target_dir))
    tok = with_eos(tok)  # no EOS: every generation runs to max_tokens
    return model, tok, drafter_factories(model, tok, draft_model=str(draft_dir))


@pytest.fixture(scope="module", params=["batch", "solo"])
def url(request, target):
    """A server whose requests run as rows of the batch engine, or as solo streams."""
    model, tok, drafters = target
    config = ServerConfig(model_id=MODEL_ID, batching=request.param == "batch")
    with serving(create_app(model, tok, config, drafters)) as base:
        yield base


def events(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    """The JSON payloads of a streamed response (without `[DONE]`)."""
    out = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def completion(speculative: dict, max_tokens: int = 40, **extra) -> dict:
    return {
        "model": MODEL_ID, "prompt": PROMPT, "temperature": 0, "max_tokens": max_tokens,
        "speculative": speculative, **extra,
    }  # fmt: skip


@pytest.mark.parametrize("case", SPECULATION)
def test_trace_counts_equal_the_stats(url, case):
    """Greedy text is the same with the trace and without; every token has one entry, the
    entries' texts are the chunks' texts, the drafted tokens are the accepted count, the
    target's own tokens one per target pass (less a last round cut inside its drafts), and
    the rounds' draft counts add up to the drafted count."""
    speculative = SPECULATION[case]
    plain = events(url, completion(speculative))
    traced = events(url, completion({**speculative, "trace": True}))
    text = "".join(e["choices"][0]["text"] for e in plain)
    assert "".join(e["choices"][0]["text"] for e in traced) == text
    assert all("speculative" not in e for e in plain)
    entries = []
    for e in traced:
        tokens = e["speculative"]["tokens"]
        if tokens:
            assert "".join(t["text"] for t in tokens) == e["choices"][0]["text"]
        entries += tokens
    summary = traced[-1]["speculative"]["summary"]
    kinds = Counter(t["kind"] for t in entries)
    assert len(entries) == summary["generated_tokens"] == 40
    assert kinds["draft"] == summary["accepted_tokens"]
    cut = entries[-1]["kind"] == "draft"
    assert sum(kinds[k] for k in TARGET_KINDS) == summary["target_passes"] - cut
    closing = [t for t in entries if t["kind"] != "draft"]
    drafted = sum(t["drafted"] for t in closing)
    assert drafted == summary["drafted_tokens"] if not cut else drafted <= summary["drafted_tokens"]
    assert all((t["kind"] == "plain") == (t["drafted"] == 0) for t in closing)
    if case == "off":
        assert kinds["plain"] == 40 and summary["drafter"] is None
        return
    names = {t.get("drafter") for t in entries if t["kind"] == "draft"}
    offered = {"ngram", "draft-model"} if case == "all-auto" else {speculative["drafter"]}
    assert names <= offered and summary["drafter"] is not None
    by_position = summary["acceptance_by_position"]
    assert all(0 <= a <= 1 for a in by_position)


def test_trace_alone_keeps_the_default_speculation(url):
    """`{"trace": true}` alone leaves speculation as the server's default (here: none)."""
    traced = events(url, completion({"trace": True}, max_tokens=8))
    assert traced[-1]["speculative"]["summary"]["drafter"] is None


def test_chat_trace_and_the_openai_client(url, target):
    """The chat stream carries the field on every chunk; the official client reads the same
    content, keeping the field as an unknown extra."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "abc"}], temperature=0,
                  max_tokens=24)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(
        stream=True, extra_body={"speculative": {"drafter": "draft-model", "trace": True}},
        **kwargs,
    )  # fmt: skip
    pieces, extras = [], []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        extras.append(chunk.model_extra["speculative"])
    assert "".join(pieces) == whole
    assert "summary" in extras[-1] and sum(len(e["tokens"]) for e in extras) == 24


def test_top_k_and_min_p(url):
    """top_k 1 and a min_p near 1 leave only the likeliest token: sampling at temperature 1
    then gives the greedy text, speculating or not; bad values are refused."""
    greedy = "".join(e["choices"][0]["text"] for e in events(url, completion({})))
    for case in ({"top_k": 1}, {"min_p": 0.999}):
        for speculative in ({"enabled": False}, {"drafter": "draft-model", "num_draft": 3}):
            body = completion(speculative, temperature=1.0, seed=3, **case)
            assert "".join(e["choices"][0]["text"] for e in events(url, body)) == greedy
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    for bad in ({"top_k": -1}, {"top_k": 1.5}, {"top_k": "2"}, {"min_p": 1.0}, {"min_p": -0.1}):
        for path, body in (("/v1/completions", completion({})), ("/v1/chat/completions", chat)):
            r = httpx.post(url + path, json={**body, **bad}, timeout=60)
            assert r.status_code == 400, (path, bad, r.text)
