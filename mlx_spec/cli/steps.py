"""`mlx-spec steps`: a summary of a server's step trace (serve --trace-steps FILE)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from mlx_spec.bench import step_timeline

    p = sub.add_parser(
        "steps",
        help="summarise a server's step trace (serve --trace-steps FILE)",
        description=step_timeline.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    step_timeline.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from mlx_spec.bench import step_timeline

    return step_timeline.run(args)
