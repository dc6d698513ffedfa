"""Generation: stream_generate and generate (a drafter's rounds, or plain decoding)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mlx_spec.core import clock
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.core.stopping import StopMatcher
from mlx_spec.decoding import distributed
from mlx_spec.decoding.chain import Round, plain_rounds, speculative_rounds
from mlx_spec.decoding.policy import (
    AdaptiveDraftLength,
    DraftPolicy,
    FixedDraftLength,
    memory_of,
)
from mlx_spec.decoding.policy_store import remembered
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.decoding.tree import (
    TreeAsChain,
    TreeDrafter,
    TreeTarget,
    tree_rounds,
    tree_unsupported,
)
from mlx_spec.drafters.base import Drafter, hidden_layer_ids, hidden_wanted, unique_id
from mlx_spec.loading import DrafterSpec, resolve_drafter
from mlx_spec.models.mtp import target_hidden_size

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass
class GenerationChunk:
    """One streamed token. The last chunk has `token=None`, `finish_reason` and `stats` set.

    How the token came (`kind`): "draft" (a drafted token the target accepted), "recovered"
    (the target's token after a rejected draft), "bonus" (the target's token after every draft
    was accepted) or "plain" (a round that drafted nothing); `drafter`: the drafter its round
    asked (a group's member; None for a plain step), `drafted`: how many tokens that round
    drafted. None on the last chunk.
    """

    text: str
    token: int | None
    from_draft: bool = False
    finish_reason: str | None = None
    stats: SpecStats | None = None
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended the output
    kind: str | None = None
    drafter: str | None = None
    drafted: int = 0


def target_kind(rnd: Round) -> str:
    """How the round's last token (the target's own) came: "plain", "bonus" or "recovered"."""
    if not rnd.num_drafted:
        return "plain"
    return "bonus" if rnd.num_accepted >= rnd.num_drafted else "recovered"


@dataclass
class GenerationResult:
    """What `generate` returns; unpacks as `text, stats = generate(...)`."""

    text: str
    stats: SpecStats
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    def __iter__(self):
        return iter((self.text, self.stats))


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of the prompt (BOS added unless the text already starts with it)."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def _check_prompt_ids(ids: list[int], vocab: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")


AUTO = "auto"


def check_settings(num_draft, max_tokens: int, max_draft: int = 8) -> None:
    if isinstance(num_draft, DraftPolicy):
        pass
    elif num_draft != AUTO and (not isinstance(num_draft, int) or num_draft < 0):
        raise ValueError(f"num_draft must be 'auto' or an integer >= 0, got {num_draft!r}")
    if not isinstance(max_draft, int) or max_draft < 1:
        raise ValueError(f"max_draft must be an integer >= 1, got {max_draft!r}")
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens}")


def draft_label(num_draft) -> int | str:
    """How `num_draft` is reported in the stats: k, "auto", or the policy's description."""
    return num_draft.describe() if isinstance(num_draft, DraftPolicy) else num_draft


