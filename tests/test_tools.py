"""Tool-call splitting of streamed text (mlx-lm's parsers behind it) and the prompt cache's
choice and eviction of idle sessions."""

from __future__ import annotations

import json

import mlx_spec
from mlx_spec.caches.prompt_cache import PromptCache, parse_bytes
from mlx_spec.serving.session import Session
from mlx_spec.serving.tools import ToolCall, ToolCallStream, template_messages

import pytest
from mlx_lm.tool_parsers import json_tools

CALL = '{"name": "f", "arguments": {"x": 1}}'


def split(pieces, **kwargs):
    stream = ToolCallStream("<tool_call>", "</tool_call>", json_tools.parse_tool_call, **kwargs)
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    return events + stream.finish(), stream


def text_of(events):
    return "".join(e for e in events if isinstance(e, str))


def calls_of(events):
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_calls_and_text_whatever_the_chunking(size):
    """Markers cut anywhere between chunks: the same content and calls come out."""
    output = f"hi <tool_call>{CALL}</tool_call> and <tool_call>{CALL}</tool_call>bye <tool"
    pieces = [output[i : i + size] for i in range(0, len(output), size)]
    events, stream = split(pieces)
    assert text_of(events) == "hi  and bye <tool"
    assert calls_of(events) == [("f", {"x": 1}), ("f", {"x": 1})]
    assert len(stream.calls) == 2 and len({c.id for c in stream.calls}) == 2
    assert all(c.id.startswith("call_") for c in stream.calls)


def test_text_that_may_start_a_marker_is_held_back_only_until_it_cannot():
    stream = ToolCallStream("<tool_call>", "</tool_call>", json_tools.parse_tool_call)
    assert stream.feed("a <tool") == ["a "]
    assert stream.feed("box") == ["<toolbox"]


def test_unfinished_or_unparsable_calls_come_back_as_text():
    events, stream = split([f"x<tool_call>{CALL[:10]}"])  # cut by max_tokens
    assert text_of(events) == f"x<tool_call>{CALL[:10]}" and not stream.calls
    events, stream = split(["<tool_call>not json</tool_call>y"])
    assert text_of(events) == "<tool_call>not json</tool_call>y" and not stream.calls


def test_forced_call_and_no_end_marker():
    """A prompt that ends with the start marker: the output begins inside the call. A parser
    family without an end marker: the call runs to the end of the output."""
    events, _ = split([CALL[:5], CALL[5:] + "</tool_call>ok"], in_call=True)
    assert calls_of(events) == [("f", {"x": 1})] and text_of(events) == "ok"
    stream = ToolCallStream("[TOOL_CALLS]", "", json_tools.parse_tool_call)
    events = stream.feed("t[TOOL_CALLS]" + CALL) + stream.finish()
    assert text_of(events) == "t" and calls_of(events) == [("f", {"x": 1})]


def test_template_messages_parse_arguments():
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "2"},
    ]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # not mutated
    assert out[1] == messages[1]


# ------------------------------------------------------------------------ prompt cache


@pytest.fixture(scope="module")
def llama(loaded):
    model, tok, _, _ = loaded["llama"]
    return model, tok


def finished_session(model, tok, prompt, drafter=None):
    session = Session(model, tok, drafter=drafter, num_draft=2 if drafter else 0)
    session.generate(prompt, max_tokens=6)
    return session


def test_take_picks_the_longest_reuse_of_the_same_drafter(llama):
    model, tok = llama
    cache = PromptCache(max_bytes=1 << 30, max_entries=8)
    a = finished_session(model, tok, [5, 6, 7, 8])
    b = finished_session(model, tok, [5, 6, 9, 9, 9])
    c = finished_session(model, tok, [5, 6, 9, 9, 9, 9], drafter="ngram")
    cache.put(None, a)
    cache.put(None, b)
    cache.put("ngram", c)
    made = []
    got = cache.take(None, [5, 6, 9, 9, 9, 4], lambda: made.append(1))
    assert got is b and not made and len(cache) == 2
    assert cache.counts["hits"] == 1 and cache.counts["reused_tokens"] == 5
    fresh = cache.take(None, [1, 2, 3], lambda: "new")  # shares no prefix: a new session
    assert fresh == "new" and cache.counts["misses"] == 1
    assert cache.take("ngram", [5, 6, 9, 9, 9, 9, 1], lambda: None) is c


def test_a_session_taken_from_the_cache_gives_the_fresh_greedy_output(llama):
    model, tok = llama
    cache = PromptCache()
    first = cache.take(None, [5, 6, 7], lambda: Session(model, tok, num_draft=0))
    reply = first.generate([5, 6, 7], max_tokens=8).tokens
    cache.put(None, first)
    follow = [5, 6, 7, *reply, 9, 4]
    again = cache.take(None, follow, lambda: None)
    result = again.generate(follow, max_tokens=8)
    assert result.stats.cached_tokens == 3 + len(reply)  # only the new 9 is prefilled
    assert result.tokens == mlx_spec.generate(model, tok, follow, max_tokens=8).tokens


def test_eviction_by_entries_and_bytes(llama):
    model, tok = llama
    sessions = [finished_session(model, tok, [3 + i, 6, 7]) for i in range(4)]
    size = sessions[0].nbytes
    assert size > 0
    cache = PromptCache(max_bytes=1 << 30, max_entries=2)
    for s in sessions:
        cache.put(None, s)
    assert len(cache) == 2 and cache.counts["evicted"] == 2
    assert cache.take(None, [3, 6, 7, 1], lambda: None) is None  # the oldest went first
    assert cache.take(None, [6, 6, 7, 1], lambda: None) is sessions[3]
    cache = PromptCache(max_bytes=int(size * 2.5), max_entries=10)
    for s in sessions:
        cache.put(None, s)
    assert len(cache) == 2 and cache.nbytes <= size * 2.5
    assert PromptCache(max_bytes=0).enabled is False


def test_a_session_whose_turn_failed_is_not_kept(llama):
    model, tok = llama
    session = Session(model, tok, num_draft=0)
    stream = session.stream([5, 6, 7], max_tokens=4)
    next(stream)  # mid-turn: not settled
    cache = PromptCache()
    assert not session.settled
    cache.put(None, session)
    assert len(cache) == 0
    stream.close()
    cache.put(None, session)
    assert len(cache) == 1


@pytest.mark.parametrize(
    "text, value", [("0", 0), ("1000", 1000), ("512K", 512 << 10), ("2G", 2 << 30),
                    ("1.5m", 3 << 19), ("2GiB", 2 << 30), ("3gb", 3 << 30)]
)  # fmt: skip
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1G", "G"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)
