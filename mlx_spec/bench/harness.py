"""The benchmark harness behind `mlx-spec bench`: tokens/s of every decoding mode, A/B.

A configuration is a decoding mode, a number of drafts per round k (or `"auto"`: the adaptive
policy picks k in 0..max_draft every round) and a temperature. The modes are plain decoding
(`plain`), mlx-spec with each drafter (`draft-model`, `ngram`, `mtp`), all of them as one
group chosen between every round (`all`, auto only), and
mlx-lm's own speculative decoding with the same draft model (`mlx-lm`, the peer:
`mlx_lm.stream_generate(..., draft_model=..., num_draft_tokens=k, sampler=make_sampler(temp=T))`).
Only the mode changes between configurations: the prompts, the number of generated tokens, the
sampling settings and the seeds are the same.

How it runs:

- Prompts: the built-in set is the first `prompt_tokens` tokens of each held-out
  standard-library file of the embedded pair (`embedded.HELDOUT`); `prompts_file` reads one
  prompt per line, or JSON lines `{"prompt": ...}`.
- EOS is disabled (on a copy of the tokenizer), so every configuration generates exactly
  `max_tokens` tokens per prompt. Generation `p` of repeat `r` is seeded with
  `seed + 1000 * r + p` in every configuration.
- Order: every configuration runs once on the first prompt (warm-up, not measured). Then
  `repeats` repeats, each running every prompt through every configuration back to back
  (round-robin, the order rotated by one configuration per prompt), so machine noise spreads
  over all configurations alike; after each repeat's prompts, the cost model is sampled (each
  speculative mlx-spec configuration runs once more with its drafter timed, and a share of the
  target-pass micro-benchmarks runs), under the same load as the measured runs. Plain decoding
  always runs: it is the baseline. Objects alive when the run starts are frozen out of Python's
  garbage collector (`gc.freeze`), and a collection runs before each generation.

What is measured, per configuration (identically for mlx-spec and mlx-lm, from the stream):

- Arrival times: the clock is read when the generation call is made and as each token's chunk
  arrives. A round is one target pass; it emits its accepted drafts (`from_draft` true) then
  one token from the target (the recovered or bonus token), so the rounds are read off the
  stream of either library. Plain decoding is one token per round.
- `tokens_per_sec` (decode): the tokens after the first round divided by the time from the end
  of the first round to the last token, summed over the prompts of a repeat; the median over
  repeats. The first round, which follows the prefill, is left out of every configuration
  alike. `tokens_per_sec_runs` lists the repeats.
- `speedup`: `tokens_per_sec` over plain decoding's at the same temperature (mlx-spec's plain
  decoding; benchmarks/plain_overhead.py measures it against mlx-lm's).
- `ttft_ms`: time to the first token (prefill and the first round), median over all generations.
- `latency_p50_ms`, `latency_p95_ms` (per-token latency): each round after the first takes
  the time from the end of the previous round to its own end; each of its tokens is given that
  time divided by the round's token count. Percentiles over the tokens of all prompts of a
  repeat, median over repeats.
- `acceptance_rate`: accepted drafts / drafted tokens over every measured generation;
  `acceptance_by_position[i]`: rounds that kept draft i+1 / rounds that drafted it;
  `mean_accepted_length`: tokens per round (target pass), recovered and bonus tokens
  included; `target_passes_per_token` is its inverse. mlx-spec's come from `SpecStats`, mlx-lm's
  from its `from_draft` flags (a round drafts `min(k, tokens left)`).
- `prefill_tokens_per_sec`: mlx-spec: prompt tokens / `SpecStats.prefill_seconds` (the
  target's prefill and the drafter's `begin`); mlx-lm: its own `prompt_tps`, which counts its
  first round as prompt time. Median over generations.
- `peak_memory_mb`: `mx.get_peak_memory()` during one generation (reset before it; weights
  included), the largest over a repeat's prompts, median over repeats.
- `k_histogram` (auto rows): rounds per k asked for, k = 0 counting plain decoding steps;
  `drafter_rounds`: the group's rounds per drafter; `vs_best_fixed_k`: the auto row's
  tokens/s over the best fixed k of the same mode and temperature in the same run.
- `rollback_ms`: mlx-spec's time restoring the caches after verification
  (`SpecStats.rollback_seconds`) per generation, median; `rollback_share` is its share of the
  decode time. mlx-lm's rollback happens inside its generator and is not measured (None).

The cost model (the analytic bound), in units of one plain decoding step (1 / plain decoding's
`tokens_per_sec` at the same temperature, `plain_step_ms`):

- `target_pass_ms[n]` (per temperature): one target forward pass over n tokens at a cache of
  `cost_context` tokens (the mean prompt length plus half the generated tokens), with the
  sampling work of that temperature (argmax; or probabilities and a draw), evaluated; the cache
  is rolled back after each pass. Medians of `micro_repeats` passes after two warm-up passes,
  the sizes and temperatures interleaved. `verify_cost[j]` (v_j) is the (j + 1)-token pass
  over the plain step; for the result rows, v_k.
- Tree modes (medusa, lookahead, draft-tree, mtp-tree, eagle3-tree): `draft_cost` is per level
  of the tree drafted (`draft_tree()` timed), `target_pass_ms` also holds passes of 2k + 1 tokens (a
  two-branch tree of depth k and its root; lookahead's largest pass), `nodes_per_pass` is the
  mean of the tokens a tree round's pass scored, and `predicted_speedup` is left out (the chain
  model's v_k is not a tree's pass); `benchmarks/tree_prediction.py` applies the model to them.
- `draft_cost` (c): the drafter's time per drafted token (`draft_ms`) over the plain step,
  measured in situ: the timed run wraps the drafter and times each `draft()` call until its
  tokens and probabilities are evaluated (for a draft model or an MTP head: k forward passes,
  the first one also feeding the tokens pending from the last round; for n-gram: the lookup).
- `expected_tokens_per_round` E = 1 + sum_i a_i / R, where a_i counts the rounds that kept
  draft i+1 and R the rounds; when every round drafts k this is 1 + sum_i a_i / d_i, the sum of
  the probabilities that a round keeps at least i+1 drafts (d_i: rounds that drafted i+1).
- `predicted_speedup` = E / sum_j f_j (j c + v_j), f_j the share of rounds that drafted j
  tokens; when every round drafts k this is E / (k c + v_k): the speedup if a round cost
  nothing but its drafter and target passes. `realized_over_predicted` = speedup /
  predicted_speedup, which equals the modeled round time over the measured round time: the
  share of a round spent in the model passes, the rest being sampling, verification, rollback
  and bookkeeping. (Plain decoding's own per-token overhead cancels out of this ratio.)
- mlx-lm rows use the draft-model configuration's c and the same v_k with their own E.
- `vs_mlx_lm` (draft-model and mlx-lm rows): mlx-spec's draft-model tokens/s over mlx-lm's at
  the same k and temperature.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import mlx_spec
from mlx_spec import embedded
from mlx_spec.api import SOURCE_ATTR, encode_prompt
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig, greedy, logits_to_probs, sample
from mlx_spec.core.stats import SpecStats, merge_stats
from mlx_spec.decoding import distributed
from mlx_spec.decoding.runner import ModelRunner, context_limit
from mlx_spec.decoding.tree import TreeDrafter
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.drafters.branching import BranchingDraftModel, BranchingMTP
from mlx_spec.drafters.group import DrafterGroup
from mlx_spec.drafters.lookahead import LookaheadDrafter
from mlx_spec.drafters.mtp import MTP_DIR
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.platform import blas as _blas

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

PLAIN, DRAFT_MODEL, NGRAM, MTP, PEER = "plain", "draft-model", "ngram", "mtp", "mlx-lm"
MEDUSA = "medusa"  # Medusa heads: a tree verified in one pass (k: the tree's depth)
LOOKAHEAD = "lookahead"  # lookahead decoding (k: the n-grams' length, at most N - 1 = 2)
DRAFT_TREE = "draft-tree"  # the draft model's top 2 first tokens, each continued greedily
MTP_TREE = "mtp-tree"  # the MTP head's top 2 first tokens, each continued by the head
EAGLE3_TREE = "eagle3-tree"  # the EAGLE-3 head's dynamic tree (EAGLE-2), 2 paths grown a level
EAGLE3 = "eagle3"  # an EAGLE-3 head over three target layers' features (the target's eagle3/)
DFLASH = "dflash"  # a DFlash block drafter (the target's dflash/)
ALL = "all"  # every drafter of the run as one group, chosen between each round (auto only)
MODES = (
    PLAIN, DRAFT_MODEL, NGRAM, MTP, EAGLE3, DFLASH, MEDUSA, LOOKAHEAD, DRAFT_TREE, MTP_TREE,
    EAGLE3_TREE, ALL,
    PEER,
)  # fmt: skip
TREE_MODES = (MEDUSA, LOOKAHEAD, DRAFT_TREE, MTP_TREE, EAGLE3_TREE)
SPEC_MODES = (DRAFT_MODEL, NGRAM, MTP, EAGLE3, DFLASH, ALL)
AUTO = "auto"
SEED_STRIDE = 1000  # seed of prompt p in repeat r: seed + SEED_STRIDE * r + p


@dataclass(frozen=True)
class BenchConfig:
    """What `run_bench` measures.

    Attributes:
        model: target directory or hub id; None: the embedded demo pair.
        draft_model: draft model for `draft-model` and `mlx-lm`; None: the embedded pair's
            draft when `model` is None, else no draft model.
        mtp: MTP drafter directory; "" requires MODEL/mtp; None uses MODEL/mtp when present.
        prompts_file: one prompt per line, or JSON lines with a "prompt" string; None: the
            held-out standard-library files.
        prompt_tokens: length of each built-in prompt, in tokens.
        num_prompts: use only the first N prompts (None: all).
        modes: modes to run (None: every mode the models allow).
        num_draft: the k sweep for speculative modes.
        auto: also run each speculative mode with num_draft="auto" (k chosen every round in
            0..max_draft), and all drafters as one group (mode "all").
        max_draft: K for the auto rows.
        temperatures: sampling temperatures (0 = greedy).
        max_tokens: tokens generated per prompt.
        repeats: measured repeats (medians are reported).
        seed: base seed.
        peer: run mlx-lm's speculative decoding (needs a draft model).
        micro_repeats: passes per size in the cost micro-benchmarks.
    """

    model: str | None = None
    draft_model: str | None = None
    mtp: str | None = None
    prompts_file: str | None = None
    prompt_tokens: int = 128
    num_prompts: int | None = None
    modes: tuple[str, ...] | None = None
    num_draft: tuple[int, ...] = (1, 2, 4, 8)
    auto: bool = True
    max_draft: int = 8
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_tokens: int = 128
    repeats: int = 3
    seed: int = 0
    peer: bool = True
    micro_repeats: int = 20
    shard: str | None = None

    @classmethod
    def preset(cls, quick: bool = False, **overrides) -> BenchConfig:
        """The default run, or with `quick` a run of a few minutes (3 prompts, 64 tokens,
        k in {2, 4}, 2 repeats); `overrides` replace single fields."""
        base = cls()
        if quick:
            base = replace(
                base, num_prompts=3, max_tokens=64, num_draft=(2, 4), repeats=2, micro_repeats=8
            )
        return replace(base, **overrides)

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if not self.num_draft or any(not isinstance(k, int) or k < 1 for k in self.num_draft):
            raise ValueError(f"num_draft must be integers >= 1, got {self.num_draft}")
        if not self.temperatures or any(t < 0 or not math.isfinite(t) for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        for name in ("max_tokens", "repeats", "prompt_tokens", "micro_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 2 * (max(self.num_draft) + 1):
            raise ValueError(
                f"max_tokens must be >= 2 (k + 1) = {2 * (max(self.num_draft) + 1)} for the "
                f"largest k, so that rounds follow the first; got {self.max_tokens}"
            )
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        unknown = [m for m in self.modes or () if m not in MODES]
        if unknown:
            raise ValueError(f"unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}")
        if self.modes is not None and not self.modes:
            raise ValueError("no modes given")


def parse_int_list(text: str, flag: str = "--num-draft") -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): distinct integers >= 1, sorted."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag}: expected comma-separated integers >= 1, got {text!r}")
    return tuple(sorted(set(values)))


def parse_float_list(text: str, flag: str = "--temperatures") -> tuple[float, ...]:
    """'0,1.0' -> (0.0, 1.0): distinct finite numbers >= 0, in the given order."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 or not math.isfinite(v) for v in values):
        raise ValueError(f"{flag}: expected comma-separated numbers >= 0, got {text!r}")
    return tuple(dict.fromkeys(values))


