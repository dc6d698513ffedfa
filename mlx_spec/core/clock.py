"""The clock generation reads (seconds, monotonic): tests replace `now` to run on simulated time."""

from __future__ import annotations

import time

now = time.perf_counter
