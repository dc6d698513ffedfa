"""The time of a small all-sum after a pass's larger ones, by size, on 2 ranks over loopback.

A tensor-parallel pass of the embedded target runs 17 all-sums of 1536 floats; a decision
shared after it (a token, an accepted count) is a few integers. This measures 17 large
all-sums followed by one all-sum of n int32 elements, evaluated together, for several n: the
one-element case is the slow one, which is why `Sync.share` pads to `MIN_SHARED` elements.

    python benchmarks/collectives.py            # ms per pass-like chain, fastest of 5 runs
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_spec  # noqa: F401 - first: loads the optimized BLAS before mlx

import mlx.core as mx

SIZES = (1, 2, 4, 8, 64, 512, 1536)


def chain(group, small: int, rounds: int = 100, large: int = 1536, per_pass: int = 17) -> float:
    """Seconds per pass-like chain: `per_pass` all-sums of `large` floats, then one of
    `small` int32 elements depending on them, evaluated."""
    x, y = mx.ones((large,)), mx.ones((small,), mx.int32)
    mx.eval(mx.distributed.all_sum(x, group=group), mx.distributed.all_sum(y, group=group))
    tic = time.perf_counter()
    for _ in range(rounds):
        for _ in range(per_pass):
            x = mx.distributed.all_sum(x, group=group) * 0.5
        y = mx.distributed.all_sum(y + x[:1].astype(mx.int32), group=group) * 0
        mx.eval(y)
        x = x + y[0]
    return (time.perf_counter() - tic) / rounds


def worker(out: str) -> None:
    group = mx.distributed.init(strict=True)
    result = {n: min(chain(group, n) for _ in range(5)) * 1e3 for n in SIZES}
    if group.rank() == 0:
        Path(out).write_text(json.dumps(result))


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        hostfile, out = Path(tmp) / "hosts.json", Path(tmp) / "out.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
        argv = [sys.executable, __file__, "--worker", str(out)]
        procs = [subprocess.Popen(argv, env={**env, "MLX_RANK": str(r)}) for r in range(2)]
        if any(p.wait() for p in procs):
            raise SystemExit("a rank failed")
        result = json.loads(out.read_text())
    print("| shared elements | ms per chain (17 large all-sums + 1 small) |")
    print("| ---: | ---: |")
    for n, ms in result.items():
        print(f"| {n} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
