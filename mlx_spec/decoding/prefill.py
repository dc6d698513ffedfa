"""Joining the batch: waiting requests take what the prompt cache holds of their prompts, are
prefilled together a chunk per step, draw their first tokens and join the batch's rows."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_spec.caches.batch import BatchCache
from mlx_spec.caches.taps import logits_at
from mlx_spec.core import clock
from mlx_spec.decoding.rows import Row

import mlx.core as mx


@dataclass
class Joining:
    """Requests prefilled together: their rows and their cache (one row each)."""

    rows: list
    cache: BatchCache


class Prefill:
    """Requests prefilled together and joining the batch. A part of `BatchEngine` (its state:
    `BatchEngine.__init__`)."""

    def _form_group(self) -> Joining | None:
        """The waiting requests that fit now (batch slots, cache memory), each with the prefix
        the prompt cache had for it, as one cache to prefill together. A request whose prompt
        the prompt cache holds all but the last token of joins the batch at once instead: its
        last token is fed by the batch's next step, like any row's last token, and that step
        draws its first token (a pass of its own saved)."""
        rows: list[Row] = []
        direct: list[Row] = []
        while self.waiting and len(self.active) + len(rows) + len(direct) < self.max_batch:
            row = self.waiting[0]
            if not self._fits(row, rows + direct):
                break
            self.waiting.pop(0)
            try:
                self._start_prefill(row)
            except Exception as exc:  # this request alone fails
                row.request.emit(exc)
                continue
            if row.fed and row.fed == len(row.request.prompt) - 1:
                direct.append(row)
            else:
                rows.append(row)
        if direct:
            self._join_direct(direct)
        if not rows:
            return None
        cache = rows[0].prefill
        for row in rows[1:]:
            cache.extend(row.prefill)
        for row in rows:
            row.prefill = None
        return Joining(rows, cache)

    def _prefill_group(self, group: Joining) -> None:
        """Feed the group's next chunk (right-padded); a row whose prompt is in draws its first
        token and emits it at once; when every prompt is in, the rows join the batch."""
        rows = group.rows
        left = [len(r.request.prompt) - r.fed for r in rows]  # prompt tokens still to feed
        width = min(max(left), max(16, self.prefill_step // len(rows)))
        lengths = [min(width, n) for n in left]
        pads = [width - n for n in lengths]
        x = [
            r.tokens[r.fed : r.fed + width - pad] + [0] * pad
            for r, pad in zip(rows, pads, strict=True)
        ]
        self._threads(len(rows) * width)
        group.cache.begin(lengths)
        at = mx.array([max(n - 1, 0) for n in lengths])
        # The head projects each row's last position only (the others' logits are not read).
        logits = logits_at(self.model, at, mx.array(x, mx.uint32), cache=group.cache.layers)
        group.cache.end(lengths)
        finishing = [i for i, (n, m) in enumerate(zip(lengths, left, strict=True)) if n and n == m]
        last = logits[:, 0, : self.vocab]
        first = self._draw(rows, last) if finishing else None
        features = self.features.now()
        for i, row in enumerate(rows):
            if row.needs_hidden and lengths[i]:
                row.hidden.append(self.features.keep(row.features, features[i, : lengths[i]]))
            row.fed += lengths[i]
        mx.eval(group.cache.state, [r.hidden[-1:] for r in rows], first)
        if first is not None:
            tokens = first.tolist()
            for i in finishing:
                self._first_token(rows[i], tokens[i])
        if all(r.fed == len(r.request.prompt) for r in rows):
            self._joining = None
            self._join(group)

    def _start_prefill(self, row: Row) -> None:
        """The row's cache: what the prompt cache holds of its prompt, or an empty one."""
        row.tic = clock.now()
        ids = row.tokens
        if self.context is not None and len(ids) >= self.context:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.context}")
        entry = None
        if self.row_cache is not None:
            names = [self.names[a] for a in row.arms]
            entry = self.row_cache.take(ids, names, row.features)
        if entry is None:
            row.prefill, row.fed = BatchCache(self.model, 1), 0
            return
        row.prefill, row.fed = entry.cache, entry.reuse
        row.cached, row.states, row.common = entry.reuse, entry.states, entry.common
        if row.needs_hidden:  # the entry kept them, and maybe more kinds (`take` saw to it)
            hidden = entry.hidden[: entry.reuse]
            row.hidden = [self.features.keep(row.features, hidden, entry.features)]

    def _first_token(self, row: Row, token: int) -> None:
        """Emit the token drawn after the prompt (it joins the sequence, not yet the cache)."""
        self._prefilled(row)
        self._emit(row, [token], 0, 0, None, tell=False)

    @staticmethod
    def _prefilled(row: Row) -> None:
        """Its prompt is in and its first token drawn: the prompt's share of the stats."""
        row.stats.cached_tokens = row.cached
        row.stats.prefill_seconds = clock.now() - row.tic
        row.tic = clock.now()
        row.first_pending = False

    def _join(self, group: Joining) -> None:
        """Every prompt of the group is in: rows its first token ended (or whose client left)
        go to the prompt cache; the others' drafters catch up and their caches join the
        batch."""
        staying = [i for i, row in enumerate(group.rows) if not (row.done or row.cancelled)]
        for i, row in enumerate(group.rows):
            if row.done or row.cancelled:
                if self.row_cache is not None and not row.cancelled:
                    hidden = mx.concatenate(row.hidden) if row.needs_hidden else None
                    one = group.cache.extract(i, self.model)
                    self.row_cache.put(row.tokens, one, {}, hidden, row.features)
                continue
            self._join_drafters(row, self._size_for(len(self.active) + len(staying), True))
        if not staying:
            return
        if len(staying) < len(group.rows):
            group.cache.filter(staying)
        self._extend(group.cache, [group.rows[i] for i in staying])

    def _join_direct(self, rows: list[Row]) -> None:
        """Rows whose caches hold all but their prompt's last token join the batch now; their
        first token comes from the next step (see `_form_group`)."""
        cache = rows[0].prefill
        for row in rows[1:]:
            cache.extend(row.prefill)
        for row in rows:
            row.prefill, row.first_pending = None, True
            self._join_drafters(row, self._size_for(len(self.active) + len(rows), True))
        self._extend(cache, rows)