def parse_modes(text: str) -> tuple[str, ...]:
    """'plain,ngram' -> ('plain', 'ngram'), each one of MODES."""
    values = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [v for v in values if v not in MODES]
    if not values or bad:
        raise ValueError(
            f"--modes: unknown mode {bad[0] if bad else text!r}; choose from {','.join(MODES)}"
        )
    return values


# --- prompts -------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One benchmark prompt: a label (file name or line number) and its token ids."""

    label: str
    ids: list[int]


def read_prompts_file(path: str | Path) -> list[tuple[str, str]]:
    """(label, text) of each prompt in a file: one per line, or JSON lines whose objects have a
    "prompt" string (the format is JSON lines when the first non-blank line starts with "{").
    Blank lines are skipped; `\\n` in a plain line stays literal.

    Raises:
        FileNotFoundError: no such file.
        ValueError: no prompts, or a JSON line that is not an object with a "prompt" string.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise ValueError(f"{path}: no prompts (the file is empty)")
    if not numbered[0][1].lstrip().startswith("{"):
        return [(f"line {n}", line) for n, line in numbered]
    out = []
    for n, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
        text = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text:
            raise ValueError(f'{path}:{n}: expected an object with a non-empty "prompt" string')
        out.append((f"line {n}", text))
    return out


def builtin_prompts(tokenizer, num_tokens: int) -> list[Prompt]:
    """The first `num_tokens` tokens of each held-out standard-library file."""
    out = []
    for path in embedded.stdlib_files()[1]:
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            ids = encode_prompt(tokenizer, text[: 32 * num_tokens])  # a token is < 32 characters
            if len(ids) < num_tokens and len(text) > 32 * num_tokens:
                ids = encode_prompt(tokenizer, text)
            out.append(Prompt(path.name, ids[:num_tokens]))
    if not out:
        raise FileNotFoundError("none of the held-out standard-library files exist here")
    return out


# --- one generation ------------------------------------------------------------------------


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


def _settle() -> None:
    """Finish queued work and collect garbage so one generation does not spill into the next."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    gc.collect()


