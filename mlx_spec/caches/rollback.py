"""Exact, checked rollback of mlx-lm caches after a speculative round.

Every round the owner of a cache list calls `checkpoint()` before feeding tokens and
`rollback(num_keep)` after verification. Each cache is either trimmed exactly or, when that is
impossible (recurrent state, a sliding window overwritten in place), every cache of the model is
restored to the checkpoint and the caller replays the kept tokens. Offsets are checked after every
rollback; a cache type we cannot roll back is refused when the runner is built, never skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)


class UnsupportedCacheError(ValueError):
    """A cache type that mlx-spec cannot roll back exactly."""


class RollbackError(RuntimeError):
    """A cache did not end up where the rollback said it would."""


def cache_leaves(cache: list) -> list:
    """Flatten a model's cache list (CacheList nests several caches per layer)."""
    leaves = []
    for entry in cache:
        if isinstance(entry, CacheList):
            leaves.extend(cache_leaves(list(entry.caches)))
        else:
            leaves.append(entry)
    return leaves


def check_supported(cache: list) -> None:
    """Raise UnsupportedCacheError before decoding if any cache cannot be rolled back."""
    bad = sorted(
        {
            type(c).__name__
            for c in cache_leaves(cache)
            if not isinstance(c, (*_TRIMMABLE, RotatingKVCache, ArraysCache))
        }
    )
    if bad:
        raise UnsupportedCacheError(
            f"speculative decoding cannot roll back cache type(s) {', '.join(bad)}; "
            "supported: KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache"
        )


@dataclass
class _Saved:
    refs: tuple | list | None = None  # rotating: (keys, values, offset, idx); arrays: states
    copy: tuple | None = None  # rotating: copied buffers when in-place writes may wrap


def _rotating_trim_exact(c: RotatingKVCache, num: int, single_call: bool) -> None:
    if single_call:
        # The concat path left the window in temporal order with the new tokens last.
        end = c.keys.shape[2] - num
        c.keys, c.values = c.keys[..., :end, :], c.values[..., :end, :]
        c._idx = end
    else:
        c._idx -= num
    c.offset -= num


class CacheRollback:
    """Checkpoint and exact rollback for one model's cache list."""

    def __init__(self, cache: list):
        check_supported(cache)
        self.leaves = cache_leaves(cache)
        self._saved: list[_Saved] = []

    def checkpoint(self, num_tokens: int, single_call: bool) -> None:
        """Record the caches before `num_tokens` are fed (in one call if `single_call`)."""
        self._saved = [self._save(c, num_tokens, single_call) for c in self.leaves]

    @staticmethod
    def _save(c, num_tokens: int, single_call: bool) -> _Saved:
        if isinstance(c, ArraysCache):
            return _Saved(refs=list(c.cache))
        if isinstance(c, RotatingKVCache):
            saved = _Saved(refs=(c.keys, c.values, c.offset, c._idx))
            in_place = not single_call or num_tokens == 1
            if in_place and c.keys is not None and c.offset + num_tokens > c.max_size:
                # One-token writes overwrite the window in place: keep a real copy.
                saved.copy = (mx.array(c.keys), mx.array(c.values), c.offset, c._idx)
            return saved
        return _Saved()

    def rollback(self, num_fed: int, num_keep: int, single_call: bool) -> bool:
        """Drop all but the first `num_keep` of the `num_fed` tokens fed since the checkpoint.

        Returns:
            True when the caches were restored to the checkpoint and the caller must replay the
            `num_keep` kept tokens; False when they were trimmed exactly in place.
        """
        if num_keep > num_fed or num_keep < 0:
            raise ValueError(f"cannot keep {num_keep} of {num_fed} fed tokens")
        if num_keep == num_fed:
            return False
        if all(self._trimmable(c, single_call) for c in self.leaves):
            for c in self.leaves:
                self._trim(c, num_fed - num_keep, single_call)
            return False
        for c, saved in zip(self.leaves, self._saved, strict=True):
            self._restore(c, saved, num_fed, single_call)
        return True

    @staticmethod
    def _trimmable(c, single_call: bool) -> bool:
        if isinstance(c, ArraysCache):
            return False
        if isinstance(c, RotatingKVCache):
            return single_call or c.offset <= c.max_size
        return True

    @staticmethod
    def _trim(c, num: int, single_call: bool) -> None:
        if isinstance(c, RotatingKVCache):
            _rotating_trim_exact(c, num, single_call)
        elif c.trim(num) != num:
            raise RollbackError(f"{type(c).__name__} trimmed fewer than {num} tokens")

    def _restore(self, c, saved: _Saved, num_fed: int, single_call: bool) -> None:
        if isinstance(c, ArraysCache):
            c.cache = list(saved.refs)
        elif isinstance(c, RotatingKVCache):
            if saved.copy is not None:
                c.keys, c.values, c.offset, c._idx = saved.copy
            elif self._trimmable(c, single_call):
                c.keys, c.values, c.offset, c._idx = saved.refs
            else:
                raise RollbackError("sliding window overwritten without a checkpoint copy")
        else:
            self._trim(c, num_fed, single_call)

    def verify(self, length: int) -> None:
        """Raise RollbackError unless every positional cache holds exactly `length` tokens."""
        check_length(self.leaves, length)


