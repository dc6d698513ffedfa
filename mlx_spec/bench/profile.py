"""Where a speculative round's time goes: phases timed by `benchmarks/round_breakdown.py`.

`PhaseTimer` is handed to the decode loop; at each phase boundary it evaluates the arrays the
phase produced (a synchronisation the loop does not otherwise make, so that lazily queued work
is charged to the phase that queued it) and adds the time since the previous boundary.
"""

from __future__ import annotations

import time
from collections import defaultdict

import mlx.core as mx


class PhaseTimer:
    """Seconds per phase, summed over rounds."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.rounds = 0
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str, *arrays) -> None:
        """End `phase`: evaluate `arrays` (None skipped), charge the time since the last mark."""
        live = [a for a in arrays if a is not None]
        if live:
            mx.eval(*live)
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now