def run_mlx_spec(
    model, tokenizer, ids, drafter, k, temperature, max_tokens, seed, max_draft: int = 8
) -> Run:
    """One mlx-spec generation, timed from its stream (k: an integer or "auto")."""
    _settle()
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

    _settle()
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


class TimedDrafter(Drafter):
    """Wraps a drafter and times each `draft()` until its output is evaluated."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = inner.name
        self.needs_hidden = inner.needs_hidden
        self.hidden_layers = getattr(inner, "hidden_layers", None)
        self.seconds = 0.0
        self.drafted = 0

    @property
    def runner(self):
        return getattr(self.inner, "runner", None)

    @property
    def arm_names(self) -> list[str]:
        return self.inner.arm_names

    def select(self, arm: int) -> None:
        self.inner.select(arm)

    def arms_available(self, k: int) -> list[int | None]:
        return self.inner.arms_available(k)

    def catch_up(self) -> None:
        self.inner.catch_up()

    def check_compatible(self, target, tokenizer, vocab_size: int) -> None:
        self.inner.check_compatible(target, tokenizer, vocab_size)

    def bind_target(self, target) -> None:
        self.inner.bind_target(target)

    def begin(self, prompt, vocab_size, hidden=None) -> None:
        self.inner.begin(prompt, vocab_size, hidden)

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        tic = time.perf_counter()
        draft = self.inner.draft(k, sampling)
        mx.eval(draft.tokens, *([] if draft.probs is None else [draft.probs]))
        self.seconds += time.perf_counter() - tic
        self.drafted += draft.tokens.size
        return draft

    def accept(self, num_accepted, emitted, hidden=None) -> None:
        self.inner.accept(num_accepted, emitted, hidden)


class TimedTreeDrafter(TreeDrafter):
    """Wraps a tree drafter and times each `draft_tree()`; `drafted` counts levels."""

    def __init__(self, inner: TreeDrafter):
        self.inner = inner
        self.name, self.needs_hidden = inner.name, inner.needs_hidden
        self.hidden_layers = getattr(inner, "hidden_layers", None)
        self.max_depth = inner.max_depth
        self.seconds = 0.0
        self.drafted = 0
        self.nodes, self.rounds = 0, 0  # tokens of the trees' passes (root included), rounds

    def check_compatible(self, hidden_size: int, vocab_size: int) -> None:
        self.inner.check_compatible(hidden_size, vocab_size)

    def begin(self, prompt, hidden) -> None:
        self.inner.begin(prompt, hidden)

    def draft_tree(self, depth, vocab_size, sampling):
        tic = time.perf_counter()
        tree = self.inner.draft_tree(depth, vocab_size, sampling)
        if tree.probs is not None:
            mx.eval(tree.probs)
        self.seconds += time.perf_counter() - tic
        self.drafted += tree.depth
        self.nodes += 1 + len(tree)
        self.rounds += 1
        return tree

    def accept(self, tokens, hidden) -> None:
        self.inner.accept(tokens, hidden)

    def side_branch(self):
        side = self.inner.side_branch()
        self.nodes += 0 if side is None else len(side.tokens)
        return side

    def observe_side(self, best) -> None:
        self.inner.observe_side(best)


# --- the cost model ------------------------------------------------------------------------


class PassTimer:
    """Times target passes over n tokens at a fixed cache length, with the sampling work of a
    temperature; the cache is rolled back after each pass.

    Args:
        model: the target.
        vocab_size: logits are cut to this many tokens.
        ids: tokens to fill the cache with (repeated up to `context`).
        context: cache length at which passes are timed.
        sizes: token counts per pass.
        temperatures: 0 times an argmax, others probabilities and a draw.
    """

    def __init__(self, model, vocab_size, ids, context, sizes, temperatures):
        self.runner = ModelRunner(model, vocab_size, rollback=True)
        seq = (list(ids) * (context // max(len(ids), 1) + 1))[:context]
        self.runner.prefill(seq)
        self.feed = mx.array((seq * 2)[: max(sizes)], mx.uint32)
        self.sizes, self.temperatures = list(sizes), list(temperatures)
        self.times = {t: {n: [] for n in self.sizes} for t in self.temperatures}
        self.sample(2, keep=False)  # warm-up

    def _once(self, n: int, temperature: float) -> float:
        self.runner.checkpoint(n, single_call=True)
        tic = time.perf_counter()
        logits = self.runner(self.feed[:n])
        if temperature == 0:
            out = greedy(logits)
        else:
            out = sample(logits_to_probs(logits, SamplingConfig(temperature=temperature)))
        mx.eval(out)
        seconds = time.perf_counter() - tic
        self.runner.rollback(0)
        return seconds

    def sample(self, repeats: int, keep: bool = True) -> None:
        """Time `repeats` passes of every size and temperature, interleaved."""
        for _ in range(repeats):
            for temperature in self.temperatures:
                for n in self.sizes:
                    seconds = self._once(n, temperature)
                    if keep:
                        self.times[temperature][n].append(seconds)

    def medians(self) -> dict[float, dict[int, float]]:
        """{temperature: {n: median seconds}}."""
        return {t: {n: _median(v) for n, v in by_n.items()} for t, by_n in self.times.items()}


def expected_tokens_per_round(stats: SpecStats) -> float:
    """E[tokens per round] = 1 + sum_i a_i / R (a_i: rounds that kept draft i+1; R: rounds)."""
    if not stats.target_passes:
        return 0.0
    return 1.0 + sum(stats.accepted_per_position) / stats.target_passes


def draft_length_shares(stats: SpecStats) -> dict[int, float]:
    """{j: share of rounds that drafted exactly j tokens}."""
    rounds = stats.target_passes
    if not rounds:
        return {}
    reached = [rounds, *stats.drafted_per_position, 0]
    return {j: (reached[j] - reached[j + 1]) / rounds for j in range(len(reached) - 1)}


def expected_round_cost(
    stats: SpecStats, draft_cost: float, verify_cost: Mapping[int, float]
) -> float:
    """sum_j f_j (j c + v_j), in target steps; v_0 = 1."""
    costs = {0: 1.0, **verify_cost}  # v_0: a plain step unless measured
    return sum(f * (j * draft_cost + costs[j]) for j, f in draft_length_shares(stats).items())


def predicted_speedup(
    stats: SpecStats, draft_cost: float, verify_cost: Mapping[int, float]
) -> float:
    """The analytic bound: E[tokens per round] / E[round cost in target steps].

    Args:
        stats: acceptance counts (per draft position) and the number of rounds.
        draft_cost: c, one drafted token's cost over one target step.
        verify_cost: v_j for each j drafted: a (j + 1)-token target pass over a 1-token pass.
    """
    cost = expected_round_cost(stats, draft_cost, verify_cost)
    return expected_tokens_per_round(stats) / cost if cost else 0.0


def analytic_curve(report: BenchReport, mode: str, temperature: float) -> list[tuple[int, float]]:
    """The bound as a function of k, [(k, predicted speedup)] for k = 1 .. K, from the
    configuration of `mode` with the largest k K: its acceptance by position (E(k) = 1 +
    sum_{i<k} a_i / d_i), its drafter cost c, and each k's measured v_k. It assumes every round
    drafts k tokens (true of draft models and MTP heads; n-gram lookups may draft fewer)."""
    rows = [
        r
        for r in report.select(mode, temperature)
        if r.draft_cost is not None and isinstance(r.num_draft, int)
    ]
    if not rows:
        return []
    ref = max(rows, key=lambda r: r.num_draft)
    verify = report.costs["verify_cost"][str(temperature)]
    out = []
    for k in range(1, ref.num_draft + 1):
        tokens = 1.0 + sum(ref.acceptance_by_position[:k])
        v = verify[k] if k in verify else verify[str(k)]
        out.append((k, tokens / (k * ref.draft_cost + v)))
    return out


# --- results -------------------------------------------------------------------------------


@dataclass
class BenchResult:
    """One configuration's measurements (see the module docstring for each definition)."""

    mode: str
    library: str
    num_draft: int | str
    temperature: float
    tokens_per_sec: float
    tokens_per_sec_runs: list[float]
    speedup: float
    acceptance_rate: float | None
    acceptance_by_position: list[float]
    mean_accepted_length: float
    target_passes_per_token: float
    latency_p50_ms: float
    latency_p95_ms: float
    ttft_ms: float
    prefill_tokens_per_sec: float
    peak_memory_mb: float
    rollback_ms: float | None
    rollback_share: float | None
    expected_tokens_per_round: float
    draft_ms: float | None
    draft_cost: float | None
    verify_cost: float | None
    predicted_speedup: float | None
    realized_over_predicted: float | None
    vs_mlx_lm: float | None = None
    vs_best_fixed_k: float | None = None
    k_histogram: dict[str, int] = field(default_factory=dict)
    drafter_rounds: dict[str, int] = field(default_factory=dict)
    matches_plain: bool | None = None
    generations: int = 0
    nodes_per_pass: float | None = None  # tree modes: tokens a tree round's pass scores
    comm_ms_per_pass: float | None = None  # a sharded target: priced collectives per pass
    stats: SpecStats | None = field(default=None, repr=False)
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        return self.mode if self.mode == PLAIN else f"{self.mode} k={self.num_draft}"

    def to_dict(self) -> dict:
        """JSON-ready record (the per-token latency samples left out)."""
        out = asdict(self)
        out.pop("latencies_ms")
        stats = out.pop("stats")
        if stats is not None:
            out["drafted_per_position"] = stats["drafted_per_position"]
            out["accepted_per_position"] = stats["accepted_per_position"]
            out["target_passes"] = stats["target_passes"]
            out["generated_tokens"] = stats["generated_tokens"]
        return out


