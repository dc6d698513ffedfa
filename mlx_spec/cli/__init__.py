"""The `mlx-spec` command line (argparse lives here and nowhere else)."""

from __future__ import annotations

import argparse
import sys

from mlx_spec.cli import bench, chat, convert, distill, generate, info, serve, steps

EPILOG = """examples:
  mlx-spec generate --model ./target --draft-model ./draft --prompt "def parse_args(argv):"
  mlx-spec generate --model ./target --ngram --temp 1.0 --seed 0 --prompt "..." --json
  mlx-spec convert --hf-path Qwen/Qwen3-0.6B --mlx-path ./qwen3-0.6b
  mlx-spec bench --quick --json bench.json
  mlx-spec chat --model ./target --ngram --system "Be brief."
  mlx-spec serve --model ./target --draft-model ./draft --port 8080
  mlx-spec info
"""

COMMANDS = (generate, convert, distill, bench, chat, serve, steps, info)  # in --help's order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-spec",
        description="Lossless speculative decoding on MLX.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mlx_spec.decoding import ranks

    args = build_parser().parse_args(argv)
    _quiet_third_parties()
    args.group = None
    code = _main(args)
    if args.group is not None:  # a launched rank: out without tearing the group down
        ranks.leave(code)
    return code


def _quiet_third_parties() -> None:
    """The command prints its own output only: transformers' notices (long-text tokenizer
    warnings, deprecated config keys) are not about anything the user did."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers comes with mlx-lm
        return
    hf_logging.set_verbosity_error()


def _main(args) -> int:
    from mlx_spec.decoding import distributed, ranks

    try:
        if args.command not in ("info", "steps"):
            args.group = distributed.world()
        ranks.quiet_other_ranks(args.group)
        if args.group is not None:
            ranks.stop_on_signal()
            ranks.watch_for_lost_ranks(args.group.rank())
            if args.command in ("convert", "distill"):
                raise ValueError(f"{args.command} runs on one machine: start it without mlx.launch")
        return args.func(args)
    except distributed.DistributedError as exc:
        _error(args, exc)
        return 1
    except RuntimeError as exc:
        if not ranks.lost_peer(exc):
            raise
        _error(args, f"a rank of the distributed run was lost ({exc})")
        return 1
    except KeyboardInterrupt:
        print("\nmlx-spec: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, OSError) as exc:
        _error(args, exc)
        return 2


def _error(args, message) -> None:
    """One line on standard error; in a distributed run it names the rank, and the other
    ranks' errors reach the terminal though the rest of their output does not."""
    group = getattr(args, "group", None)
    if group is None:
        print(f"mlx-spec: error: {message}", file=sys.stderr)
        return
    stream = sys.stderr if group.rank() == 0 else sys.__stderr__
    print(f"mlx-spec: error: rank {group.rank()}: {message}", file=stream, flush=True)


if __name__ == "__main__":
    sys.exit(main())
