"""Sessions: a conversation's later turns reuse the target's and the drafter's caches, prefill
only what the new prompt adds, and still decode exactly what a fresh run on the whole prompt
decodes (greedy, token for token)."""

from __future__ import annotations

import mlx_spec
from mlx_spec.serving.session import Session, common_prefix

import pytest
from conftest import FAMILIES
from helpers import make_drafter, with_eos

KINDS = ["none", "draft-model", "ngram", "mtp"]
PROMPT = "abcab cab"
NEW = " ponm lk"  # what the second turn adds after the first reply
N = 30


def fresh(entry, family, kind, prompt, **kwargs):
    """Greedy tokens of a one-off generation on the whole prompt."""
    model, tok = entry[:2]
    return mlx_spec.generate(
        model, tok, prompt, drafter=make_drafter(kind, family, entry), max_tokens=N, **kwargs
    ).tokens


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def no_eos(entry):
    model, tok, draft, draft_tok = entry
    return model, with_eos(tok), draft, with_eos(draft_tok)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_second_turn_equals_fresh_run(loaded, family, kind):
    """Turn two (turn one's prompt + reply + new text) decodes what a fresh run on the whole
    prompt decodes, past the gemma3 window and through the qwen3_5 recurrent state; only the
    new tokens are prefilled (the reply's last token, pending in speculative decoding, too)."""
    entry = no_eos(loaded[family])
    model, tok = entry[:2]
    session = Session(model, tok, drafter=make_drafter(kind, family, entry), num_draft=4)
    first = session.generate(PROMPT, max_tokens=N)
    assert first.stats.cached_tokens == 0 and not first.stats.cache_reset
    prompt = tok.encode(PROMPT) + first.tokens + encode(tok, NEW)
    second = session.generate(prompt, max_tokens=N)
    assert (
        second.tokens == fresh(entry, family, kind, prompt) == fresh(entry, family, "none", prompt)
    )
    assert not second.stats.cache_reset
    pending = 0 if kind == "none" else 1  # plain decoding's pipeline fed the last token too
    assert second.stats.prefilled_tokens == len(encode(tok, NEW)) + pending
    assert second.stats.cached_tokens == len(prompt) - len(encode(tok, NEW)) - pending
    if kind != "none":
        assert second.stats.drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["self", "ngram", "mtp"])
def test_turn_ended_by_eos_inside_a_round(loaded, family, kind):
    """A reply that ends with an EOS accepted inside a round leaves the caches at the EOS
    (later drafts of the round dropped), so the next turn reuses all of it, even on the hybrid
    target whose recurrent state cannot be cut afterwards. The target drafting for itself
    ("self", k=4: rounds of 5) accepts everything, so the EOS is inside a round for sure."""
    entry = no_eos(loaded[family])
    model, tok = entry[:2]
    plain = fresh(entry, family, "none", PROMPT)
    eos = next(t for i, t in enumerate(plain) if i >= 6 and i % 5 != 4 and plain.index(t) == i)
    eos_tok = with_eos(tok, [eos])
    if kind == "self":
        drafter = mlx_spec.DraftModelDrafter(model, eos_tok)
    else:
        drafter = make_drafter(kind, family, entry)
    session = Session(model, eos_tok, drafter=drafter, num_draft=4)
    first = session.generate(PROMPT, max_tokens=N)
    assert first.finish_reason == "stop" and first.tokens == plain[: plain.index(eos)]
    prompt = tok.encode(PROMPT) + first.tokens + [eos] + encode(tok, NEW)
    second = session.generate(prompt, max_tokens=N)
    assert second.tokens == fresh((model, eos_tok, *entry[2:]), family, "none", prompt)
    assert not second.stats.cache_reset
    assert second.stats.cached_tokens == len(prompt) - len(encode(tok, NEW)) - 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["none", "draft-model", "mtp"])
def test_interrupted_reply_keeps_what_was_shown(loaded, family, kind):
    """Closing the stream after 7 chunks (a user's Ctrl-C) leaves the caches at those 7
    tokens: the next turn, built on them, reuses the cache and decodes like a fresh run."""
    entry = no_eos(loaded[family])
    model, tok = entry[:2]
    session = Session(model, tok, drafter=make_drafter(kind, family, entry), num_draft=4)
    stream = session.stream(PROMPT, max_tokens=N)
    shown = [next(stream).token for _ in range(7)]
    stream.close()
    assert session.last_stats.generated_tokens == 7
    prompt = tok.encode(PROMPT) + shown + encode(tok, NEW)
    second = session.generate(prompt, max_tokens=N)
    assert second.tokens == fresh(entry, family, "none", prompt)
    assert not second.stats.cache_reset
    assert second.stats.cached_tokens >= len(tok.encode(PROMPT)) + 6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["none", "draft-model", "ngram", "mtp"])
