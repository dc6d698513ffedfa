"""Adaptive draft lengths end to end: whatever k the policy picks each round (plain stretches
included), greedy output equals plain decoding, sessions stay exact when a reply ends inside a
plain stretch, and the real controller settles on k = K or on plain decoding as it should."""

from __future__ import annotations

import mlx_spec
from mlx_spec.decoding.policy import AdaptiveDraftLength, Choice
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.serving.session import Session

import mlx.core as mx
import pytest
from conftest import FAMILIES
from helpers import ScriptedPolicy, make_drafter, with_eos

PROMPT = "abcab cab"
DRAFTERS = ["draft-model", "ngram", "mtp", "group"]


def drafter_for(kind, family, entry):
    if kind == "group":
        return [make_drafter(k, family, entry) for k in ("draft-model", "ngram", "mtp")]
    return make_drafter(kind, family, entry)


def no_eos(entry):
    model, tok, draft, draft_tok = entry
    return model, with_eos(tok), draft, with_eos(draft_tok)


def plain(entry, prompt, n):
    return mlx_spec.generate(entry[0], entry[1], prompt, max_tokens=n).tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("n", [40, 200])
def test_greedy_equals_plain_while_k_moves(loaded, family, kind, n):
    """A scripted policy jumps between plain stretches and k = 1..4 (and between a group's
    drafters): greedy output equals plain decoding, past the gemma3 window, through the
    qwen3_5 recurrent state."""
    entry = no_eos(loaded[family])
    drafter = drafter_for(kind, family, entry)
    arms = 3 if kind == "group" else 1
    policy = ScriptedPolicy(arms=arms, seed=n)
    out = mlx_spec.generate(
        entry[0], entry[1], PROMPT, drafter=drafter, num_draft=policy, max_tokens=n
    )
    assert out.tokens == plain(entry, PROMPT, n)
    hist = out.stats.k_histogram
    assert hist.get(0, 0) > 0 and sum(v for k, v in hist.items() if k > 0) > 0
    assert out.stats.generated_tokens == n
    assert out.stats.num_draft == "scripted"
    if kind == "group":
        assert len(out.stats.drafter_rounds) == 3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_equals_plain_with_auto(loaded, family, kind):
    """The real controller (the default num_draft="auto")."""
    entry = no_eos(loaded[family])
    drafter = drafter_for(kind, family, entry)
    out = mlx_spec.generate(entry[0], entry[1], PROMPT, drafter=drafter, max_tokens=120)
    assert out.tokens == plain(entry, PROMPT, 120)
    assert out.stats.num_draft == "auto"
    assert out.stats.k_histogram.get(0, 0) >= 4  # it starts by measuring plain decoding


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["draft-model", "mtp", "group"])
@pytest.mark.parametrize("cut", [3, 10])
def test_reply_closed_inside_a_plain_stretch(loaded, family, kind, cut):
    """A consumer that stops listening inside a plain stretch (its next step already queued)
    leaves the caches at the tokens it saw: the next turn reuses them and decodes like a fresh
    run on the whole prompt."""
    entry = no_eos(loaded[family])
    model, tok = entry[:2]

    class Stretches(ScriptedPolicy):
        """Plain stretches of 6 steps between rounds of 3 drafts."""

        def choose(self, limit, available=None):
            self.choices.append(None)
            return Choice(plain_tokens=6) if len(self.choices) % 2 else Choice(0, min(3, limit))

    drafter = drafter_for(kind, family, entry)
    session = Session(model, tok, drafter=drafter, num_draft=Stretches(arms=3))
    stream = session.stream(PROMPT, max_tokens=40)
    shown = [next(stream).token for _ in range(cut)]
    stream.close()
    prompt = tok.encode(PROMPT) + shown + tok.encode(" ponm", add_special_tokens=False)
    second = session.generate(prompt, max_tokens=30)
    assert second.tokens == plain(entry, prompt, 30)
    assert not second.stats.cache_reset
    assert (
        second.stats.cached_tokens
        == len(prompt) - len(tok.encode(" ponm", add_special_tokens=False)) - 1
    )


