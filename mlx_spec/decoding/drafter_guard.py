"""The guard: per batch size, each drafter's steps against steps without it, over windows of
steps, for what the step costs leave out (catch-ups and joins as rows come and go, a pipeline
of plain steps broken, rows out of step)."""

from __future__ import annotations


class DrafterGuard:
    """What each drafter adds, against decoding without it, per batch size.

    The step costs the policy predicts leave out what only shows over many steps: the
    model drafters' catch-ups and joins as rows come and go, a pipeline of plain steps
    broken by each speculative one, rows out of step. So steps run in windows of `window`
    steps, and in each, every drafter the rows have is either allowed (the policy may draft
    with it) or barred (it may not: the rows draft with their other drafters, or decode
    plainly where every one is barred). Per batch size and drafter, the guard keeps the
    tokens per second of the steps where it was allowed and of those where it was barred
    (decayed by `decay` per step; speculative and plain steps alike). What a switch costs
    is the allowed side's: a drafter's first steps after barred ones pay its backlog, and
    the first `settle` steps after it is barred again still count as allowed (they pay
    what it left behind: a pipeline to start again, rows out of step). The side that
    realised more leads; the other runs one window in every `|ratio - 1| / budget`
    (`least` .. `most`), so that it stays measured at an expected cost of about `budget`
    of the time. A batch size with no barred windows yet runs one after `first` allowed
    ones (a size that persists, not one passed through).

    Each drafter keeps its own schedule, so a lone drafter is judged against plain
    decoding, and a group's drafters each against the others: mostly, where the n-gram
    lookup leads and the MTP head trails, the head's windows add it to the lookup and its
    barred windows are the lookup alone (what the head adds, with its joins and
    catch-ups), and the lookup's barred windows are plain decoding.

    A window is a bitmask of the drafters barred (`BatchChoice.window`; 0: none).
    """

    def __init__(self, window=16, settle=4, budget=0.01, least=4, most=64, decay=0.98, first=3):
        self.window, self.settle, self.budget, self.decay = window, settle, budget, decay
        self.least, self.most, self.first = least, most, first
        # (B, drafter, allowed) -> decayed tokens, seconds, steps
        self.rates: dict[tuple[int, int, bool], list[float]] = {}
        self.since: dict[tuple[int, int], int] = {}  # (B, drafter) -> windows since it trailed
        # (B, drafter) -> decayed allowed steps that drafted with it, until `least` of them
        # have: then it is in `drafted`, and judged whatever its allowed steps draft (the
        # policy decoding plainly where it may draft costs the asks and probes)
        self.drafting: dict[tuple[int, int], float] = {}
        self.drafted: set[tuple[int, int]] = set()
        self.arms: tuple = ()  # the drafters the current window's rows have
        self.barred = 0  # the current window's barred drafters (a bitmask)
        self.left = 0  # its steps still to run
        self.unsettled: dict[int, int] = {}  # drafter -> barred steps still counted as allowed

    def ratio(self, rows: int, arm: int, drafted: bool = False) -> float | None:
        """Tokens per second of the steps with drafter `arm` allowed over those with it
        barred at `rows` rows (or a size one away, where `rows` has not both); None where
        neither has (`drafted`: or where its allowed steps have not yet drafted with it
        `least` times, decayed: `drafted`)."""
        for b in sorted((rows, rows - 1, rows + 1), key=lambda b: (abs(b - rows), -b)):
            on, off = self.rates.get((b, arm, True)), self.rates.get((b, arm, False))
            if on and off and min(on[2], off[2]) >= 4 and on[1] and off[1]:
                if drafted and (b, arm) not in self.drafted:
                    return None
                return (on[0] / on[1]) / (off[0] / off[1])
        return None

    verdict = ratio  # `BatchDraftPolicy.join_pays`: what taking a row into a drafter pays

    def holds(self, arms: tuple) -> bool:
        """Whether the next step runs on in the current window (drafters `arms` as its own):
        `window_for` then answers its bitmask, judging nothing."""
        return self.left > 0 and arms == self.arms

    def window_for(self, rows: int, arms: tuple) -> int:
        """The drafters barred for the next step, of `rows` rows with drafters `arms` (a
        bitmask). A drafter new to the window (a row that joined with it) is judged at
        once; the others keep their side until the window ends."""
        fresh = self.left <= 0
        if fresh or arms != self.arms:
            barred = 0
            for arm in arms:
                was = bool(self.barred >> arm & 1)
                bar = was if not fresh and arm in self.arms else self._bars(rows, arm)
                if bar and not was:  # its first barred steps still count as allowed
                    self.unsettled[arm] = self.settle
                elif not bar:
                    self.unsettled.pop(arm, None)
                barred |= bar << arm
            self.arms, self.barred = arms, barred
            if fresh:
                self.left = self.window
        self.left -= 1
        return self.barred

    def _bars(self, rows: int, arm: int) -> bool:
        """Whether drafter `arm` is barred in the window starting now (its schedule moves
        on by one window)."""
        # Until its allowed steps have drafted with it, they weigh plain steps against plain
        # steps, and its joins: no verdict.
        ratio = self.ratio(rows, arm, drafted=True)
        if ratio is None:
            lead, every = False, self.first
        else:
            lead = ratio < 1.0
            every = int(min(self.most, max(self.least, abs(ratio - 1.0) / self.budget)))
        behind = self.since.get((rows, arm), 0) + 1
        self.since[rows, arm] = behind if behind < every else 0
        return lead if behind < every else not lead

    def observe(
        self, rows: int, barred: int, tokens: int, seconds: float, drafted=frozenset()
    ) -> None:
        """A step of `rows` rows ran with drafters `barred` (a bitmask; `drafted`: those its
        rows drafted with): it counts for each drafter of the window's rows, on its side."""
        d = self.decay
        for arm in self.arms:
            allowed = not barred >> arm & 1
            if not allowed and self.unsettled.get(arm, 0) > 0:
                self.unsettled[arm] -= 1
                allowed = True
            entry = self.rates.setdefault((rows, arm, allowed), [0.0, 0.0, 0.0])
            entry[:] = [d * entry[0] + tokens, d * entry[1] + seconds, d * entry[2] + 1.0]
            if allowed and (rows, arm) not in self.drafted:
                count = d * self.drafting.get((rows, arm), 0.0) + (arm in drafted)
                self.drafting[rows, arm] = count
                if count >= self.least:
                    self.drafted.add((rows, arm))

    def charge(self, rows: int, arm: int, seconds: float) -> None:
        """Time drafter `arm` spent beside the steps at `rows` rows (taking rows in: no step
        without it would have it), with no tokens: its allowed side's."""
        entry = self.rates.setdefault((rows, arm, True), [0.0, 0.0, 0.0])
        entry[1] += seconds
