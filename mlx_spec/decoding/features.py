"""The target features the batch engine's drafters read, as its rows keep them."""

from __future__ import annotations

from mlx_spec.caches.taps import tap_for
from mlx_spec.drafters.base import hidden_wanted
from mlx_spec.drafters.batch import BatchDrafter

import mlx.core as mx
import mlx.nn as nn


class Features:
    """The target features the engine's drafters read, one kind per drafter that reads any (the
    final hidden state: MTP heads; its layers' features: EAGLE-3, DFlash), recorded on every
    target pass and concatenated kind after kind. A row keeps the kinds of its own drafters
    only, and each of them reads its kind's columns."""

    def __init__(self, model: nn.Module, drafters: dict[str, BatchDrafter]):
        self.kinds: list = []  # `hidden_wanted` of the drafters: True, or layer ids
        for drafter in drafters.values():
            kind = hidden_wanted(drafter)
            if kind and kind not in self.kinds:
                self.kinds.append(kind)
        self.kind_of = {name: hidden_wanted(d) for name, d in drafters.items()}
        self._taps = [tap_for(model, kind) for kind in self.kinds]
        self.widths: dict = {}  # kind -> columns, once a pass was seen (`measure`)
        self.itemsize = 0

    def now(self) -> mx.array | None:
        """`[B, S, W]`: every kind from the last target pass (None: no drafter reads any)."""
        if not self._taps:
            return None
        parts = [tap.hidden for tap in self._taps]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def measure(self) -> None:
        """Read each kind's width from the last pass."""
        for kind, tap in zip(self.kinds, self._taps, strict=True):
            self.widths[kind] = tap.hidden.shape[-1]
            self.itemsize = tap.hidden.dtype.size

    def of(self, names: list[str]) -> tuple:
        """The kinds drafters `names` read, in the engine's order."""
        wanted = {self.kind_of[n] for n in names}
        return tuple(kind for kind in self.kinds if kind in wanted)

    def keep(self, kinds: tuple, h: mx.array, held: tuple | None = None) -> mx.array:
        """A row's columns (its `kinds`) of `[..., W]` features of the kinds `held` (default:
        every kind, as a pass records them)."""
        held = tuple(self.kinds) if held is None else tuple(held)
        if kinds == held:
            return h
        parts, start = [], 0
        for kind in held:
            end = start + self.widths[kind]
            if kind in kinds:
                parts.append(h[..., start:end])
            start = end
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def columns(self, kinds: tuple, name: str) -> slice:
        """Where drafter `name`'s kind lies among a row's kept columns (`kinds`)."""
        start = 0
        for kind in kinds:
            if kind == self.kind_of[name]:
                return slice(start, start + self.widths[kind])
            start += self.widths[kind]
        raise KeyError(name)

    def row_bytes(self, kinds: tuple) -> int:
        """Bytes a row keeps per token for `kinds`."""
        return self.itemsize * sum(self.widths[kind] for kind in kinds)
