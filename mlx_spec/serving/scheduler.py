"""The server's engine thread: every MLX call of the server happens here.

Requests arrive as `Job`s. A job whose target and drafter can be batched becomes a row of the
`BatchEngine` (continuous batching: one target pass per step serves all its rows); any other
job (a target with recurrent layers, a drafter that reads the target's cache) runs as a solo
stream, advanced one round at a time between the batch's steps. Up to `max_concurrent` jobs
run at once; later ones wait first-in first-out (beyond `max_queued`: 429).

On a target sharded over several ranks, rank 0's engine shares each turn (the jobs it admits,
as `Job.spec`, and the ones cancelled) through a `Lockstep`; the other ranks' engines
(`follow=True`) rebuild those jobs with `build` and run the same turns, without clients.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mlx_spec.api import GenerationChunk
from mlx_spec.decoding.engine import BatchEngine, BatchRequest
from mlx_spec.decoding.ranks import abort, lost_peer
from mlx_spec.serving.session import PREFILLING

import mlx.core as mx


class QueueFull(Exception):
    """The engine's waiting line is full."""


class ShuttingDown(Exception):
    """The engine no longer takes jobs."""


@dataclass
class Job:
    """One request on the engine, and the asyncio queue its chunks go to.

    Either `open_stream` (a solo stream, opened on the engine thread) or `batch` (builds the
    request for the batch engine, given the callback that receives its chunks).
    """

    open_stream: Callable[[], Iterator[GenerationChunk]] | None
    loop: asyncio.AbstractEventLoop | None
    seed: int | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    stream: Iterator[GenerationChunk] | None = None
    # Called on the engine thread once the stream is closed, with the outcome.
    release: Callable[[str], None] | None = None
    batch: Callable[[Callable[[object], None]], BatchRequest] | None = None
    row: object = None  # the job's row in the batch engine
    finished: bool = False
    # Asked for by `Engine.cancel` at any time; it takes effect (`cancelled`) at a turn's start.
    cancel_requested: bool = False
    # What rebuilds the job on another rank (a sharded target's followers), and its number.
    spec: dict | None = None
    uid: int = -1
    delivered: bool = False  # a chunk of it was handed to the event loop

    def put(self, item) -> None:
        if self.loop is None:  # a follower's job: nobody reads it
            return
        held = getattr(_outbox, "items", None)
        if held is not None and self.delivered:  # a step's chunk: delivered when it ends
            held.append((self, item))
            return
        self.delivered = True  # the first chunk goes at once (the time to first token)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel_requested = True


CANCELLED = object()  # put on a job's queue when the engine drops it

# The chunks a step of the batch engine puts on its rows' queues, delivered together when the
# step ends: one wake-up of each event loop per step (a step of 8 rows put 8 chunks, each its
# own cross-thread call and self-pipe write), in order per queue. A job's first chunk and solo
# streams' chunks go at once: a joining row's first token is not held while its drafters take
# it in and the batch steps.
_outbox = threading.local()


def _deliver(items: list) -> None:
    for job, item in items:
        job.queue.put_nowait(item)


