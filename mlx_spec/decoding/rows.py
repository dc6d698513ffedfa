"""A request of the batch engine and the row it becomes: its sequence, sampling stream, output
cutter, stats, drafters and the state they keep for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlx_spec.api import OutputCutter
from mlx_spec.caches.batch import BatchCache
from mlx_spec.core.batch_verify import RowRandom
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.decoding.batch_policy import RowRecord

ALL = "all"


@dataclass
class BatchRequest:
    """One generation asked of the engine.

    Attributes:
        prompt: token ids (at least one).
        sampling: temperature, top-k, top-p, min-p.
        max_tokens: tokens generated at most.
        emit: called on the engine's thread with each `GenerationChunk` (the last has
            `token=None`, the finish reason and the stats), or with an exception if the
            generation failed.
        stop: strings that end the output.
        drafter: a drafter of the engine, "all" (any of them, chosen each step) or None.
        num_draft: "auto" (the batch's K) or a fixed k (0: plain decoding).
        seed: the row's own random stream (None: an unseeded one).
    """

    prompt: list[int]
    sampling: SamplingConfig
    max_tokens: int
    emit: Callable[[object], None]
    stop: Sequence[str] = ()
    drafter: str | None = None
    num_draft: int | str = "auto"
    seed: int | None = None


@dataclass
class Row:
    id: int
    request: BatchRequest
    tokens: list[int]  # the sequence; the target's cache holds all but the last
    cutter: OutputCutter
    stats: SpecStats
    arms: list[int]  # indices of the drafters it may use (that took it in)
    random: RowRandom | None
    features: tuple = ()  # the target features its drafters read (`Features` kinds)
    prefill: BatchCache | None = None  # before its group forms: what the prompt cache had
    fed: int = 0  # prompt tokens in its cache so far
    cached: int = 0  # prompt tokens that came from the prompt cache
    # Drafter states from the prompt cache; once joined, those of the drafters it left in a
    # closed batch (`BatchEngine._shed`), for the prompt cache with its sequence.
    states: dict = field(default_factory=dict)
    common: int = 0  # tokens shared with those states' sequence
    hidden: list = field(default_factory=list)  # its features, in order (`features`)
    # Its plain steps since its drafters were last told (`BatchEngine._tell`): the last
    # `untold` of its tokens and, where it keeps features, each step's (`[B, W]` features of
    # the pass, its row in them).
    untold: int = 0
    untold_features: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # model drafters it left out at joining
    produced: int = 0
    record: RowRecord = field(default_factory=RowRecord)  # its own acceptance
    # Its pace against plain decoding (`BatchEngine.pace_slack`): the seconds its speculative
    # steps took beyond what plain steps at their batch sizes would have taken for the tokens
    # they gave it (negative: ahead), and those plain steps' seconds for every token it got.
    lag: float = 0.0
    paced: float = 0.0
    first_pending: bool = False  # joined the batch before its first token (`_join_direct`)
    done: bool = False
    cancelled: bool = False
    tic: float = 0.0

    @property
    def needs_hidden(self) -> bool:
        return bool(self.features)