def k_shares(r: BenchResult) -> str:
    """'0:40% 2:35% 4:25%' (k = 0: plain steps), and the group's rounds by drafter."""
    total = sum(r.k_histogram.values())
    text = " ".join(f"{k}:{n / total:.0%}" for k, n in r.k_histogram.items()) if total else "-"
    if r.mode == ALL and r.drafter_rounds:
        rounds = sum(r.drafter_rounds.values())
        text += " (" + ", ".join(f"{d} {n / rounds:.0%}" for d, n in r.drafter_rounds.items()) + ")"
    return text


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


@dataclass
class BenchReport:
    """What `run_bench` returns: the machine and settings, the cost model, one result per
    configuration."""

    header: dict
    config: dict
    costs: dict
    results: list[BenchResult]

    def result(self, mode: str, num_draft: int, temperature: float) -> BenchResult | None:
        """The result of one configuration (num_draft 0 for plain), or None."""
        for r in self.results:
            if (r.mode, r.num_draft, r.temperature) == (mode, num_draft, temperature):
                return r
        return None

    def select(self, mode: str | None = None, temperature: float | None = None) -> list:
        """Results of a mode and/or temperature, in run order."""
        return [
            r
            for r in self.results
            if (mode is None or r.mode == mode)
            and (temperature is None or r.temperature == temperature)
        ]

    @property
    def temperatures(self) -> list[float]:
        return list(dict.fromkeys(r.temperature for r in self.results))

    @property
    def modes(self) -> list[str]:
        return list(dict.fromkeys(r.mode for r in self.results))

    def summary(self) -> dict:
        """The headline numbers: the best speculative configuration at greedy (speedup,
        realized/predicted) and mlx-spec against mlx-lm per temperature."""
        out: dict = {}
        greedy_spec = [r for r in self.select(temperature=0.0) if r.mode in SPEC_MODES]
        if greedy_spec:
            best = max(greedy_spec, key=lambda r: r.speedup)
            out["best_greedy"] = {
                "mode": best.mode,
                "num_draft": best.num_draft,
                "speedup": best.speedup,
                "predicted_speedup": best.predicted_speedup,
                "realized_over_predicted": best.realized_over_predicted,
            }
        versus = {}
        for t in self.temperatures:
            ours = self.select(DRAFT_MODEL, t)
            peers = self.select(PEER, t)
            if ours and peers:
                a = max(ours, key=lambda r: r.tokens_per_sec)
                b = max(peers, key=lambda r: r.tokens_per_sec)
                versus[str(t)] = {
                    "mlx_spec_num_draft": a.num_draft,
                    "mlx_spec_tokens_per_sec": a.tokens_per_sec,
                    "mlx_lm_num_draft": b.num_draft,
                    "mlx_lm_tokens_per_sec": b.tokens_per_sec,
                    "ratio": a.tokens_per_sec / b.tokens_per_sec if b.tokens_per_sec else None,
                }
        if versus:
            out["vs_mlx_lm"] = versus
        auto = [r for r in self.results if r.num_draft == AUTO]
        if auto:
            out["auto"] = [
                {
                    "mode": r.mode,
                    "temperature": r.temperature,
                    "speedup": r.speedup,
                    "vs_best_fixed_k": r.vs_best_fixed_k,
                }
                for r in auto
            ]
        differ = [
            r.label + f" T={r.temperature:g}" for r in self.results if r.matches_plain is False
        ]
        if differ:
            out["greedy_outputs_differing_from_plain"] = differ
        return out

    def to_dict(self) -> dict:
        return {
            "benchmark": "mlx-spec bench",
            "header": self.header,
            "config": self.config,
            "costs": self.costs,
            "results": [r.to_dict() for r in self.results],
            "summary": self.summary(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    def to_markdown(self) -> str:
        """The header, the results table, mlx-spec against mlx-lm, the cost model, the
        headline numbers."""
        h = self.header
        lines = [
            "## mlx-spec bench",
            "",
            f"- machine: {h['machine']}; device {h['device']}; BLAS {h['blas']}; "
            f"dtype {h['dtype']}",
            f"- versions: mlx {h['mlx']}, mlx-lm {h['mlx_lm']}, mlx-spec {h['mlx_spec']}, "
            f"Python {h['python']}",
            f"- target: {h['target']}",
        ]
        for key in ("sharded", "draft_model", "mtp"):
            if h.get(key):
                lines.append(f"- {key.replace('_', ' ')}: {h[key]}")
        lines += [
            f"- prompts: {h['prompts']}; {h['max_tokens']} tokens generated per prompt (EOS "
            f"off); {h['repeats']} repeat(s) after a warm-up, medians",
            *[f"- note: {note}" for note in h.get("notes", [])],
            "",
            "| mode | k | T | tok/s | speedup | bound | realized/bound | acceptance | by position "
            "| mean acc. len | passes/token | latency p50/p95 ms | TTFT ms | prefill tok/s "
            "| peak MB | rollback | k chosen (share of rounds) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: "
            "| ---: | ---: | ---: | ---: | --- |",
        ]
        for r in self.results:
            positions = " ".join(f"{a:.2f}" for a in r.acceptance_by_position) or "-"
            rollback = _fmt(r.rollback_share, ".1%")
            lines.append(
                f"| {r.mode} | {r.num_draft or '-'} | {r.temperature:g} | {r.tokens_per_sec:.1f} "
                f"| {r.speedup:.2f}x | {_fmt(r.predicted_speedup, '.2f', 'x')} "
                f"| {_fmt(r.realized_over_predicted)} | {_fmt(r.acceptance_rate)} | {positions} "
                f"| {r.mean_accepted_length:.2f} | {r.target_passes_per_token:.2f} "
                f"| {r.latency_p50_ms:.2f} / {r.latency_p95_ms:.2f} | {r.ttft_ms:.1f} "
                f"| {r.prefill_tokens_per_sec:.0f} | {r.peak_memory_mb:.0f} | {rollback} "
                f"| {k_shares(r) if r.num_draft == AUTO else '-'} |"
            )
        comm = [
            f"{r.label} T={r.temperature:g} {r.comm_ms_per_pass:.2f}"
            for r in self.results
            if r.comm_ms_per_pass is not None
        ]
        if comm:
            lines += ["", "Communication of the sharded target, ms per pass (priced "
                      "collectives): " + ", ".join(comm)]  # fmt: skip
        peer_rows = [r for r in self.results if r.mode == DRAFT_MODEL and r.vs_mlx_lm]
        if peer_rows:
            lines += [
                "",
                "mlx-spec against mlx-lm's speculative decoding (same draft model, prompts and "
                "settings):",
                "",
                "| k | T | mlx-spec tok/s | mlx-lm tok/s | mlx-spec / mlx-lm |",
                "| ---: | ---: | ---: | ---: | ---: |",
            ]
            for r in peer_rows:
                peer = self.result(PEER, r.num_draft, r.temperature)
                lines.append(
                    f"| {r.num_draft} | {r.temperature:g} | {r.tokens_per_sec:.1f} "
                    f"| {peer.tokens_per_sec:.1f} | {r.vs_mlx_lm:.2f}x |"
                )
        lines += ["", *self._cost_lines(), *self._summary_lines()]
        return "\n".join(lines)

    def _cost_lines(self) -> list[str]:
        c = self.costs
        out = [
            "Cost model, in plain decoding steps (target passes timed at a "
            f"{c['cost_context']}-token cache):",
            "",
        ]
        for t, step in c["plain_step_ms"].items():
            v = ", ".join(f"{j}: {x:.2f}" for j, x in c["verify_cost"][t].items())
            one = c["target_pass_ms"][t][1]
            out.append(
                f"- T={float(t):g}: plain step {step:.2f} ms, 1-token target pass {one:.2f} ms; "
                f"v_k (k drafts verified) {v}"
            )
        drafts = [
            f"{r.label} T={r.temperature:g}: {r.draft_cost:.3f}"
            for r in self.results
            if r.library == "mlx-spec" and r.draft_cost is not None
        ]
        if drafts:
            out.append("- drafter cost c per drafted token: " + ", ".join(drafts))
        return out

    def _summary_lines(self) -> list[str]:
        s = self.summary()
        out = []
        for a in s.get("auto", []):
            out.append(
                f"auto, {a['mode']} T={a['temperature']:g}: {a['speedup']:.2f}x plain, "
                f"{_fmt(a['vs_best_fixed_k'], '.2f', 'x')} the best fixed k."
            )
        if "best_greedy" in s:
            b = s["best_greedy"]
            out.append(
                f"Best greedy: {b['mode']} k={b['num_draft']}, {b['speedup']:.2f}x plain, "
                f"{_fmt(b['realized_over_predicted'])} of the bound "
                f"({_fmt(b['predicted_speedup'], '.2f', 'x')})."
            )
        for t, v in s.get("vs_mlx_lm", {}).items():
            out.append(
                f"mlx-spec vs mlx-lm at T={float(t):g}, each at its best k "
                f"(mlx-spec k={v['mlx_spec_num_draft']}, mlx-lm k={v['mlx_lm_num_draft']}): "
                f"{_fmt(v['ratio'], '.2f', 'x')}."
            )
        if "greedy_outputs_differing_from_plain" in s:
            out.append(
                "Greedy output differing from plain decoding (near-ties in a batched pass): "
                + ", ".join(s["greedy_outputs_differing_from_plain"])
                + "."
            )
        return ["", *out] if out else []


# --- the run -------------------------------------------------------------------------------


@dataclass
class _Loaded:
    model: object
    tokenizer: object
    draft: Drafter | None
    mtp: Drafter | None
    header: dict
    notes: list[str]
    medusa: object = None  # a MedusaDrafter (a tree drafter: never in the group)
    eagle: Drafter | None = None  # reads other target features than MTP: not in the group
    dflash: Drafter | None = None  # likewise


def _shown(path) -> str:
    """A path for reports, with the home directory written as ~."""
    text, home = str(path), str(Path.home())
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text


def machine_info() -> dict:
    """The machine and software versions, for benchmark headers."""
    import mlx_lm

    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "device": str(mx.default_device()),
        "blas": _blas.describe(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_spec": mlx_spec.__version__,
        "python": platform.python_version(),
    }


def param_count(model) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))


