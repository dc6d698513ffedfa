"""`Server`: plans run as jobs of the engine thread, and their output read back as it comes."""

from __future__ import annotations

import asyncio
import os

from mlx_spec.api import GenerationChunk
from mlx_spec.caches.prompt_cache import PromptCache
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.engine import ALL, BatchRequest
from mlx_spec.serving.config import ServerConfig
from mlx_spec.serving.errors import APIError
from mlx_spec.serving.planning import Plan
from mlx_spec.serving.scheduler import CANCELLED, Engine, Job, QueueFull, ShuttingDown
from mlx_spec.serving.session import Session

from fastapi import Request


class Server:
    """The target, the drafters offered and the engine that runs the requests' jobs."""

    def __init__(self, model, tokenizer, config: ServerConfig, drafters, engine: Engine):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.drafters, self.engine = drafters, engine
        # Used on the engine thread only.
        self.prompt_cache = PromptCache(config.prompt_cache_bytes, config.prompt_cache_entries)

    async def start(
        self,
        plan: Plan,
        temperature: float,
        top_p: float,
        seed,
        request: Request,
        top_k: int = 0,
        min_p: float = 0.0,
    ):
        """Queue the plan on the engine: (job, its first chunk, the task that cancels the job
        when the client disconnects). The first chunk comes after the prefill."""
        if seed is None and self.engine.lockstep is not None:  # the ranks must draw alike
            seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        spec = {
            "ids": plan.ids,
            "max_tokens": plan.max_tokens,
            "stops": list(plan.stops),
            "drafter": plan.drafter_name,
            "num_draft": plan.num_draft,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "seed": seed,
        }
        job = self.job(spec, asyncio.get_running_loop())
        self._submit(job)
        watcher = asyncio.create_task(self._watch(request, job))
        try:
            first = await self.next_chunk(job)
        except BaseException:
            watcher.cancel()
            self.engine.cancel(job)
            raise
        return job, first, watcher

    def _submit(self, job: Job) -> None:
        """Queue the job, or answer why the engine cannot take it (429, 503)."""
        try:
            self.engine.submit(job)
        except QueueFull as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), code="shutting_down") from None

    def job(self, spec: dict, loop) -> Job:
        """The engine job for a request's `spec` (a JSON-able dict: every rank of a sharded
        target builds the same job from it); `loop`: where its chunks go (None: nowhere)."""
        if self._batched(spec["drafter"]):
            return self._batch_job(spec, loop)
        return self._stream_job(spec, loop)

    def _batch_job(self, spec: dict, loop) -> Job:
        """A job run as a row of the batch engine."""
        seed, name = spec["seed"], spec["drafter"]
        sampling = SamplingConfig(
            temperature=spec["temperature"],
            top_k=spec["top_k"],
            top_p=spec["top_p"],
            min_p=spec["min_p"],
        )

        def batch_request(emit) -> BatchRequest:  # on the engine thread
            return BatchRequest(
                spec["ids"],
                sampling,
                spec["max_tokens"],
                emit,
                stop=tuple(spec["stops"]),
                drafter=name,
                num_draft=spec["num_draft"],
                seed=seed,
            )

        return Job(None, loop, seed=seed, batch=batch_request, spec=spec)

    def _stream_job(self, spec: dict, loop) -> Job:
        """A job run as a solo stream over a session the prompt cache lends (and takes back
        unless the job failed)."""
        name = spec["drafter"]
        taken: list[Session] = []

        def open_stream():  # on the engine thread
            session = self.prompt_cache.take(name, spec["ids"], lambda: self._session(name, spec))
            taken.append(session)
            return session.stream(
                spec["ids"],
                num_draft=spec["num_draft"],
                max_draft=self.config.max_draft,
                temperature=spec["temperature"],
                top_p=spec["top_p"],
                top_k=spec["top_k"],
                min_p=spec["min_p"],
                max_tokens=spec["max_tokens"],
                stop=tuple(spec["stops"]),
                prefill_step=self.config.prefill_step,
            )

        def release(outcome: str) -> None:  # on the engine thread, after the stream closed
            if taken and outcome != "failed":
                self.prompt_cache.put(name, taken[0])

        return Job(open_stream, loop, seed=spec["seed"], release=release, spec=spec)

    def _session(self, name: str | None, spec: dict) -> Session:
        """A fresh session (caches and drafter state) for the drafter `name`."""
        make = None if name is None else self.drafters[name]
        return Session(
            self.model,
            self.tokenizer,
            drafter=None if make is None else make(),
            num_draft=spec["num_draft"],
            max_draft=self.config.max_draft,
            check=False,  # the factories checked the drafters' weights once
        )

    def _batched(self, name: str | None) -> bool:
        """Whether requests drafting with `name` run as rows of the batch engine (its drafter
        can be batched)."""
        batch = self.engine.batch
        return batch is not None and (name is None or name == ALL or name in batch.drafters)

    async def _watch(self, request: Request, job: Job) -> None:
        """Cancel the job as soon as its client disconnects."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the connection failed in some other way: the client is gone too
            pass
        self.engine.cancel(job)

    async def next_chunk(self, job: Job) -> GenerationChunk:
        """The job's next chunk; raises its error, or APIError(499) if it was cancelled."""
        return self._chunk(await job.queue.get())

    @staticmethod
    def _chunk(item) -> GenerationChunk:
        """A queue's item as a chunk, or its error raised as an `APIError`."""
        if item is CANCELLED:
            raise APIError(499, "the client closed the request", code="client_closed")
        if isinstance(item, ValueError):
            raise APIError(400, str(item))
        if isinstance(item, ShuttingDown):
            raise APIError(503, str(item), code="shutting_down")
        if isinstance(item, Exception):
            raise APIError(500, f"generation failed: {type(item).__name__}: {item}")
        return item

    async def output(self, job: Job, chunk: GenerationChunk, splitter, traced: list | None = None):
        """The job's output as content strings and `ToolCall`s, in order, then its last chunk
        (finish reason and stats). The tokens already waiting behind a chunk go out with it
        as one piece: a speculative step's accepted tokens, or whatever piled up while the
        event loop served other streams, cost one event each time, not one per token (each
        event is a few hundred microseconds of this thread's Python, taken from the engine's
        thread on a GPU whose step of a small model is a few milliseconds). `traced` (if
        given) gets each token chunk before the piece that holds its text."""
        while chunk.token is not None:
            text, ahead = self._waiting(job, chunk, traced)
            for item in splitter.feed(text):
                yield item
            chunk = await self.next_chunk(job) if ahead is None else self._chunk(ahead)
        for item in splitter.feed(chunk.text) + splitter.finish():
            yield item
        yield chunk

    @staticmethod
    def _waiting(job: Job, chunk: GenerationChunk, traced: list | None):
        """The token chunk's text with that of the token chunks queued behind it (each added
        to `traced`, if given), and the queued item that ended them (the last chunk, or an
        error; None: the queue ran dry)."""
        pieces, ahead = [chunk.text], None
        if traced is not None:
            traced.append(chunk)
        while ahead is None and not job.queue.empty():
            item = job.queue.get_nowait()
            if isinstance(item, GenerationChunk) and item.token is not None:
                pieces.append(item.text)
                if traced is not None:
                    traced.append(item)
            else:  # the last chunk, or an error: after the text before it
                ahead = item
        return "".join(pieces), ahead
