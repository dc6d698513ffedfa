"""Stopping and limits: EOS, stop strings, max_tokens and the context limit cut output exactly.

All generations are greedy (temperature 0) in float32, so speculative output must equal plain
decoding token for token; every expectation below is derived from a plain run.
"""

from __future__ import annotations

import mlx_spec
from mlx_spec.core.stopping import StopMatcher
from mlx_spec.drafters.base import Drafter

import pytest
import tinymodels as tm
from helpers import with_eos

FAMILIES = ["llama", "gemma3", "qwen3_5"]
PROMPTS = ["abc", "hello", "pop", "mad", "long"]
K = 4
PLAIN_LEN = 40


class RecordingDrafter(Drafter):
    """Wraps a drafter and records each round as (drafted, accepted, emitted tokens)."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = inner.name
        self.rounds: list[tuple[int, int, list[int]]] = []
        self._last_k = 0

    @property
    def runner(self):
        return getattr(self.inner, "runner", None)

    def check_compatible(self, target, tokenizer, vocab_size):
        self.inner.check_compatible(target, tokenizer, vocab_size)

    def begin(self, prompt, vocab_size, hidden=None):
        self.rounds = []
        self.inner.begin(prompt, vocab_size)

    def draft(self, k, sampling):
        draft = self.inner.draft(k, sampling)
        self._last_k = draft.tokens.size
        return draft

    def accept(self, num_accepted, emitted, hidden=None):
        self.rounds.append((self._last_k, num_accepted, list(emitted)))
        self.inner.accept(num_accepted, emitted)


def make_drafter(kind: str, entry):
    """A fresh drafter: 'self' (target drafts for itself), 'noisy' (the perturbed copy), 'ngram'."""
    model, tok, draft_model, draft_tok = entry
    if kind == "self":
        return mlx_spec.DraftModelDrafter(model, tok)
    if kind == "noisy":
        return mlx_spec.DraftModelDrafter(draft_model, draft_tok)
    if kind == "ngram":
        return mlx_spec.NgramDrafter()
    return None


def run_stream(model, tok, prompt, **kwargs):
    """(token chunks, final chunk) of one stream_generate call."""
    chunks = list(mlx_spec.stream_generate(model, tok, prompt, **kwargs))
    assert chunks[-1].token is None and all(c.token is not None for c in chunks[:-1])
    return chunks[:-1], chunks[-1]


def plain(entry, prompt, n=PLAIN_LEN):
    """Greedy plain decoding of `n` tokens with EOS disabled: (tokens, per-token text segments)."""
    model, tok = entry[0], with_eos(entry[1], ())
    chunks, _ = run_stream(model, tok, prompt, max_tokens=n)
    return [c.token for c in chunks], [c.text for c in chunks]


def eos_candidate(entry, kind):
    """(prompt, position, plain tokens): a token whose first occurrence is at position >= 4 and
    that the drafter proposed and the target accepted in the speculative run (EOS disabled)."""
    model, tok = entry[0], with_eos(entry[1], ())
    for prompt in PROMPTS:
        tokens, _ = plain(entry, prompt)
        chunks, _ = run_stream(
            model, tok, prompt, drafter=make_drafter(kind, entry), num_draft=K, max_tokens=PLAIN_LEN
        )
        assert [c.token for c in chunks] == tokens
        for p in range(4, PLAIN_LEN - K - 1):
            if chunks[p].from_draft and tokens.index(tokens[p]) == p:
                return prompt, p, tokens
    pytest.fail(f"no accepted draft token first occurring at position >= 4 for {kind}")


def expected_positions(rounds, cut: int, k: int) -> tuple[list[int], list[int]]:
    """Drafted/accepted counts per draft position when the output is cut after `cut` tokens
    inside an accepted run: full rounds count fully, the cut round counts only emitted drafts.
    (The drafter is told that the cut round ended at the cut: its accepted drafts up to it.)"""
    drafted, accepted = [0] * k, [0] * k
    start = 0
    for num_drafted, num_accepted, emitted in rounds:
        if start + len(emitted) > cut:  # the round holding the cut
            assert cut - start <= num_accepted, "the cut is not inside the accepted run"
            num_drafted = num_accepted = cut - start
        for i in range(num_drafted):
            drafted[i] += 1
            accepted[i] += int(i < num_accepted)
        start += len(emitted)
        if start >= cut:
            break
    return drafted, accepted


def trimmed(counts: list[int]) -> list[int]:
    while counts and counts[-1] == 0:
        counts = counts[:-1]
    return counts


# ---------------------------------------------------------------- EOS inside an accepted run


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["self", "noisy"])
def test_eos_inside_accepted_run_truncates_output_and_stats(loaded, family, kind):
    """An EOS that the target accepted as a draft ends the output there; later drafts of the
    round are neither emitted nor counted in the stats."""
    entry = loaded[family]
    prompt, p, tokens = eos_candidate(entry, kind)
    eos_tok = with_eos(entry[1], [tokens[p]])
    drafter = RecordingDrafter(make_drafter(kind, entry))
    chunks, final = run_stream(
        entry[0], eos_tok, prompt, drafter=drafter, num_draft=K, max_tokens=PLAIN_LEN
    )
    stats = final.stats
    assert [c.token for c in chunks] == tokens[:p]
    assert final.finish_reason == "stop"
    assert stats.generated_tokens == len(chunks) == p
    drafted, accepted = expected_positions(drafter.rounds, p, K)
    assert trimmed(stats.drafted_per_position) == trimmed(drafted)
    assert trimmed(stats.accepted_per_position) == trimmed(accepted)
    assert stats.accepted == sum(c.from_draft for c in chunks)
    assert stats.target_passes == len(drafter.rounds), "a target pass ran after the EOS"
    # the caches end at the EOS: the drafter's last round ends with it, later drafts dropped
    assert drafter.rounds[-1][2][-1] == tokens[p]
    assert sum(len(emitted) for _, _, emitted in drafter.rounds) == p + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_plain_and_speculative_agree(loaded, family):
    """With the real EOS id or a chosen one, plain and speculative decoding stop alike."""
    model, tok = loaded[family][:2]
    for eos in [tok.eos_token_ids, [plain(loaded[family], "pop")[0][6]]]:
        eos_tok = with_eos(tok, eos)
        ref = mlx_spec.generate(model, eos_tok, "pop", max_tokens=60)
        for kind in ["self", "noisy", "ngram"]:
            drafter = make_drafter(kind, loaded[family])
            out = mlx_spec.generate(model, eos_tok, "pop", drafter=drafter, max_tokens=60)
            assert out.tokens == ref.tokens, kind
            assert out.finish_reason == ref.finish_reason
            assert out.stats.generated_tokens == len(out.tokens)


# ------------------------------------------------------------------------------ stop strings


def stop_candidate(entry):
    """(prompt, p, tokens, segments): tokens p and p+1 are plain characters, both accepted drafts
    of a self-draft run, and their text first occurs at token p."""
    model, tok = entry[0], with_eos(entry[1], ())
    for prompt in PROMPTS:
        tokens, segments = plain(entry, prompt)
        chunks, _ = run_stream(
            model,
            tok,
            prompt,
            drafter=make_drafter("self", entry),
            num_draft=K,
            max_tokens=PLAIN_LEN,
        )
        text = "".join(segments)
        for p in range(4, PLAIN_LEN - K - 2):
            stop = segments[p] + segments[p + 1]
            offset = len("".join(segments[:p]))
            single = len(segments[p]) == len(segments[p + 1]) == 1
            if single and chunks[p].from_draft and chunks[p + 1].from_draft:
                if text.find(stop) == offset:
                    return prompt, p, tokens, segments
    pytest.fail("no stop-string candidate inside an accepted run")


@pytest.mark.parametrize("kind", ["self", "noisy", "ngram", "plain"])
def test_stop_string_inside_accepted_run(loaded, kind):
    """A stop string completed inside an accepted run: text ends right before it, the tokens
    end with the token that completed it, and nothing after is emitted."""
    entry = loaded["llama"]
    prompt, p, tokens, segments = stop_candidate(entry)
    stop = segments[p] + segments[p + 1]
    tok = with_eos(entry[1], ())
    chunks, final = run_stream(
        entry[0],
        tok,
        prompt,
        drafter=make_drafter(kind, entry),
        num_draft=K,
        max_tokens=PLAIN_LEN,
        stop=(stop,),
    )
    text = "".join(c.text for c in chunks) + final.text
    assert text == "".join(segments[:p])
    assert [c.token for c in chunks] == tokens[: p + 2]
    assert final.text == ""
    assert final.finish_reason == "stop"
    assert final.stats.generated_tokens == p + 2
    assert final.stats.accepted == sum(c.from_draft for c in chunks)


@pytest.mark.parametrize("kind", ["self", "plain"])
def test_unmatched_stop_prefix_is_released(loaded, kind):
    """Text held back as a possible stop-string prefix is emitted when the stop never
    completes, including at the very end of the generation."""
    entry = loaded["llama"]
    tokens, segments = plain(entry, "abc", n=20)
    text = "".join(segments)
    stops = (text[-1] + "#", segments[5] + "#")  # '#' is not in the alphabet: never completes
    tok = with_eos(entry[1], ())
    result = mlx_spec.generate(
        entry[0], tok, "abc", drafter=make_drafter(kind, entry), max_tokens=20, stop=stops
    )
    assert result.text == text
    assert result.tokens == tokens
    assert result.finish_reason == "length"


def test_stop_matcher_split_across_segments():
    """A stop string split over two segments is found; text before it is released."""
    m = StopMatcher(["bc"])
    assert m.feed("ab") == ("a", False)
    assert m.feed("cde") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_partial_prefix_held_then_released():
    """A suffix that could start a stop string is held back until it cannot."""
    m = StopMatcher(["abc"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("d") == ("abd", False)
    assert m.feed("a") == ("", False)
    assert m.flush() == "a"
    assert m.flush() == ""


def test_stop_matcher_overlapping_prefix():
    """Repeated characters: the held text shrinks to the longest possible stop prefix."""
    m = StopMatcher(["aab"])
    out = [m.feed(ch) for ch in "aaab"]
    assert "".join(text for text, _ in out) == "a"
    assert [hit for _, hit in out] == [False, False, False, True]


def test_stop_matcher_earliest_stop_wins_and_stays_stopped():
    """Of several stops the earliest in the text cuts; after a hit nothing more comes out."""
    m = StopMatcher(["cd", "b"])
    assert m.feed("abcd") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_ignores_empty_stops():
    """An empty stop string neither stops nor holds text back."""
    m = StopMatcher(["", "zz"])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


# -------------------------------------------------------------------------------- max_tokens


@pytest.mark.parametrize("max_tokens", [1, 3, 7, 10])
@pytest.mark.parametrize("kind", ["self", "noisy", "ngram", "plain"])
def test_max_tokens_mid_draft(loaded, kind, max_tokens):
    """A budget that ends inside a k=4 round gives exactly max_tokens tokens, the plain prefix."""
    entry = loaded["llama"]
    tokens, _ = plain(entry, "abc", n=12)
    tok = with_eos(entry[1], ())
    chunks, final = run_stream(
        entry[0],
        tok,
        "abc",
        drafter=make_drafter(kind, entry),
        num_draft=K,
        max_tokens=max_tokens,
    )
    assert [c.token for c in chunks] == tokens[:max_tokens]
    assert final.finish_reason == "length"
    assert final.stats.generated_tokens == max_tokens
    assert final.stats.accepted == sum(c.from_draft for c in chunks)
    if kind == "self":
        assert final.stats.drafted == final.stats.accepted


@pytest.mark.parametrize("kind", ["self", "noisy", "ngram", "plain"])
def test_max_tokens_zero(loaded, kind):
    """max_tokens=0 generates nothing and runs no decode pass."""
    entry = loaded["llama"]
    chunks, final = run_stream(
        entry[0], entry[1], "abc", drafter=make_drafter(kind, entry), max_tokens=0
    )
    assert chunks == []
    assert final.text == ""
    assert final.finish_reason == "length"
    assert final.stats.generated_tokens == 0
    assert final.stats.target_passes == 0


# ----------------------------------------------------------------------------- context limit

LIMIT = 24


class PeakModel:
    """Proxy of an mlx-lm model that records the most cache positions any call reached."""

    def __init__(self, model):
        self._model = model
        self.peak = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        out = self._model(inputs, cache=cache, **kwargs)
        self.peak = max([self.peak] + [c.offset for c in cache if hasattr(c, "offset")])
        return out


class PeakDrafter(mlx_spec.DraftModelDrafter):
    """A draft-model drafter that records the most positions its own cache ever held."""

    peak = 0

    def _note(self):
        offsets = [c.offset for c in self.runner.cache if hasattr(c, "offset")]
        self.peak = max([self.peak, self.runner.length] + offsets)

    def begin(self, prompt, vocab_size, hidden=None):
        super().begin(prompt, vocab_size)
        self._note()

    def draft(self, k, sampling):
        draft = super().draft(k, sampling)
        self._note()
        return draft


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """(target, tok, noisy draft, draft tok, small-context draft, its tok): llama with
    max_position_embeddings=24; the small-context draft is the target's weights with 16."""
    root = tmp_path_factory.mktemp("short-context")
    config = tm.llama_config(tm.tokenizer_size(), max_position_embeddings=LIMIT)
    weights = tm.random_weights(config, seed=3)
    target = tm.write_checkpoint(root / "target", config, weights)
    draft = tm.write_checkpoint(root / "draft", config, tm.perturb(weights, 0.3, seed=4))
    small = tm.llama_config(tm.tokenizer_size(), max_position_embeddings=16)
    small_dir = tm.write_checkpoint(root / "small", small, weights)
    model, tok = mlx_spec.load(str(target))
    draft_model, draft_tok = mlx_spec.load(str(draft))
    small_model, small_tok = mlx_spec.load(str(small_dir))
    return model, with_eos(tok, ()), draft_model, draft_tok, small_model, small_tok


