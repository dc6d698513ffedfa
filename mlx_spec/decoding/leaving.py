"""Rows leaving the batch: finished (their caches to the prompt cache), cancelled, or failed
with the prefill or the step they were in."""

from __future__ import annotations

from mlx_spec.decoding.policy import ema
from mlx_spec.decoding.prefill import Joining
from mlx_spec.decoding.rows import Row
from mlx_spec.decoding.step_trace import RowTrace

import mlx.core as mx


class Leaving:
    """Rows leaving the batch: finished, cancelled or failed. A part of `BatchEngine` (its state:
    `BatchEngine.__init__`)."""

    def _fail_batch(self, exc: Exception) -> None:
        for row in self.active:
            row.done = True
            row.request.emit(exc)
        self.active, self.cache, self._ahead, self._vacant = [], None, None, []
        self._stacked = None
        for drafter in self.drafters.values():
            drafter.reset()

    def _fail_joining(self, group: Joining, exc: Exception) -> None:
        """A prefill or a drafter's join failed: the group's rows end with the error (not
        retried every step, which would hold them and every request after them forever).
        Where some of them had joined the batch, its state is unknown and every row fails."""
        self._joining = None
        ids = {row.id for row in group.rows}
        if any(row.id in ids for row in self.active):
            self._fail_batch(exc)
        for row in group.rows:
            for drafter in self.drafters.values():
                if row.id in drafter.rows:
                    drafter.leave(row.id)
            if not row.done:
                row.done = True
                row.request.emit(exc)

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(row)
        cancelled = [r for r in self.active if r.cancelled]
        if cancelled:
            for row in cancelled:
                row.done = True  # the queued step's token for it is dropped
            self._flush()

    def _remove(self, row: Row, keep_cache: bool) -> None:
        i = self._physical(self.active.index(row))
        if keep_cache:
            self._tell(row)  # (the states its drafters leave go to the prompt cache)
        if row.done and not row.cancelled:
            self._used = ema(self._used, row.produced / max(row.request.max_tokens, 1), 0.2)
            if self.row_trace is not None:
                s = row.stats
                trace = RowTrace(s.decode_seconds, row.paced, row.lag, row.produced, s.drafted,
                                 s.accepted)  # fmt: skip
                self.row_trace.append(trace)
        states = {self.names[a]: self.drafters[self.names[a]].leave(row.id) for a in row.arms}
        states.update(row.states)
        if keep_cache and self.row_cache is not None:
            one = self.cache.extract(i, self.model)
            if one.lengths[0] > len(row.tokens) - 1:  # a queued step fed its last token
                one.truncate([len(row.tokens) - 1])
            hidden = mx.concatenate(row.hidden) if row.needs_hidden and row.hidden else None
            self.row_cache.put(row.tokens, one, states, hidden, row.features)
        self.active.remove(row)
        if not self.active:
            self.cache, self._vacant, self._stacked = None, [], None  # (an idle server holds none)
        else:  # its row stays until the next step: a row that joins before it takes it over
            self._vacant = sorted([*self._vacant, i])
            self._left = self._turnover = True
