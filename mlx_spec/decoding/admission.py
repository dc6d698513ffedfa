"""Admission to the batch: the cache memory each row reserves (its prompt and `max_tokens`) and
whether a waiting request may start beside the active rows."""

from __future__ import annotations

from mlx_spec.caches.batch import BatchCache
from mlx_spec.decoding.rows import Row

import mlx.core as mx
import mlx.nn as nn


def token_bytes(model: nn.Module) -> int:
    """Cache bytes one token takes in `model`'s `BatchCache` (measured on a one-token pass)."""
    cache = BatchCache(model, 1)
    cache.begin([1])
    model(mx.zeros((1, 1), mx.uint32), cache=cache.layers)
    cache.end([1])
    return cache.bytes_per_token()


class Admission:
    """What a row reserves of the cache memory, and whether it may start now. A part of
    `BatchEngine` (its state: `BatchEngine.__init__`)."""

    def reserved(self, row: Row) -> int:
        """Cache bytes a row may come to hold: its prompt and max_tokens, in the target's and
        its model drafters' caches."""
        names = [None] + [self.names[a] for a in row.arms]
        per_token = sum(self.token_bytes.get(n, 0) for n in names)
        per_token += self.features.row_bytes(row.features)  # the features it keeps
        return per_token * (len(row.request.prompt) + row.request.max_tokens)

    def _fits(self, row: Row, joining: list[Row]) -> bool:
        """Whether the row may start now beside the active rows and those `joining` with it;
        a row that could never fit fails."""
        if self.max_kv_bytes is None:
            return True
        need = self.reserved(row)
        if need > self.max_kv_bytes:
            self.waiting.remove(row)
            row.request.emit(
                ValueError(
                    f"the request needs about {need >> 20} MiB of cache (prompt and max_tokens); "
                    f"the server allows {self.max_kv_bytes >> 20} MiB: ask for fewer tokens"
                )
            )
            return False
        held = sum(self.reserved(r) for r in self.active + joining)
        return need + held <= self.max_kv_bytes