def context_drafter(kind, ctx):
    model, tok, draft_model, draft_tok = ctx[:4]
    if kind == "self":
        return PeakDrafter(model, tok)
    if kind == "noisy":
        return PeakDrafter(draft_model, draft_tok)
    return "ngram" if kind == "ngram" else None


def prompt_of(n: int) -> str:
    return (tm.ALPHABET.strip() * 4)[:n]


def near_limit(model, ctx, drafter, prompt_len=6):
    """Greedy generation with k=8 and max_tokens=100 from a `prompt_len`-token prompt."""
    tok = ctx[1]
    prompt = prompt_of(prompt_len)
    return mlx_spec.generate(model, tok, prompt, drafter=drafter, num_draft=8, max_tokens=100)


@pytest.mark.parametrize("prompt_len", [6, LIMIT - 1])
@pytest.mark.parametrize("kind", ["plain", "self", "noisy", "ngram"])
def test_prompt_plus_output_fits_context(short_context, kind, prompt_len):
    """Prompt plus generated tokens never exceed max_position_embeddings (24), even with k=8."""
    model, tok = short_context[:2]
    assert len(tok.encode(prompt_of(prompt_len))) == prompt_len
    drafter = context_drafter(kind, short_context)
    result = near_limit(model, short_context, drafter, prompt_len)
    assert prompt_len + len(result.tokens) <= LIMIT
    assert result.finish_reason == "length"


