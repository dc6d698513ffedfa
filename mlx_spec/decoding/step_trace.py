"""Where the batch engine's time goes: each step's (`StepTrace`, kept in a list or written as
it runs by `StepLog`) and each finished row's pace (`RowTrace`)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from mlx_spec.core import clock


@dataclass
class StepTrace:
    """Where one step's seconds went (`BatchEngine.trace`): rows B, drafts K, catch-up
    tokens, the tokens it emitted over its rows; `choose` (a speculative step's, below the
    fields): the rows' asks and the policy's plan; `draft_build`: building the drafters' graphs
    (a model drafter's passes each queued as it is built, the next built while it runs: on a
    CPU, where MLX returns from queueing only once a bounded number of its operations are
    still pending, most of the drafting); `draft_queue`: queueing what is left;
    `verify_build`: building the verifying pass while the drafts finish; `verify`: waiting
    for it; `host`: reading the outcome, the rows' bookkeeping and the policy (the device idle
    again). A plain step (K = 0; each pass is queued before the last is read) is timed from
    the last step read to its own, all in `verify`; a run of them starts with a step of no
    tokens, `why` "start" (queueing the first pass, which on a CPU returns once most of it
    ran: its tokens come with the next step), and ends with "flush" (its last pass read as
    the run stops: a speculative step, rows leaving), so that every second of decoding is in
    some step. `columns`: the target cache's columns
    in use after the step (what a pass attends over, per row), `held`: the tokens its rows
    hold, on average (rows out of step make `columns` exceed `held`: every row's pass
    attends over the longest row's columns)."""

    rows: int
    num_draft: int
    catch_up: int
    tokens: int
    draft_build: float
    draft_queue: float
    verify_build: float
    verify: float
    host: float
    columns: int = 0
    held: float = 0.0
    why: str = "best"  # the policy's reason for the step (`BatchChoice.why`)
    drafters: str = ""  # the drafters its rows drafted with, "+"-joined ("": a plain step)
    # A speculative step's choice before `draft_build`: the rows' asks (each row's n-gram
    # lookup, its drafters' backlogs) and the policy's plan, the device idle (on a switch out
    # of plain decoding, reading the plain step still queued too).
    choose: float = 0.0
    # What the policy priced a speculative step at (`BatchChoice.expected`): its tokens and
    # seconds (0: not priced, as a follow step).
    expected_tokens: float = 0.0
    expected_seconds: float = 0.0


class StepLog:
    """A step trace written as the engine runs (`serve --trace-steps FILE`): each `StepTrace`
    one JSON line, its fields, `t` (the seconds since the log was opened) and `wall` (the
    clock's time, Unix seconds: what a client's own marks line up with), appended where the
    engine would append to its `trace` list. Lines are flushed one by one, so a server
    stopped at any moment leaves every step it ran."""

    def __init__(self, path: str | os.PathLike):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the server's life)
        self.start = clock.now()

    def append(self, step: StepTrace) -> None:
        t = clock.now() - self.start
        line = {**asdict(step), "t": round(t, 4), "wall": round(time.time(), 4)}
        self.file.write(json.dumps(line) + "\n")


@dataclass
class RowTrace:
    """A finished row's pace (`BatchEngine.row_trace`): `seconds` from its first token to its
    last, `paced` what plain steps at the batch sizes it ran in would have taken for its
    tokens, `lag` the seconds its speculative steps took beyond that (its ledger, see
    `pace_slack`), its tokens, and the drafts it was given and kept. `seconds` beyond
    `paced` + `lag` is what its speculative steps do not show: plain steps slower than the
    cost model's (a pipeline restarted after speculative ones), prompts prefilled and rows
    joining between its steps."""

    seconds: float
    paced: float
    lag: float
    tokens: int
    drafted: int
    accepted: int
