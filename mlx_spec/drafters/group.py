"""Several drafters behind one: a policy picks which one drafts each round, and every one of
them follows the sequence (the others as if they had drafted nothing)."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.drafters.base import Draft, Drafter, hidden_wanted

import mlx.core as mx
import mlx.nn as nn


class DrafterGroup(Drafter):
    """Offers its drafters as arms to the draft-length policy.

    The drafter selected for a round drafts it; after verification every drafter is told what
    was emitted (the selected one with its accepted count, the others with none), so any of them
    can draft the next round. Drafters that need the target's hidden states get them.

    Args:
        drafters: two or more drafters with distinct names.
    """

    def __init__(self, drafters: Sequence[Drafter]):
        if len(drafters) < 1:
            raise ValueError("a drafter group needs at least one drafter")
        names = [d.name for d in drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names must differ, got {names}")
        self.drafters = list(drafters)
        self.name = "+".join(names)
        self.needs_hidden = any(d.needs_hidden for d in drafters)
        wanted = {hidden_wanted(d) for d in drafters} - {False}
        if len(wanted) > 1:
            raise ValueError(
                "these drafters read different target features (final hidden states, layer "
                f"ids {sorted(w for w in wanted if w is not True)}): they cannot share a group"
            )
        self.hidden_layers = None if not wanted or True in wanted else wanted.pop()
        self._active = 0

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.drafters)

    @property
    def identity(self):
        return tuple(d.identity for d in self.drafters)

    @property
    def arm_names(self) -> list[str]:
        return [d.name for d in self.drafters]

    def select(self, arm: int) -> None:
        self._active = arm

    def arms_available(self, k: int) -> list[int | None]:
        return [d.available(k) for d in self.drafters]

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:
        for d in self.drafters:
            d.check_compatible(target, tokenizer, vocab_size)

    def bind_target(self, target) -> None:
        for d in self.drafters:
            d.bind_target(target)

    def _hidden(self, d: Drafter, hidden: mx.array | None) -> mx.array | None:
        return hidden if d.needs_hidden else None

    def begin(self, prompt: list[int], vocab_size: int, hidden: mx.array | None = None) -> None:
        for d in self.drafters:
            d.begin(prompt, vocab_size, self._hidden(d, hidden))

    def extend(self, prompt, common, vocab_size, hidden=None, hidden_start=0) -> bool:
        """Every drafter extends; one that cannot is begun again over the whole prompt, which
        for drafters that need hidden states requires the caller's full begin (False)."""
        ok = True
        for d in self.drafters:
            if not d.extend(prompt, common, vocab_size, self._hidden(d, hidden), hidden_start):
                if d.needs_hidden:
                    ok = False
                else:
                    d.begin(prompt, vocab_size)
        return ok

    def catch_up(self) -> None:
        self.drafters[self._active].catch_up()

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        return self.drafters[self._active].draft(k, sampling)

    def accept(self, num_accepted: int, emitted: list[int], hidden: mx.array | None = None) -> None:
        for i, d in enumerate(self.drafters):
            d.accept(num_accepted if i == self._active else 0, emitted, self._hidden(d, hidden))