@contextmanager
def _held_chunks():
    """Hold the chunks `Job.put` is given on this thread until the block ends."""
    _outbox.items = held = []
    try:
        yield
    finally:
        _outbox.items = None
        by_loop: dict = {}
        for job, item in held:
            by_loop.setdefault(job.loop, []).append((job, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is gone (server shutting down)
                for job, _ in items:
                    job.cancel_requested = True


def _rng_seed() -> int:
    hi, lo = mx.random.state[0].tolist()
    return (hi << 32) | lo


class Engine:
    """The one thread that runs the model.

    Args:
        max_concurrent: jobs run at once (batch rows and solo streams together).
        max_queued: waiting jobs at most (more are refused with `QueueFull`).
        batch: the batch engine for batched jobs (None: every job is solo).
        lockstep: a sharded target's `Lockstep` (None: one process).
        build: on the ranks that follow rank 0: makes a job from its `spec`.
    """

    def __init__(
        self,
        max_concurrent: int = 8,
        max_queued: int = 256,
        batch=None,
        lockstep=None,
        build: Callable[[dict], Job] | None = None,
    ):
        if max_concurrent < 1 or max_queued < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queued >= 0")
        self.max_concurrent, self.max_queued = max_concurrent, max_queued
        self.batch: BatchEngine | None = batch
        self.lockstep, self.build = lockstep, build
        self.following = lockstep is not None and lockstep.rank != 0
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._closed = False
        self._next_uid = 0
        self.error: BaseException | None = None  # what stopped a follower's thread
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "peak_active": 0}
        run = self._follow if self.following else self._run
        self._thread = threading.Thread(target=run, name="mlx-spec-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queued:
                raise QueueFull("too many requests are waiting; retry later")
            job.uid, self._next_uid = self._next_uid, self._next_uid + 1
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client left): at the next turn its stream is closed and its caches
        dropped."""
        job.cancel_requested = True
        with self._cond:
            self._cond.notify()

    def status(self) -> dict:
        with self._cond:
            return {"active": len(self._active), "queued": len(self._waiting), **self.counts}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self._lead()
        except BaseException as exc:  # noqa: BLE001
            if self.lockstep is None:
                raise
            # A sharded target's collective failed (a rank is gone): nothing can run now.
            with self._cond:
                self._closed = True
                jobs = self._active + list(self._waiting)
            why = "a rank of the distributed run was lost" if lost_peer(exc) else repr(exc)
            for job in jobs:
                job.put(ShuttingDown(f"{why}; the server stops"))
            abort(f"{why}; the server stops", delay=1.0)  # time for the answers to leave

    def _lead(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._active or self._waiting):
                    self._cond.wait()
                if self._closed:
                    break
                admitted = []
                while self._waiting and len(self._active) < self.max_concurrent:
                    job = self._waiting.popleft()
                    if job.cancel_requested:
                        self.counts["cancelled"] += 1
                        job.put(CANCELLED)
                    else:
                        self._active.append(job)
                        admitted.append(job)
                peak = max(self.counts["peak_active"], len(self._active))
                self.counts["peak_active"] = peak
                cancelled = [j for j in self._active if j.cancel_requested and not j.cancelled]
                for job in cancelled:
                    job.cancelled = True
                turn = list(self._active)
            if self.lockstep is not None:
                self.lockstep.send(
                    {
                        "admit": [[job.uid, job.spec] for job in admitted],
                        "cancel": [job.uid for job in cancelled],
                    }
                )
            self._turn(turn)
        for job in self._active + list(self._waiting):
            self._finish(job, "cancelled")
        if self.lockstep is not None:
            self.lockstep.send({"close": True})

    def _follow(self) -> None:
        """A follower's loop: rank 0's turns, run here, until rank 0 closes its engine."""
        jobs: dict[int, Job] = {}
        try:
            while True:
                turn = self.lockstep.receive()
                if turn.get("close"):
                    break
                for uid, spec in turn.get("admit", []):
                    job = jobs[uid] = self.build(spec)
                    job.uid = uid
                    self._active.append(job)
                for uid in turn.get("cancel", []):
                    if uid in jobs:
                        jobs[uid].cancelled = True
                self._turn(list(self._active))
                for uid in [uid for uid, job in jobs.items() if job.finished]:
                    del jobs[uid]
        except BaseException as exc:  # noqa: BLE001 - reported by `wait`
            self.error = exc
        for job in list(self._active):
            self._finish(job, "cancelled")

    def wait(self) -> None:
        """A follower: block until rank 0 closes its engine; raise what stopped it early."""
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)
        if self.error is not None:
            raise self.error

    def _turn(self, turn: list[Job]) -> None:
        with _held_chunks():  # a step's chunks for all its rows, one wake-up per event loop
            self._batch_turn([job for job in turn if job.batch is not None])
        solo = [job for job in turn if job.batch is None]
        if solo and self.batch is not None and self.batch.threads is not None:
            self.batch.threads.reset()  # solo streams run on the library's own thread count
        for job in solo:
            self._step(job)

    # --- batched jobs ----------------------------------------------------------------------

    def _batch_turn(self, jobs: list[Job]) -> None:
        """Admit new batched jobs, drop cancelled ones, and run one step of the batch."""
        for job in jobs:
            if job.cancelled:
                if job.row is not None:
                    self.batch.cancel(job.row)
                self._finish(job, "cancelled")
            elif job.row is None:
                try:
                    job.row = self.batch.add(job.batch(self._emitter(job)))
                except Exception as exc:
                    job.put(exc)
                    self._finish(job, "failed")
        if self.batch is not None and self.batch.busy:
            try:
                self.batch.step()
            except Exception:  # the rows were told; the engine goes on
                pass

    def _emitter(self, job: Job) -> Callable[[object], None]:
        def emit(item) -> None:  # on the engine thread, from the batch engine
            if job.finished:
                return
            job.put(item)
            if isinstance(item, Exception):
                self._finish(job, "failed")
            elif item.token is None:
                self._finish(job, "completed")

        return emit

    # --- solo jobs ----------------------------------------------------------------------------

    def _step(self, job: Job) -> None:
        """Advance one solo job by one chunk (its first step also prefills)."""
        if job.cancelled:
            self._finish(job, "cancelled")
            return
        try:
            with self._own_rng(job):
                if job.stream is None:
                    job.stream = job.open_stream()
                chunk = next(job.stream)
        except Exception as exc:  # reported to the request; the engine goes on
            job.put(exc)
            self._finish(job, "failed")
            return
        if chunk is PREFILLING:  # a chunk of a long prompt: the other streams go on
            return
        job.put(chunk)
        if chunk.token is None:
            self._finish(job, "completed")

    def _finish(self, job: Job, outcome: str) -> None:
        if job.finished:
            return
        job.finished = True
        if job.stream is not None:
            try:
                job.stream.close()  # settles the rounds
            except Exception:  # a failure while settling: the caches are not reused
                outcome = "failed"
            job.stream = None
        if job.release is not None:
            job.release(outcome)
            job.release = None
        if outcome == "cancelled":
            job.put(CANCELLED)
        with self._cond:
            if job in self._active:
                self._active.remove(job)
                self.counts[outcome] += 1

    @staticmethod
    @contextmanager
    def _own_rng(job: Job):
        """A seeded solo job draws from its own random stream, whatever runs in between."""
        if job.seed is None:
            yield
            return
        shared = _rng_seed()
        mx.random.seed(job.seed)
        try:
            yield
        finally:
            job.seed = _rng_seed()
            mx.random.seed(shared)
