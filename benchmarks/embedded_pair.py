"""Acceptance and speedup of each drafter of the embedded pair on held-out standard-library files.

A thin wrapper of `mlx-spec bench` (see `mlx_spec/bench.py` for how every number is measured):
with no model flags it runs the embedded pair; any other `mlx-spec bench` option passes through.

    python benchmarks/embedded_pair.py --json benchmarks/results/embedded_pair.json
    python benchmarks/embedded_pair.py --quick
"""

from __future__ import annotations

import sys

from mlx_spec import cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