def make_policy(
    num_draft: int | str | DraftPolicy,
    max_draft: int,
    drafter: Drafter,
    *,
    model: nn.Module | None = None,
    sampling: SamplingConfig | None = None,
) -> DraftPolicy:
    """The draft-length policy for `num_draft`: "auto" measures and adapts k in 0..max_draft
    (and picks among a group's drafters); an integer drafts that many every round; a
    `DraftPolicy` is used as it is. With `model`, an "auto" policy is taken from the
    target's `PolicyMemory` (what earlier generations with the same drafter and sampling
    settings learned), else made new."""
    if isinstance(num_draft, DraftPolicy):
        return num_draft
    arms = len(drafter.arm_names)
    if num_draft == AUTO:
        if model is None:
            return AdaptiveDraftLength(max_draft, arms)
        key = (drafter.identity, sampling, max_draft)
        return memory_of(model).get(key, lambda: remembered(max_draft, model, drafter, sampling))
    if arms > 1:
        return AdaptiveDraftLength(num_draft, arms, fixed=num_draft)
    return FixedDraftLength(num_draft)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    drafter: DrafterSpec = None,
    num_draft: int | str = AUTO,
    max_draft: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    max_tokens: int = 256,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> Iterator[GenerationChunk]:
    """Generate from the target, speculatively when a drafter is given; output is distributed
    exactly as plain sampling from the target with the same settings.

    Args:
        model, tokenizer: the target, e.g. from `load`.
        prompt: text or token ids.
        drafter: None (plain decoding), "ngram" (prompt lookup), "mtp" (the MTP head converted
            beside the target), a `Drafter`, or a list of these (each round drafts with the
            one the policy expects to be fastest).
        num_draft: "auto" (default): each round's k in 0..max_draft maximises the expected
            tokens per second from the acceptance and costs measured so far, falling back to
            plain decoding when speculation does not pay; or a fixed k (0 decodes plainly).
            A `DraftPolicy` object chooses each round itself.
        max_draft: the longest draft "auto" considers.
        temperature, top_p, top_k, min_p: sampling settings (temperature 0 = greedy).
        max_tokens: generated tokens at most.
        seed: seeds MLX's random generator for reproducible sampling.
        stop: strings that end the output (not included).
    Yields:
        One `GenerationChunk` per token, then a final chunk with `token=None` and the stats.
    """
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    check_settings(num_draft, max_tokens, max_draft)
    tokenizer = wrap_tokenizer(tokenizer)
    whole = distributed.whole(model)  # a sharded target's unsharded (lazy) twin
    vocab = scored_vocab(whole, tokenizer)
    ids = checked_prompt(tokenizer, prompt, vocab)
    drafter = resolve_drafter(drafter, whole)
    if num_draft == 0:
        drafter = None
    sync = distributed.sync_for(model)
    if isinstance(drafter, TreeDrafter) and sync is not None:
        warnings.warn(
            f"a sharded target verifies chains only: {drafter.name} drafts chains (its first "
            "candidates) instead",
            stacklevel=2,
        )
        drafter = TreeAsChain(drafter)
    if isinstance(drafter, TreeDrafter) and (reason := tree_unsupported(model)) is not None:
        warnings.warn(
            f"{reason}: {drafter.name} drafts chains (its first candidates) instead", stacklevel=2
        )
        drafter = TreeAsChain(drafter)
    stats = SpecStats(
        drafter=drafter.name if drafter else "none",
        num_draft=draft_label(num_draft),
        prompt_tokens=len(ids),
    )
    if isinstance(drafter, TreeDrafter):
        yield from _tree_stream(
            model,
            tokenizer,
            ids,
            drafter,
            vocab,
            sampling,
            num_draft,
            max_tokens,
            seed,
            stats,
            stop,
        )
        return
    if drafter is not None:
        drafter.check_compatible(whole, tokenizer, vocab)
        distributed.check_drafter(model, drafter, hidden_layer_ids(drafter))
    target = ModelRunner(
        model,
        vocab,
        rollback=drafter is not None,
        keep_hidden=hidden_wanted(drafter),
    )
    check_fits(ids, target)
    if sync is not None:  # every rank draws the same random numbers
        seed = sync.shared_seed(seed)
        stats.world_size = sync.size
    if seed is not None:
        mx.random.seed(seed)
    policy = None
    if drafter is not None:
        policy = make_policy(num_draft, max_draft, drafter, model=model, sampling=sampling)
    try:
        yield from _stream(
            target, drafter, ids, tokenizer, sampling, policy, max_tokens, stats, stop
        )
    finally:
        kept = getattr(policy, "kept", None)
        if kept is not None:
            kept.save(policy.state())


