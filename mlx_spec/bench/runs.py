"""One timed generation of mlx-spec or mlx-lm, read from its stream as a `Run`."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx_spec
from mlx_spec.core.stats import SpecStats

import mlx.core as mx


@dataclass
class Run:
    """One generation, seen from the stream: token arrival times and where rounds end."""

    tokens: list[int]
    stamps: list[float]
    flags: list[bool]
    start: float
    stats: SpecStats
    peak_memory: int
    prefill_tokens_per_sec: float

    @property
    def round_ends(self) -> list[int]:
        """Index of the last token of each round."""
        ends = [i for i, from_draft in enumerate(self.flags) if not from_draft]
        if self.flags and self.flags[-1]:
            ends.append(len(self.flags) - 1)
        return ends

    def steady(self) -> tuple[int, float]:
        """(tokens, seconds) after the first round."""
        first = self.round_ends[0]
        return len(self.tokens) - first - 1, self.stamps[-1] - self.stamps[first]

    def token_latencies(self) -> list[float]:
        """Per-token latency (seconds) of every token after the first round."""
        ends = self.round_ends
        out = []
        for prev, end in zip(ends[:-1], ends[1:], strict=True):
            n = end - prev
            out += [(self.stamps[end] - self.stamps[prev]) / n] * n
        return out

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.start


def steady_sum(runs: Sequence[Run]) -> tuple[int, float]:
    """(tokens, seconds) after the first round, summed over `runs`."""
    pairs = [run.steady() for run in runs]
    return sum(n for n, _ in pairs), sum(s for _, s in pairs)


def settle() -> None:
    """Finish queued work and collect garbage so one generation does not spill into the next."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    gc.collect()


def run_mlx_spec(
    model, tokenizer, ids, drafter, k, temperature, max_tokens, seed, max_draft: int = 8
) -> Run:
    """One mlx-spec generation, timed from its stream (k: an integer or "auto")."""
    settle()
    mx.reset_peak_memory()
    tokens, stamps, flags, stats = [], [], [], None
    start = time.perf_counter()
    for chunk in mlx_spec.stream_generate(
        model,
        tokenizer,
        ids,
        drafter=drafter,
        num_draft=k,
        max_draft=max_draft,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
    ):
        now = time.perf_counter()
        if chunk.token is None:
            stats = chunk.stats
        else:
            stamps.append(now)
            tokens.append(chunk.token)
            flags.append(chunk.from_draft)
    return Run(
        tokens,
        stamps,
        flags,
        start,
        stats,
        mx.get_peak_memory(),
        stats.prefill_tokens_per_sec,
    )


def stats_from_flags(flags: Sequence[bool], num_draft: int, prompt_tokens: int = 0) -> SpecStats:
    """SpecStats of a stream of `from_draft` flags from a drafter that drafts `min(k, tokens
    left)` per round (mlx-lm's speculative decoding)."""
    stats = SpecStats(drafter="draft-model", num_draft=num_draft, prompt_tokens=prompt_tokens)
    total, i = len(flags), 0
    while i < total:
        j = i
        while j < total and flags[j]:
            j += 1
        accepted = j - i
        emitted = accepted + (1 if j < total else 0)
        stats.observe_round(min(num_draft, total - i), accepted, emitted, 0.0)
        i += emitted
    return stats


def run_mlx_lm(model, tokenizer, ids, draft_model, k, temperature, max_tokens, seed) -> Run:
    """One mlx-lm speculative generation with the same draft model, timed from its stream."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    settle()
    mx.reset_peak_memory()
    mx.random.seed(seed)
    tokens, stamps, flags, last = [], [], [], None
    start = time.perf_counter()
    for response in mlx_lm.stream_generate(
        model,
        tokenizer,
        mx.array(ids, mx.uint32),
        max_tokens=max_tokens,
        draft_model=draft_model,
        num_draft_tokens=k,
        sampler=make_sampler(temp=temperature),
    ):
        stamps.append(time.perf_counter())
        tokens.append(int(response.token))
        flags.append(bool(response.from_draft))
        last = response
    stats = stats_from_flags(flags, k, len(ids))
    return Run(tokens, stamps, flags, start, stats, mx.get_peak_memory(), last.prompt_tps)