def check_length(cache: list, length: int) -> None:
    """Raise RollbackError unless every positional cache holds exactly `length` tokens."""
    for c in cache_leaves(cache):
        if not isinstance(c, ArraysCache) and c.offset != length:
            raise RollbackError(f"{type(c).__name__} offset is {c.offset}, expected {length}")


def _cuttable(c) -> bool:
    if isinstance(c, ArraysCache):
        return False
    if isinstance(c, RotatingKVCache):
        # Before the window wraps the buffer is in position order: cutting the end is exact.
        return c.offset <= c.max_size and c._idx == c.offset
    return isinstance(c, _TRIMMABLE)


def can_cut(cache: list, num: int) -> bool:
    """Whether `cut_cache(cache, num)` would succeed (it changes nothing)."""
    return num <= 0 or all(_cuttable(c) and c.offset >= num for c in cache_leaves(cache))


def cache_nbytes(cache: list) -> int:
    """Bytes held by a model's caches."""
    return sum(c.nbytes for c in cache_leaves(cache))


def cut_cache(cache: list, num: int) -> bool:
    """Drop the last `num` tokens of every cache in place when that is exact for all of them
    (KV caches; sliding windows that never wrapped). Returns False, changing nothing, when some
    cache cannot be cut (recurrent state, a wrapped window): the caller then starts afresh."""
    if num <= 0:
        return True
    if not can_cut(cache, num):
        return False
    for c in cache_leaves(cache):
        if isinstance(c, RotatingKVCache):
            c.offset -= num
            c._idx -= num
        elif c.trim(num) != num:
            raise RollbackError(f"{type(c).__name__} trimmed fewer than {num} tokens")
    return True


class PrefixSnapshot:
    """The caches as they stood at `length` tokens, so that they can later be cut back to
    there even where an in-place cut is impossible (recurrent state, a sliding window that
    wraps in between). KV caches keep nothing (they are trimmed), recurrent states keep
    references (they are replaced, never written in place), sliding windows keep a copy of
    their buffers (at most the window)."""

    def __init__(self, cache: list, length: int):
        self.length = length
        self._saved = [self._save(c) for c in cache_leaves(cache)]

    @staticmethod
    def _save(c):
        if isinstance(c, ArraysCache):
            return list(c.cache)
        if isinstance(c, RotatingKVCache):
            keys = None if c.keys is None else mx.array(c.keys)
            values = None if c.values is None else mx.array(c.values)
            return (keys, values, c.offset, c._idx)
        return None

    def restore(self, cache: list, length: int) -> None:
        """Bring `cache`, now at `length` tokens and grown from the snapshot's state, back to
        the snapshot."""
        leaves = cache_leaves(cache)
        if length < self.length or len(leaves) != len(self._saved):
            raise RollbackError("the snapshot is not of these caches")
        for c, saved in zip(leaves, self._saved, strict=True):
            if isinstance(c, ArraysCache):
                c.cache = list(saved)
            elif isinstance(c, RotatingKVCache):
                c.keys, c.values, c.offset, c._idx = saved
            elif length > self.length and c.trim(length - self.length) != length - self.length:
                raise RollbackError(f"{type(c).__name__} trimmed fewer tokens than asked")
        check_length(cache, self.length)


def needs_snapshot(cache: list) -> bool:
    """Whether some cache may not be cut back in place (so a snapshot is worth keeping)."""
    return any(isinstance(c, (ArraysCache, RotatingKVCache)) for c in cache_leaves(cache))