def test_edited_history(loaded, family, kind):
    """A prompt that departs from the cached tokens inside the first reply: KV caches are cut
    back to the common prefix; the hybrid target's recurrent state (and the gemma3 window,
    wrapped by then) cannot be cut and goes back to its snapshot at the end of the first
    prompt. Either way the output equals a fresh run."""
    entry = no_eos(loaded[family])
    model, tok = entry[:2]
    session = Session(model, tok, drafter=make_drafter(kind, family, entry), num_draft=4)
    first = session.generate(PROMPT, max_tokens=N)
    keep = len(tok.encode(PROMPT)) + 5
    prompt = (tok.encode(PROMPT) + first.tokens)[:keep] + encode(tok, NEW)
    second = session.generate(prompt, max_tokens=N)
    assert second.tokens == fresh(entry, family, "none", prompt)
    if family == "llama":
        assert not second.stats.cache_reset
        assert second.stats.cached_tokens == keep - (kind == "mtp")
    else:
        assert not second.stats.cache_reset
        assert second.stats.cached_tokens == len(tok.encode(PROMPT)) - 1
    third = session.generate(prompt + second.tokens + encode(tok, "ab"), max_tokens=N)
    assert third.tokens == fresh(entry, family, "none", prompt + second.tokens + encode(tok, "ab"))
    assert not third.stats.cache_reset


@pytest.mark.parametrize("kind", ["draft-model", "mtp"])
def test_plain_turn_between_speculative_turns(loaded, kind):
    """A turn decoded plainly (num_draft=0) leaves the drafter behind; the next speculative
    turn brings it up to date (the MTP head, lacking hidden states, from scratch)."""
    entry = no_eos(loaded["llama"])
    model, tok = entry[:2]
    session = Session(model, tok, drafter=make_drafter(kind, "llama", entry))
    prompt = tok.encode(PROMPT)
    for turn, num_draft in enumerate([4, 0, 4]):
        out = session.generate(prompt, num_draft=num_draft, max_tokens=N)
        assert out.tokens == fresh(entry, "llama", "none", prompt), turn
        assert (out.stats.drafter == "none") == (num_draft == 0)
        prompt = prompt + out.tokens + encode(tok, NEW)


def test_sampled_turns_follow_the_seed(loaded):
    """At temperature 1 a session's turn with a seed equals a fresh run with the same seed (a
    fixed k: with "auto" the draft lengths, and so the draws, follow measured timings)."""
    entry = no_eos(loaded["llama"])
    model, tok = entry[:2]
    drafter = make_drafter("draft-model", "llama", entry)
    session = Session(model, tok, drafter=drafter, num_draft=4)
    first = session.generate(PROMPT, max_tokens=N, temperature=1.0, seed=3)
    prompt = tok.encode(PROMPT) + first.tokens + encode(tok, NEW)
    second = session.generate(prompt, max_tokens=N, temperature=1.0, seed=4)
    expected = fresh(entry, "llama", "draft-model", prompt, temperature=1.0, seed=4, num_draft=4)
    assert second.tokens == expected
    assert second.stats.cached_tokens > len(tok.encode(PROMPT))


def test_reset_and_bad_input(loaded):
    """`reset` forgets the cache; bad settings raise ValueError and leave the session usable."""
    entry = no_eos(loaded["llama"])
    model, tok = entry[:2]
    session = Session(model, tok, drafter="ngram")
    session.generate(PROMPT, max_tokens=5)
    session.reset()
    assert session.cached_tokens == [] and session.generate(PROMPT).stats.cached_tokens == 0
    for bad in [dict(top_p=2.0), dict(max_tokens=-1), dict(num_draft=-1)]:
        with pytest.raises(ValueError):
            session.generate(PROMPT, **bad)
    with pytest.raises(ValueError, match="context"):
        session.generate("a" * 600)
    assert session.generate(PROMPT, max_tokens=5).stats.cached_tokens == len(tok.encode(PROMPT)) - 1
    with pytest.raises(ValueError):
        Session(model, tok, drafter="nonsense")


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
