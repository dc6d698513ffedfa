"""`mlx-spec generate`: one prompt, speculatively when a drafter is given."""

from __future__ import annotations

import json
import sys

import mlx_spec
from mlx_spec.cli.common import (
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
        "generate",
        help="generate text, speculatively when a drafter is given",
        description="Generate from a target model. With --draft-model or --ngram the output is "
        "distributed exactly as plain sampling from the target, only faster.",
    )
    p.add_argument(
        "--model",
        help="target: MLX model directory or hub id (default: the embedded demo pair with "
        "--compare on, offering n-gram lookup, its draft model and its MTP head: each round "
        "drafts with the one measured fastest so far)",
    )
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    add_drafter_flags(p)
    add_shard_flag(p)
    _add_tree_flags(p)
    add_sampling_flags(p)
    _add_request_flags(p)
    p.set_defaults(func=run)


def _add_tree_flags(p) -> None:
    """Medusa, lookahead decoding and drafting trees."""
    p.add_argument(
        "--medusa",
        nargs="?",
        const="",
        metavar="DIR",
        help="Medusa heads (default: MODEL/medusa): each round the target verifies a tree of "
        "their guesses in one pass; --num-draft is the tree's depth (auto: one level per head)",
    )
    p.add_argument(
        "--lookahead",
        action="store_true",
        help="lookahead decoding, no drafter: each pass also runs Jacobi iterations over a "
        "window of guesses and verifies the n-grams they left that continue the text",
    )
    p.add_argument("--window", type=int, default=4, help="--lookahead: window W (default 4)")
    p.add_argument(
        "--ngram-size", type=int, default=3, help="--lookahead: n-gram size N (default 3)"
    )
    p.add_argument(
        "--candidates", type=int, default=4, help="--lookahead: n-grams verified G (default 4)"
    )
    p.add_argument(
        "--branches",
        type=int,
        metavar="B",
        help="with --draft-model, --mtp or --eagle: draft a tree, the drafter's B best first "
        "tokens each continued greedily, verified in one target pass",
    )
    p.add_argument(
        "--dynamic-tree",
        action="store_true",
        help="with --branches B: EAGLE-2's dynamic tree instead: the B likeliest paths so far "
        "grow B children each, level by level, and the B x depth likeliest are verified",
    )
    p.add_argument(
        "--tree-size",
        type=int,
        metavar="N",
        help="with --medusa: nodes per tree at most (default: two per level)",
    )


def _add_request_flags(p) -> None:
    """Length, seed, stop strings, the chat template and the output."""
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the prompt as it is (default: as the user's message in the model's chat "
        "template, when it has one, as mlx_lm.generate does)",
    )
    p.add_argument("--system", help="a system message before the prompt (with the template)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also decode plainly and report the speedup (on by default without --model)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, tokens and stats instead of streaming",
    )


def run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    blas.warn_if_slow()
    model_defaults(args)
    model, tokenizer = load_target(args)
    if not args.ignore_chat_template:
        prompt = _chat_prompt(tokenizer, prompt, args.system)
    drafter = make_drafter(args, model)
    stream = mlx_spec.stream_generate(
        model,
        tokenizer,
        prompt,
        drafter=drafter,
        num_draft=args.num_draft,
        max_draft=args.max_draft,
        **_request(args),
    )
    pieces, tokens, last = _consume(stream, args.json)
    stats = last.stats.to_dict()
    if args.compare and drafter is not None:
        stats["speedup"] = _speedup(args, model, tokenizer, prompt, stats)
    if args.json:
        record = {
            "text": "".join(pieces),
            "tokens": tokens,
            "finish_reason": last.finish_reason,
            "stats": stats,
        }
        print(json.dumps(record))
    else:
        print()
        print(_summary(stats, last.stats.choices_line()), file=sys.stderr)
    return 0


def _request(args) -> dict:
    """The sampling and stopping settings of `args`, as `generate`'s keyword arguments."""
    return dict(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _consume(stream, keep: bool):
    """Print the stream's text as it comes (or keep it, when `keep`); returns the pieces
    kept, the tokens and the last chunk."""
    pieces, tokens, last = [], [], None
    for chunk in stream:
        if keep:
            pieces.append(chunk.text)
        else:
            print(chunk.text, end="", flush=True)
        if chunk.token is not None:
            tokens.append(chunk.token)
        last = chunk
    return pieces, tokens, last


def _chat_prompt(tokenizer, prompt: str, system: str | None) -> str:
    """`prompt` as the user's message in the model's chat template (as mlx_lm.generate does),
    after `system` if given; as it is when the tokenizer has no template."""
    from mlx_spec.serving.chat import chat_prompt, has_chat_template

    if not has_chat_template(tokenizer):
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    return chat_prompt(tokenizer, [*messages, {"role": "user", "content": prompt}])


def _speedup(args, model, tokenizer, prompt, stats: dict) -> float:
    """Decode tokens/s of this run over plain decoding of the same request, measured now."""
    plain = mlx_spec.generate(model, tokenizer, prompt, **_request(args)).stats
    rate = plain.decode_tokens_per_sec
    return stats["decode_tokens_per_sec"] / rate if rate else 0.0


def _summary(stats: dict, choices: str) -> str:
    line = (
        f"[{stats['generated_tokens']} tokens, {stats['decode_tokens_per_sec']:.1f} tok/s, "
        f"prefill {stats['prefill_tokens_per_sec']:.1f} tok/s"
    )
    if stats["drafter"] != "none":
        line += (
            f", drafter {stats['drafter']} k={stats['num_draft']}, acceptance "
            f"{stats['acceptance_rate']:.2f}, mean accepted length "
            f"{stats['mean_accepted_length']:.2f}"
        )
        if stats["num_draft"] == "auto":
            line += f"; {choices}"
    if "speedup" in stats:
        line += f", speedup {stats['speedup']:.2f}x over plain decoding"
    if stats.get("world_size", 1) > 1:
        line += (
            f"; {stats['world_size']} ranks, communication ~"
            f"{stats['comm_seconds_per_pass'] * 1e3:.2f} ms per target pass"
        )
    return line + "]"
