"""The configurations of a run (mode, k, temperature, drafter) and one generation of each."""

from __future__ import annotations

from dataclasses import dataclass

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
    MTP,
    MTP_TREE,
    NGRAM,
    PEER,
    PLAIN,
    BenchConfig,
    asked_for,
    wants,
)
from mlx_spec.bench.loading import Loaded
from mlx_spec.bench.runs import Run, run_mlx_lm, run_mlx_spec
from mlx_spec.drafters.base import Drafter
from mlx_spec.drafters.branching import BranchingDraftModel, BranchingMTP
from mlx_spec.drafters.group import DrafterGroup
from mlx_spec.drafters.lookahead import LookaheadDrafter
from mlx_spec.drafters.ngram import NgramDrafter


@dataclass
class Setting:
    """One configuration: a mode, its k (an integer or "auto") and temperature, its drafter."""

    mode: str
    num_draft: int | str
    temperature: float
    drafter: Drafter | None = None
    max_draft: int = 8


def drafters_for(config: BenchConfig, loaded: Loaded) -> dict[str, Drafter]:
    """{mode: drafter} of every speculative mode this run has (the group when auto rows run
    and there are two drafters or more)."""
    single = {DRAFT_MODEL: loaded.draft, NGRAM: NgramDrafter(), MTP: loaded.mtp}
    out = {m: d for m, d in single.items() if d is not None and wants(config, m)}
    if config.auto and len(out) > 1 and (config.modes is None or ALL in config.modes):
        out[ALL] = DrafterGroup(list(out.values()))
    if loaded.eagle is not None and wants(config, EAGLE3):
        out[EAGLE3] = loaded.eagle
    if loaded.dflash is not None and wants(config, DFLASH):
        out[DFLASH] = loaded.dflash
    if loaded.medusa is not None:
        out[MEDUSA] = loaded.medusa
    return out | _tree_drafters(config, loaded)


def _tree_drafters(config: BenchConfig, loaded: Loaded) -> dict[str, Drafter]:
    """The tree modes built from the run's drafters, each only when asked for."""
    out = {}
    if asked_for(config, LOOKAHEAD):  # W 4, N 3, G 4
        out[LOOKAHEAD] = LookaheadDrafter()
    if asked_for(config, DRAFT_TREE) and loaded.draft is not None:
        out[DRAFT_TREE] = BranchingDraftModel(loaded.draft.model, width=2, max_depth=8)
    if asked_for(config, MTP_TREE) and loaded.mtp is not None:
        out[MTP_TREE] = BranchingMTP(loaded.mtp.module, width=2, max_depth=8)
    if asked_for(config, EAGLE3_TREE) and loaded.eagle is not None:
        out[EAGLE3_TREE] = BranchingMTP(loaded.eagle.module, width=2, max_depth=8, dynamic=True)
    return out


def settings_for(config: BenchConfig, loaded: Loaded, peer_ok: bool) -> list[Setting]:
    """Every configuration of the run, per temperature: plain decoding first (the baseline),
    then each drafter's k sweep (and "auto"), then mlx-lm's when `peer_ok`."""
    drafters = drafters_for(config, loaded)
    out = []
    for t in config.temperatures:
        out.append(Setting(PLAIN, 0, t))  # the baseline, always
        for mode, drafter in drafters.items():
            ks = [] if mode == ALL else list(config.num_draft)
            ks += [AUTO] if config.auto else []
            out += [Setting(mode, k, t, drafter, config.max_draft) for k in ks]
        if peer_ok:
            out += [Setting(PEER, k, t) for k in config.num_draft]
    return out


def peer_available(config: BenchConfig, loaded: Loaded) -> bool:
    """Whether mlx-lm's speculative decoding runs (a note in `loaded.notes` says why not)."""
    if not (config.peer and wants(config, PEER) and loaded.draft is not None):
        return False
    if config.shard is not None:
        loaded.notes.append("mlx-lm peer skipped: it refuses a draft model on a sharded target")
        return False
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    if not can_trim_prompt_cache(make_prompt_cache(loaded.model)):
        if asked_for(config, PEER):
            raise ValueError("mlx-lm's speculative decoding needs a trimmable cache (this target)")
        loaded.notes.append("mlx-lm peer skipped: its speculative decoding needs trimmable caches")
        return False
    return True


def generate(loaded: Loaded, s: Setting, ids, max_tokens, seed, drafter=None) -> Run:
    """One timed generation of configuration `s` (with `drafter` in place of its own), which
    must generate exactly `max_tokens` tokens."""
    run = _generate_once(loaded, s, ids, max_tokens, seed, drafter)
    if len(run.tokens) != max_tokens:
        raise ValueError(
            f"{s.mode} k={s.num_draft} generated {len(run.tokens)} tokens instead of "
            f"{max_tokens}: every configuration must generate the same number"
        )
    return run


def _generate_once(loaded: Loaded, s: Setting, ids, max_tokens, seed, drafter) -> Run:
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
