"""`ServerConfig`: the limits and defaults of a server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    """Limits and defaults of a server.

    Attributes:
        model_id: the name clients use in `model` (the model directory's name by default).
        api_key: if set, `/v1/*` needs `Authorization: Bearer <key>`.
        max_tokens_limit: the largest `max_tokens` accepted (also the default).
        max_request_bytes: the largest request body accepted.
        max_concurrent: generations advanced together.
        max_queued: requests waiting at most.
        default_drafter: drafter used when a request does not say (None: plain decoding).
        num_draft: "auto" or draft tokens per round, unless a request says otherwise.
        max_draft: the longest draft "auto" considers.
        prompt_cache_bytes: the most bytes the caches of finished requests may keep for reuse
            by later requests sharing a prefix (0: no prompt cache).
        prompt_cache_entries: the most finished requests' caches kept.
        prefill_step: prompts are prefilled in chunks of this many tokens, each followed by a
            step of every other active stream.
        batching: run requests as rows of one continuously batched engine where the target
            and the drafter allow (else each request is a solo stream, advanced in turn).
        max_kv_bytes: cache memory the batch's rows may reserve (prompt + max_tokens each);
            more requests wait, and one that alone needs more is refused. None: 40% of the
            device's memory.
        pace_slack: how far behind plain decoding's pace speculation inside the batch may put
            a request, as a share of its decoding time (`BatchEngine`); None (the default):
            the batch's throughput alone decides.
        trace_steps: a file the batch engine appends each step's trace to, one JSON line a
            step (`StepLog`: rows, drafts, drafters, where its time went, the policy's reason;
            `mlx-spec steps FILE` summarises it). None: no trace.
        ui: serve the chat page at `/`.
    """

    model_id: str = "model"
    api_key: str | None = None
    max_tokens_limit: int = 4096
    max_request_bytes: int = 1 << 20
    max_concurrent: int = 8
    max_queued: int = 256
    default_drafter: str | None = None
    num_draft: int | str = "auto"
    max_draft: int = 8
    prompt_cache_bytes: int = 2 << 30
    prompt_cache_entries: int = 32
    prefill_step: int = 256
    batching: bool = True
    max_kv_bytes: int | None = None
    pace_slack: float | None = None
    trace_steps: str | None = None
    ui: bool = True