class OracleDrafter(Drafter):
    """Proposes the known plain continuation (always right, nearly free) or, from `wrong_after`
    tokens on, wrong tokens at the cost of `wrong_cost` seconds per round (a real drafter costs
    something; on these tiny targets a free one would lose almost nothing even when wrong)."""

    name = "oracle"

    def __init__(self, continuation: list[int], clock, wrong_after=None, wrong_cost=0.002):
        self.continuation, self.wrong_after, self.wrong_cost = continuation, wrong_after, wrong_cost
        self.clock = clock  # a FakeClock: the policy sees the costs, not the machine's load

    def begin(self, prompt, vocab_size, hidden=None):
        self.pos = 0
        self.vocab = vocab_size

    def draft(self, k, sampling):
        tokens = self.continuation[self.pos : self.pos + k]
        if self.wrong_after is not None and self.pos >= self.wrong_after:
            tokens = [(t + 1) % self.vocab for t in tokens]  # never right from here on
            self.clock.advance(self.wrong_cost)
        return Draft(mx.array(tokens, mx.uint32))

    def accept(self, num_accepted, emitted, hidden=None):
        self.pos += len(emitted)


def oracle_run(loaded, clock, n: int, wrong_after=None, **kwargs):
    """Chunks of a generation by `OracleDrafter` (checked to equal plain decoding) and stats."""
    entry = no_eos(loaded["llama"])
    continuation = plain(entry, PROMPT, n)
    drafter = OracleDrafter(continuation, clock, wrong_after)
    chunks = list(
        mlx_spec.stream_generate(
            entry[0], entry[1], PROMPT, drafter=drafter, max_tokens=n, **kwargs
        )
    )
    assert [c.token for c in chunks[:-1]] == continuation
    return chunks[:-1], chunks[-1].stats


def test_controller_settles_on_k_max_for_an_always_right_drafter(loaded, fake_clock):
    """k = K on most rounds."""
    _, stats = oracle_run(loaded, fake_clock, 400, max_draft=6)
    assert stats.k_histogram.get(6, 0) >= 30, stats.k_histogram
    assert stats.acceptance_rate == 1.0


def test_controller_settles_on_plain_for_a_never_right_drafter(loaded, fake_clock):
    _, stats = oracle_run(loaded, fake_clock, 240, wrong_after=0)
    assert stats.k_histogram.get(0, 0) >= 0.9 * 240, stats.k_histogram  # but for a few probes
    assert stats.accepted == 0


def test_controller_follows_a_drafter_that_stops_being_right(loaded, fake_clock):
    """Right for 60 tokens, wrong afterwards: k = K early on, plain decoding at the end."""
    chunks, stats = oracle_run(loaded, fake_clock, 300, wrong_after=60)
    assert stats.k_histogram.get(0, 0) >= 180
    assert sum(c.from_draft for c in chunks[:60]) >= 30
    assert sum(v for k, v in stats.k_histogram.items() if k > 0) <= 80


def test_fixed_num_draft_is_unchanged(loaded):
    """An integer k drafts k every round (fewer only at the end, the last round none): no plain
    stretches."""
    entry = no_eos(loaded["llama"])
    out = mlx_spec.generate(entry[0], entry[1], PROMPT, drafter="ngram", num_draft=3, max_tokens=40)
    assert set(out.stats.k_histogram) <= {0, 1, 2, 3}
    assert out.stats.k_histogram.get(0, 0) <= 1
    assert out.stats.k_histogram[3] >= out.stats.target_passes - 3
    assert out.stats.num_draft == 3


@pytest.mark.parametrize("bad", ["fast", -1, 1.5])
def test_bad_num_draft(loaded, bad):
    model, tok = loaded["llama"][:2]
    with pytest.raises(ValueError, match="num_draft must be 'auto' or an integer"):
        mlx_spec.generate(model, tok, PROMPT, drafter="ngram", num_draft=bad)


def test_bad_max_draft(loaded):
    model, tok = loaded["llama"][:2]
    with pytest.raises(ValueError, match="max_draft must be an integer >= 1"):
        mlx_spec.generate(model, tok, PROMPT, drafter="ngram", max_draft=0)


def test_auto_policy_instance_is_accepted(loaded):
    entry = no_eos(loaded["llama"])
    policy = AdaptiveDraftLength(3)
    out = mlx_spec.generate(
        entry[0], entry[1], PROMPT, drafter="ngram", num_draft=policy, max_tokens=30
    )
    assert out.tokens == plain(entry, PROMPT, 30)
    assert policy.plain is not None


def test_a_new_drafter_never_inherits_a_freed_ones_policy(loaded, fake_clock):
    """Policies are remembered per drafter identity; a drafter made after another was freed
    (Python may give it the freed object's id) starts afresh, not with the other's policy."""
    entry = no_eos(loaded["llama"])
    continuation = plain(entry, PROMPT, 40)
    seen = set()
    for _ in range(20):
        drafter = OracleDrafter(continuation, fake_clock, wrong_after=0)
        assert drafter.identity not in seen
        seen.add(drafter.identity)
        del drafter
