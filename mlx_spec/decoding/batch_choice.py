"""The batch policy's answer for a step (`BatchChoice`), and the kind of decision it was."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Decision(enum.Enum):
    """Why the policy chose a step; its value is the name traces print (`BatchChoice.why`)."""

    BEST = "best"  # the plan it rates best (a plain step where that is plain decoding)
    EXPLORE = "explore"  # an exploring step: another width or drafter
    PROBE = "probe"  # a probe of speculation while plain decoding wins
    FOLLOW = "follow"  # the step after a switch out of plain decoding, repeating its plan
    CLOSED = "closed"  # a closed batch's rule: a plan every row gains by, or plain decoding


@dataclass(init=False)
class BatchChoice:
    """K for the step and, per row, (arm or None, k).

    Attributes:
        probe: the step is a probe of speculation.
        catch_up: the catch-up tokens of the step (see `StepCosts`).
        only: the one drafter a group's rows draft with (None: each its best).
        window: the guard's window the step runs in (`DrafterGuard`): a bitmask of the
            drafters barred from it (0: none; every drafter the rows have: plain decoding,
            the policy unasked), or None (the guard stood aside: no row can draft, one
            drafts a fixed k, or a lone row whose drafters are not watched alone).
        decision: why the policy chose it (`why`: its name, which `--trace` reports).
        expected: what the policy priced the step at: (tokens, seconds) of its plan as the
            cost model and the acceptance estimates have them, or None (a follow step, a
            drafter tried for the first time), kept beside what the step realised.
    """

    num_draft: int
    rows: list[tuple[int | None, int]]
    probe: bool = False
    catch_up: int = 0
    only: int | None = None
    window: int | None = None
    decision: Decision = Decision.BEST
    expected: tuple[float, float] | None = None

    def __init__(
        self,
        num_draft: int,
        rows: list[tuple[int | None, int]],
        probe: bool = False,
        catch_up: int = 0,
        only: int | None = None,
        window: int | None = None,
        decision: Decision | str = Decision.BEST,
        expected: tuple[float, float] | None = None,
        *,
        why: str | None = None,
    ):
        self.num_draft, self.rows, self.probe, self.catch_up = num_draft, rows, probe, catch_up
        self.only, self.window, self.expected = only, window, expected
        # A decision may be given by its name (`why`, or in place of `decision`).
        self.decision = Decision(decision if why is None else why)

    @property
    def why(self) -> str:
        """The decision's name, as traces print it."""
        return self.decision.value
