"""`mlx-spec chat`: a streaming conversation, the prompt cache reused across turns."""

from __future__ import annotations

import sys

from mlx_spec.cli.common import (
    DEFAULT_ASSISTANT,
    add_drafter_flags,
    add_sampling_flags,
    add_shard_flag,
    load_target,
    make_drafter,
    model_defaults,
)
from mlx_spec.platform import blas


def add_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model, speculatively, reusing the prompt cache across turns",
        description="A streaming conversation using the model's chat template (or a plain "
        "User:/Assistant: transcript). Each turn prefills only the new tokens: the caches of "
        "target and drafter carry over. Reads lines from standard input; /stats, /reset, "
        "/help, /quit. Ctrl-C stops a reply, not the conversation.",
    )
    p.add_argument(
        "--model",
        help="target: MLX model directory or hub id (default: the embedded demo pair, with its "
        "three drafters chosen between every round)",
    )
    add_drafter_flags(p)
    add_shard_flag(p)
    add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per reply (default 512)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mlx_spec.serving.chat import Chat, input_lines
    from mlx_spec.serving.session import Session

    blas.warn_if_slow()
    model_defaults(args, default=DEFAULT_ASSISTANT)
    model, tokenizer = load_target(args)
    session = Session(
        model,
        tokenizer,
        drafter=make_drafter(args, model),
        num_draft=args.num_draft,
        max_draft=args.max_draft,
    )
    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    if args.seed is not None:
        import mlx.core as mx

        mx.random.seed(args.seed)
    chat = Chat(session, system=args.system, max_tokens=args.max_tokens, sampling=sampling)
    chat.check_settings()
    lines = input_lines(sys.stdin)
    if getattr(args, "group", None) is not None:  # rank 0 reads; every rank gets its lines
        from mlx_spec.decoding.distributed import shared_lines

        lines = shared_lines(args.group, lines)
    return chat.run(lines)
