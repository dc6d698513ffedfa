"""A server built and its engine started: on rank 0 to answer, on the other ranks to follow."""

from __future__ import annotations

import functools
import os

from mlx_spec.caches.batch import batchable
from mlx_spec.caches.prompt_cache import RowCache
from mlx_spec.core.compat import scored_vocab
from mlx_spec.decoding import distributed
from mlx_spec.decoding.engine import ALL, BatchEngine, StepLog
from mlx_spec.serving.config import ServerConfig
from mlx_spec.serving.factories import check_sharded_drafters, ngram_factory
from mlx_spec.serving.jobs import Server
from mlx_spec.serving.scheduler import Engine

import mlx.core as mx
import mlx.nn as nn


def build_server(model, tokenizer, config: ServerConfig, drafters, follow: bool = False) -> Server:
    """The server's state and its engine (started). On a sharded target rank 0's engine shares
    its turns and the other ranks' engines (`follow`) replay them; every rank builds the same
    engine in the same order, since building it runs the target (collectives included)."""
    drafters = {"ngram": ngram_factory(), **(drafters or {})}
    if config.default_drafter is not None and config.default_drafter not in drafters:
        raise ValueError(f"default drafter {config.default_drafter!r} is not offered")
    check_sharded_drafters(model, drafters)
    batch = batch_engine(model, tokenizer, config, drafters)
    sharding = distributed.sharding_of(model)
    lockstep = None if sharding is None else distributed.Lockstep(sharding)
    servers: list[Server] = []  # the follower's engine builds jobs with the server below
    engine = Engine(
        config.max_concurrent,
        config.max_queued,
        batch,
        lockstep=lockstep,
        build=(lambda spec: servers[0].job(spec, None)) if follow else None,
    )
    server = Server(model, tokenizer, config, drafters, engine)
    if sharding is not None:  # the prompt caches keep and evict alike on every rank
        agree_on_caches(server, functools.partial(distributed.agreed_bytes, sharding.group))
    servers.append(server)
    return server


def agree_on_caches(server: Server, agree) -> None:
    """Have the server's prompt caches (the solo streams' and the batch rows') evict as
    `agree` says, alike on every rank."""
    server.prompt_cache.agree = agree
    batch = server.engine.batch
    if batch is not None and batch.row_cache is not None:
        batch.row_cache.agree = agree


def follow(model, tokenizer, config: ServerConfig, drafters=None) -> None:
    """A rank other than 0 of a sharded target: run rank 0's server turns until it stops."""
    build_server(model, tokenizer, config, drafters, follow=True).engine.wait()


def batch_engine(
    model: nn.Module, tokenizer, config: ServerConfig, drafters: dict
) -> BatchEngine | None:
    """The continuous-batching engine for the target and the drafters that can be batched, or
    None when the target cannot be (recurrent layers) or batching is off."""
    if not config.batching or not batchable(model):
        return None
    batched = {
        name: factory.batch()
        for name, factory in drafters.items()
        if name != ALL and getattr(factory, "batch", None) is not None
    }
    engine = BatchEngine(
        model,
        tokenizer,
        scored_vocab(model, tokenizer),
        batched,
        max_batch=config.max_concurrent,
        max_draft=config.max_draft,
        prefill_step=config.prefill_step,
        row_cache=RowCache(config.prompt_cache_bytes, config.prompt_cache_entries),
        max_kv_bytes=config.max_kv_bytes or int(0.4 * device_memory()),
        pace_slack=config.pace_slack,
    )
    if config.trace_steps:
        engine.trace = StepLog(config.trace_steps)
    return engine


def device_memory() -> int:
    """Bytes of memory the default device has (the machine's RAM for the CPU)."""
    try:
        info = mx.device_info()
        if info.get("memory_size"):
            return int(info["memory_size"])
    except (AttributeError, RuntimeError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
