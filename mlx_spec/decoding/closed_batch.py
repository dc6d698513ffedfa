"""A closed batch (every slot taken, nothing waiting): the plain steps it holds its rows to
while it finds no plan every row gains by, and its rows shedding their model drafters."""

from __future__ import annotations

from mlx_spec.decoding.batch_choice import BatchChoice, Decision
from mlx_spec.decoding.rows import Row

# A closed batch's hold grows with its steps without a plan, up to this many `closed_hold`s
# (`BatchEngine._hold_steps`).
HOLD_GROWTH = 4


class ClosedBatch:
    """A closed batch's choice: holding its rows to plain steps, and shedding their model drafters.
    A part of `BatchEngine` (its state: `BatchEngine.__init__`)."""

    def _closed_choice(self, rows: list[Row], ids: list[int], free: bool) -> BatchChoice:
        """The policy's choice for the rows' asks. Every slot taken, nothing waiting or
        joining: a closed batch, which drafts only where every row gains
        (`BatchDraftPolicy`'s `every_row`); where it found no plan that does, the same rows
        decode plainly for its `closed_hold` steps without asking (a row's ask is a host's
        work per step, an n-gram lookup and each drafter's backlog, which a CPU's passes
        share). A batch that has been running full lately is full while it refills
        (`_size_for`): the rows that ended are replaced within a step or two as their
        clients send their next requests, and a probe or an exploring step of the rows
        left in between (a wide one: 6 rows verifying 8 drafts each, 5 plain steps' time
        on a 2-core x86) slows every one of them. Rows that join a batch that sheds
        (`_shedding`: the full batch has gone more than a `closed_hold` without a plan) wait
        out its hold, as they leave its model drafters out (`_join_drafters`): its verdict
        is the batch's at its size, and every row must gain for a plan to pass."""
        full = self._size_for(len(rows)) >= self.max_batch
        closed = full and not self.waiting and self._joining is None
        hold, self._hold = self._hold, None
        ours = hold is not None and (hold[0] == ids or (free and self._shedding))
        if closed and ours and hold[1] > 0:
            self._hold = (ids, hold[1] - 1)
            return BatchChoice(0, [(None, 0)] * len(rows), decision=Decision.CLOSED)
        self.policy.closed = closed
        choice = self.policy.choose([self._ask(r) for r in rows])
        if (
            closed
            and free
            and choice.decision is Decision.CLOSED
            and not any(k for _, k in choice.rows)
        ):
            self._hold = (ids, self._hold_steps() - 1)
        return choice

    def _hold_steps(self) -> int:
        """The plain steps a closed batch that found no plan takes before its rows ask again:
        `closed_hold`, or half the steps the full batch has gone without a plan where that
        is longer, up to `HOLD_GROWTH` holds. A batch that never finds one (a 2-core CPU at
        8 rows, where a wider pass costs near its width) asks once a few dozen steps, not
        every `closed_hold` (a choice over 8 rows' asks is about a millisecond of the host's
        work, which on a CPU the passes share); new rows ask at once (the hold is the rows')
        but where the batch sheds, and a plan found starts the count again."""
        hold = self.policy.closed_hold
        return min(HOLD_GROWTH * hold, max(hold, self._no_plan // 2))

    def _shed(self, rows: list[Row]) -> None:
        """A closed batch that found no plan every row gains by (the policy's "closed" plain
        choice) twice running, a `closed_hold` of plain steps between (not a moment without
        a lookup's match, nor a dip in a drafter's acceptance): its rows give up their model
        drafters for the rest of their requests (those they joined leave them, those they
        left out at joining are not judged again), so that their steps cost about what
        plain decoding's do; the lookup, which costs a host's work alone, stays. A row
        keeps its target features: the prompt cache keeps them with its sequence, for the
        next turn of its conversation to draft with the head where its batch is smaller,
        and so do the states of the drafters it leaves. While the batch stays full and
        keeps finding no plan (`_shedding`), rows joining it leave the model drafters out
        (`_join_drafters`)."""
        for row in rows:
            models = [a for a in row.arms if self.drafters[self.names[a]].feeds_prompt]
            if not models and not row.skipped:
                continue
            self._tell(row)
            for arm in models:
                row.states[self.names[arm]] = self.drafters[self.names[arm]].leave(row.id)
            row.arms = [a for a in row.arms if a not in models]
            row.skipped = []

    @property
    def _shedding(self) -> bool:
        """Whether the full batch's rows shed their model drafters (`_shed`)."""
        return self._no_plan > self.policy.closed_hold
