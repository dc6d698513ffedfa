"""A prompt cache across requests: the caches of finished generations, kept so that a later
request whose prompt starts with the same tokens (a conversation's next turn, a shared system
prompt) prefills only what is new.

Entries are idle `Session`s (a target cache, a drafter with its own cache, and the tokens they
hold), grouped by drafter, since a drafter's state follows only the sequence it was begun on. A
request takes the entry that saves it the most prefill, generates with it, and puts it back
when done; the least recently used entries go first when the cache holds more bytes or entries
than allowed. Not thread-safe: the server's engine thread is its only user.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from mlx_spec.serving.session import Session, common_prefix


class _LRU:
    """Entries (each with `nbytes`), least recently used first out beyond `max_bytes` or
    `max_entries`; hit/miss counters for `/health`.

    Args:
        max_bytes: the most bytes the entries may hold (0 disables the cache).
        max_entries: the most entries.
    """

    def __init__(self, max_bytes: int = 2 << 30, max_entries: int = 32):
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("max_bytes and max_entries must be >= 0")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: list = []  # least recently used first
        self.counts = {"hits": 0, "misses": 0, "reused_tokens": 0, "evicted": 0}
        # On a sharded target: the byte count every rank agrees on (`distributed.agreed_bytes`),
        # so that every rank keeps and evicts the same entries.
        self.agree: Callable[[int], int] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        """The entries held, least recently used first (each with its `tokens`; a batch row's
        entry with its target `hidden` features too)."""
        return iter(list(self._entries))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    def _add(self, entry) -> None:
        """Keep an entry (most recently used), then evict down to the limits."""
        if self.agree is not None:
            entry.nbytes = self.agree(entry.nbytes)
        self._entries.append(entry)
        total = self.nbytes
        while self._entries and (total > self.max_bytes or len(self._entries) > self.max_entries):
            total -= self._entries.pop(0).nbytes
            self.counts["evicted"] += 1

    def _taken(self, entry, reuse: int) -> None:
        self._entries.remove(entry)
        self.counts["hits"] += 1
        self.counts["reused_tokens"] += reuse

    def clear(self) -> None:
        self._entries.clear()

    def status(self) -> dict:
        """Entries, bytes and counters, for `/health`."""
        return {"entries": len(self), "bytes": self.nbytes, **self.counts}


@dataclass
class _Entry:
    key: Hashable
    session: Session
    nbytes: int


class PromptCache(_LRU):
    """Idle sessions (solo streams), least recently used first out."""

    def take(
        self, key: Hashable, prompt_ids: Sequence[int], make: Callable[[], Session]
    ) -> Session:
        """The idle session of drafter `key` that reuses the most of `prompt_ids`, removed
        from the cache; a new one from `make()` when none reuses anything."""
        best, best_reuse = None, 0
        for entry in self._entries:
            if entry.key != key:
                continue
            reuse = entry.session.reusable(prompt_ids)
            if reuse > best_reuse:
                best, best_reuse = entry, reuse
        if best is None:
            self.counts["misses"] += 1
            return make()
        self._taken(best, best_reuse)
        return best.session

    def put(self, key: Hashable, session: Session) -> None:
        """Keep a finished session. A session whose last turn failed midway is dropped."""
        if self.enabled and session.settled and session.cached_tokens:
            self._add(_Entry(key, session, session.nbytes))


def parse_bytes(text: str) -> int:
    """A byte count with an optional K/M/G/T suffix (powers of 1024): "512M" -> 536870912."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = units.get(value[-1:], 1)
    if scale > 1:
        value = value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"not a byte count: {text!r} (e.g. 2G, 512M, 1000000)") from None
    if number < 0:
        raise ValueError(f"a byte count must be >= 0, got {text!r}")
    return int(number * scale)


@dataclass
class RowEntry:
    """What `RowCache.take` hands out: the target's one-row cache cut back to `reuse` prompt
    tokens, the drafters' states ({name: state}), how many first tokens the new prompt shares
    with the sequence those states follow (`common`), and the target's features of that
    sequence (for drafters that read them; None if not kept) with the kinds they hold
    (`features`: those asked for, or more)."""

    cache: object
    reuse: int
    states: dict
    common: int
    hidden: object = None
    features: tuple = ()


