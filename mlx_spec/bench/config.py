"""What a benchmark run measures: the decoding modes, `BenchConfig` and the parsers of its flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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


def wants(config: BenchConfig, mode: str) -> bool:
    """Whether `config` runs `mode` (every mode when `config.modes` is None)."""
    return config.modes is None or mode in config.modes


def asked_for(config: BenchConfig, mode: str) -> bool:
    """Whether `config.modes` names `mode` (modes that run only when asked for)."""
    return config.modes is not None and mode in config.modes


def longest_draft(config: BenchConfig) -> int:
    """The most drafts any configuration of the run may verify in one pass."""
    return max(max(config.num_draft), config.max_draft if config.auto else 0)


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
