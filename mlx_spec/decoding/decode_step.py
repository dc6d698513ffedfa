"""The batch's decoding step: each row's ask, the policy's choice (shared by every rank of a
sharded target), then a plain or a speculative step and the rows that ended leaving."""

from __future__ import annotations

from mlx_spec.core import clock
from mlx_spec.decoding.batch_asks import RowAsk
from mlx_spec.decoding.batch_choice import BatchChoice, Decision
from mlx_spec.decoding.rows import Row

# After rows leave, the columns are squeezed once they exceed the longest row's by this
# share and 8 (docs/serving.md).
COLUMNS_SLACK = 0.1


class DecodeStep:
    """The batch's decoding step: the rows' asks, the policy's choice, a plain or a speculative
    step. A part of `BatchEngine` (its state: `BatchEngine.__init__`)."""

    def _ask(self, row: Row) -> RowAsk:
        self._tell(row)
        request = row.request
        limit = request.max_tokens - row.produced - 1
        if self.context is not None:
            limit = min(limit, self.context - len(row.tokens) - 1)
        left = limit + 1  # the tokens it may still emit
        fixed = request.num_draft if isinstance(request.num_draft, int) else None
        limit = max(0, min(limit, self.max_draft if fixed is None else fixed))
        if row.first_pending:  # its first token is drawn alone, as after a prefill: a seeded
            limit = 0  # row's draws are the same whether its prompt was cached or not
        drafters = [self.drafters[self.names[a]] for a in row.arms]
        available = [d.available(row.id, limit) for d in drafters]
        backlog = [d.backlog(row.id) for d in drafters]
        behind = self.pace_slack is not None and row.lag > self.pace_slack * row.paced
        return row.record.ask(row.arms, fixed, limit, available, backlog, behind, left)

    def _decode(self) -> None:
        self._stacked = None  # (the last step's rows told together, `_untold_hidden`)
        self._join_late()
        if not self.active:
            return
        self._settle_vacant()
        if self._left and self._ahead is None:
            # Rows that left at different steps leave columns wider than the longest row, which
            # every pass attends over; a leaving broke the pipeline already (docs/serving.md).
            self.cache.tidy(slack=COLUMNS_SLACK, spare=8)
        self._left = False
        rows = list(self.active)
        self._size_seen += 0.05 * (len(rows) - self._size_seen)  # about the last 20 steps
        self._last_decode = clock.now()
        free = all(not isinstance(r.request.num_draft, int) for r in rows)
        ids = [r.id for r in rows]
        choice = self.policy.barred(len(rows), {a for r in rows for a in r.arms}, free)
        if choice is None:  # the guard's plain window does not decide it: the rows ask
            choice = self._closed_choice(rows, ids, free)
        choice = self._shared(choice)
        plain = not any(k for _, k in choice.rows)
        if plain and free and choice.decision is Decision.CLOSED:
            self._no_plan += 1  # (a held step too: the hold is a choice of no plan)
            if self._shedding and ids != self._shed_ids:  # (shed rows stay so)
                self._shed(rows)
                self._shed_ids = ids
        elif choice.decision is Decision.CLOSED or self._size_for(len(rows)) < self.max_batch:
            self._no_plan = 0  # a closed batch found a plan, or it runs full no more
        if self._ahead is not None and (not plain or self._ahead.ids != ids):
            self._flush()  # the pipeline of plain steps ends here
            if plain or [r.id for r in self.active] != ids:
                return  # choose again, for the rows there are now
            # The rows drafting K as chosen, each as far as it can now that it has one token
            # more (its budget and lookup moved on).
            choice = self._shared(self.policy.replan([self._ask(r) for r in rows], choice))
        if plain:
            self._plain_step(rows, choice)
        else:
            self._speculative_step(rows, choice)
        for row in [r for r in self.active if r.done]:
            self._remove(row, keep_cache=True)

    def _shared(self, choice: BatchChoice) -> BatchChoice:
        """Rank 0's choice on every rank of a sharded target (the choice itself otherwise)."""
        if self.sync is None:
            return choice
        only = -1 if choice.only is None else choice.only
        flat = [choice.num_draft, int(choice.probe), choice.catch_up, only]
        flat.append(-1 if choice.window is None else choice.window)
        for arm, k in choice.rows:
            flat += [-1 if arm is None else arm, k]
        flat = self.sync.share_ints(flat)
        rows = [(None if a < 0 else a, k) for a, k in zip(flat[5::2], flat[6::2], strict=True)]
        only = None if flat[3] < 0 else flat[3]
        window = None if flat[4] < 0 else flat[4]
        return BatchChoice(
            flat[0], rows, bool(flat[1]), flat[2], only, window, choice.decision, choice.expected
        )

    def _widths(self) -> tuple[int, float]:
        """(columns in use, mean tokens held per row) of the target's cache (`StepTrace`)."""
        if self.cache is None:
            return 0, 0.0
        lengths = self.cache.lengths
        return self.cache.columns, sum(lengths) / max(len(lengths), 1)
