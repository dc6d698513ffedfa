"""`mlx-spec serve`: an OpenAI-compatible API with speculative decoding."""

from __future__ import annotations

import argparse
import gc
import os
import sys

from mlx_spec.cli.common import (
    DEFAULT_ASSISTANT,
    add_drafter_flags,
    add_shard_flag,
    load_target,
    model_defaults,
)
from mlx_spec.platform import blas


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API (chat/completions, completions, models)",
        description="An OpenAI-compatible HTTP server with speculative decoding: "
        "/v1/chat/completions, /v1/completions (streaming or not), /v1/models, /health. "
        "Requests choose speculation with the extra field "
        '"speculative": {"enabled": true, "drafter": "ngram", "num_draft": 4}; '
        "usage.speculative reports acceptance and speed. A chat page that shows how each "
        "token came is served at / (--no-ui: none). Under mlx.launch the target is "
        "split over the ranks (--shard); rank 0 answers HTTP and the others follow its "
        "batches.",
    )
    p.add_argument(
        "--model",
        help="target: MLX model directory or hub id (default: the embedded demo pair; requests "
        "draft with all its drafters, chosen between every round, unless they say otherwise)",
    )
    add_drafter_flags(p)
    _add_http_flags(p)
    _add_memory_flags(p)
    _add_engine_flags(p)
    add_shard_flag(p)
    p.set_defaults(func=run)


def _add_http_flags(p) -> None:
    """The address, the key and the limits of a request."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLX_SPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $MLX_SPEC_API_KEY, else none)",
    )
    p.add_argument("--model-id", help="the model name clients send (default: the directory name)")
    p.add_argument(
        "--max-tokens-limit", type=int, default=4096, help="largest max_tokens (default 4096)"
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="largest body (default 1 MiB)"
    )
    p.add_argument(
        "--max-concurrent", type=int, default=8, help="generations advanced together (default 8)"
    )
    p.add_argument(
        "--max-queued", type=int, default=256, help="requests waiting at most (default 256)"
    )
    p.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the chat page at / (the API alone)",
    )


def _add_memory_flags(p) -> None:
    """The prompt cache and the batch's cache memory."""
    p.add_argument(
        "--prompt-cache-bytes",
        type=_byte_count,
        default=2 << 30,
        metavar="BYTES",
        help="memory for the caches of finished requests, reused by later requests that share "
        "their prefix (a conversation's next turn prefills only its new tokens); K/M/G "
        "suffixes, 0 turns the prompt cache off (default 2G)",
    )
    p.add_argument(
        "--max-kv-bytes",
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="cache memory the batched requests may reserve (prompt + max_tokens each): more "
        "requests wait, one that alone needs more is refused; K/M/G suffixes (default: 40%% "
        "of the device's memory)",
    )


def _add_engine_flags(p) -> None:
    """How the batch engine advances its requests, and its step trace."""
    p.add_argument(
        "--pace-slack",
        type=_pace_slack,
        default=None,
        metavar="SHARE",
        help="how far behind plain decoding's pace speculation inside a batch may put a "
        "request, as a share of its decoding time, e.g. 0.02: a request whose drafts fail is "
        "not slowed further for the batch's sake once that far behind, at some cost to the "
        "batch's throughput (default: off, the batch's throughput alone decides)",
    )
    p.add_argument(
        "--trace-steps",
        metavar="FILE",
        help="append each step of the batch engine to FILE as a JSON line (rows, drafts, the "
        "drafters, where its milliseconds went, the policy's reason): why speculation pays "
        "or not under your load; `mlx-spec steps FILE` summarises it",
    )
    p.add_argument(
        "--no-batching",
        action="store_true",
        help="advance requests one after another in turn instead of batching them",
    )
    p.add_argument(
        "--prefill-step",
        type=int,
        default=256,
        metavar="N",
        help="prefill prompts N tokens at a time, letting the other streams take a step "
        "between chunks (default 256)",
    )
    p.add_argument(
        "--prompt-cache-entries",
        type=int,
        default=32,
        metavar="N",
        help="finished requests' caches kept at most (default 32)",
    )


