"""Runs of consecutive steps per drafter set, and how long they last on average."""

from __future__ import annotations


class StepRuns:
    """Per drafter set, the decayed (steps, runs) of the runs that ended (`ended`), and the run
    going on (`current`: [drafters, steps], or None)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.ended: dict[tuple, tuple[float, float]] = {}
        self.current: list | None = None

    def start(self, drafters: tuple) -> None:
        """A run of drafters `drafters` starts with the step just run (ending none)."""
        self.current = [drafters, 1]

    def extend(self) -> None:
        """The step just run extends the run going on."""
        self.current[1] += 1

    def end(self) -> None:
        """The run going on, if any, ended with the step before the one just run."""
        if self.current is None:
            return
        drafters, length = self.current
        steps, runs = self.ended.get(drafters, (0.0, 0.0))
        self.ended[drafters] = (self.decay * steps + length, self.decay * runs + 1.0)
        self.current = None
