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
import statistics
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone

from mlx_spec.bench.config import (
    ALL,
    AUTO,
    DFLASH,
    DRAFT_MODEL,
    DRAFT_TREE,
    EAGLE3,
    EAGLE3_TREE,
    LOOKAHEAD,
    MEDUSA,
    MODES,
    MTP,
    MTP_TREE,
    NGRAM,
    PEER,
    PLAIN,
    SEED_STRIDE,
    SPEC_MODES,
    TREE_MODES,
    BenchConfig,
    longest_draft,
    parse_float_list,
    parse_int_list,
    parse_modes,
)
from mlx_spec.bench.costs import (
    analytic_curve,
    draft_length_shares,
    expected_round_cost,
    expected_tokens_per_round,
    predicted_speedup,
)
from mlx_spec.bench.loading import Loaded, load_models
from mlx_spec.bench.machine import machine_info, model_dtype, param_count
from mlx_spec.bench.prompts import Prompt, builtin_prompts, load_prompts, read_prompts_file
from mlx_spec.bench.report import BenchReport, BenchResult, k_shares
from mlx_spec.bench.results import relate, summarize
from mlx_spec.bench.runs import Run, run_mlx_lm, run_mlx_spec, stats_from_flags, steady_sum
from mlx_spec.bench.settings import Setting, generate, peer_available, settings_for
from mlx_spec.bench.timers import PassTimer, TimedDrafter, TimedTreeDrafter
from mlx_spec.core.compat import scored_vocab
from mlx_spec.decoding.runner import context_limit

__all__ = [  # the harness's public names, wherever they live
    "ALL",
    "AUTO",
    "DFLASH",
    "DRAFT_MODEL",
    "DRAFT_TREE",
    "EAGLE3",
    "EAGLE3_TREE",
    "LOOKAHEAD",
    "MEDUSA",
    "MODES",
    "MTP",
    "MTP_TREE",
    "NGRAM",
    "PEER",
    "PLAIN",
    "SEED_STRIDE",
    "SPEC_MODES",
    "TREE_MODES",
    "BenchConfig",
    "BenchReport",
    "BenchResult",
    "PassTimer",
    "Prompt",
    "Run",
    "TimedDrafter",
    "TimedTreeDrafter",
    "analytic_curve",
    "builtin_prompts",
    "draft_length_shares",
    "expected_round_cost",
    "expected_tokens_per_round",
    "k_shares",
    "longest_draft",
    "machine_info",
    "model_dtype",
    "param_count",
    "parse_float_list",
    "parse_int_list",
    "parse_modes",
    "predicted_speedup",
    "read_prompts_file",
    "run_bench",
    "run_mlx_lm",
    "run_mlx_spec",
    "stats_from_flags",
]


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
    loaded = load_models(config)
    gc.collect()
    gc.freeze()  # what is loaded now stays: the collection between generations stays cheap
    try:
        return _run(config, loaded, say)
    finally:
        gc.unfreeze()


def _run(config: BenchConfig, loaded: Loaded, say: Callable[[str], None]) -> BenchReport:
    loaded.tokenizer = copy.copy(loaded.tokenizer)
    loaded.tokenizer.eos_token_ids = set()  # every configuration generates max_tokens tokens
    vocab = scored_vocab(loaded.model, loaded.tokenizer)
    models = [loaded.model] + ([loaded.draft.model] if loaded.draft is not None else [])
    limits = [c for c in (context_limit(m) for m in models) if c is not None]
    prompts = load_prompts(config, loaded.tokenizer, vocab, limits)
    settings = settings_for(config, loaded, peer_available(config, loaded))
    if len(settings) == len(config.temperatures):
        raise ValueError("nothing to compare: no speculative mode is available with these models")
    header = _header(config, loaded, prompts)

    first = prompts[0].ids
    for s in settings:  # warm-up
        generate(loaded, s, first, config.max_tokens, config.seed)
    cost_context = _cost_context(config, prompts, limits)
    sizes = _pass_sizes(config, settings)
    passes = PassTimer(loaded.model, vocab, first, cost_context, sizes, config.temperatures)
    timed = _timed_drafters(settings)
    say(f"warm-up done; {len(settings)} configurations x {len(prompts)} prompts")

    runs = _measure(config, loaded, prompts, settings, timed, passes, say)
    steps = passes.medians()
    results = [summarize(s, runs[i], timed.get(i)) for i, s in enumerate(settings)]
    costs = relate(results, runs, settings, steps)
    costs = {"cost_context": cost_context, **costs}
    return BenchReport(header, asdict(config), costs, results)