def _byte_count(text: str) -> int:
    from mlx_spec.caches.prompt_cache import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pace_slack(text: str) -> float | None:
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1) or 'off', got {text!r}")
    return value


def trace_file(path: str | None, no_batching: bool) -> str | None:
    """`--trace-steps`: a file the server can append to (checked before the model loads)."""
    if path is None:
        return None
    if no_batching:
        raise ValueError("--trace-steps traces the batch engine's steps: drop --no-batching")
    try:
        open(path, "a").close()
    except OSError as exc:
        raise ValueError(f"--trace-steps: cannot write {path}: {exc.strerror}") from None
    return path


def freeze_loaded() -> None:
    """Keep what a long-running command has loaded (the model, the libraries: some 240,000
    objects) out of the garbage collector's full passes: each of them would otherwise scan
    it all, 60-100 ms on a 2-core x86 in which the engine holds every stream."""
    gc.collect()
    gc.freeze()


def run(args) -> int:
    from mlx_spec.serving.server import create_app, drafter_factories, follow

    import uvicorn

    group = getattr(args, "group", None)
    for name in ("max_tokens_limit", "max_request_bytes", "max_concurrent", "port", "prefill_step"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    trace_steps = trace_file(args.trace_steps, args.no_batching)
    blas.warn_if_slow()
    named_model = args.model or DEFAULT_ASSISTANT
    model_defaults(args, default=DEFAULT_ASSISTANT)
    model, tokenizer = load_target(args)
    mtp = None if args.mtp is None else (args.mtp or args.model)
    drafters = drafter_factories(
        model, tokenizer, draft_model=args.draft_model, mtp=mtp, assistant=args.assistant,
        eagle=args.eagle, dflash=args.dflash,
    )  # fmt: skip
    config = _config(args, named_model, _default_drafter(args, mtp), trace_steps)
    if group is not None and group.rank() != 0:  # rank 0 answers; this rank runs its turns
        freeze_loaded()
        follow(model, tokenizer, config, drafters)
        return 0
    app = create_app(model, tokenizer, config, drafters)
    freeze_loaded()
    _announce(args, config, drafters)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _default_drafter(args, mtp: str | None) -> str | None:
    """The drafter a request that names none gets: the one flagged, 'all' for several."""
    flags = [("draft-model", args.draft_model), ("ngram", args.ngram), ("mtp", mtp),
             ("gemma4-assistant", args.assistant), ("eagle3", args.eagle),
             ("dflash", args.dflash)]  # fmt: skip
    named = [name for name, flag in flags if flag]
    return "all" if len(named) > 1 else (named[0] if named else None)


def _config(args, named_model: str, default: str | None, trace_steps: str | None):
    """The server's settings from the flags."""
    from mlx_spec.serving.server import ServerConfig

    return ServerConfig(
        model_id=args.model_id or os.path.basename(os.path.normpath(named_model)),
        api_key=args.api_key,
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        max_concurrent=args.max_concurrent,
        max_queued=args.max_queued,
        default_drafter=default,
        num_draft=args.num_draft,
        max_draft=args.max_draft,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_entries=max(args.prompt_cache_entries, 0),
        prefill_step=args.prefill_step,
        batching=not args.no_batching,
        max_kv_bytes=args.max_kv_bytes or None,
        pace_slack=args.pace_slack,
        trace_steps=trace_steps,
        ui=not args.no_ui,
    )


def _announce(args, config, drafters: dict) -> None:
    """Where it serves, with what (and a warning when anyone who reaches it may use it)."""
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(
            f"mlx-spec: warning: serving on {args.host} without --api-key: anyone who can "
            "reach this address can use the model",
            file=sys.stderr,
        )
    default = config.default_drafter or "none"
    print(
        f"mlx-spec: serving {config.model_id!r} at http://{args.host}:{args.port}/v1 "
        f"(drafters: {', '.join(sorted(drafters))}; default: {default})",
        file=sys.stderr,
        flush=True,
    )
    if config.ui:
        print(f"mlx-spec: chat page at http://{args.host}:{args.port}/", file=sys.stderr)
