"""A KV cache for a batch of sequences that each grow, and roll back, by their own amount.

mlx-lm's `BatchKVCache` keeps every row's tokens contiguous and right-aligned, so a row can only
lose tokens from its end by rolling its whole cache (a copy of everything, every round), and
all rows write at one shared column. Here each row has its own end (the column after its last
token: tokens are written there, per row, by one scatter), and each cache column records, per
row, the logical position of the token stored there (-1: nothing). Attention masks are computed
from those positions, so:

- a chunk of different lengths per row is fed right-padded (the pads get position -1 and lie
  past the row's end, where its next tokens go);
- rolling row i back to L tokens marks its columns at positions >= L empty and moves its end
  back, copying nothing: its next tokens overwrite them, so rows that accept drafts by
  different amounts leave no holes and every pass attends over the longest row's columns
  only (a shared write column would leave each row's rejected drafts as empty columns that
  every later pass attends over, until a compaction);
- sliding windows are masks over positions (`pos > query - window`), exact after any rollback;
- rows join (`extend`) and leave (`filter`) between steps, and one row is taken out compact
  (`extract`) for a prompt cache.

While every row ends at the same column (after a compaction or a join, as long as rows grow
alike), tokens are written by a slice update, as mlx-lm does. Columns left of a row's tokens
(a row shorter than the batch when it joined, a sliding window's expired tokens) are squeezed
out by `compact` once they make up a large part of the cache. One `_Positions` object is
shared by every layer of a window group (full attention, or one sliding-window size); the
layers' `BatchLayerCache`s hold the keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_spec.platform import fused

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

STEP = 256  # columns are allocated in steps of this many
EMPTY = -1
# Columns of a sliding-window group older than the window by more than this stay until a
# compaction drops them: a rollback of up to this many tokens still finds its window exact.
DEAD_MARGIN = 64


class _Positions:
    """Per row: the position of the token in each column (EMPTY if none), the next position,
    and the column after its last token (its end: where its next tokens go).

    Args:
        batch: rows.
        window: the group's sliding window (None: full attention).
    """

    def __init__(self, batch: int, window: int | None = None):
        self.window = window
        self.pos = mx.full((batch, 0), EMPTY, mx.int32)  # [B, capacity]
        self.offset = mx.zeros((batch,), mx.int32)  # [B] tokens held (the next position)
        self.lengths = [0] * batch  # the same, as Python ints
        self.ends = [0] * batch  # per row, the column after its last token
        self.chunk = 0  # width of the chunk being fed
        # Where the chunk being fed goes: a column all rows share (int), or `[B, chunk]` the
        # columns per row (rows ending at different columns).
        self.write: int | mx.array = 0
        # A tree being fed (one row): its nodes' depths `[n]` and ancestor mask `[n, n]`, and
        # the first column it took (until `keep_tree`).
        self.tree: tuple[mx.array, mx.array] | None = None
        self.tree_start = 0

    @property
    def offset(self) -> mx.array:
        """`[B]` the next position of each row. Replaced, never updated in place: the array
        is registered with `fused.stable`, so RoPE shares its angles across the layers."""
        return self._offset

    @offset.setter
    def offset(self, value: mx.array) -> None:
        self._offset = fused.stable(value)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def idx(self) -> int:
        """Columns in use: up to the end of the row that ends last."""
        return max(self.ends, default=0)

    @property
    def span(self) -> int:
        """Columns the chunk being fed attends over (those in use, then the chunk's)."""
        return self.idx + self.chunk

    def aligned(self, width: int) -> None:
        """Every row now ends at column `width` (its tokens moved to end there)."""
        self.ends = [width] * self.batch

    def begin(self, lengths: Sequence[int]) -> None:
        """Reserve columns for a chunk of `n = max(lengths)` tokens after each row's end;
        row i's first `lengths[i]` get the positions after its tokens, its pads stay EMPTY."""
        n = max(lengths)
        top = self.idx
        self.chunk = n
        if top + n > self.pos.shape[1]:
            grow = ((top + n - self.pos.shape[1] + STEP - 1) // STEP) * STEP
            self.pos = mx.concatenate([self.pos, mx.full((self.batch, grow), EMPTY, mx.int32)], 1)
        j = mx.arange(n)[None]  # [1, n]
        fed = mx.array(list(lengths), mx.int32)[:, None]  # [B, 1]
        new = mx.where(j < fed, self.offset[:, None] + j, EMPTY)  # [B, n]
        if all(end == top for end in self.ends):
            self.write = top
            self.pos[:, top : top + n] = new
        else:
            self.write = mx.array(self.ends, mx.int32)[:, None] + j  # [B, n]
            self.pos = mx.put_along_axis(self.pos, self.write, new, axis=1)

    def end(self, lengths: Sequence[int]) -> None:
        """The chunk was fed: row i now holds `lengths[i]` more tokens (its pads' columns are
        free again)."""
        self.chunk = 0
        self.ends = [e + n for e, n in zip(self.ends, lengths, strict=True)]
        self.lengths = [a + b for a, b in zip(self.lengths, lengths, strict=True)]
        self.offset = mx.array(self.lengths, mx.int32)

    def begin_tree(self, depths: Sequence[int], ancestors) -> None:
        """Reserve columns for a tree fed to a one-row cache: node j at position offset +
        depths[j], seeing the columns of its ancestors (`ancestors[j, c]`) among the new ones."""
        if self.batch != 1:
            raise ValueError("trees are fed to one-row caches")
        n = len(depths)
        self.begin([n])
        depth = mx.array(list(depths), mx.int32)
        self.pos[:, self.write : self.write + n] = self.offset[:, None] + depth[None]
        self.tree = (depth, mx.array(ancestors))
        self.tree_start = self.write

    def end_tree(self) -> None:
        """The tree was fed; its columns stay until `keep_tree` picks the path that stays."""
        self.ends = [self.tree_start + self.chunk]
        self.chunk = 0

    def keep_tree(self, rows: Sequence[int]) -> mx.array | None:
        """Keep the tree's nodes `rows` (the root and an accepted path, depths 0, 1, ...): the
        row then holds len(rows) more tokens, in the tree's first columns; the other nodes'
        columns are free again. Returns the columns to move to the tree's first ones, in
        order (the layers' keys and values follow), or None if the kept nodes are there."""
        rows = list(rows)
        start = self.tree_start
        move = None
        if rows != list(range(len(rows))):
            move = start + mx.array(rows, mx.int32)
            self.pos[:, start : start + len(rows)] = self.pos[:, move]
        self.pos[:, start + len(rows) : self.idx] = EMPTY
        self.tree = None
        self.ends = [start + len(rows)]
        self.lengths = [self.lengths[0] + len(rows)]
        self.offset = mx.array(self.lengths, mx.int32)
        return move

    def drop_tree(self) -> None:
        """Give the whole tree's columns back (none of its nodes stays)."""
        self.pos[:, self.tree_start : self.idx] = EMPTY
        self.ends = [self.tree_start]
        self.tree = None

    def mask(self, n: int, window: int | None) -> mx.array:
        """`[B, 1, n, span]` bool: query j of row i (position offset_i + j) sees the columns
        holding positions <= its own (and within the window); a tree's node sees, of the
        tree's columns, only its ancestors'."""
        span = self.span
        pos = self.pos[:, None, :span]  # [B, 1, C]
        if self.tree is not None:
            depth, ancestors = self.tree
            query = (self.offset[:, None] + depth[None])[:, :, None]  # [1, n, 1]
        else:
            query = (self.offset[:, None] + mx.arange(n)[None])[:, :, None]  # [B, n, 1]
        visible = (pos >= 0) & (pos <= query)
        if self.tree is not None:
            old = mx.ones((n, span - n), dtype=mx.bool_)
            visible = visible & mx.concatenate([old, ancestors], axis=1)[None]
        window = window or self.window
        if window is not None:
            visible = visible & (pos > query - window)
        # Every query also sees its own column: real tokens do anyway, and a pad of a row
        # that holds nothing yet is never left with no column at all (a softmax over nothing).
        if isinstance(self.write, int):
            own = mx.arange(span)[None] == (self.write + mx.arange(n))[:, None]  # [n, C]
        else:
            own = mx.arange(span)[None, None] == self.write[:, :, None]  # [B, n, C]
        return (visible | own)[:, None]

    def truncate(self, lengths: Sequence[int]) -> None:
        """Keep only the first `lengths[i]` tokens of row i (its last columns: its end moves
        back by what it drops)."""
        if any(new > old for new, old in zip(lengths, self.lengths, strict=True)):
            raise ValueError(f"cannot grow rows by truncation: {self.lengths} -> {list(lengths)}")
        keep = mx.array(list(lengths), mx.int32)[:, None]
        self.pos = mx.where(self.pos >= keep, EMPTY, self.pos)
        self.ends = [
            max(0, end - (old - new))
            for end, old, new in zip(self.ends, self.lengths, lengths, strict=True)
        ]
        self.lengths = list(lengths)
        self.offset = mx.array(self.lengths, mx.int32)

    def held(self) -> list[int]:
        """Columns in use per row that hold a token (sliding groups: those inside the window)."""
        return self._live()[1].sum(axis=1).tolist()

    def _live(self, rows: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """`[B', idx]` the positions in the columns in use, and whether each holds a token a
        row still needs; `rows` picks rows (default: all)."""
        pos = self.pos[:, : self.idx] if rows is None else self.pos[rows, : self.idx]
        offset = self.offset if rows is None else self.offset[rows]
        live = pos >= 0
        if self.window is not None:
            live = live & (pos > offset[:, None] - self.window - DEAD_MARGIN)
        return pos, live

    def live_columns(self, rows: mx.array | None = None) -> tuple[mx.array, int, mx.array]:
        """`[B', V]` column indices of each row's live tokens in order, right-aligned (empty
        columns before them), V, and `[B', V]` the positions in those columns (EMPTY where a
        row's column holds nothing it still needs); `rows` picks rows (default: all)."""
        pos, live = self._live(rows)
        width = int(live.sum(axis=1).max().item()) if live.shape[0] else 0
        cols = mx.arange(self.idx)[None]
        order = mx.argsort(mx.where(live, cols + self.idx, cols), axis=1)[:, self.idx - width :]
        return order, width, mx.take_along_axis(mx.where(live, pos, EMPTY), order, axis=1)


class BatchLayerCache:
    """One attention layer's keys and values for the batch (mlx-lm's cache protocol)."""

    def __init__(self, positions: _Positions):
        self.positions = positions
        self.keys: mx.array | None = None  # [B, heads, capacity, head_dim]
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        return self.positions.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        p = self.positions
        span = p.span
        if self.keys is None or span > self.keys.shape[2]:
            self._grow(keys, values, span)
        if isinstance(p.write, int):
            n = keys.shape[2]
            self.keys[:, :, p.write : p.write + n] = keys
            self.values[:, :, p.write : p.write + n] = values
        else:  # rows end at different columns: each row's chunk goes after its own end
            where = p.write[:, None, :, None]  # [B, 1, n, 1]
            self.keys = mx.put_along_axis(self.keys, where, keys, axis=2)
            self.values = mx.put_along_axis(self.values, where, values, axis=2)
        return self.keys[:, :, :span], self.values[:, :, :span]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = ((needed + STEP - 1) // STEP) * STEP
        b, h, _, dk = keys.shape

        def grown(old, d, dtype):
            new = mx.zeros((b, h, capacity, d), dtype)
            if old is not None:
                new[:, :, : self.positions.idx] = old[:, :, : self.positions.idx]
            return new

        self.keys = grown(self.keys, dk, keys.dtype)
        self.values = grown(self.values, values.shape[3], values.dtype)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return self.positions.mask(n, window_size)

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return self.keys is None


class BatchCache:
    """The caches of every layer of one model for a batch of rows.

    Args:
        model: an mlx-lm model whose prompt cache is made of `KVCache`s and `RotatingKVCache`s
            (see `batchable`).
        batch: rows (all empty).
    """

    def __init__(self, model: nn.Module, batch: int = 1):
        self.groups: dict[int | None, _Positions] = {}
        self.layers: list[BatchLayerCache] = []
        for cache in make_prompt_cache(model):
            window = _window_of(cache)
            if window not in self.groups:
                self.groups[window] = _Positions(batch, window)
            self.layers.append(BatchLayerCache(self.groups[window]))

    # --- what the model sees -------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return self._any.batch

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""
        return list(self._any.lengths)

    @property
    def columns(self) -> int:
        """Columns in use (the widest group's): what every row's next pass attends over."""
        return max(group.idx for group in self.groups.values())

    @property
    def _any(self) -> _Positions:
        return next(iter(self.groups.values()))

    def begin(self, lengths: Sequence[int]) -> None:
        """Before a forward pass over `[B, max(lengths)]` tokens (row i's first `lengths[i]`
        real, the rest pads)."""
        for group in self.groups.values():
            group.begin(lengths)

    def end(self, lengths: Sequence[int]) -> None:
        """After that pass."""
        for group in self.groups.values():
            group.end(lengths)

    def truncate(self, lengths: Sequence[int]) -> None:
        """Row i keeps its first `lengths[i]` tokens."""
        for group in self.groups.values():
            group.truncate(lengths)

    def begin_tree(self, depths: Sequence[int], ancestors) -> None:
        """Before a pass over a tree's root and nodes (a one-row cache; see
        `_Positions.begin_tree`)."""
        for group in self.groups.values():
            group.begin_tree(depths, ancestors)

    def end_tree(self) -> None:
        for group in self.groups.values():
            group.end_tree()

    def keep_tree(self, rows: Sequence[int]) -> None:
        """Keep the tree's root and accepted path (`rows`: 0, then node index + 1 each)."""
        for group in self.groups.values():
            start = group.tree_start
            move = group.keep_tree(rows)
            if move is None:
                continue
            for layer in self.layers:
                if layer.positions is group and layer.keys is not None:
                    for name in ("keys", "values"):
                        x = getattr(layer, name)
                        x[:, :, start : start + len(rows)] = x[:, :, move]

    def drop_tree(self) -> None:
        """Drop the tree's root and nodes: the cache is as before the pass."""
        for group in self.groups.values():
            group.drop_tree()

    @property
    def state(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.state] + [
            g.pos for g in self.groups.values()
        ]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers) + sum(
            g.pos.nbytes for g in self.groups.values()
        )

    # --- rows joining and leaving ---------------------------------------------------------------

    def bytes_per_token(self) -> int:
        """Key and value bytes one token takes (measured on a cache that holds some)."""
        mx.eval(self.state)
        layers = [layer for layer in self.layers if layer.keys is not None]
        return sum(
            (layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[2] for layer in layers
        )

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order)."""
        index = mx.array(list(rows), mx.int32)
        for layer in self.layers:
            if layer.keys is not None:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        for group in self.groups.values():
            group.pos, group.offset = group.pos[index], group.offset[index]
            group.lengths = [group.lengths[r] for r in rows]
            group.ends = [group.ends[r] for r in rows]

    def extend(self, other: BatchCache) -> None:
        """Append `other`'s rows (a cache of the same model) after this one's."""
        for window, group in self.groups.items():
            mine, theirs = group, other.groups[window]
            width = max(mine.idx, theirs.idx)
            layers = [(a, b) for a, b in zip(self.layers, other.layers, strict=True)]
            layers = [(a, b) for a, b in layers if a.positions is mine]
            for a, b in layers:
                a.keys, a.values = _stack_rows(a, b, mine, theirs, width)
            pads = [_left_pad(g.pos, g.idx, width, EMPTY) for g in (mine, theirs)]
            mine.pos = mx.concatenate(pads)
            shift = [width - mine.idx, width - theirs.idx]
            mine.ends = [e + shift[0] for e in mine.ends] + [e + shift[1] for e in theirs.ends]
            mine.lengths = mine.lengths + theirs.lengths
            mine.offset = mx.array(mine.lengths, mx.int32)

    def place(self, slots: Sequence[int], other: BatchCache) -> bool:
        """Write `other`'s rows into rows `slots` (rows that left: what they held is dropped),
        each row's columns ending where this batch's columns in use end, so that every pass
        attends over no more columns than before: a row leaving and another joining cost a
        copy of the joining row's keys and values, not two copies of the whole batch's
        (`filter`, then `extend`). False, and nothing changed, where a joining row has more
        columns than this batch uses (then `filter` and `extend`)."""
        if len(slots) != other.batch:
            raise ValueError(f"{other.batch} rows for {len(slots)} slots")
        for window, group in self.groups.items():
            if max(other.groups[window].ends, default=0) > group.idx:
                return False
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if (mine.keys is None and mine.positions.idx) or (
                theirs.keys is None and theirs.positions.idx
            ):
                return False
        for window, group in self.groups.items():
            theirs, top = other.groups[window], group.idx
            layers = [
                (a, b)
                for a, b in zip(self.layers, other.layers, strict=True)
                if a.positions is group and a.keys is not None
            ]
            for j, slot in enumerate(slots):
                width = theirs.ends[j]
                start = top - width
                row = mx.full((1, group.pos.shape[1]), EMPTY, mx.int32)
                if width:
                    row[:, start:top] = theirs.pos[j : j + 1, :width]
                group.pos[slot : slot + 1] = row
                for a, b in layers:
                    if width:
                        a.keys[slot : slot + 1, :, start:top] = b.keys[j : j + 1, :, :width]
                        a.values[slot : slot + 1, :, start:top] = b.values[j : j + 1, :, :width]
                group.ends[slot] = top
                group.lengths[slot] = theirs.lengths[j]
            group.offset = mx.array(group.lengths, mx.int32)
        return True

    def extract(self, row: int, model: nn.Module) -> BatchCache:
        """Row `row` as a one-row cache holding only its tokens (no empty columns)."""
        out = BatchCache(model, 1)
        rows = mx.array([row], mx.int32)
        for window, group in self.groups.items():
            mine = out.groups[window]
            order, width, positions = group.live_columns(rows)  # [1, V]
            for a, b in zip(self.layers, out.layers, strict=True):
                if a.positions is group and a.keys is not None:
                    b.keys = _gather(a.keys[rows], order)
                    b.values = _gather(a.values[rows], order)
            mine.pos = positions
            mine.aligned(width)
            mine.lengths = [group.lengths[row]]
            mine.offset = mx.array(mine.lengths, mx.int32)
        return out

    def copy(self) -> BatchCache:
        """An independent copy: writes to either (a pass, a truncation) leave the other as it
        was. The arrays themselves are shared until one side writes."""
        out = BatchCache.__new__(BatchCache)
        out.groups = {}
        for window, group in self.groups.items():
            mine = _Positions(group.batch, window)
            mine.pos, mine.offset = mx.array(group.pos), mx.array(group.offset)
            mine.lengths, mine.ends = list(group.lengths), list(group.ends)
            out.groups[window] = mine
        out.layers = []
        for layer in self.layers:
            twin = BatchLayerCache(out.groups[layer.positions.window])
            if layer.keys is not None:
                twin.keys, twin.values = mx.array(layer.keys), mx.array(layer.values)
            out.layers.append(twin)
        return out

    def compact(self) -> None:
        """Squeeze the empty columns out: each row's tokens moved, in order, to end at one
        column (the longest row's count), where every row's next tokens then go."""
        for group in self.groups.values():
            order, width, positions = group.live_columns()
            for layer in self.layers:
                if layer.positions is group and layer.keys is not None:
                    layer.keys = _gather(layer.keys, order)
                    layer.values = _gather(layer.values, order)
            group.pos = positions
            group.aligned(width)

    def tidy(self, slack: float = 0.25, spare: int = 16) -> None:
        """Compact once the columns in use outnumber what a row can still need (its tokens,
        or a sliding window's) by more than `slack` of it plus `spare` columns: every pass
        attends over every column in use, and a row that joined shorter than the batch, or
        outlived the row that was longest, leaves columns before its tokens. Decided on
        counts held in Python; the compaction itself reads the columns back (a device
        sync)."""
        longest = max(self.lengths, default=0)
        for group in self.groups.values():
            need = longest if group.window is None else min(longest, group.window + DEAD_MARGIN)
            if group.idx > (1 + slack) * need + spare:
                self.compact()
                return

    def waste(self) -> float:
        """Share of the columns in use that hold nothing any row still needs."""
        worst = 0.0
        for group in self.groups.values():
            if group.idx:
                worst = max(worst, 1 - max(group.held(), default=0) / group.idx)
        return worst

    def can_truncate(self, length: int) -> bool:
        """Whether a one-row cache still holds what a cut back to `length` tokens needs (a
        sliding window's tokens before the cut, which a compaction may have dropped)."""
        for group in self.groups.values():
            if group.window is None or length <= 0:
                continue
            pos = group.pos[0, : group.idx]
            first = int(mx.where(pos >= 0, pos, 1 << 30).min().item()) if group.idx else 0
            if first > max(0, length - group.window):
                return False
        return True


def _window_of(cache) -> int | None:
    if type(cache) is KVCache:
        return None
    if type(cache) is RotatingKVCache and cache.keep == 0:
        return cache.max_size
    raise TypeError(f"{type(cache).__name__} cannot be batched")


def batchable(model: nn.Module) -> bool:
    """Whether the model's layers all use caches `BatchCache` can stand in for (attention with
    full or sliding-window caches; not recurrent state)."""
    try:
        for cache in make_prompt_cache(model):
            _window_of(cache)
    except TypeError:
        return False
    return True


def _left_pad(a: mx.array, used: int, width: int, fill) -> mx.array:
    """The first `used` columns of `[B, C]` `a`, with `width - used` columns of `fill` before."""
    a = a[:, :used]
    if width == used:
        return a
    return mx.concatenate([mx.full((a.shape[0], width - used), fill, a.dtype), a], axis=1)


def _stack_rows(a: BatchLayerCache, b: BatchLayerCache, pa: _Positions, pb: _Positions, width):
    """Keys and values of two layers' rows stacked, each left-padded to `width` columns."""
    ref = a if a.keys is not None else b
    if ref.keys is None:
        return None, None
    out = []
    for name in ("keys", "values"):
        parts = []
        for layer, group in ((a, pa), (b, pb)):
            x = getattr(layer, name)
            shape = getattr(ref, name).shape
            if x is None:
                x = mx.zeros((group.batch, shape[1], 0, shape[3]), getattr(ref, name).dtype)
            x = x[:, :, : group.idx]
            if width > group.idx:
                pad = mx.zeros((x.shape[0], x.shape[1], width - group.idx, x.shape[3]), x.dtype)
                x = mx.concatenate([pad, x], axis=2)
            parts.append(x)
        out.append(mx.concatenate(parts))
    return out[0], out[1]


def _gather(x: mx.array, order: mx.array) -> mx.array:
    """`[B, H, C, D]` columns picked per row by `[B, V]` `order` -> `[B, H, V, D]`."""
    return mx.take_along_axis(x, order[:, None, :, None], axis=2)
