"""A row's tokens handed on: through its output cutter to its client, and to its drafters
(with the target features they read), at once or, after plain steps, late in one go."""

from __future__ import annotations

from mlx_spec.core import clock
from mlx_spec.decoding.chain import Round
from mlx_spec.decoding.rows import Row
from mlx_spec.drafters.batch import concat_rows

import mlx.core as mx


class Telling:
    """A row's tokens handed on: to its client through its cutter, and to its drafters (at once, or
    late). A part of `BatchEngine` (its state: `BatchEngine.__init__`)."""

    def _emit(
        self, row: Row, emitted: list[int], drafted: int, accepted: int, hidden, tell=True
    ) -> int:
        """A row's step: its tokens through the cutter to its callback and, with `tell`, its
        drafters told (else: they have not joined yet, or a plain step's tokens wait for the
        row's next `_tell`); returns how many of `emitted` stay in the sequence."""
        if row.first_pending:  # a row that joined with its prompt's last token: its first step
            self._prefilled(row)
        arm = self._arm_of.get(row.id) if drafted else None
        name = None if arm is None else self.names[arm]
        chunks, finish, keep = row.cutter.round(Round(emitted, drafted, accepted, 0.0, None, name))
        keep = len(emitted) if keep is None else keep
        row.stats.observe_round(drafted, accepted, len(chunks), 0.0)
        row.stats.observe_choice(name, drafted)
        row.tokens += emitted[:keep]
        row.produced += len(chunks)
        if tell:
            kept = None if hidden is None else hidden[:keep]  # (one row per emitted token)
            self._told(row, emitted[:keep], drafted, min(accepted, keep - 1), arm, kept)
        for chunk in chunks:
            row.request.emit(chunk)
        if finish is not None or row.produced >= row.request.max_tokens:
            row.done = True
            row.stats.decode_seconds = clock.now() - row.tic
            row.stats.plain_seconds, row.stats.plain_tokens = row.paced, row.produced
            row.request.emit(row.cutter.final(finish or "length"))
        return keep

    def _tell(self, row: Row) -> None:
        """Tell the row's drafters the tokens, and keep the features, of its plain steps since
        they were last told: one `accept` of them all, before anything reads the drafters'
        state of the row (its ask, a draft, a late join, its leaving). A plain step's host
        work per row and drafter, which a CPU's passes share, is then a reference kept."""
        if not row.untold:
            return
        hidden = self._untold_hidden(row.untold_features)
        self._told(row, row.tokens[len(row.tokens) - row.untold :], 0, 0, None, hidden)
        row.untold, row.untold_features = 0, []

    def _untold_hidden(self, parts: list[tuple[mx.array, int]]) -> mx.array | None:
        """`[T, W]`: a row's features of its untold plain steps (`parts`: each step's `[B, W]`
        features, the row's index in them). Rows told together (a closed batch's asks, rows
        that end at one step) share one stack of the steps' features, each taking its own
        row out of it: cheaper than a slice per step and row, each evaluated on its own."""
        if not parts:
            return None
        steps, i = [h for h, _ in parts], parts[0][1]
        if len(parts) == 1 or any(j != i or h.shape != steps[0].shape for h, j in parts):
            return concat_rows([h[j : j + 1] for h, j in parts])  # the rows moved between
        last = self._stacked
        if (
            last is None
            or len(last[0]) != len(steps)
            or any(a is not b for a, b in zip(last[0], steps, strict=True))
        ):
            last = self._stacked = (steps, mx.stack(steps, axis=1))
        return mx.take(last[1], mx.array(i), axis=0)  # (a copy: the stack is not held)

    def _told(self, row: Row, emitted: list[int], drafted: int, accepted: int, arm, hidden):
        """The row's features at the positions that produced `emitted` kept (`hidden`, one row
        each), and each of its drafters told: drafter `arm` drafted `drafted` tokens, the
        others none, and `accepted` of the drafts were kept."""
        kept = None
        if row.needs_hidden and hidden is not None:
            kept = self.features.keep(row.features, hidden)
            row.hidden.append(kept)
        for a in row.arms:
            name = self.names[a]
            mine = drafted if a == arm else 0
            columns = self._columns(row, name, kept)
            self.drafters[name].accept(row.id, mine, accepted, emitted, columns)

    def _columns(self, row: Row, name: str, hidden: mx.array | None) -> mx.array | None:
        """The columns of a row's kept features that drafter `name` reads (None: it reads
        none)."""
        if hidden is None or not self.drafters[name].needs_hidden:
            return None
        if len(row.features) == 1:
            return hidden
        return hidden[..., self.features.columns(row.features, name)]