def _tree_stream(
    model, tokenizer, ids, drafter, vocab, sampling, num_draft, max_tokens, seed, stats, stop
) -> Iterator[GenerationChunk]:
    """`stream_generate` with a tree drafter: every round verifies a tree in one pass; the
    depth is `num_draft` (at most the drafter's; "auto": the drafter's)."""
    drafter.check_compatible(target_hidden_size(model), vocab)
    if num_draft == AUTO:
        key = ("tree", unique_id(drafter), sampling, drafter.max_depth)
        policy = memory_of(model).get(key, lambda: AdaptiveDraftLength(drafter.max_depth))
    elif isinstance(num_draft, DraftPolicy):
        policy = num_draft
    else:
        policy = FixedDraftLength(min(int(num_draft), drafter.max_depth))
    target = TreeTarget(model, vocab, keep_hidden=hidden_wanted(drafter))
    check_fits(ids, target)
    if seed is not None:
        mx.random.seed(seed)
    tic = clock.now()
    drafter.begin(ids, target.prefill(ids[:-1]))
    stats.prefill_seconds = clock.now() - tic
    rounds = tree_rounds(
        target, drafter, ids[-1], sampling=sampling, max_tokens=max_tokens, policy=policy,
        stats=stats,
    )  # fmt: skip
    yield from _emit(rounds, tokenizer, stats, stop, max_tokens)


def wrap_tokenizer(tokenizer) -> TokenizerWrapper:
    """mlx-lm's `TokenizerWrapper` around a tokenizer (unchanged if it is one)."""
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def checked_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int], vocab: int):
    """The prompt's token ids; ValueError when it is empty or holds ids outside the vocabulary."""
    ids = encode_prompt(tokenizer, prompt)
    _check_prompt_ids(ids, vocab)
    return ids


def check_fits(ids: list[int], target: ModelRunner | TreeTarget) -> None:
    """ValueError when the prompt leaves no room in the target's context."""
    if target.context_limit is not None and len(ids) >= target.context_limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; the model's context holds {target.context_limit}"
        )


def _stream(target, drafter, ids, tokenizer, sampling, policy, max_tokens, stats, stop):
    tic = clock.now()
    hidden = target.prefill(ids[:-1])
    if drafter is not None:
        drafter.bind_target(target)
        drafter.begin(ids, target.vocab_size, hidden)
    stats.prefill_seconds = clock.now() - tic
    yield from decode(
        target, drafter, ids[-1], tokenizer, sampling, policy, max_tokens, stats, stop
    )


def decode(
    target: ModelRunner,
    drafter: Drafter | None,
    last: int,
    tokenizer: TokenizerWrapper,
    sampling: SamplingConfig,
    policy: DraftPolicy | None,
    max_tokens: int,
    stats: SpecStats,
    stop: Sequence[str],
    trace: list[int] | None = None,
) -> Iterator[GenerationChunk]:
    """Decode after the prompt: `target` holds every prompt token but `last`, the drafter (if
    any) has been begun or extended on the same sequence. Yields the chunks of
    `stream_generate`. When the output ends or the consumer closes the generator, the caches
    hold the sequence up to its last kept token; `trace` (if given) gets the tokens added to
    the sequence (beyond what is emitted: an EOS token, or the token the plain pipeline fed)."""
    replays = _replays(target, drafter)
    if target.sync is not None:  # the last generation's queued passes: finished everywhere
        distributed.settle_streams()
    if drafter is None:
        rounds = plain_rounds(target, last, sampling=sampling, max_tokens=max_tokens, trace=trace)
    else:
        rounds = speculative_rounds(
            target,
            drafter,
            last,
            policy=policy,
            sampling=sampling,
            max_tokens=max_tokens,
            stats=stats,
            trace=trace,
        )
    if target.sync is not None:
        rounds = _counting_comm(rounds, target.sync.ledger, stats)
    try:
        yield from _emit(rounds, tokenizer, stats, stop, max_tokens)
    finally:
        stats.replays += _replays(target, drafter) - replays


def _counting_comm(rounds: Iterator[Round], ledger, stats: SpecStats) -> Iterator[Round]:
    """`rounds`, with the collectives they build (a sharded target's) added to the stats when
    they end (before the final chunk carries the stats)."""
    with ledger.counting() as counted:
        try:
            yield from rounds
        finally:
            rounds.close()
            collectives, nbytes = counted()
            stats.comm_collectives += collectives
            stats.comm_seconds += ledger.price(collectives, nbytes)