def model_dtype(model) -> str:
    dtypes = sorted({str(p.dtype) for _, p in tree_flatten(model.parameters())})
    return ", ".join(d.replace("mlx.core.", "") for d in dtypes)


def longest_draft(config: BenchConfig) -> int:
    """The most drafts any configuration of the run may verify in one pass."""
    return max(max(config.num_draft), config.max_draft if config.auto else 0)


def _wants(config: BenchConfig, mode: str) -> bool:
    return config.modes is None or mode in config.modes


def _load(config: BenchConfig) -> _Loaded:
    model_path, draft_path = config.model, config.draft_model
    if model_path is None:
        target_dir, draft_dir = embedded.converted_pair()
        model_path = str(target_dir)
        if draft_path is None and any(_wants(config, m) for m in (DRAFT_MODEL, PEER, DRAFT_TREE)):
            draft_path = str(draft_dir)
    needs_draft = config.modes is not None and ({DRAFT_MODEL, PEER, DRAFT_TREE} & set(config.modes))
    if needs_draft and draft_path is None:
        raise ValueError("modes draft-model and mlx-lm need a draft model (--draft-model PATH)")
    model, tokenizer = mlx_spec.load(model_path, shard=config.shard)
    what = " (the embedded demo pair)" if config.model is None else ""
    header = {"target": f"{_shown(model_path)}{what} ({param_count(model) / 1e6:.1f}M parameters)"}
    sharding = distributed.sharding_of(model)
    if sharding is not None:
        header["sharded"] = f"{sharding.mode} parallel over {sharding.size} ranks"
    notes = []
    draft = None
    if draft_path is not None and any(_wants(config, m) for m in (DRAFT_MODEL, PEER, DRAFT_TREE)):
        draft = mlx_spec.load_drafter(draft_path)
        size = param_count(draft.model) / 1e6
        header["draft_model"] = f"{_shown(draft_path)} ({size:.1f}M parameters)"
    mtp = None
    if _wants(config, MTP) or _wants(config, MTP_TREE):
        local = Path(getattr(model, SOURCE_ATTR, model_path))  # a hub id's download
        mtp_path = config.mtp
        if mtp_path is None and (local / MTP_DIR / "config.json").is_file():
            mtp_path = ""
        if mtp_path is not None:
            mtp = mlx_spec.load_mtp_drafter(mtp_path or str(local), model)
            header["mtp"] = _shown(Path(mtp_path) if mtp_path else local / MTP_DIR)
        elif config.modes is not None:
            raise ValueError(
                f"mode mtp/mtp-tree: {model_path} has no {MTP_DIR}/ drafter; pass --mtp DIR"
            )
    eagle = None
    local = Path(getattr(model, SOURCE_ATTR, model_path))
    tree = config.modes is not None and EAGLE3_TREE in config.modes
    wants_eagle = _wants(config, EAGLE3) or tree
    if wants_eagle and (local / EAGLE3 / "config.json").is_file():
        eagle = mlx_spec.load_eagle3_drafter(str(local), model)
        ids = list(eagle.hidden_layers)
        header["eagle3"] = f"{_shown(local / EAGLE3)} (target layers {ids})"
    elif config.modes is not None and {EAGLE3, EAGLE3_TREE} & set(config.modes):
        raise ValueError(f"mode eagle3/eagle3-tree: {model_path} has no {EAGLE3}/ head")
    block = None
    if _wants(config, DFLASH) and (local / DFLASH / "config.json").is_file():
        block = mlx_spec.load_dflash_drafter(str(local), model)
        size = block.model.cfg.block_size
        header["dflash"] = f"{_shown(local / DFLASH)} (block {size}, layers {block.hidden_layers})"
    elif config.modes is not None and DFLASH in config.modes:
        raise ValueError(f"mode dflash: {model_path} has no {DFLASH}/ drafter")
    medusa = None
    if config.modes is not None and MEDUSA in config.modes:  # tree modes run when asked for
        local = Path(getattr(model, SOURCE_ATTR, model_path))
        if (local / MEDUSA).is_dir():
            medusa = mlx_spec.load_medusa_drafter(str(local))
            header["medusa"] = f"{_shown(local / MEDUSA)} ({medusa.max_depth} heads)"
        else:
            raise ValueError(f"mode medusa: {model_path} has no {MEDUSA}/ heads")
    return _Loaded(model, tokenizer, draft, mtp, header, notes, medusa, eagle, block)


