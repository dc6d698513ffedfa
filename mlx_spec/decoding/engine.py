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
   by the target passes: `Features`);
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

The engine's parts, one module each: `rows` (requests and rows), `admission` (cache memory),
`prefill` (joining), `drafter_joins`, `row_slots` (the cache's rows), `decode_step`,
`closed_batch`, `plain_steps`, `speculative_step`, `telling` (tokens to clients and drafters),
`leaving`; `features` (what drafters read of the target) and `step_trace` (where time goes).
"""

from __future__ import annotations

from mlx_spec.api import OutputCutter
from mlx_spec.caches.batch import BatchCache
from mlx_spec.core import clock
from mlx_spec.core.batch_verify import RowRandom
from mlx_spec.core.stats import SpecStats
from mlx_spec.decoding import distributed
from mlx_spec.decoding.admission import Admission, token_bytes
from mlx_spec.decoding.batch_policy import BatchDraftPolicy
from mlx_spec.decoding.closed_batch import HOLD_GROWTH, ClosedBatch
from mlx_spec.decoding.decode_step import DecodeStep
from mlx_spec.decoding.drafter_joins import IDLE_RESET, LATE_EVERY, DrafterJoins
from mlx_spec.decoding.features import Features
from mlx_spec.decoding.leaving import Leaving
from mlx_spec.decoding.plain_steps import Ahead, PlainSteps
from mlx_spec.decoding.prefill import Joining, Prefill
from mlx_spec.decoding.row_slots import RowSlots
from mlx_spec.decoding.rows import ALL, BatchRequest, Row
from mlx_spec.decoding.runner import context_limit
from mlx_spec.decoding.speculative_step import SpeculativeStep
from mlx_spec.decoding.step_trace import RowTrace, StepLog, StepTrace
from mlx_spec.decoding.telling import Telling
from mlx_spec.drafters.base import hidden_wanted
from mlx_spec.drafters.batch import BatchDrafter
from mlx_spec.platform.blas_threads import BlasThreads

import mlx.core as mx
import mlx.nn as nn

__all__ = [
    "ALL",
    "HOLD_GROWTH",
    "IDLE_RESET",
    "LATE_EVERY",
    "BatchEngine",
    "BatchRequest",
    "RowTrace",
    "StepLog",
    "StepTrace",
    "token_bytes",
]


class BatchEngine(
    Admission,
    Prefill,
    DrafterJoins,
    RowSlots,
    DecodeStep,
    ClosedBatch,
    PlainSteps,
    SpeculativeStep,
    Telling,
    Leaving,
):
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
            ledger (`Row.lag`) exceeds this share of the plain time of the tokens it got
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
        self.features = Features(model, drafters)
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
        self.active: list[Row] = []
        # Rows of `cache` whose rows left since the last decoding step (`_remove`), in order:
        # the next rows to join are written there (`_extend`); before a step, the rest go.
        # `active` lists the other rows of `cache`, in order.
        self._vacant: list[int] = []
        self._left = False  # a row left since the last decoding step
        # Rows joined or left since the last step observed: the next one runs what that
        # left queued (`BatchDraftPolicy.observe`'s `disturbed`).
        self._turnover = False
        self._hold: tuple[list[int], int] | None = None  # (rows, steps): `_closed_choice`
        self._stacked: tuple[list, mx.array] | None = None  # `_untold_hidden`
        self._no_plan = 0  # the full batch's plain steps since its last plan (`_shed`)
        self._shed_ids: list[int] | None = None  # the rows shed last (`_shed`)
        self.waiting: list[Row] = []
        self._next_id = 0
        self._ahead: Ahead | None = None  # a plain step queued ahead of the one being read
        self._joining: Joining | None = None  # requests being prefilled together
        self._last_settle = clock.now()
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

    def add(self, request: BatchRequest) -> Row:
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
        row = Row(
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

    def cancel(self, row: Row) -> None:
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
        tic = clock.now()
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
        self._prefill_spent += clock.now() - tic  # not charged to the decoding steps
        if self.active:
            try:
                self._decode()
            except Exception as exc:  # the batch's state is unknown: every active row fails
                self._fail_batch(exc)
                raise
