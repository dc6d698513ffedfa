"""A conversation's target and drafter kept across turns: each turn prefills only what its prompt
adds to the tokens already cached.

The target's cache holds a known prefix of the sequence (every earlier prompt and reply). A new
prompt is compared with it token by token; the cache is cut back to the longest common prefix
when every cache can be cut exactly (KV caches, sliding windows that never wrapped), and only
the rest of the prompt is prefilled. Recurrent state (hybrid models) and wrapped windows cannot
be cut: when the new prompt does not extend the cached tokens they are rebuilt from scratch
(`SpecStats.cache_reset`). The drafter follows through `Drafter.extend`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mlx_spec.api import (
    AUTO,
    GenerationChunk,
    GenerationResult,
    check_fits,
    check_settings,
    checked_prompt,
    decode,
    draft_label,
    make_policy,
    wrap_tokenizer,
)
from mlx_spec.core import clock
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.base import Drafter, hidden_wanted
from mlx_spec.loading import DrafterSpec, resolve_drafter

import mlx.core as mx
import mlx.nn as nn


class _Prefilling:
    """What `Session.stream(..., prefill_step=N)` yields between prefill chunks."""

    def __repr__(self) -> str:
        return "PREFILLING"


PREFILLING = _Prefilling()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Session:
    """A target and a drafter that keep their caches from one generation to the next.

    Args:
        model, tokenizer: the target, e.g. from `mlx_spec.load`.
        drafter: None, "ngram", "mtp", a `Drafter` or a list of them (as for
            `stream_generate`); it is kept, with its own cache, for the whole session.
        num_draft: "auto" or draft tokens per round, unless a call says otherwise. With "auto"
            the costs and acceptance measured in one turn carry over to the next.
        max_draft: the longest draft "auto" considers.
        check: check that the drafter fits the target and tokenizer (skip it only for a
            drafter built over weights already checked, as the server's factories do).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        drafter: DrafterSpec = None,
        num_draft: int | str = AUTO,
        max_draft: int = 8,
        check: bool = True,
    ):
        check_settings(num_draft, 0, max_draft)
        self.model = model
        self.tokenizer = wrap_tokenizer(tokenizer)
        self.vocab_size = scored_vocab(model, self.tokenizer)
        self.drafter = resolve_drafter(drafter, model)
        if self.drafter is not None and check:
            self.drafter.check_compatible(model, self.tokenizer, self.vocab_size)
        self.num_draft = num_draft
        self.max_draft = max_draft
        self.last_stats: SpecStats | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every cached token (the next prompt is prefilled in full)."""
        self._new_target()
        self._drafter_sequence: list[int] | None = None  # what the drafter last followed
        self._broken = False  # a turn failed midway: the caches hold something unknown

    def _new_target(self) -> None:
        self.target = ModelRunner(
            self.model,
            self.vocab_size,
            rollback=self.drafter is not None,
            keep_hidden=hidden_wanted(self.drafter),
        )
        if self.drafter is not None:
            self.drafter.bind_target(self.target)
        self._sequence: list[int] = []  # the target's cache holds _sequence[: target.length]
        # The target's cache at the end of the last prompt, where it cannot be cut in place
        # (recurrent layers, sliding windows): a next turn that shares that prompt but not the
        # reply as re-tokenized goes back there instead of starting over.
        self._snapshot = None

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens in the target's cache, in order."""
        return self._sequence[: self.target.length]

    @property
    def settled(self) -> bool:
        """False while a turn runs, and after one that failed midway (the next turn then
        starts from fresh caches)."""
        return not self._broken

    @property
    def nbytes(self) -> int:
        """Bytes held by the target's and the drafter's caches."""
        return self.target.nbytes + (0 if self.drafter is None else self.drafter.nbytes)

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """How many of the prompt's tokens the next turn would take from the cache instead of
        prefilling them (0 when the caches would have to be rebuilt)."""
        if self._broken:
            return 0
        start = self._reuse_point(list(prompt_ids), self.drafter is not None)
        if self.target.can_truncate(start):
            return start
        return self._snapshot.length if self._usable_snapshot(start) else 0

    def _usable_snapshot(self, start: int) -> bool:
        return self._snapshot is not None and 0 < self._snapshot.length <= start

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        num_draft: int | str | None = None,
        max_draft: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 256,
        seed: int | None = None,
        stop: Sequence[str] = (),
        prefill_step: int | None = None,
    ) -> Iterator[GenerationChunk]:
        """Generate from `prompt` (the whole conversation so far, as text or token ids),
        reusing the cached prefix it shares with the earlier turns. Arguments and chunks are
        those of `stream_generate`; `num_draft` defaults to the session's (0: plain decoding
        this turn). Closing the generator early (or Ctrl-C between chunks) keeps the caches
        consistent with the tokens emitted so far.

        `prefill_step`: prefill the prompt in chunks of that many tokens and yield
        `PREFILLING` after each chunk but the last, so that a scheduler can run other work in
        between (the server interleaves long prefills with other streams' decoding)."""
        num_draft = self.num_draft if num_draft is None else num_draft
        max_draft = self.max_draft if max_draft is None else max_draft
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        check_settings(num_draft, max_tokens, max_draft)
        ids = checked_prompt(self.tokenizer, prompt, self.vocab_size)
        check_fits(ids, self.target)
        drafter = self.drafter if num_draft else None
        if seed is not None:
            mx.random.seed(seed)
        stats = SpecStats(
            drafter=drafter.name if drafter else "none",
            num_draft=draft_label(num_draft),
            prompt_tokens=len(ids),
        )
        if self.target.sync is not None:
            stats.world_size = self.target.sync.size
        self.last_stats = stats
        if self._broken:  # an earlier turn failed midway: what the caches hold is unknown
            self._reset_target(stats, keep_drafter=False)
        self._broken = True  # until this turn has settled
        tic = clock.now()
        hidden_start, hidden = yield from self._prefill(
            ids, stats, drafter is not None, prefill_step
        )
        if drafter is not None:
            self._follow(drafter, ids, hidden_start, hidden, stats)
        stats.prefill_seconds = clock.now() - tic
        trace: list[int] = []
        try:
            yield from decode(
                self.target,
                drafter,
                ids[-1],
                self.tokenizer,
                sampling,
                self._policy(drafter, num_draft, max_draft, sampling),
                max_tokens,
                stats,
                stop,
                trace,
            )
        except GeneratorExit:  # closed between chunks: the rounds settled where output ended
            self._commit(ids, trace, drafter)
            raise
        else:
            self._commit(ids, trace, drafter)

    def _policy(self, drafter: Drafter | None, num_draft, max_draft: int, sampling):
        """The turn's policy; "auto" keeps what earlier turns (and other conversations with
        the same target, drafter and sampling settings) learned."""
        if drafter is None:
            return None
        return make_policy(num_draft, max_draft, drafter, model=self.model, sampling=sampling)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Run `stream` to the end; returns a `GenerationResult` (text, stats, tokens, ...)."""
        pieces, tokens, last = [], [], None
        for chunk in self.stream(prompt, **kwargs):
            pieces.append(chunk.text)
            if chunk.token is not None:
                tokens.append(chunk.token)
            last = chunk
        return GenerationResult("".join(pieces), last.stats, tokens, last.finish_reason)

    def _commit(self, ids: list[int], trace: list[int], drafter: Drafter | None) -> None:
        self._sequence = ids + trace
        if drafter is not None:
            self._drafter_sequence = self._sequence
        self._broken = False

    def _prefill(self, ids: list[int], stats: SpecStats, drafting: bool, step: int | None):
        """Bring the target's cache to `ids[:-1]` (yielding `PREFILLING` between chunks of
        `step` tokens, if given); returns where the prefill started and the hidden states of
        the tokens it fed (if kept)."""
        start = self._reuse_point(ids, drafting)
        if not self.target.truncate(start):
            if self._usable_snapshot(start):
                self.target.restore(self._snapshot)
                start = self._snapshot.length
            else:
                self._reset_target(stats)
                start = 0
        stats.cached_tokens = start
        if step is None:
            hidden = self.target.prefill(ids[start:-1])
        else:
            steps = self.target.prefill_steps(ids[start:-1], step=step)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    hidden = done.value
                    break
                yield PREFILLING
        self._snapshot = self.target.snapshot()
        return start, hidden

    def _reuse_point(self, ids: list[int], drafting: bool) -> int:
        """Where the prefill of `ids` starts: the end of the cached prefix they share (the
        last prompt token is always fed)."""
        cached = self.cached_tokens
        start = min(common_prefix(ids, cached), len(ids) - 1)
        if drafting and self.drafter is not None and self.drafter.needs_hidden:
            if start < len(cached):
                # The drafter's state ends one position before the cut: give it that hidden state.
                start = max(0, start - 1)
        return start

    def _reset_target(self, stats: SpecStats, keep_drafter: bool = True) -> None:
        """A fresh target cache (the drafter's own state is kept when `keep_drafter`)."""
        stats.cache_reset = stats.cache_reset or self.target.length > 0
        self._new_target()
        if not keep_drafter:
            self._drafter_sequence = None

    def _follow(self, drafter: Drafter, ids, start: int, hidden, stats: SpecStats) -> None:
        """Bring the drafter to `ids`: extend from what it followed, else begin afresh (with
        the hidden states of the whole prompt when it needs them)."""
        if self._drafter_sequence is not None:
            common = common_prefix(ids, self._drafter_sequence)
            if drafter.extend(ids, common, self.vocab_size, hidden, start):
                return
        if drafter.needs_hidden and start > 0:
            self._reset_target(stats)
            stats.cached_tokens = 0
            hidden = self.target.prefill(ids[:-1])
        drafter.begin(ids, self.vocab_size, hidden)
