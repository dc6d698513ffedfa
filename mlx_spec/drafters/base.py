"""The drafter interface: begin / draft / accept, and extend for the next turn of a conversation
(the decode loop never asks what kind)."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

from mlx_spec.core.sampling import SamplingConfig

import mlx.core as mx
import mlx.nn as nn

_TOKENS = itertools.count()


def unique_id(obj) -> int:
    """A number no other object of this process gets, even after `obj` is gone (`id()` is
    reused by later objects, which would hand them a policy learned with another drafter)."""
    token = obj.__dict__.get("_mlx_spec_uid")
    if token is None:
        token = next(_TOKENS)
        object.__setattr__(obj, "_mlx_spec_uid", token)
    return token


@dataclass
class Draft:
    """Proposed tokens for one round.

    Attributes:
        tokens: `[k]` uint32 ids (k may be smaller than asked, or 0).
        probs: `[k, vocab]` distributions the tokens were sampled from, or None when the
            drafter has none (treated as one-hot by the verifier).
    """

    tokens: mx.array
    probs: mx.array | None = None

    @classmethod
    def empty(cls) -> Draft:
        return cls(mx.array([], mx.uint32))


class Drafter(ABC):
    """Anything that proposes tokens for the target to verify."""

    name: str = "drafter"
    # True: `begin` and `accept` receive the target's final hidden states (the head's input).
    needs_hidden: bool = False
    # With `needs_hidden`: the target layers whose features it reads instead, concatenated
    # (Hugging Face `hidden_states` indices; see `hidden.LayerFeatures`). None: final states.
    hidden_layers: tuple[int, ...] | None = None

    @property
    def identity(self) -> Hashable:
        """What makes two drafters draft alike (the weights they run, their settings), so
        that a policy learned with one serves the other; by default the object itself."""
        return ("drafter", unique_id(self))

    @property
    def arm_names(self) -> list[str]:
        """The drafters a policy can choose between (one, except for a `DrafterGroup`)."""
        return [self.name]

    def select(self, arm: int) -> None:  # noqa: B027
        """Draft the next round with drafter `arm` of `arm_names` (a group switches)."""

    def available(self, k: int) -> int | None:
        """How many of k drafts this drafter can propose now, when it can tell without drafting
        (a lookup that may find nothing); None: all k."""
        return None

    def arms_available(self, k: int) -> list[int | None]:
        """`available(k)` of each arm (a group answers for each of its drafters)."""
        return [self.available(k)]

    @property
    def nbytes(self) -> int:
        """Bytes of the drafter's own caches (kept by a prompt cache between requests)."""
        runner = getattr(self, "runner", None)
        return 0 if runner is None else runner.nbytes

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:  # noqa: B027
        """Raise ValueError if this drafter cannot serve this target and tokenizer."""

    def bind_target(self, target) -> None:  # noqa: B027
        """Called before `begin` with the target's `ModelRunner`, for drafters that read the
        target's cache (Gemma 4 assistant); others ignore it."""

    @abstractmethod
    def begin(self, prompt: list[int], vocab_size: int, hidden: mx.array | None = None) -> None:
        """Start a new sequence; `prompt` is every token so far, `hidden` the target's
        `[len(prompt) - 1, T]` hidden states for all but the last (if `needs_hidden`)."""

    def extend(
        self,
        prompt: list[int],
        common: int,
        vocab_size: int,
        hidden: mx.array | None = None,
        hidden_start: int = 0,
    ) -> bool:
        """Move on to a new prompt that continues the sequence so far (a conversation's next
        turn) without starting from scratch.

        Args:
            prompt: every token of the new sequence.
            common: how many first tokens `prompt` shares with the sequence so far (the last
                `begin`/`extend` prompt plus every token emitted since).
            vocab_size: as in `begin`.
            hidden: if `needs_hidden`, the target's hidden states at positions
                `hidden_start .. len(prompt) - 2` (those it just prefilled); `hidden_start` is
                at most `common`.
        Returns:
            False when the drafter cannot continue; the caller then calls `begin` with the
            hidden states of the whole prompt. The default begins again over the whole prompt
            (drafters without hidden states) or returns False (drafters with them).
        """
        if self.needs_hidden:
            return False
        self.begin(prompt, vocab_size)
        return True

    def catch_up(self) -> None:  # noqa: B027
        """Feed what piled up while this drafter did not draft (plain steps, or another drafter
        of a group), so that the next `draft` does drafting work only (a few tokens may stay:
        they ride along with the first draft step). Optional: drafters without a cache ignore
        it, and `draft` must work without it."""

    @abstractmethod
    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        """Propose up to k tokens following the sequence."""

    @abstractmethod
    def accept(self, num_accepted: int, emitted: list[int], hidden: mx.array | None = None) -> None:
        """Record the round's outcome: the first `num_accepted` drafts were kept and `emitted`
        (accepted drafts + the recovered or bonus token) was appended to the sequence.
        `hidden` (if `needs_hidden`): the target's `[len(emitted), T]` hidden states at the
        positions whose next token is each emitted token."""


def hidden_layer_ids(drafter) -> tuple[int, ...]:
    """The target layers whose features `drafter` reads (`hidden.LayerFeatures` numbering;
    empty when it reads none or only the final hidden state)."""
    wanted = hidden_wanted(drafter)
    return wanted if isinstance(wanted, tuple) else ()


def hidden_wanted(drafter) -> bool | tuple[int, ...]:
    """What a target runner must record for `drafter` (`ModelRunner(keep_hidden=...)`)."""
    if drafter is None or not drafter.needs_hidden:
        return False
    return getattr(drafter, "hidden_layers", None) or True