def _replays(target: ModelRunner, drafter: Drafter | None) -> int:
    return target.replays + getattr(getattr(drafter, "runner", None), "replays", 0)


class OutputCutter:
    """Turns one generation's rounds into chunks, cutting at EOS, a stop string or max_tokens.

    `round(rnd)` returns the round's chunks up to the first stopping point, the finish reason
    if the output ended there, and how many of the round's tokens stay in the sequence (an EOS
    token does; None: all); `final(finish)` the last chunk (held-back text, finish reason and
    stats). The stats observe each round as it was emitted.
    """

    def __init__(self, tokenizer, stats: SpecStats, stop: Sequence[str], max_tokens: int):
        self.detokenizer = copy.copy(tokenizer.detokenizer)  # own state: streams may interleave
        self.detokenizer.reset()
        self.eos = set(tokenizer.eos_token_ids)
        self.stopper = StopMatcher(stop)
        self.stats, self.max_tokens = stats, max_tokens

    def round(self, rnd: Round) -> tuple[list[GenerationChunk], str | None, int | None]:
        chunks, accepted, drafter, drafted = [], rnd.num_accepted, rnd.drafter, rnd.num_drafted
        last = target_kind(rnd)
        for i, token in enumerate(rnd.tokens):
            if token in self.eos:
                return chunks, "stop", i + 1
            self.detokenizer.add_token(token)
            text, hit = self.stopper.feed(self.detokenizer.last_segment)
            draft = i < accepted
            chunks.append(
                GenerationChunk(
                    text,
                    token,
                    draft,
                    kind="draft" if draft else last,
                    drafter=drafter,
                    drafted=drafted,
                )  # fmt: skip
            )
            if hit:
                return chunks, "stop", i + 1
            if self.stats.generated_tokens + len(chunks) >= self.max_tokens:
                return chunks, "length", i + 1
        return chunks, None, None

    def final(self, finish: str | None) -> GenerationChunk:
        self.detokenizer.finalize()
        tail = self.stopper.feed(self.detokenizer.last_segment)[0] + self.stopper.flush()
        return GenerationChunk(
            text=tail,
            token=None,
            finish_reason=finish or "length",
            stats=self.stats,
            stop_sequence=self.stopper.hit,
        )


def _emit(
    rounds: Iterator[Round], tokenizer, stats: SpecStats, stop: Sequence[str], max_tokens: int
) -> Iterator[GenerationChunk]:
    """Turn rounds into chunks (`OutputCutter`); each round is cut (`Round.keep`) where the
    output ended, or after the last chunk its consumer took."""
    cutter = OutputCutter(tokenizer, stats, stop, max_tokens)
    finish, tic = "length", clock.now()
    try:
        for rnd in rounds:
            emitted, finish, keep = cutter.round(rnd)
            for i, chunk in enumerate(emitted):
                rnd.keep = i + 1
                try:
                    yield chunk
                except GeneratorExit:  # the consumer stopped listening after this chunk
                    stats.observe_round(rnd.num_drafted, rnd.num_accepted, i + 1, rnd.seconds)
                    raise
            rnd.keep = keep
            stats.observe_round(rnd.num_drafted, rnd.num_accepted, len(emitted), rnd.seconds)
            if finish is not None:
                break
        else:
            finish = "length"
    finally:
        rounds.close()
        stats.decode_seconds = clock.now() - tic
    yield cutter.final(finish)


def generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    drafter: DrafterSpec = None,
    num_draft: int | str = AUTO,
    max_draft: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    max_tokens: int = 256,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> GenerationResult:
    """Run `stream_generate` to the end; the arguments are those of `stream_generate`.

    Returns:
        A `GenerationResult` (text, stats, tokens, finish_reason); unpacks as `text, stats`.
    """
    stream = stream_generate(
        model,
        tokenizer,
        prompt,
        drafter=drafter,
        num_draft=num_draft,
        max_draft=max_draft,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        seed=seed,
        stop=stop,
    )
    pieces, tokens, last = [], [], None
    for chunk in stream:
        pieces.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        last = chunk
    return GenerationResult("".join(pieces), last.stats, tokens, last.finish_reason)
