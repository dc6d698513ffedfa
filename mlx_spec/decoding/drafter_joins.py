"""Which of its drafters a row joins: as it joins the batch, or late once the policy drafts
with one at the batch's size; judged at the size the batch runs at."""

from __future__ import annotations

from mlx_spec.core import clock
from mlx_spec.decoding.rows import Row

import mlx.core as mx

# Seconds a batch may stand empty and still count as refilling (`BatchEngine._size_for`): a
# client's next request comes within one round trip; a second is a new spell.
IDLE_RESET = 1.0
LATE_EVERY = 8  # steps between late-join judgments of unchanged rows at an unchanged size


class DrafterJoins:
    """Which drafters a row joins, at joining or late, and the batch size it is judged at. A part of
    `BatchEngine` (its state: `BatchEngine.__init__`)."""

    def _size_for(self, size: int, joining: bool = False) -> int:
        """The batch size a joining row is judged at (`_join_drafters`): the batch's size
        once it joined, or the size it has been running at lately where that is larger.
        Under steady load a batch refills one request at a time as rows end (each client
        sends its next request when its last one finished): a row joining a batch of 1 or 2
        then runs most of its life among N. A batch that stood empty for longer than
        `IDLE_RESET` seconds starts afresh (a request after a busy spell is over). A row
        `joining` counts the requests that came while its prompt was prefilled: they join
        within a step or two (a burst of 8 clients' first requests, the first prefilled
        alone, was judged at 1 row and fed the draft model and the MTP head its prompt for
        a run among 8)."""
        if not self.active and clock.now() - self._last_decode > IDLE_RESET:
            self._size_seen = 0.0
        if joining:
            size = min(self.max_batch, size + len(self.waiting))
        return max(size, min(self.max_batch, int(self._size_seen + 0.5)))

    def _join_drafters(self, row: Row, size: int) -> None:
        """The row's drafters take it in: its sequence, its features, their saved states. A
        model drafter is left out where the policy has not been drafting with it at this
        batch size (`BatchDraftPolicy.join_pays`; rows with a fixed k always join): the row
        decodes without it until it joins late (`_join_late`). For a group's row that holds
        for a drafter whose state the prompt cache saved too (`saved`: nothing to feed but
        what the state lacks), though taking it in costs nothing: a row joined to a drafter
        costs the steps the policy weighs it in, its catch-ups and its probes
        (docs/serving.md, "Joins"). A row's only drafter takes its saved state in."""
        hidden = self._all_hidden(row)
        auto = not isinstance(row.request.num_draft, int)
        # No probe join (`join_pays`' `probe`) into a batch that will run closed: it runs no
        # probe, so the drafter would be fed and told for steps that never use it.
        closing = self.policy.every_row and size >= self.max_batch and not self.waiting
        states = [row.states.pop(self.names[arm], None) for arm in row.arms]
        grouped, wanted, dropped = self._grouped(row), [], []
        for arm, state in zip(row.arms, states, strict=True):
            # Saved: a state that covers most of the prompt (not another prompt's that
            # began alike); else it would be fed the whole prompt. A row's only drafter
            # takes its saved state in: how often the policy drafts with it at this size is
            # mostly how often a group's rows preferred their others (the guard judges its
            # steps).
            saved = state is not None and 2 * row.common >= len(row.tokens)
            model = auto and self.drafters[self.names[arm]].feeds_prompt
            if model and closing and self._shedding:  # it would leave it at once (`_shed`)
                wanted.append(False)
                dropped.append(arm)
                continue
            if not model or (saved and not grouped):
                wanted.append(True)
                continue
            tokens = len(row.tokens) - (row.common if saved else 0)
            life = self._life_left(row)
            wanted.append(self.policy.join_pays(arm, size, not closing, tokens, life, not saved))
        joined = []
        for arm, state, join in zip(row.arms, states, self._agreed(wanted), strict=True):
            if not join:
                if arm not in dropped:  # (a dropped one: not judged for a late join either)
                    row.skipped.append(arm)
                continue
            self._take_in(row, arm, hidden, state, row.common)
            joined.append(arm)
        row.arms = joined
        row.states = {}

    @staticmethod
    def _grouped(row: Row) -> bool:
        """Whether the row may draft with several drafters (a group), those it left out at
        joining included."""
        return len(row.arms) + len(row.skipped) > 1

    def _agreed(self, flags: list[bool]) -> list[bool]:
        """Rank 0's decisions on every rank of a sharded target (the flags otherwise): each
        rank times its own joins and steps, and their drafters must hold the same rows."""
        if self.sync is None or not flags:
            return flags
        return [bool(f) for f in self.sync.share_ints([int(f) for f in flags])]

    @staticmethod
    def _all_hidden(row: Row) -> mx.array | None:
        """The row's features at every position fed so far, as one array (None: it keeps
        none)."""
        if not row.needs_hidden:
            return None
        hidden = mx.concatenate(row.hidden) if len(row.hidden) > 1 else row.hidden[0]
        row.hidden = [hidden]
        return hidden

    def _join_late(self) -> None:
        """Rows that left out a model drafter at joining take it in now where the policy has
        come to draft with it at the batch's size (`_size_for`: once the batch has run
        smaller for a while, not as it refills; however cheap the join, as for a saved
        state) (the queued plain step settled first, so that each row's sequence and
        features are whole). The policy's judgment moves with the batch's size and slowly
        with what it measures: the rows are judged again where the size or the rows changed,
        else every `LATE_EVERY` steps (each judgment is a host's work per row and drafter,
        which a CPU's passes share)."""
        size = self._size_for(len(self.active))  # not while a busy batch refills
        skipped = [(row, arm) for row in self.active for arm in row.skipped]
        key = (size, tuple((row.id, arm) for row, arm in skipped))
        if key == self._late_key and self._late_wait > 0:
            self._late_wait -= 1
            return
        self._late_key, self._late_wait = key, LATE_EVERY - 1
        wanted = [
            self.policy.join_pays(
                arm,
                size,
                False,
                len(row.tokens),
                self._life_left(row),
                not self._grouped(row),
                late=True,
            )
            for row, arm in skipped
        ]
        late = [pair for pair, join in zip(skipped, self._agreed(wanted), strict=True) if join]
        if not late:
            return
        self._flush()
        before = sum(self._join_spent.values())
        for row, arm in late:
            if row.done or row.cancelled:
                continue
            self._tell(row)  # its drafters so far first: the new one joins with it whole
            self._take_in(row, arm, self._all_hidden(row), None, 0)
            row.skipped.remove(arm)
            row.arms.append(arm)
        # Prefill work, as the joins at a prefill: no step's time (the policy's, through
        # `_join_spent`).
        self._prefill_spent += sum(self._join_spent.values()) - before

    def _take_in(self, row: Row, arm: int, hidden, state, common: int) -> None:
        """Drafter `arm` takes the row in (from `state`, sharing `common` tokens with it); the
        time is reported with the next step observed (`BatchDraftPolicy.observe`'s `joined`)."""
        name = self.names[arm]
        columns = self._columns(row, name, hidden)
        tic = clock.now()
        self.drafters[name].join(row.id, row.tokens, columns, state, common)
        seconds = clock.now() - tic
        self._join_spent[arm] = self._join_spent.get(arm, 0.0) + seconds
        if self.drafters[name].feeds_prompt:
            fed = len(row.tokens) - (common if state is not None else 0)
            self.policy.observe_join(arm, fed, seconds)

    def _life_left(self, row: Row) -> float:
        """Tokens the row is expected to decode still: the share of their budgets the rows
        that ended lately (not cancelled) used, of its own budget, less what it decoded (its
        whole budget left where it already went beyond that)."""
        budget = row.request.max_tokens
        expected = budget if self._used is None else self._used * budget
        left = expected - row.produced if expected > row.produced else budget - row.produced
        return max(float(left), 1.0)