def _header(config: BenchConfig, loaded: Loaded, prompts: list[Prompt]) -> dict:
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


def _cost_context(config: BenchConfig, prompts: list[Prompt], limits: list[int]) -> int:
    """The cache length of the timed target passes: the mean prompt plus half the generation,
    within every model's context."""
    cost_context = round(statistics.mean(len(p.ids) for p in prompts) + config.max_tokens / 2)
    if limits:
        cost_context = min(cost_context, min(limits) - longest_draft(config) - 2)
    return cost_context


def _pass_sizes(config: BenchConfig, settings: list[Setting]) -> list[int]:
    """The token counts of the timed target passes: every chain's k + 1, and the trees'."""
    sizes = set(range(1, longest_draft(config) + 2))
    for s in settings:  # tree passes: two-branch trees (2k nodes), lookahead's at most
        if s.mode in (MEDUSA, DRAFT_TREE, MTP_TREE, EAGLE3_TREE):
            sizes |= {2 * k + 1 for k in config.num_draft}
        elif s.mode == LOOKAHEAD:
            d, levels = s.drafter, s.drafter.ngram - 1
            sizes |= {
                1 + d.candidates * min(k, levels) + d.window * levels for k in config.num_draft
            }
    return sorted(sizes)


def _timed_drafters(settings: list[Setting]) -> dict:
    """{setting index: its drafter, timed} of every speculative and tree configuration."""
    timed = {i: TimedDrafter(s.drafter) for i, s in enumerate(settings) if s.mode in SPEC_MODES}
    return timed | {
        i: TimedTreeDrafter(s.drafter) for i, s in enumerate(settings) if s.mode in TREE_MODES
    }


def _measure(
    config: BenchConfig,
    loaded: Loaded,
    prompts: list[Prompt],
    settings: list[Setting],
    timed: dict,
    passes: PassTimer,
    say: Callable[[str], None],
) -> dict[int, list[list[Run]]]:
    """The measured repeats: {setting index: [[Run per prompt] per repeat]}. Each repeat runs
    every prompt through every configuration, round-robin, then samples the cost model."""
    micro = [config.micro_repeats // config.repeats] * config.repeats
    micro[0] += config.micro_repeats - sum(micro)
    runs: dict[int, list[list[Run]]] = {i: [] for i in range(len(settings))}
    for r in range(config.repeats):
        for i in runs:
            runs[i].append([])
        for p, prompt in enumerate(prompts):
            shift = (r * len(prompts) + p) % len(settings)
            for i in list(range(shift, len(settings))) + list(range(shift)):
                seed = config.seed + SEED_STRIDE * r + p
                runs[i][r].append(
                    generate(loaded, settings[i], prompt.ids, config.max_tokens, seed)
                )
        # The cost model is sampled in every repeat, under the same load as the runs.
        calibration = prompts[r % len(prompts)].ids
        for i, drafter in timed.items():
            generate(loaded, settings[i], calibration, config.max_tokens, config.seed, drafter)
        passes.sample(micro[r])
        say(f"repeat {r + 1}/{config.repeats}: " + _progress_line(settings, runs, r))
    return runs


def _progress_line(settings: list[Setting], runs: dict, r: int) -> str:
    parts = []
    for i, s in enumerate(settings):
        tokens, seconds = steady_sum(runs[i][r])
        label = s.mode if s.mode == PLAIN else f"{s.mode} k={s.num_draft}"
        parts.append(f"{label} T={s.temperature:g} {tokens / seconds if seconds else 0:.0f}")
    return ", ".join(parts) + " tok/s"