@dataclass
class _RowItem:
    tokens: list[int]
    cache: object
    states: dict
    hidden: object
    nbytes: int
    features: tuple = ()  # the kinds of target features `hidden` holds


class RowCache(_LRU):
    """The prompt cache of the batching engine: finished rows' caches (the target's one-row
    `BatchCache`, the drafters' states), least recently used first out.

    An entry whose whole sequence a new prompt continues (a conversation's next turn) is handed
    out and leaves the cache; one the prompt shares only a part of (the same system prompt or
    document with a different question, the same prompt asked again) is copied, cut back to
    the shared part, and stays for the next request that shares it. An entry whose sequence a
    newer one continues is dropped when the newer one comes in: it can serve nothing the newer
    one cannot.
    """

    def take(
        self, prompt_ids: Sequence[int], drafters: Sequence[str] = (), features: tuple = ()
    ) -> RowEntry | None:
        """The entry that saves `prompt_ids` the most prefill, cut back to what the prompt
        shares (its last token is always prefilled anew), or None. With `features` (the kinds
        of target features the row's drafters read), only entries that kept those (and maybe
        more: a row of every drafter serves a row of one) count; among entries that save as
        much, one holding states for more of `drafters` wins."""
        hidden = bool(features)
        best, best_score, best_reuse, best_common = None, (0, 0), 0, 0
        for item in self._entries:
            if hidden and (item.hidden is None or not set(features) <= set(item.features)):
                continue
            common = common_prefix(item.tokens, prompt_ids)
            reuse = min(common, len(prompt_ids) - 1, item.cache.lengths[0])
            if hidden:
                reuse = min(reuse, item.hidden.shape[0])
            states = sum(item.states.get(name) is not None for name in drafters)
            score = (reuse, states)
            if reuse > 0 and score > best_score and item.cache.can_truncate(reuse):
                best, best_score, best_reuse, best_common = item, score, reuse, common
        if best is None:
            self.counts["misses"] += 1
            return None
        if best_common < len(best.tokens):  # a part of it: a copy, the entry stays
            self.counts["hits"] += 1
            self.counts["reused_tokens"] += best_reuse
            self._entries.remove(best)
            self._entries.append(best)  # most recently used
            cache = best.cache.copy()
            cache.truncate([best_reuse])
            cache.compact()
            states = {k: None if s is None else s.copy() for k, s in best.states.items()}
            return RowEntry(cache, best_reuse, states, best_common, best.hidden, best.features)
        self._taken(best, best_reuse)
        best.cache.truncate([best_reuse])
        return RowEntry(
            best.cache, best_reuse, best.states, best_common, best.hidden, best.features
        )

    def put(self, tokens: list[int], cache, states: dict, hidden=None, features=()) -> None:
        """Keep a finished row's caches (dropping the entries it continues); `hidden`: its
        target features of the `features` kinds."""
        if not self.enabled or not cache.lengths[0]:
            return
        features = tuple(features) if hidden is not None else ()
        for item in list(self._entries):
            if self._subsumes(tokens, cache, states, features, item):
                self._entries.remove(item)
        nbytes = cache.nbytes + sum(getattr(s, "nbytes", 0) for s in states.values() if s)
        nbytes += 0 if hidden is None else hidden.nbytes
        self._add(_RowItem(list(tokens), cache, states, hidden, nbytes, features))

    @staticmethod
    def _subsumes(tokens, cache, states, features, item: _RowItem) -> bool:
        """Whether a new entry serves every prompt `item` serves, as well: its sequence
        continues item's, it can be cut back to item's length, and it keeps every drafter
        state and every kind of features item keeps."""
        n = len(item.tokens)
        if n > len(tokens) or common_prefix(item.tokens, tokens) < n:
            return False
        if not cache.can_truncate(min(n, cache.lengths[0])):
            return False
        if any(s is not None and states.get(k) is None for k, s in item.states.items()):
            return False
        return item.hidden is None or set(item.features) <= set(features)
