"""Continuous batching with speculation: many requests, one target pass per step.

`BatchEngine` owns the rows (one per request: its tokens, sampling settings, random stream,
output cutter and stats) and their caches: one `BatchCache` for the target over every active
row, and one per model drafter over the rows that draft with it. `step()` does one unit of
work: a chunk of the prompts of the requests that are joining (prefilled together; each
one's first token is drawn from its prefill and emitted at once; then they join the batch)
and one decoding step of the batch:

1. the policy chooses K (and each row's drafter and k); K = 0 is a plain step, pipelined:
   the next pass is queued before the last is read;
2. the drafters draft (model drafters batched over their rows, n-gram lookup per row; those
   that read target features, MTP, EAGLE-3 and DFlash, get their rows' features as recorded
   by the target passes: `_Features`);
3. one target pass over `[last] + drafts` of every row, right-padded to K + 1;
4. each row is verified (exact match when greedy, rejection sampling otherwise) and its caches
   roll back by its own amount; its tokens go through its `OutputCutter` (EOS, stop strings,
   max_tokens) to its `emit` callback.

Requests join and leave between steps. A finished row's caches go to the `RowCache` (a prompt
cache) so that a later request sharing its prefix (a conversation's next turn) prefills only
what is new. Everything runs on the caller's thread (the server's engine thread).

On a target sharded over several ranks every rank runs the same engine on the same requests
(see `scheduler.Lockstep`); what could differ between ranks is rank 0's and shared: the
policy's choice (it rests on each rank's clock), every token drawn, the drafts fed and each
row's outcome, and the byte counts that admission and the prompt cache decide on.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from mlx_spec.api import OutputCutter
from mlx_spec.caches.batch import BatchCache
from mlx_spec.caches.taps import logits_at, tap_for
from mlx_spec.core.batch_verify import (
    RowRandom,
    batch_probs,
    batch_verify,
    draw,
    greedy_batch_verify,
    gumbel,
    row_uniforms,
)
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.core.stats import SpecStats
from mlx_spec.decoding import distributed
from mlx_spec.decoding.batch_policy import BatchChoice, BatchDraftPolicy, RowAsk, RowRecord
from mlx_spec.decoding.chain import Round
from mlx_spec.decoding.policy import ema
from mlx_spec.decoding.runner import context_limit
from mlx_spec.drafters.base import hidden_wanted
from mlx_spec.drafters.batch import BatchDrafter, DraftBlock, concat_rows
from mlx_spec.platform.blas_threads import BlasThreads

import mlx.core as mx
import mlx.nn as nn

ALL = "all"
# Seconds a batch may stand empty and still count as refilling (`BatchEngine._size_for`): a
# client's next request comes within one round trip; a second is a new spell.
IDLE_RESET = 1.0
LATE_EVERY = 8  # steps between late-join judgments of unchanged rows at an unchanged size
# A closed batch's hold grows with its steps without a plan, up to this many `closed_hold`s
# (`BatchEngine._hold_steps`).
HOLD_GROWTH = 4


@dataclass
class BatchRequest:
    """One generation asked of the engine.

    Attributes:
        prompt: token ids (at least one).
        sampling: temperature, top-k, top-p, min-p.
        max_tokens: tokens generated at most.
        emit: called on the engine's thread with each `GenerationChunk` (the last has
            `token=None`, the finish reason and the stats), or with an exception if the
            generation failed.
        stop: strings that end the output.
        drafter: a drafter of the engine, "all" (any of them, chosen each step) or None.
        num_draft: "auto" (the batch's K) or a fixed k (0: plain decoding).
        seed: the row's own random stream (None: an unseeded one).
    """

    prompt: list[int]
    sampling: SamplingConfig
    max_tokens: int
    emit: Callable[[object], None]
    stop: Sequence[str] = ()
    drafter: str | None = None
    num_draft: int | str = "auto"
    seed: int | None = None


@dataclass
class _Ahead:
    """A plain step queued but not read: the rows it serves, its `[B]` draws (lazy) and the
    target's `[B, T]` hidden states at the tokens it fed (for drafters that read them)."""

    ids: list[int]
    tokens: mx.array
    hidden: mx.array | None


@dataclass
class _Joining:
    """Requests prefilled together: their rows and their cache (one row each)."""

    rows: list
    cache: BatchCache


@dataclass
class _Row:
    id: int
    request: BatchRequest
    tokens: list[int]  # the sequence; the target's cache holds all but the last
    cutter: OutputCutter
    stats: SpecStats
    arms: list[int]  # indices of the drafters it may use (that took it in)
    random: RowRandom | None
    features: tuple = ()  # the target features its drafters read (`_Features` kinds)
    prefill: BatchCache | None = None  # before its group forms: what the prompt cache had
    fed: int = 0  # prompt tokens in its cache so far
    cached: int = 0  # prompt tokens that came from the prompt cache
    # Drafter states from the prompt cache; once joined, those of the drafters it left in a
    # closed batch (`BatchEngine._shed`), for the prompt cache with its sequence.
    states: dict = field(default_factory=dict)
    common: int = 0  # tokens shared with those states' sequence
    hidden: list = field(default_factory=list)  # its features, in order (`features`)
    # Its plain steps since its drafters were last told (`BatchEngine._tell`): the last
    # `untold` of its tokens and, where it keeps features, each step's (`[B, W]` features of
    # the pass, its row in them).
    untold: int = 0
    untold_features: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # model drafters it left out at joining
    produced: int = 0
    record: RowRecord = field(default_factory=RowRecord)  # its own acceptance
    # Its pace against plain decoding (`BatchEngine.pace_slack`): the seconds its speculative
    # steps took beyond what plain steps at their batch sizes would have taken for the tokens
    # they gave it (negative: ahead), and those plain steps' seconds for every token it got.
    lag: float = 0.0
    paced: float = 0.0
    first_pending: bool = False  # joined the batch before its first token (`_join_direct`)
    done: bool = False
    cancelled: bool = False
    tic: float = 0.0

    @property
    def needs_hidden(self) -> bool:
        return bool(self.features)


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
        self.start = time.perf_counter()

    def append(self, step: StepTrace) -> None:
        t = time.perf_counter() - self.start
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


class _Features:
    """The target features the engine's drafters read, one kind per drafter that reads any (the
    final hidden state: MTP heads; its layers' features: EAGLE-3, DFlash), recorded on every
    target pass and concatenated kind after kind. A row keeps the kinds of its own drafters
    only, and each of them reads its kind's columns."""

    def __init__(self, model: nn.Module, drafters: dict[str, BatchDrafter]):
        self.kinds: list = []  # `hidden_wanted` of the drafters: True, or layer ids
        for drafter in drafters.values():
            kind = hidden_wanted(drafter)
            if kind and kind not in self.kinds:
                self.kinds.append(kind)
        self.kind_of = {name: hidden_wanted(d) for name, d in drafters.items()}
        self._taps = [tap_for(model, kind) for kind in self.kinds]
        self.widths: dict = {}  # kind -> columns, once a pass was seen (`measure`)
        self.itemsize = 0

    def now(self) -> mx.array | None:
        """`[B, S, W]`: every kind from the last target pass (None: no drafter reads any)."""
        if not self._taps:
            return None
        parts = [tap.hidden for tap in self._taps]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def measure(self) -> None:
        """Read each kind's width from the last pass."""
        for kind, tap in zip(self.kinds, self._taps, strict=True):
            self.widths[kind] = tap.hidden.shape[-1]
            self.itemsize = tap.hidden.dtype.size

    def of(self, names: list[str]) -> tuple:
        """The kinds drafters `names` read, in the engine's order."""
        wanted = {self.kind_of[n] for n in names}
        return tuple(kind for kind in self.kinds if kind in wanted)

    def keep(self, kinds: tuple, h: mx.array, held: tuple | None = None) -> mx.array:
        """A row's columns (its `kinds`) of `[..., W]` features of the kinds `held` (default:
        every kind, as a pass records them)."""
        held = tuple(self.kinds) if held is None else tuple(held)
        if kinds == held:
            return h
        parts, start = [], 0
        for kind in held:
            end = start + self.widths[kind]
            if kind in kinds:
                parts.append(h[..., start:end])
            start = end
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def columns(self, kinds: tuple, name: str) -> slice:
        """Where drafter `name`'s kind lies among a row's kept columns (`kinds`)."""
        start = 0
        for kind in kinds:
            if kind == self.kind_of[name]:
                return slice(start, start + self.widths[kind])
            start += self.widths[kind]
        raise KeyError(name)

    def row_bytes(self, kinds: tuple) -> int:
        """Bytes a row keeps per token for `kinds`."""
        return self.itemsize * sum(self.widths[kind] for kind in kinds)


class BatchEngine:
    """Continuous batching over a target and its drafters.

    Args:
        model, tokenizer: the target (mlx-lm model; its caches must be `batchable`).
        vocab_size: tokens that may be generated (the tokenizer's).
        drafters: {name: BatchDrafter}.
        max_batch: rows decoded together; more requests wait.
        max_draft: the longest draft K the policy considers.
        prefill_step: prompt tokens prefilled per step of the batch.
        row_cache: a `RowCache` for finished rows (None: no reuse).
        max_kv_bytes: the cache memory the active rows may reserve (each reserves its prompt
            and `max_tokens`, in the target's and its drafters' caches); a request waits until
            enough is free, and one that alone needs more fails with a ValueError. None: no
            limit.
        pace_slack: how far behind plain decoding's pace speculation may put a request, as
            a share of its time decoding (the policy weighs the batch's tokens as a whole;
            a row whose drafts fail pays for the wider pass all the same): a row whose
            ledger (`_Row.lag`) exceeds this share of the plain time of the tokens it got
            is `behind`, and no step is chosen that would be expected to slow it further
            until its tokens at plain pace make up the difference (None, the default: no
            ledger; on a 2-core x86 a slack of 0.02 held the rows near plain pace at the
            cost of most of what speculation gained the batch: docs/serving.md).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        vocab_size: int,
        drafters: dict[str, BatchDrafter],
        *,
        max_batch: int = 8,
        max_draft: int = 8,
        prefill_step: int = 256,
        row_cache=None,
        max_kv_bytes: int | None = None,
        pace_slack: float | None = None,
    ):
        self.model, self.tokenizer, self.vocab = model, tokenizer, vocab_size
        self.pace_slack = pace_slack
        self.drafters = drafters
        for drafter in drafters.values():
            drafter.vocab = vocab_size
        self.names = list(drafters)
        self.max_batch, self.max_draft, self.prefill_step = max_batch, max_draft, prefill_step
        self.sync = distributed.sync_for(model)  # a sharded target's sharing, else None
        self.max_kv_bytes = max_kv_bytes
        self.features = _Features(model, drafters)
        self.token_bytes = {None: token_bytes(model)}  # per drafter name (None: the target)
        self.features.measure()  # from the pass `token_bytes` ran
        for name, drafter in drafters.items():
            per_token = drafter.token_bytes(self.features.widths.get(hidden_wanted(drafter), 0))
            if per_token:
                self.token_bytes[name] = per_token
        if self.sync is not None:  # decided alike on every rank
            group = self.sync.group
            self.token_bytes = {
                n: distributed.agreed_bytes(group, b) for n, b in self.token_bytes.items()
            }
            if max_kv_bytes is not None:
                self.max_kv_bytes = distributed.agreed_bytes(group, max_kv_bytes, least=True)
        self.context = context_limit(model)
        self.threads = BlasThreads.calibrate(model)  # per pass width (CPU, OpenBLAS), or None
        self.row_cache = row_cache
        # The guard watches a lone row's model drafters too (joins and catch-ups: costs its
        # steps do not show), not its n-gram lookup (`BatchDraftPolicy`, `alone`).
        model_drafters = [i for i, n in enumerate(self.names) if drafters[n].feeds_prompt]
        chained = [i for i, n in enumerate(self.names) if drafters[n].chained]
        self.policy = BatchDraftPolicy(self.names, max_draft, alone=model_drafters, chained=chained)
        self.cache: BatchCache | None = None  # the target's, over `active`
        self.active: list[_Row] = []
        # Rows of `cache` whose rows left since the last decoding step (`_remove`), in order:
        # the next rows to join are written there (`_extend`); before a step, the rest go.
        # `active` lists the other rows of `cache`, in order.
        self._vacant: list[int] = []
        self._left = False  # a row left since the last decoding step
        # Rows joined or left since the last step observed: the next one runs what that
        # left queued (`BatchDraftPolicy.observe`'s `disturbed`).
        self._turnover = False
        # A joining row takes a row that left (`_extend`); after rows leave, the columns are
        # squeezed once they exceed the longest row's by this share and 8. The A/B of
        # `benchmarks/batch_rows.py` sets them as they were (False; 1.0).
        self.reuse_rows, self.columns_slack = True, 0.1
        self._hold: tuple[list[int], int] | None = None  # (rows, steps): `_closed_choice`
        self._stacked: tuple[list, mx.array] | None = None  # `_untold_hidden`
        self._no_plan = 0  # the full batch's plain steps since its last plan (`_shed`)
        self._shed_ids: list[int] | None = None  # the rows shed last (`_shed`)
        self.waiting: list[_Row] = []
        self._next_id = 0
        self._ahead: _Ahead | None = None  # a plain step queued ahead of the one being read
        self._joining: _Joining | None = None  # requests being prefilled together
        self._last_settle = time.perf_counter()
        self._prefill_spent = 0.0  # prefill time since the last settled step
        # Model drafters' joins since then (within the prefill time), seconds per drafter: a
        # cost of drafting with them, reported with the next step observed (to the guard, not
        # the step costs).
        self._join_spent: dict[int, float] = {}
        self._arm_of: dict[int, int] = {}  # row -> the arm that drafted it this step
        self._size_seen = 0.0  # the batch's size, averaged over its recent steps
        self._late_key, self._late_wait = None, 0  # the late joins last judged (`_join_late`)
        self._last_decode = 0.0  # when the last decoding step started
        self._used: float | None = None  # share of their budgets the rows that ended used
        # Set to a list to record where each step's time goes (`StepTrace`), and each
        # finished row's pace (`RowTrace`).
        self.trace: list[StepTrace] | StepLog | None = None
        self.row_trace: list[RowTrace] | None = None

    def _threads(self, tokens: int) -> None:
        """The BLAS threads for a pass over `tokens` tokens (see `blas_threads`)."""
        if self.threads is not None:
            self.threads.use(tokens)

    # --- requests ----------------------------------------------------------------------------

    def add(self, request: BatchRequest) -> _Row:
        """Queue a request; returns its row (pass it to `cancel`)."""
        if not request.prompt:
            raise ValueError("the prompt is empty")
        arms = self._arms(request)
        name = "+".join(self.names[a] for a in arms) if arms else "none"
        stats = SpecStats(drafter=name, num_draft=request.num_draft if arms else 0)
        stats.prompt_tokens = len(request.prompt)
        if self.sync is not None:
            stats.world_size = self.sync.size
        greedy = request.sampling.greedy
        row = _Row(
            self._next_id,
            request,
            list(request.prompt),
            OutputCutter(self.tokenizer, stats, request.stop, request.max_tokens),
            stats,
            arms,
            None if greedy else RowRandom(request.seed),
        )
        row.features = self.features.of([self.names[a] for a in arms])
        self._next_id += 1
        self.waiting.append(row)
        return row

    def _arms(self, request: BatchRequest) -> list[int]:
        if request.drafter is None or request.num_draft == 0:
            return []
        if request.drafter == ALL:
            return list(range(len(self.names)))
        if request.drafter not in self.drafters:
            raise ValueError(f"unknown drafter {request.drafter!r}")
        return [self.names.index(request.drafter)]

    def cancel(self, row: _Row) -> None:
        """Stop a row at the next step (its caches are dropped)."""
        row.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting or self._ahead or self._joining)

    # --- the loop ------------------------------------------------------------------------------

    def step(self) -> None:
        """A chunk of the prompts of the joining requests (prefilled together, about
        `prefill_step` tokens in all), then a decoding step of the batch."""
        self._drop_cancelled()
        tic = time.perf_counter()
        if not self.active and self._ahead is None:  # idle until now: no step's time
            self._last_settle, self._prefill_spent, self._join_spent = tic, 0.0, {}
        if self._joining is None:
            self._joining = self._form_group()
        group = self._joining
        if group is not None:
            try:
                self._prefill_group(group)
            except Exception as exc:  # the joining rows fail; the batch goes on without them
                self._fail_joining(group, exc)
                raise
        self._prefill_spent += time.perf_counter() - tic  # not charged to the decoding steps
        if self.active:
            try:
                self._decode()
            except Exception as exc:  # the batch's state is unknown: every active row fails
                self._fail_batch(exc)
                raise

    def _fail_batch(self, exc: Exception) -> None:
        for row in self.active:
            row.done = True
            row.request.emit(exc)
        self.active, self.cache, self._ahead, self._vacant = [], None, None, []
        self._stacked = None
        for drafter in self.drafters.values():
            drafter.reset()

    def _fail_joining(self, group: _Joining, exc: Exception) -> None:
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

    def reserved(self, row: _Row) -> int:
        """Cache bytes a row may come to hold: its prompt and max_tokens, in the target's and
        its model drafters' caches."""
        names = [None] + [self.names[a] for a in row.arms]
        per_token = sum(self.token_bytes.get(n, 0) for n in names)
        per_token += self.features.row_bytes(row.features)  # the features it keeps
        return per_token * (len(row.request.prompt) + row.request.max_tokens)

    def _fits(self, row: _Row, joining: list[_Row]) -> bool:
        """Whether the row may start now beside the active rows and those `joining` with it;
        a row that could never fit fails."""
        if self.max_kv_bytes is None:
            return True
        need = self.reserved(row)
        if need > self.max_kv_bytes:
            self.waiting.remove(row)
            row.request.emit(
                ValueError(
                    f"the request needs about {need >> 20} MiB of cache (prompt and max_tokens); "
                    f"the server allows {self.max_kv_bytes >> 20} MiB: ask for fewer tokens"
                )
            )
            return False
        held = sum(self.reserved(r) for r in self.active + joining)
        return need + held <= self.max_kv_bytes

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(row)
        cancelled = [r for r in self.active if r.cancelled]
        if cancelled:
            for row in cancelled:
                row.done = True  # the queued step's token for it is dropped
            self._flush()

    # --- joining -------------------------------------------------------------------------------

    def _form_group(self) -> _Joining | None:
        """The waiting requests that fit now (batch slots, cache memory), each with the prefix
        the prompt cache had for it, as one cache to prefill together. A request whose prompt
        the prompt cache holds all but the last token of joins the batch at once instead: its
        last token is fed by the batch's next step, like any row's last token, and that step
        draws its first token (a pass of its own saved)."""
        rows: list[_Row] = []
        direct: list[_Row] = []
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
        return _Joining(rows, cache)

    def _prefill_group(self, group: _Joining) -> None:
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

    def _start_prefill(self, row: _Row) -> None:
        """The row's cache: what the prompt cache holds of its prompt, or an empty one."""
        row.tic = time.perf_counter()
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

    def _first_token(self, row: _Row, token: int) -> None:
        """Emit the token drawn after the prompt (it joins the sequence, not yet the cache)."""
        self._prefilled(row)
        self._emit(row, [token], 0, 0, None, tell=False)

    @staticmethod
    def _prefilled(row: _Row) -> None:
        """Its prompt is in and its first token drawn: the prompt's share of the stats."""
        row.stats.cached_tokens = row.cached
        row.stats.prefill_seconds = time.perf_counter() - row.tic
        row.tic = time.perf_counter()
        row.first_pending = False

    def _join(self, group: _Joining) -> None:
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

    def _join_direct(self, rows: list[_Row]) -> None:
        """Rows whose caches hold all but their prompt's last token join the batch now; their
        first token comes from the next step (see `_form_group`)."""
        cache = rows[0].prefill
        for row in rows[1:]:
            cache.extend(row.prefill)
        for row in rows:
            row.prefill, row.first_pending = None, True
            self._join_drafters(row, self._size_for(len(self.active) + len(rows), True))
        self._extend(cache, rows)

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
        if not self.active and time.perf_counter() - self._last_decode > IDLE_RESET:
            self._size_seen = 0.0
        if joining:
            size = min(self.max_batch, size + len(self.waiting))
        return max(size, min(self.max_batch, int(self._size_seen + 0.5)))

    def _join_drafters(self, row: _Row, size: int) -> None:
        """The row's drafters take it in: its sequence, its features, their saved states. A
        model drafter is left out where the policy has not been drafting with it at this
        batch size (`BatchDraftPolicy.join_pays`; rows with a fixed k always join): the row
        decodes without it until it joins late (`_join_late`). For a group's row that holds
        for a drafter whose state the prompt cache saved too (`saved`: nothing to feed but
        what the state lacks), though taking it in costs nothing: a row joined to a drafter
        costs the steps the policy weighs it in, its catch-ups and its probes (on a 2-core
        x86, the group at 8 rows with a prompt cache kept across requests joined every row
        to every model drafter it had saved: 0.86x of plain decoding over five rounds
        through the server, 0.90x with the joins judged). A row's only drafter takes its
        saved state in."""
        hidden = self._all_hidden(row)
        auto = not isinstance(row.request.num_draft, int)
        # No probe join (`join_pays`' `probe`) into a batch that will run closed (full,
        # nothing waiting): a closed batch runs no probe, so the drafter would be fed the
        # row's prompt and told every token for steps that never use it (8 rows of a
        # 2-core x86: every 8th row joined the draft model and the MTP head, 14-20 ms of a
        # run's 2.2 s; `benchmarks/README.md`, "Shedding in a closed batch").
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
    def _grouped(row: _Row) -> bool:
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
    def _all_hidden(row: _Row) -> mx.array | None:
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

    def _take_in(self, row: _Row, arm: int, hidden, state, common: int) -> None:
        """Drafter `arm` takes the row in (from `state`, sharing `common` tokens with it); the
        time is reported with the next step observed (`BatchDraftPolicy.observe`'s `joined`)."""
        name = self.names[arm]
        columns = self._columns(row, name, hidden)
        tic = time.perf_counter()
        self.drafters[name].join(row.id, row.tokens, columns, state, common)
        seconds = time.perf_counter() - tic
        self._join_spent[arm] = self._join_spent.get(arm, 0.0) + seconds
        if self.drafters[name].feeds_prompt:
            fed = len(row.tokens) - (common if state is not None else 0)
            self.policy.observe_join(arm, fed, seconds)

    def _life_left(self, row: _Row) -> float:
        """Tokens the row is expected to decode still: the share of their budgets the rows
        that ended lately (not cancelled) used, of its own budget, less what it decoded (its
        whole budget left where it already went beyond that)."""
        budget = row.request.max_tokens
        expected = budget if self._used is None else self._used * budget
        left = expected - row.produced if expected > row.produced else budget - row.produced
        return max(float(left), 1.0)

    def _extend(self, cache: BatchCache, rows: list[_Row]) -> None:
        """Rows (and their cache) join the batch: into the rows that rows left since the last
        step, as far as there are such (`BatchCache.place`), after its rows for the rest."""
        if self.cache is None:
            self.cache, self.active = cache, list(rows)
            return
        slots = self._vacant[: len(rows)] if self.reuse_rows else []
        if slots:
            placed = len(slots)
            if placed < len(rows):  # the rest join after the batch's rows
                rest = cache.copy()
                rest.filter(range(placed, len(rows)))
                cache.filter(range(placed))
            if self.cache.place(slots, cache):
                for slot, row in zip(slots, rows, strict=False):
                    self.active.insert(self._logical(slot), row)
                    self._vacant.remove(slot)
                if placed == len(rows):
                    return
                cache, rows = rest, rows[placed:]
            elif placed < len(rows):
                cache.extend(rest)
        self._settle_vacant()
        self.cache.extend(cache)
        self.active += rows
        self._turnover = True

    def _logical(self, slot: int) -> int:
        """Where a row in `cache` row `slot` goes in `active` (the rows before it that are not
        vacant)."""
        return slot - sum(1 for v in self._vacant if v < slot)

    def _physical(self, index: int) -> int:
        """The row of `cache` that `active[index]` is in."""
        for vacant in self._vacant:  # in order
            if vacant <= index:
                index += 1
        return index

    def _settle_vacant(self) -> None:
        """Drop the rows that no row took over from the cache."""
        if self._vacant and self.cache is not None:
            vacant = set(self._vacant)
            self.cache.filter([r for r in range(self.cache.batch) if r not in vacant])
        self._vacant = []

    # --- decoding --------------------------------------------------------------------------

    def _ask(self, row: _Row) -> RowAsk:
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
            # Rows that leave at different steps (requests of different lengths, or rows a
            # speculative step put out of step) leave the batch's columns wider than its
            # longest row, and every later pass attends over them. A row's leaving broke the
            # pipeline already (a sync costs no more now), so the columns are squeezed to the
            # longest row's as soon as they exceed it by a tenth (they were left to reach
            # twice it: plain decoding of 8 rows out of step ran at 0.90x of rows in step,
            # 0.92x so; `benchmarks/batch_rows.py`).
            self.cache.tidy(slack=self.columns_slack, spare=8)
        self._left = False
        rows = list(self.active)
        self._size_seen += 0.05 * (len(rows) - self._size_seen)  # about the last 20 steps
        self._last_decode = time.perf_counter()
        free = all(not isinstance(r.request.num_draft, int) for r in rows)
        ids = [r.id for r in rows]
        choice = self.policy.barred(len(rows), {a for r in rows for a in r.arms}, free)
        if choice is None:  # the guard's plain window does not decide it: the rows ask
            choice = self._closed_choice(rows, ids, free)
        choice = self._shared(choice)
        plain = not any(k for _, k in choice.rows)
        if plain and free and choice.why == "closed":
            self._no_plan += 1  # (a held step too: the hold is a choice of no plan)
            if self._shedding and ids != self._shed_ids:  # (shed rows stay so)
                self._shed(rows)
                self._shed_ids = ids
        elif choice.why == "closed" or self._size_for(len(rows)) < self.max_batch:
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

    def _closed_choice(self, rows: list[_Row], ids: list[int], free: bool) -> BatchChoice:
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
            return BatchChoice(0, [(None, 0)] * len(rows), why="closed")
        self.policy.closed = closed
        choice = self.policy.choose([self._ask(r) for r in rows])
        if closed and free and choice.why == "closed" and not any(k for _, k in choice.rows):
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

    def _shed(self, rows: list[_Row]) -> None:
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
            flat[0], rows, bool(flat[1]), flat[2], only, window, choice.why, choice.expected
        )

    # --- plain steps, pipelined -------------------------------------------------------------

    def _plain_step(self, rows: list[_Row], choice) -> None:
        """Queue the pass of the next plain step (its input: the tokens the queued step will
        draw), then read and emit the queued step: the model computes one step while Python
        handles the last. A row that ends stops the pipeline (the step queued after it is
        emitted at once for the others)."""
        if self._ahead is None:
            tic = time.perf_counter()
            self._ahead = self._launch(rows, mx.array([r.tokens[-1] for r in rows], mx.uint32))
            if not all(self._pipelinable(r) for r in rows):
                self._flush(choice)
            else:  # the pipeline starts: the next settle times one step, not two
                self._last_settle, self._prefill_spent = time.perf_counter(), 0.0
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
    def _pipelinable(row: _Row) -> bool:
        """Whether the row's steps may be chosen one token early: a row with a fixed k and a
        drafter drafts what its lookup finds after its last token, so that its draws (and a
        seeded row's output) do not depend on what else runs."""
        return not row.arms or not isinstance(row.request.num_draft, int)

    def _launch(self, rows: list[_Row], tokens: mx.array) -> _Ahead:
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
        return _Ahead([r.id for r in rows], nxt, hidden)

    def _draw(self, rows: list[_Row], logits: mx.array) -> mx.array:
        """`[B]` next tokens from `[B, V]` logits, each row with its settings and stream."""
        if all(r.request.sampling.greedy for r in rows):
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
        else:
            probs = batch_probs(logits, [r.request.sampling for r in rows])
            tokens = draw(probs, gumbel([r.random for r in rows], (logits.shape[-1],)))
        return tokens if self.sync is None else self.sync.share(tokens)

    def _settle(self, ahead: _Ahead, choice=None) -> None:
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
        now = time.perf_counter()
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
        self._last_settle, self._prefill_spent = time.perf_counter(), 0.0
        for row in [r for r in self.active if r.done]:
            self._remove(row, keep_cache=not row.cancelled)

    # --- speculative steps --------------------------------------------------------------------

    def _speculative_step(self, rows: list[_Row], choice) -> None:
        tic = time.perf_counter()
        for row in rows:
            self._tell(row)
        self._threads(len(rows))  # the drafters' passes: a token per row, most of them
        tokens, probs, counts = self._draft(rows, choice.rows)
        k = 0 if tokens is None else tokens.shape[1]
        built = time.perf_counter()
        if k:  # the drafters compute while the verifying pass is built
            mx.async_eval(tokens if probs is None else (tokens, probs))
        # Queueing returns with the drafting nearly done (few operations may stay pending):
        # the verifying pass's width sets the threads from here.
        self._threads(len(rows) * (1 + k))
        queued = time.perf_counter()
        lengths = [1 + n for n in counts]
        x = mx.array([r.tokens[-1] for r in rows], mx.uint32)[:, None]  # [B, 1]
        if k:
            if self.sync is not None:  # every rank verifies rank 0's drafts
                tokens = self.sync.share_input(tokens)
            x = mx.concatenate([x, tokens], axis=1)  # [B, 1 + K], pads past each row's drafts
        self.cache.begin(lengths)
        logits = self.model(x, cache=self.cache.layers)[..., : self.vocab]  # [B, 1 + K, V]
        self.cache.end(lengths)
        hidden = self.features.now()
        accepted, nxt = self._verify(rows, tokens, probs, logits, counts)
        if self.sync is not None:  # rank 0's outcome, one collective for both
            both = self.sync.share(mx.stack([accepted.astype(mx.int32), nxt.astype(mx.int32)]))
            accepted, nxt = both[0], both[1]
        waited = time.perf_counter()
        mx.eval(accepted, nxt, x)
        read = time.perf_counter()
        accepted, nxt, fed = accepted.tolist(), nxt.tolist(), x.tolist()
        targets = self.cache.lengths
        outcomes = []
        for i, row in enumerate(rows):
            n = accepted[i]
            emitted = fed[i][1 : 1 + n] + [nxt[i]]
            rows_hidden = None if hidden is None else hidden[i, : n + 1]
            keep = self._emit(row, emitted, counts[i], n, rows_hidden)
            targets[i] += keep - (1 + counts[i])  # the pass fed last + drafts; keep `keep`
            outcomes.append((counts[i], min(n, keep - 1)))
            arm, asked = choice.rows[i]
            if arm is not None and asked > 0:
                row.record.drafted(arm, asked, outcomes[-1][1])
        self.cache.truncate(targets)
        self.cache.tidy()  # columns before rows' tokens, squeezed out once they are many
        # Timed like a plain step: from the last step settled (the choice, the rows' asks and
        # leaving are the step's too), prefill work and the drafters' joins apart (a join is
        # its row's cost: the policy hands it to the guard, not to the step costs).
        seconds = time.perf_counter() - self._last_settle - self._prefill_spent
        catch_up, window, joined = choice.catch_up, choice.window, self._join_spent
        turnover, self._turnover = self._turnover, False
        self._pace(rows, outcomes, seconds, turnover)
        self.policy.observe(
            choice.rows,
            outcomes,
            seconds,
            catch_up,
            window,
            joined,
            disturbed=turnover,
            drafting=queued - tic if k else 0.0,
        )
        self._last_settle, self._prefill_spent, self._join_spent = time.perf_counter(), 0.0, {}
        if self.trace is not None:
            stamps = [tic, built, queued, waited, read, self._last_settle]
            spans = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            tokens = sum(1 + n for _, n in outcomes)
            widths = self._widths()
            arms = sorted({arm for arm, asked in choice.rows if arm is not None and asked})
            drafters = "+".join(self.names[a] for a in arms)
            expected = choice.expected or (0.0, 0.0)
            self.trace.append(
                StepTrace(
                    len(rows),
                    k,
                    choice.catch_up,
                    tokens,
                    *spans,
                    *widths,
                    choice.why,
                    drafters,
                    choose=max(0.0, tic - self._last_decode),
                    expected_tokens=expected[0],
                    expected_seconds=expected[1],
                )
            )

    def _widths(self) -> tuple[int, float]:
        """(columns in use, mean tokens held per row) of the target's cache (`StepTrace`)."""
        if self.cache is None:
            return 0, 0.0
        lengths = self.cache.lengths
        return self.cache.columns, sum(lengths) / max(len(lengths), 1)

    def _draft(self, rows: list[_Row], plan):
        """The step's drafts: `[B, K]` ids, `[B, K, V]` distributions (None: every draft
        one-hot) and drafts per row, gathered from each drafter's block."""
        per_drafter: dict[int, dict[int, int]] = {}
        for row, (arm, k) in zip(rows, plan, strict=True):
            if arm is not None and k > 0:
                per_drafter.setdefault(arm, {})[row.id] = k
        configs = {r.id: r.request.sampling for r in rows}
        randoms = {r.id: r.random for r in rows}
        index = {r.id: i for i, r in enumerate(rows)}
        blocks, counts, self._arm_of = [], [0] * len(rows), {}
        for arm, ks in per_drafter.items():
            block = self.drafters[self.names[arm]].draft(ks, configs, randoms)
            if block is None:
                continue
            blocks.append(block)
            for row, n in zip(block.rows, block.counts, strict=True):
                if n:
                    counts[index[row]], self._arm_of[row] = n, arm
        k = max(counts)
        if not k:
            return None, None, counts
        line = [0] * len(rows)  # each row's line in the blocks stacked below a line of pads
        first = 1
        for block in blocks:
            for j, (row, n) in enumerate(zip(block.rows, block.counts, strict=True)):
                if n:
                    line[index[row]] = first + j
            first += len(block.rows)
        order = mx.array(line)
        pads = [mx.zeros((1, k), mx.uint32)]
        tokens = mx.concatenate(pads + [_widen(b.tokens.astype(mx.uint32), k) for b in blocks])
        probs = None
        if any(b.probs is not None for b in blocks):
            dists = [_widen(_dists(b, self.vocab), k) for b in blocks]
            probs = mx.concatenate([mx.zeros((1, k, self.vocab))] + dists)[order]
        return tokens[order], probs, counts

    def _verify(self, rows, tokens, probs, logits, counts):
        num = mx.array(counts, mx.int32)
        if tokens is None:
            tokens = mx.zeros((len(rows), 0), mx.uint32)
        if all(r.request.sampling.greedy for r in rows):
            return greedy_batch_verify(logits, tokens, num)
        k, vocab = tokens.shape[1], logits.shape[-1]
        target = batch_probs(logits, [r.request.sampling for r in rows])  # [B, K + 1, V]
        # Each row draws as many uniforms as it has drafts: its stream never depends on the
        # other rows.
        u = mx.stack([row_uniforms(r.random, n, k) for r, n in zip(rows, counts, strict=True)])
        noise = gumbel([r.random for r in rows], (vocab,))
        return batch_verify(target, probs, tokens, num, u, noise)

    def _pace(self, rows: list[_Row], outcomes, seconds: float, turnover: bool) -> None:
        """Each row's ledger after a speculative step of `seconds` (`_Row.lag`): what plain
        steps at this batch size would have taken for the tokens it got, against the step's
        time (rows joining or leaving before it cost a plain step as much: not counted)."""
        plain = self.policy.costs.plain_seconds(len(rows))
        if turnover:
            seconds -= self.policy.costs.turnover_seconds(len(rows))
        for row, (_, accepted) in zip(rows, outcomes, strict=True):
            row.lag += seconds - (1 + accepted) * plain
            row.paced += (1 + accepted) * plain

    def _emit(
        self, row: _Row, emitted: list[int], drafted: int, accepted: int, hidden, tell=True
    ) -> int:
        """A row's step: its tokens through the cutter to its callback and, with `tell`, its
        drafters told (else: they have not joined yet, or a plain step's tokens wait for the
        row's next `_tell`); returns how many of `emitted` stay in the sequence."""
        if row.first_pending:  # a row that joined with its prompt's last token: its first step
            self._prefilled(row)
        chunks, finish, keep = row.cutter.round(Round(emitted, drafted, accepted, 0.0))
        keep = len(emitted) if keep is None else keep
        row.stats.observe_round(drafted, accepted, len(chunks), 0.0)
        arm = self._arm_of.get(row.id) if drafted else None
        row.stats.observe_choice(None if arm is None else self.names[arm], drafted)
        row.tokens += emitted[:keep]
        row.produced += len(chunks)
        if tell:
            kept = None if hidden is None else hidden[:keep]  # (one row per emitted token)
            self._told(row, emitted[:keep], drafted, min(accepted, keep - 1), arm, kept)
        for chunk in chunks:
            row.request.emit(chunk)
        if finish is not None or row.produced >= row.request.max_tokens:
            row.done = True
            row.stats.decode_seconds = time.perf_counter() - row.tic
            row.request.emit(row.cutter.final(finish or "length"))
        return keep

    def _tell(self, row: _Row) -> None:
        """Tell the row's drafters the tokens, and keep the features, of its plain steps since
        they were last told: one `accept` of them all, before anything reads the drafters'
        state of the row (its ask, a draft, a late join, its leaving). A plain step's host
        work per row and drafter, which a CPU's passes share, is then a reference kept (on
        a 2-core x86 at 8 rows, settling a run's steps of the group took 39.1 ms against
        plain decoding's 31.5 when every step told them, 29.2 against 27.4 told late;
        `benchmarks/README.md`, "Telling the drafters late, and the collector")."""
        if not row.untold:
            return
        hidden = self._untold_hidden(row.untold_features)
        self._told(row, row.tokens[len(row.tokens) - row.untold :], 0, 0, None, hidden)
        row.untold, row.untold_features = 0, []

    def _untold_hidden(self, parts: list[tuple[mx.array, int]]) -> mx.array | None:
        """`[T, W]`: a row's features of its untold plain steps (`parts`: each step's `[B, W]`
        features, the row's index in them). Rows told together (a closed batch's asks, rows
        that end at one step) share one stack of the steps' features, each taking its own
        row out of it, where a slice per step and row was evaluated on its own (8 clients of
        the MTP head on a 2-core x86: telling took 2.8-3.2 ms a run, then 1.2-1.3;
        `benchmarks/README.md`, "Rows told together, and a refill that waits")."""
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

    def _told(self, row: _Row, emitted: list[int], drafted: int, accepted: int, arm, hidden):
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

    def _columns(self, row: _Row, name: str, hidden: mx.array | None) -> mx.array | None:
        """The columns of a row's kept features that drafter `name` reads (None: it reads
        none)."""
        if hidden is None or not self.drafters[name].needs_hidden:
            return None
        if len(row.features) == 1:
            return hidden
        return hidden[..., self.features.columns(row.features, name)]

    # --- leaving -------------------------------------------------------------------------------

    def _remove(self, row: _Row, keep_cache: bool) -> None:
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


def token_bytes(model: nn.Module) -> int:
    """Cache bytes one token takes in `model`'s `BatchCache` (measured on a one-token pass)."""
    cache = BatchCache(model, 1)
    cache.begin([1])
    model(mx.zeros((1, 1), mx.uint32), cache=cache.layers)
    cache.end([1])
    return cache.bytes_per_token()


def _widen(a: mx.array, k: int) -> mx.array:
    """`[n, K_a, ...]` padded with zeros to `[n, k, ...]` along its second axis."""
    if a.shape[1] >= k:
        return a[:, :k]
    pad = mx.zeros((a.shape[0], k - a.shape[1], *a.shape[2:]), a.dtype)
    return mx.concatenate([a, pad], axis=1)


def _dists(block: DraftBlock, vocab: int) -> mx.array:
    """`[n, K, V]` distributions of a block's drafts (one-hot where it has none)."""
    if block.probs is not None:
        return block.probs[..., :vocab]
    return (mx.arange(vocab) == block.tokens[..., None]).astype(mx.float32)
