"""The rows of the target's batch cache: rows that join take over those that rows left since
the last step, and the rest go before the next one."""

from __future__ import annotations

from mlx_spec.caches.batch import BatchCache
from mlx_spec.decoding.rows import Row


class RowSlots:
    """Where rows go in the target's cache: rows that left are taken over by rows that join. A part
    of `BatchEngine` (its state: `BatchEngine.__init__`)."""

    def _extend(self, cache: BatchCache, rows: list[Row]) -> None:
        """Rows (and their cache) join the batch: into the rows that rows left since the last
        step, as far as there are such (`BatchCache.place`), after its rows for the rest."""
        if self.cache is None:
            self.cache, self.active = cache, list(rows)
            return
        slots = self._vacant[: len(rows)]  # a joining row takes a row that left
        if slots:
            placed = len(slots)
            if placed < len(rows):  # the rest join after the batch's rows
                rest = cache.copy()
                rest.filter(range(placed, len(rows)))
                cache.filter(range(placed))
            if self.cache.place(slots, cache):
                for slot, row in zip(slots, rows, strict=False):
                    self.active.insert(self._logical(slot), row)
                    self._vacant.remove(slot)
                if placed == len(rows):
                    return
                cache, rows = rest, rows[placed:]
            elif placed < len(rows):
                cache.extend(rest)
        self._settle_vacant()
        self.cache.extend(cache)
        self.active += rows
        self._turnover = True

    def _logical(self, slot: int) -> int:
        """Where a row in `cache` row `slot` goes in `active` (the rows before it that are not
        vacant)."""
        return slot - sum(1 for v in self._vacant if v < slot)

    def _physical(self, index: int) -> int:
        """The row of `cache` that `active[index]` is in."""
        for vacant in self._vacant:  # in order
            if vacant <= index:
                index += 1
        return index

    def _settle_vacant(self) -> None:
        """Drop the rows that no row took over from the cache."""
        if self._vacant and self.cache is not None:
            vacant = set(self._vacant)
            self.cache.filter([r for r in range(self.cache.batch) if r not in vacant])
        self._vacant = []