def _prompts(config: BenchConfig, tokenizer, vocab: int, limits: list[int]) -> list[Prompt]:
    if config.prompts_file is None:
        prompts = builtin_prompts(tokenizer, config.prompt_tokens)
    else:
        prompts = [
            Prompt(label, encode_prompt(tokenizer, text))
            for label, text in read_prompts_file(config.prompts_file)
        ]
    prompts = prompts[: config.num_prompts]
    room = min(limits) if limits else None
    for p in prompts:
        if room is not None and len(p.ids) + config.max_tokens + longest_draft(config) >= room:
            raise ValueError(
                f"prompt {p.label} has {len(p.ids)} tokens: with max_tokens "
                f"{config.max_tokens} it does not fit the context of {room} tokens"
            )
        bad = next((t for t in p.ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt {p.label}: token id {bad} is outside the vocabulary")
    return prompts


@dataclass
class _Setting:
    mode: str
    num_draft: int | str
    temperature: float
    drafter: Drafter | None = None
    max_draft: int = 8


def _drafters(config: BenchConfig, loaded: _Loaded) -> dict[str, Drafter]:
    """{mode: drafter} of every speculative mode this run has (the group when auto rows run
    and there are two drafters or more)."""
    single = {DRAFT_MODEL: loaded.draft, NGRAM: NgramDrafter(), MTP: loaded.mtp}
    out = {m: d for m, d in single.items() if d is not None and _wants(config, m)}
    if config.auto and len(out) > 1 and (config.modes is None or ALL in config.modes):
        out[ALL] = DrafterGroup(list(out.values()))
    if loaded.eagle is not None and _wants(config, EAGLE3):
        out[EAGLE3] = loaded.eagle
    if loaded.dflash is not None and _wants(config, DFLASH):
        out[DFLASH] = loaded.dflash
    if loaded.medusa is not None:
        out[MEDUSA] = loaded.medusa
    if config.modes is not None and LOOKAHEAD in config.modes:  # asked for: W 4, N 3, G 4
        out[LOOKAHEAD] = LookaheadDrafter()
    if config.modes is not None and DRAFT_TREE in config.modes and loaded.draft is not None:
        out[DRAFT_TREE] = BranchingDraftModel(loaded.draft.model, width=2, max_depth=8)
    if config.modes is not None and MTP_TREE in config.modes and loaded.mtp is not None:
        out[MTP_TREE] = BranchingMTP(loaded.mtp.module, width=2, max_depth=8)
    if config.modes is not None and EAGLE3_TREE in config.modes and loaded.eagle is not None:
        out[EAGLE3_TREE] = BranchingMTP(loaded.eagle.module, width=2, max_depth=8, dynamic=True)
    return out


def _settings(config: BenchConfig, loaded: _Loaded, peer_ok: bool) -> list[_Setting]:
    drafters = _drafters(config, loaded)
    out = []
    for t in config.temperatures:
        out.append(_Setting(PLAIN, 0, t))  # the baseline, always
        for mode, drafter in drafters.items():
            ks = [] if mode == ALL else list(config.num_draft)
            ks += [AUTO] if config.auto else []
            out += [_Setting(mode, k, t, drafter, config.max_draft) for k in ks]
        if peer_ok:
            out += [_Setting(PEER, k, t) for k in config.num_draft]
    return out


def _peer_ok(config: BenchConfig, loaded: _Loaded) -> bool:
    if not (config.peer and _wants(config, PEER) and loaded.draft is not None):
        return False
    if config.shard is not None:
        loaded.notes.append("mlx-lm peer skipped: it refuses a draft model on a sharded target")
        return False
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    if not can_trim_prompt_cache(make_prompt_cache(loaded.model)):
        if config.modes is not None and PEER in config.modes:
            raise ValueError("mlx-lm's speculative decoding needs a trimmable cache (this target)")
        loaded.notes.append("mlx-lm peer skipped: its speculative decoding needs trimmable caches")
        return False
    return True


def _generate(loaded: _Loaded, s: _Setting, ids, max_tokens, seed, drafter=None) -> Run:
    run = _generate_once(loaded, s, ids, max_tokens, seed, drafter)
    if len(run.tokens) != max_tokens:
        raise ValueError(
            f"{s.mode} k={s.num_draft} generated {len(run.tokens)} tokens instead of "
            f"{max_tokens}: every configuration must generate the same number"
        )
    return run


def _generate_once(loaded: _Loaded, s: _Setting, ids, max_tokens, seed, drafter) -> Run:
    if s.mode == PEER:
        return run_mlx_lm(
            loaded.model,
            loaded.tokenizer,
            ids,
            loaded.draft.model,
            s.num_draft,
            s.temperature,
            max_tokens,
            seed,
        )
    return run_mlx_spec(
        loaded.model,
        loaded.tokenizer,
        ids,
        drafter or s.drafter,
        s.num_draft,
        s.temperature,
        max_tokens,
        seed,
        s.max_draft,
    )


def _header(config: BenchConfig, loaded: _Loaded, prompts: list[Prompt]) -> dict:
    lengths = [len(p.ids) for p in prompts]
    source = (
        f"{len(prompts)} held-out standard-library files, first {config.prompt_tokens} tokens"
        if config.prompts_file is None
        else f"{len(prompts)} prompts from {config.prompts_file}"
    )
    return {
        **machine_info(),
        "dtype": model_dtype(loaded.model),
        **loaded.header,
        "prompts": f"{source} (mean {statistics.mean(lengths):.0f} tokens)",
        "prompt_labels": [p.label for p in prompts],
        "max_tokens": config.max_tokens,
        "repeats": config.repeats,
        "notes": loaded.notes,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),  # noqa: UP017
    }


def run_bench(
    config: BenchConfig | None = None, progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Measure every configuration of `config` (see the module docstring for the method).

    Args:
        config: what to run (default: `BenchConfig()`, the embedded pair).
        progress: called with one line of progress at a time (e.g. `print`).
    Returns:
        A `BenchReport`: `.results`, `.to_markdown()`, `.to_json()`.
    """
    config = config or BenchConfig()
    config.validate()
    say = progress or (lambda line: None)
    if config.prompts_file is not None:
        read_prompts_file(config.prompts_file)  # fail before loading models
    loaded = _load(config)
    gc.collect()
    gc.freeze()  # what is loaded now stays: the collection between generations stays cheap
    try:
        return _run(config, loaded, say)
    finally:
        gc.unfreeze()


def _run(config: BenchConfig, loaded: _Loaded, say: Callable[[str], None]) -> BenchReport:
    loaded.tokenizer = copy.copy(loaded.tokenizer)
    loaded.tokenizer.eos_token_ids = set()  # every configuration generates max_tokens tokens
    vocab = scored_vocab(loaded.model, loaded.tokenizer)
    models = [loaded.model] + ([loaded.draft.model] if loaded.draft is not None else [])
    limits = [c for c in (context_limit(m) for m in models) if c is not None]
    prompts = _prompts(config, loaded.tokenizer, vocab, limits)
    settings = _settings(config, loaded, _peer_ok(config, loaded))
    if len(settings) == len(config.temperatures):
        raise ValueError("nothing to compare: no speculative mode is available with these models")
    header = _header(config, loaded, prompts)

    first = prompts[0].ids
    for s in settings:  # warm-up
        _generate(loaded, s, first, config.max_tokens, config.seed)
    cost_context = round(statistics.mean(len(p.ids) for p in prompts) + config.max_tokens / 2)
    if limits:
        cost_context = min(cost_context, min(limits) - longest_draft(config) - 2)
    sizes = set(range(1, longest_draft(config) + 2))
    for s in settings:  # tree passes: two-branch trees (2k nodes), lookahead's at most
        if s.mode in (MEDUSA, DRAFT_TREE, MTP_TREE, EAGLE3_TREE):
            sizes |= {2 * k + 1 for k in config.num_draft}
        elif s.mode == LOOKAHEAD:
            d, levels = s.drafter, s.drafter.ngram - 1
            sizes |= {
                1 + d.candidates * min(k, levels) + d.window * levels for k in config.num_draft
            }
    sizes = sorted(sizes)
    passes = PassTimer(loaded.model, vocab, first, cost_context, sizes, config.temperatures)
    timed = {i: TimedDrafter(s.drafter) for i, s in enumerate(settings) if s.mode in SPEC_MODES}
    timed |= {
        i: TimedTreeDrafter(s.drafter) for i, s in enumerate(settings) if s.mode in TREE_MODES
    }
    micro = [config.micro_repeats // config.repeats] * config.repeats
    micro[0] += config.micro_repeats - sum(micro)
    say(f"warm-up done; {len(settings)} configurations x {len(prompts)} prompts")

    runs: dict[int, list[list[Run]]] = {i: [] for i in range(len(settings))}
    for r in range(config.repeats):
        for i in runs:
            runs[i].append([])
        for p, prompt in enumerate(prompts):
            shift = (r * len(prompts) + p) % len(settings)
            for i in list(range(shift, len(settings))) + list(range(shift)):
                seed = config.seed + SEED_STRIDE * r + p
                runs[i][r].append(
                    _generate(loaded, settings[i], prompt.ids, config.max_tokens, seed)
                )
        # The cost model is sampled in every repeat, under the same load as the runs.
        calibration = prompts[r % len(prompts)].ids
        for i, drafter in timed.items():
            _generate(loaded, settings[i], calibration, config.max_tokens, config.seed, drafter)
        passes.sample(micro[r])
        say(f"repeat {r + 1}/{config.repeats}: " + _progress_line(settings, runs, r))

    steps = passes.medians()
    results = [_result(s, runs[i], timed.get(i)) for i, s in enumerate(settings)]
    costs = _relate(results, runs, settings, steps)
    costs = {"cost_context": cost_context, **costs}
    return BenchReport(header, asdict(config), costs, results)


def _progress_line(settings: list[_Setting], runs: dict, r: int) -> str:
    parts = []
    for i, s in enumerate(settings):
        tokens, seconds = _steady_sum(runs[i][r])
        label = s.mode if s.mode == PLAIN else f"{s.mode} k={s.num_draft}"
        parts.append(f"{label} T={s.temperature:g} {tokens / seconds if seconds else 0:.0f}")
    return ", ".join(parts) + " tok/s"


def _steady_sum(runs: Sequence[Run]) -> tuple[int, float]:
    pairs = [run.steady() for run in runs]
    return sum(n for n, _ in pairs), sum(s for _, s in pairs)


def _result(s: _Setting, runs: list[list[Run]], timed: TimedDrafter | None) -> BenchResult:
    """Medians over repeats, counts over all generations; costs and ratios come later."""
    rates = []
    for repeat in runs:
        tokens, seconds = _steady_sum(repeat)
        rates.append(tokens / seconds if seconds else 0.0)
    flat = [run for repeat in runs for run in repeat]
    stats = merge_stats([run.stats for run in flat])
    by_repeat = [[x for run in repeat for x in run.token_latencies()] for repeat in runs]
    p50 = _median([float(np.percentile(x, 50)) for x in by_repeat if x])
    p95 = _median([float(np.percentile(x, 95)) for x in by_repeat if x])
    speculative = s.mode != PLAIN
    rollback = [run.stats.rollback_seconds for run in flat]
    decode = sum(run.stats.decode_seconds for run in flat)
    measured_rollback = s.mode not in (PLAIN, PEER)
    return BenchResult(
        mode=s.mode,
        library="mlx-lm" if s.mode == PEER else "mlx-spec",
        num_draft=s.num_draft,
        temperature=s.temperature,
        tokens_per_sec=_median(rates),
        tokens_per_sec_runs=rates,
        speedup=1.0,
        acceptance_rate=stats.acceptance_rate if speculative else None,
        acceptance_by_position=[
            a / d if d else 0.0
            for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=True)
        ],
        mean_accepted_length=stats.mean_accepted_length,
        target_passes_per_token=(
            stats.target_passes / stats.generated_tokens if stats.generated_tokens else 0.0
        ),
        latency_p50_ms=p50 * 1e3,
        latency_p95_ms=p95 * 1e3,
        ttft_ms=_median([run.ttft for run in flat]) * 1e3,
        prefill_tokens_per_sec=_median([run.prefill_tokens_per_sec for run in flat]),
        peak_memory_mb=_median([max(run.peak_memory for run in rep) for rep in runs]) / 1e6,
        rollback_ms=_median(rollback) * 1e3 if measured_rollback else None,
        rollback_share=(sum(rollback) / decode if decode else 0.0) if measured_rollback else None,
        expected_tokens_per_round=expected_tokens_per_round(stats),
        draft_ms=timed.seconds / timed.drafted * 1e3 if timed and timed.drafted else None,
        nodes_per_pass=timed.nodes / timed.rounds if getattr(timed, "rounds", 0) else None,
        draft_cost=None,
        verify_cost=None,
        predicted_speedup=None,
        realized_over_predicted=None,
        generations=len(flat),
        comm_ms_per_pass=stats.comm_seconds_per_pass * 1e3 if stats.world_size > 1 else None,
        k_histogram={str(k): n for k, n in sorted(stats.k_histogram.items())},
        drafter_rounds=dict(stats.drafter_rounds),
        stats=stats,
        latencies_ms=[x * 1e3 for rep in by_repeat for x in rep],
    )


def _relate(results: list[BenchResult], runs: dict, settings: list[_Setting], steps: dict) -> dict:
    """Speedups over plain; the cost model in plain decoding steps and the predicted speedups
    (the peer borrows the draft model's c); the peer ratios; whether greedy outputs equal plain
    decoding's. Returns the cost model's numbers per temperature."""
    by_key = {(r.mode, r.num_draft, r.temperature): r for r in results}
    plain_tokens = {
        s.temperature: [run.tokens for rep in runs[i] for run in rep]
        for i, s in enumerate(settings)
        if s.mode == PLAIN
    }
    unit = {}  # seconds per plain decoding step, per temperature
    for r in results:
        if r.mode == PLAIN and r.tokens_per_sec:
            unit[r.temperature] = 1.0 / r.tokens_per_sec
    verify = {t: {n - 1: seconds / unit[t] for n, seconds in steps[t].items()} for t in unit}
    for i, r in enumerate(results):
        t = r.temperature
        if t not in unit:
            continue
        if r.mode == PLAIN:
            r.speedup = r.predicted_speedup = r.realized_over_predicted = 1.0
            continue
        r.speedup = r.tokens_per_sec * unit[t]
        r.verify_cost = verify[t].get(r.num_draft)
        draft_ms = r.draft_ms
        if r.mode == PEER:
            ours = by_key.get((DRAFT_MODEL, r.num_draft, t))
            draft_ms = ours.draft_ms if ours is not None else None
            if ours is not None and r.tokens_per_sec:
                ours.vs_mlx_lm = r.vs_mlx_lm = ours.tokens_per_sec / r.tokens_per_sec
        if draft_ms is not None and r.stats is not None:
            r.draft_cost = draft_ms / 1e3 / unit[t]
        if r.draft_cost is not None and r.mode not in TREE_MODES:  # trees: tree_prediction.py
            r.predicted_speedup = predicted_speedup(r.stats, r.draft_cost, verify[t])
            if r.predicted_speedup:
                r.realized_over_predicted = r.speedup / r.predicted_speedup
        if t == 0 and t in plain_tokens:
            tokens = [run.tokens for rep in runs[i] for run in rep]
            r.matches_plain = tokens == plain_tokens[t]
    for r in results:
        fixed = [x for x in results if (x.mode, x.temperature) == (r.mode, r.temperature)]
        fixed = [x.tokens_per_sec for x in fixed if isinstance(x.num_draft, int)]
        if r.num_draft == AUTO and fixed and max(fixed):
            r.vs_best_fixed_k = r.tokens_per_sec / max(fixed)
    return {
        "plain_step_ms": {str(t): u * 1e3 for t, u in unit.items()},
        "target_pass_ms": {
            str(t): {n: seconds * 1e3 for n, seconds in by_n.items()} for t, by_n in steps.items()
        },
        "verify_cost": {str(t): v for t, v in verify.items()},
    }
