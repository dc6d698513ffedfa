"""Plain steps (K = 0), pipelined: the next pass is queued before the last is read, so that
the model computes one step while the host handles the last."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_spec.core import clock
from mlx_spec.core.batch_verify import batch_probs, draw, gumbel
from mlx_spec.decoding.rows import Row
from mlx_spec.decoding.step_trace import StepTrace

import mlx.core as mx


@dataclass
class Ahead:
    """A plain step queued but not read: the rows it serves, its `[B]` draws (lazy) and the
    target's `[B, T]` hidden states at the tokens it fed (for drafters that read them)."""

    ids: list[int]
    tokens: mx.array
    hidden: mx.array | None


class PlainSteps:
    """Plain steps, pipelined: each pass queued before the last is read. A part of `BatchEngine`
    (its state: `BatchEngine.__init__`)."""

    def _plain_step(self, rows: list[Row], choice) -> None:
        """Queue the pass of the next plain step (its input: the tokens the queued step will
        draw), then read and emit the queued step: the model computes one step while Python
        handles the last. A row that ends stops the pipeline (the step queued after it is
        emitted at once for the others)."""
        if self._ahead is None:
            tic = clock.now()
            self._ahead = self._launch(rows, mx.array([r.tokens[-1] for r in rows], mx.uint32))
            if not all(self._pipelinable(r) for r in rows):
                self._flush(choice)
            else:  # the pipeline starts: the next settle times one step, not two
                self._last_settle, self._prefill_spent = clock.now(), 0.0
                if self.trace is not None:
                    # Queueing a pass returns once most of it ran (on a CPU, MLX waits while
                    # more than a few of its operations are pending): the pipeline's first
                    # pass is timed here, its tokens with the next step's.
                    spans = [0.0, 0.0, 0.0, self._last_settle - tic, 0.0]
                    step = StepTrace(len(rows), 0, 0, 0, *spans, *self._widths(), why="start")
                    self.trace.append(step)
            return
        ahead = self._launch(rows, self._ahead.tokens)
        self._settle(self._ahead, choice)
        self._ahead = ahead
        if any(r.done for r in rows):
            self._flush()  # not timed: the queued step was half done

    @staticmethod
    def _pipelinable(row: Row) -> bool:
        """Whether the row's steps may be chosen one token early: a row with a fixed k and a
        drafter drafts what its lookup finds after its last token, so that its draws (and a
        seeded row's output) do not depend on what else runs."""
        return not row.arms or not isinstance(row.request.num_draft, int)

    def _launch(self, rows: list[Row], tokens: mx.array) -> Ahead:
        """Queue a plain pass of every row over `[B]` tokens; its draws stay lazy."""
        if self.sync is not None and self.sync.eager_inputs:
            mx.eval(tokens)  # a pipeline stage's input may not wait on a collective
        self._threads(len(rows))
        self.cache.begin([1] * len(rows))
        logits = self.model(tokens[:, None], cache=self.cache.layers)[:, 0, : self.vocab]
        self.cache.end([1] * len(rows))
        hidden = self.features.now()
        hidden = None if hidden is None else hidden[:, 0]
        nxt = self._draw(rows, logits)
        mx.async_eval(nxt)
        return Ahead([r.id for r in rows], nxt, hidden)

    def _draw(self, rows: list[Row], logits: mx.array) -> mx.array:
        """`[B]` next tokens from `[B, V]` logits, each row with its settings and stream."""
        if all(r.request.sampling.greedy for r in rows):
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
        else:
            probs = batch_probs(logits, [r.request.sampling for r in rows])
            tokens = draw(probs, gumbel([r.random for r in rows], (logits.shape[-1],)))
        return tokens if self.sync is None else self.sync.share(tokens)

    def _settle(self, ahead: Ahead, choice=None) -> None:
        """Read a queued plain step and hand each row its token (rows that ended since it was
        queued get nothing: their token is dropped with their caches)."""
        tokens = ahead.tokens.tolist()
        rows = {r.id: r for r in self.active}
        plain = self.policy.costs.plain_seconds(len(ahead.ids))
        emitted = 0
        for i, row_id in enumerate(ahead.ids):
            row = rows.get(row_id)
            if row is None or row.done:
                continue
            row.paced += plain  # a plain step keeps a row at plain pace, timed or not
            if self._emit(row, [tokens[i]], 0, 0, None, tell=False):  # told later (`_tell`)
                row.untold += 1
                if row.needs_hidden and ahead.hidden is not None:
                    row.untold_features.append((ahead.hidden, i))
            emitted += 1
        now = clock.now()
        if choice is not None:
            seconds = now - self._last_settle - self._prefill_spent
            outcomes = [(0, 0)] * len(choice.rows)
            joined, self._join_spent = self._join_spent, {}
            turnover, self._turnover = self._turnover, False
            self.policy.observe(
                choice.rows,
                outcomes,
                seconds,
                window=choice.window,
                joined=joined,
                disturbed=turnover,
            )
            if self.trace is not None:  # a pipelined step: its time is its pass's
                spans = [0.0, 0.0, 0.0, seconds, 0.0]
                step = StepTrace(len(ahead.ids), 0, 0, emitted, *spans, *self._widths())
                self.trace.append(step)
        elif self.trace is not None:  # the pipeline's last pass, read as it stops
            spans = [0.0, 0.0, 0.0, now - self._last_settle - self._prefill_spent, 0.0]
            step = StepTrace(len(ahead.ids), 0, 0, emitted, *spans, *self._widths(), why="flush")
            self.trace.append(step)
        self._last_settle, self._prefill_spent = now, 0.0

    def _flush(self, choice=None) -> None:
        """Settle the queued plain step, if any."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self._settle(ahead, choice)
        self._last_settle, self._prefill_spent = clock.now(), 0.0
        for row in [r for r in self.active if r.done]:
            self._remove(row, keep_cache=not row.cancelled)