@pytest.mark.parametrize("kind", ["self", "noisy", "ngram"])
def test_speculative_equals_plain_at_context_limit(short_context, kind):
    """Near the context limit speculative output equals plain output and ends at the same
    length."""
    model = short_context[0]
    ref = near_limit(model, short_context, None)
    out = near_limit(model, short_context, context_drafter(kind, short_context))
    assert out.tokens == ref.tokens
    assert out.finish_reason == ref.finish_reason


@pytest.mark.parametrize("kind", ["plain", "self", "noisy", "ngram"])
def test_target_cache_never_exceeds_context(short_context, kind):
    """No target forward pass ever puts more than 24 positions in the target's cache."""
    peak_model = PeakModel(short_context[0])
    near_limit(peak_model, short_context, context_drafter(kind, short_context))
    assert 0 < peak_model.peak <= LIMIT


@pytest.mark.parametrize("kind", ["self", "noisy"])
def test_drafter_cache_never_exceeds_its_context(short_context, kind):
    """The draft model's own cache never holds more than its max_position_embeddings."""
    drafter = context_drafter(kind, short_context)
    near_limit(short_context[0], short_context, drafter)
    assert 0 < drafter.peak <= LIMIT


@pytest.mark.parametrize("prompt_len", [6, 19])
def test_smaller_drafter_context_is_respected(short_context, prompt_len):
    """A drafter with a shorter context (16) than the target (24) never runs past it, even
    when the prompt alone does not fit it, and the output still equals plain decoding."""
    model, _, _, _, small_model, small_tok = short_context
    ref = near_limit(model, short_context, None, prompt_len)
    drafter = PeakDrafter(small_model, small_tok)
    out = near_limit(model, short_context, drafter, prompt_len)
    assert out.tokens == ref.tokens
    assert drafter.peak <= 16
