"""What a row of the batch asks of the policy each step (`RowAsk`), and the record of its own
drafts that its asks carry (`RowRecord`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mlx_spec.decoding.policy import count_round

UNTOLD_LEFT = 64  # a row's tokens still to emit where its ask does not tell (`RowAsk.left`)


@dataclass
class RowAsk:
    """What a row may do this step.

    Attributes:
        arms: the drafters it may draft with (indices into the policy's arms); empty: none.
        fixed: a fixed k (None: the batch's K).
        limit: the most drafts its output budget and context allow.
        available: per arm in `arms`, drafts it can have now (None: any number).
        backlog: per arm in `arms`, tokens its drafter must feed before drafting (piled up
            over plain steps); empty: none.
        own: per arm in `arms`, the row's own (kept, reached) counts by draft position
            (`count_round`), or None; empty: none. Its acceptance against the drafter's
            over all rows sets its `levels`.
        levels: set by the policy (`BatchDraftPolicy._prepare`): per arm, the row's
            acceptance level (`Gains.of`).
        behind: the row has fallen behind the pace plain decoding would have kept by more
            than it may (the engine's ledger, `BatchEngine.pace_slack`): no step may be
            expected to slow it further (`MergedAsks.slows`).
        left: the tokens it may still emit (its budget; 0: not told, as `UNTOLD_LEFT`): a
            catch-up is spread over no more steps than its rows have left
            (`CatchUpHorizon.serves`).
        drafting: per arm in `arms`, the share of its recent asks where that drafter had
            drafts to be had (`RowRecord`; empty: always): an n-gram lookup finds none on
            some steps, a model drafter always has.
    """

    arms: list[int]
    fixed: int | None = None
    limit: int = 0
    available: list[int | None] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    own: list = field(default_factory=list)
    levels: list[int] = field(default_factory=list)
    behind: bool = False
    left: int = 0
    drafting: list[float] = field(default_factory=list)

    def level(self, arm: int) -> int:
        return self.levels[self.arms.index(arm)] if self.levels else 0

    def share(self, arm: int) -> float:
        """The share of its recent asks where drafter `arm` had drafts to be had."""
        return self.drafting[self.arms.index(arm)] if self.drafting else 1.0

    def drafts(self, index: int, k: int, max_draft: int) -> int:
        """The drafts it can have at K = `k` from its drafter at `index` of `arms`."""
        avail = self.available[index]
        return min(k, self.limit, max_draft if avail is None else avail)

    def keeping(self, indices: list[int]) -> RowAsk:
        """The ask with the drafters at `indices` of `arms` alone."""

        def kept(values: list) -> list:
            return [values[i] for i in indices] if values else []

        return replace(
            self,
            arms=kept(self.arms),
            available=kept(self.available),
            backlog=kept(self.backlog),
            own=kept(self.own),
            levels=kept(self.levels),
            drafting=kept(self.drafting),
        )

    def without(self, barred: int) -> RowAsk:
        """The ask with the drafters in `barred` (a bitmask) left out."""
        if not any(barred >> arm & 1 for arm in self.arms):
            return self
        return self.keeping([i for i, arm in enumerate(self.arms) if not barred >> arm & 1])


def asks_signature(asks: list[RowAsk]) -> tuple | None:
    """What of the rows' asks can make speculation newly worth it: their drafters, the drafts
    each can have (an n-gram lookup that found a match) and whether it is behind its pace;
    None where a row has a fixed k (it drafts whatever the batch's K)."""
    if any(ask.fixed is not None for ask in asks):
        return None
    return tuple((tuple(a.arms), a.limit > 0, tuple(a.available), a.behind) for a in asks)


@dataclass
class RowRecord:
    """A row's own acceptance, for its asks (`RowAsk.own`): per drafter, its (kept, reached)
    counts by draft position, each round weighing `DECAY` times the next, since what a row's
    text lets a drafter guess changes within a request."""

    own: dict = field(default_factory=dict)
    # Per drafter, the share of its recent asks where it had drafts to be had
    # (`RowAsk.drafting`), each ask weighing 1 / (1 - HAD) times the one before it.
    had: dict = field(default_factory=dict)

    DECAY = 0.7
    HAD = 0.85

    def drafted(self, arm: int, asked: int, accepted: int) -> None:
        """The row asked drafter `arm` for `asked` drafts and kept `accepted`."""
        hits, trials = self.own.setdefault(arm, ([], []))
        hits[:] = [h * self.DECAY for h in hits]
        trials[:] = [t * self.DECAY for t in trials]
        if len(trials) < asked:
            hits += [0.0] * (asked - len(hits))
            trials += [0.0] * (asked - len(trials))
        count_round(hits, trials, asked, accepted)

    def ask(
        self,
        arms: list[int],
        fixed,
        limit: int,
        available: list,
        backlog: list,
        behind=False,
        left: int = 0,
    ) -> RowAsk:
        own = [self.own.get(a) for a in arms]
        if limit > 0:
            for arm, avail in zip(arms, available, strict=False):
                has = avail is None or avail > 0
                self.had[arm] = self.HAD * self.had.get(arm, 1.0) + (1.0 - self.HAD) * has
        return RowAsk(
            arms, fixed, limit, available, backlog, own, behind=behind, left=left,
            drafting=[self.had.get(a, 1.0) for a in arms],
        )  # fmt: skip
