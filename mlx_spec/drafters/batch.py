"""Drafters for a batch of rows: n-gram lookup per row; a draft model, an MTP head and an
EAGLE-3 head batched; a DFlash drafter's blocks for every row in one pass.

Each drafter keeps the rows that draft with it (its own order; blocks name their rows). A step
asks every such row for k_i drafts (0: not this step); model drafters run one pass per draft
position over all their rows (the first pass feeds what each row has not fed yet,
right-padded; rows not drafting feed nothing), and after verification each row's cache is cut
back by its own amount. DFlash drafts a row's whole block in one pass and stores none of it.

A finished row's drafter cache can wait in the prompt cache (`leave` returns it) and continue
the next turn of its conversation (`join` takes it back with the shared prefix length).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_spec.caches.batch import BatchCache
from mlx_spec.caches.taps import logits_at
from mlx_spec.core.batch_verify import RowRandom, batch_probs, draw, gumbel
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.drafters.ngram import NgramIndex

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class DraftBlock:
    """A drafter's drafts for a step, for its rows at once.

    Attributes:
        rows: row ids, one per line of the arrays.
        counts: drafts per row (0: none; a row may get fewer than asked).
        tokens: `[len(rows), K]` ids (past a row's count: anything).
        probs: `[len(rows), K, V]` distributions the drafts were drawn from, or None (one-hot:
            lookup drafts, greedy rows).
    """

    rows: list[int]
    counts: list[int]
    tokens: mx.array
    probs: mx.array | None = None


class BatchDrafter:
    """Base: a drafter over the rows that use it (row ids, in the engine's order)."""

    name = "drafter"
    needs_hidden = False
    # Whether a row joining it costs a pass over its prompt (a model drafter's cache), which
    # the engine pays only where the batch policy has been drafting with it (`join_pays`).
    feeds_prompt = False
    # Whether drafting k tokens runs k passes of a model one after another (a draft model, an
    # MTP or EAGLE head), so that each draft position costs about a pass: the batch policy
    # bounds what a width it has not run may cost by it (`BatchDraftPolicy`, `chained`).
    chained = False

    def __init__(self):
        self.rows: list[int] = []
        self.vocab: int | None = None  # ids it may draft (the engine's); None: its head's

    def available(self, row: int, k: int) -> int | None:
        """Drafts the row can have now, where the drafter can tell without drafting."""
        return None

    def backlog(self, row: int) -> int:
        """Tokens the row's next draft must feed before its own first token rides along
        (what piled up while it did not draft); 0 for drafters without a model."""
        return 0

    def token_bytes(self, width: int) -> int:
        """Cache bytes one token of a row takes in the drafter (0: it keeps no cache);
        `width`: the columns of the target features it reads."""
        return 0

    def reset(self) -> None:
        """Forget every row (after a failed step)."""
        self.rows = []

    def join(self, row: int, sequence: list[int], hidden, state, common: int) -> None:
        """Add a row whose target cache holds `sequence[:-1]`.

        Args:
            row: the row's id (appended after the drafter's other rows).
            sequence: every token of the row; the last is not in the target's cache yet.
            hidden: `needs_hidden` drafters: the target's `[len(sequence) - 1, T]` hidden
                states of every token but the last.
            state: what `leave` returned for an earlier sequence, or None.
            common: how many first tokens `sequence` shares with that earlier sequence.
        """
        raise NotImplementedError

    def leave(self, row: int):
        """Remove a row; returns its state for a later `join` (None if there is none)."""
        raise NotImplementedError

    def draft(
        self,
        ks: dict[int, int],
        configs: dict[int, SamplingConfig],
        randoms: dict[int, RowRandom | None],
    ) -> DraftBlock | None:
        """Drafts for the rows asked for k > 0 (None when there are none)."""
        raise NotImplementedError

    def accept(self, row: int, drafted: int, accepted: int, emitted: list[int], hidden) -> None:
        """The row drafted `drafted` tokens this step (0: none), the first `accepted` were kept
        and `emitted` joined the sequence; `hidden` (`needs_hidden`): the target's
        `[len(emitted), T]` hidden states at the positions that produced them."""
        raise NotImplementedError


class BatchNgram(BatchDrafter):
    """Prompt lookup, row by row (no model)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__()
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._history: dict[int, NgramIndex] = {}
        # The last lookup per row and the k it was asked for, until the sequence grows.
        self._found: dict[int, tuple[np.ndarray, int]] = {}

    def _lookup(self, row: int, k: int) -> np.ndarray:
        found, asked = self._found.get(row, (None, 0))
        if found is None or (k > asked and found.size == asked):
            found = self._history[row].continuation(k)
            self._found[row] = (found, k)
        return found[:k]

    def available(self, row: int, k: int) -> int | None:
        return int(self._lookup(row, k).size)

    def reset(self) -> None:
        super().reset()
        self._history.clear()
        self._found.clear()

    def join(self, row, sequence, hidden, state, common) -> None:
        self.rows.append(row)
        self._history[row] = NgramIndex(sequence, self.max_ngram, self.min_ngram)
        self._found.pop(row, None)

    def leave(self, row: int):
        self.rows.remove(row)
        self._found.pop(row, None)
        self._history.pop(row)

    def draft(self, ks, configs, randoms) -> DraftBlock | None:
        found = {row: self._lookup(row, k) for row, k in ks.items()}
        rows = [row for row, f in found.items() if f.size]
        if not rows:
            return None
        width = max(found[row].size for row in rows)
        tokens = np.zeros((len(rows), width), dtype=np.uint32)
        for i, row in enumerate(rows):
            tokens[i, : found[row].size] = found[row]
        return DraftBlock(rows, [int(found[row].size) for row in rows], mx.array(tokens))

    def accept(self, row, drafted, accepted, emitted, hidden) -> None:
        self._history[row].extend(emitted)
        self._found.pop(row, None)


class _ModelDrafter(BatchDrafter):
    """A model over a `BatchCache` of its rows; per row the tokens emitted but not yet fed
    (the next draft feeds them, the last one included)."""

    feeds_prompt = True
    chained = True

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cache: BatchCache | None = None
        self._pending: dict[int, list[int]] = {}
        self._hidden: dict[int, list[mx.array]] = {}  # MTP: hidden rows of the pending pairs
        self._fed: dict[int, tuple[int, int]] = {}  # row -> (cache length, pending) at drafting
        self._cuts: dict[int, int] = {}  # row -> the length its cache is cut back to (queued)

    def available(self, row: int, k: int) -> int | None:
        return None if self._pending[row] else 0

    def backlog(self, row: int) -> int:
        return max(0, len(self._pending[row]) - 1)

    def reset(self) -> None:
        super().reset()
        self.cache = None
        for state in (self._pending, self._hidden, self._fed, self._cuts):
            state.clear()

    def _add(self, row: int, cache: BatchCache) -> None:
        self._apply_cuts()
        self.rows.append(row)
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)

    def leave(self, row: int) -> BatchCache:
        """The row's cache, compact."""
        self._apply_cuts()
        i = self.rows.index(row)
        one = self.cache.extract(i, self.model)
        rest = [j for j in range(len(self.rows)) if j != i]
        self.rows.pop(i)
        self.cache = None if not self.rows else self.cache
        if self.cache is not None:
            self.cache.filter(rest)
        self._pending.pop(row)
        self._hidden.pop(row, None)
        self._fed.pop(row, None)
        return one

    def _reuse(self, state: BatchCache | None, keep: int) -> tuple[BatchCache, int]:
        """`state` cut back to `keep` tokens where it can be, else a new empty cache."""
        if state is not None and keep > 0 and state.can_truncate(keep):
            state.truncate([min(keep, state.lengths[0])])
            return state, state.lengths[0]
        return BatchCache(self.model, 1), 0

    def token_bytes(self, width: int) -> int:
        self._apply_cuts()
        kept, self.cache = self.cache, BatchCache(self.model, 1)
        try:  # one token through a fresh one-row cache
            hidden = mx.zeros((1, 1, width)) if self.needs_hidden else None
            self._pass(mx.zeros((1, 1), mx.uint32), [1], hidden, mx.zeros((1,), mx.int32))
            return self.cache.bytes_per_token()
        finally:
            self.cache = kept

    def _pass(self, x: mx.array, lengths: list[int], hidden: mx.array | None, at) -> mx.array:
        """One pass over the drafter's rows: `[B, S]` ids (row i's first `lengths[i]` real);
        the logits `[B, V]` at row i's position `at[i]` (the head projects no other)."""
        self.cache.begin(lengths)
        logits = _logits_at(self.model, x, self.cache.layers, hidden, at)
        self.cache.end(lengths)
        return logits[:, 0]

    def draft(self, ks, configs, randoms) -> DraftBlock | None:
        want = [ks.get(row, 0) if self._pending[row] else 0 for row in self.rows]
        if not any(want):
            return None
        self._apply_cuts()
        self.cache.tidy()
        first = [self._pending[row] if k else [] for row, k in zip(self.rows, want, strict=True)]
        lengths = [len(t) for t in first]
        width = max(lengths)
        x = mx.array([t + [0] * (width - len(t)) for t in first], mx.uint32)
        hidden = self._first_hidden(want, lengths) if self.needs_hidden else None
        self._fed = {
            row: (self.cache.lengths[i], lengths[i]) for i, row in enumerate(self.rows) if want[i]
        }
        configs = [configs.get(row, SamplingConfig()) for row in self.rows]
        randoms = [randoms.get(row) for row in self.rows]
        at = mx.array([max(n - 1, 0) for n in lengths])
        greedy = all(c.greedy for c, k in zip(configs, want, strict=True) if k)
        tokens, probs = [], []
        for step in range(max(want)):
            last = self._pass(x, lengths, hidden, at)[:, : self.vocab]
            if greedy:  # every drafting row takes the argmax: no distributions, no noise
                token = mx.argmax(last, axis=-1).astype(mx.uint32)
            else:
                p = batch_probs(last, configs)
                drawing = [r if k > step else None for r, k in zip(randoms, want, strict=True)]
                token = draw(p, gumbel(drawing, (p.shape[-1],)))  # [B]
                probs.append(p)
            tokens.append(token)
            # Each draft computes while the next pass is built (the passes run one after
            # another; built all before any ran, a lone row's K = 4 waited 1.2-1.9 ms).
            mx.async_eval(token)
            lengths = [1 if k > step + 1 else 0 for k in want]
            if self.needs_hidden:  # the module's own output at the drawing position
                hidden = self.model.feedback
            x, at = token[:, None], mx.zeros_like(at)
        dists = None if greedy else mx.stack(probs, axis=1)  # [B, steps, V]
        return DraftBlock(list(self.rows), want, mx.stack(tokens, axis=1), dists)

    def _cut(self, row: int, length: int) -> None:
        """Queue the row's rollback to `length` tokens: the rows settled after one step are
        cut together (one masking pass over the positions, not one per row)."""
        self._cuts[row] = length

    def _apply_cuts(self) -> None:
        if not self._cuts:
            return
        lengths = self.cache.lengths
        for row, length in self._cuts.items():
            lengths[self.rows.index(row)] = length
        self._cuts.clear()
        self.cache.truncate(lengths)

    def accept(self, row, drafted, accepted, emitted, hidden) -> None:
        if drafted and row in self._fed:
            self._settle(row, drafted, accepted, list(emitted), hidden)
            return
        self._pending[row] = self._pending[row] + list(emitted)
        if self.needs_hidden:
            self._hidden.setdefault(row, []).append(hidden)


class BatchDraftModel(_ModelDrafter):
    """A small model with the target's tokenizer, batched over its rows.

    Its cache holds each row's sequence but the pending tokens. Drafting k feeds the pending
    tokens, then k - 1 drafts; afterwards the cache keeps the pending tokens and the accepted
    drafts (after a full acceptance the last draft was never fed and stays pending with the
    bonus token).
    """

    name = "draft-model"

    def join(self, row, sequence, hidden, state, common) -> None:
        cache, fed = self._reuse(state, min(common, len(sequence) - 1))
        _prefill(self.model, cache, sequence[fed:-1])
        self._pending[row] = [sequence[-1]]
        self._add(row, cache)

    def _settle(self, row, drafted, accepted, emitted, hidden) -> None:
        length, pending = self._fed.pop(row)
        fed = pending + drafted - 1  # the pending tokens and every draft but the last
        keep = fed if accepted == drafted else pending + accepted
        self._cut(row, length + keep)
        self._pending[row] = emitted[keep - pending :]


class BatchMTP(_ModelDrafter):
    """An MTP head batched over its rows.

    Its cache holds the pairs (h_p, t_{p+1}) of each row's sequence but the pending ones;
    drafting feeds the pending pairs, then its own output back (recursive reuse); afterwards
    the self-fed steps are dropped and the round's verified pairs become pending.
    """

    name = "mtp"
    needs_hidden = True

    def join(self, row, sequence, hidden, state, common) -> None:
        """Pairs of positions 0 .. len - 3 go into the cache; the last one stays pending."""
        pairs = len(sequence) - 1  # positions with a hidden state and a next token
        cache, fed = self._reuse(state, min(common - 1, pairs - 1))
        nexts = sequence[fed + 1 :]  # the token after each position fed .. len - 2
        _prefill(self.model, cache, nexts[:-1], hidden[fed : pairs - 1])
        self._pending[row] = nexts[-1:]
        self._hidden[row] = [hidden[pairs - 1 : pairs]] if pairs else []
        self._size = hidden.shape[-1]
        self._add(row, cache)

    def _first_hidden(self, want: list[int], lengths: list[int]) -> mx.array:
        """`[B, S, T]` hidden rows of the pending pairs fed by the first pass (zeros as pads)."""
        rows = []
        for row, n in zip(self.rows, lengths, strict=True):
            h = concat_rows(self._hidden.get(row, [])) if n else None
            if h is not None:
                self._hidden[row] = [h]
            rows.append(h)
        return _padded(rows, max(lengths), self._size)

    def _settle(self, row, drafted, accepted, emitted, hidden) -> None:
        length, pending = self._fed.pop(row)
        self._cut(row, length + pending)  # the true pairs fed; every self-fed step dropped
        self._pending[row] = emitted
        self._hidden[row] = [hidden]


class BatchEagle3(BatchMTP):
    """An EAGLE-3 head batched over its rows: the MTP head's pairs, rollback and recursive
    reuse, over the features of the target layers it names (`hidden_layers`)."""

    name = "eagle3"

    def __init__(self, head: nn.Module):
        super().__init__(head)
        self.hidden_layers = tuple(head.cfg.layer_ids)


class BatchDFlash(_ModelDrafter):
    """A DFlash block drafter batched over its rows: one pass of its stack drafts every row's
    block.

    Its cache holds each row's context: the K/V of the target's features at the committed
    positions, fed when the row joins and, for the positions committed since (queued by
    `accept`), at the start of the next draft. A row's block (its pending token, then k mask
    tokens) is never stored, so a rejection leaves nothing to roll back.
    """

    name = "dflash"
    needs_hidden = True
    chained = False  # one pass drafts the whole block

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.hidden_layers = model.hidden_layers
        self.max_depth = model.cfg.block_size - 1

    def available(self, row: int, k: int) -> int | None:
        return min(k, self.max_depth)

    def backlog(self, row: int) -> int:
        return max(0, sum(h.shape[0] for h in self._hidden[row]) - 1)

    def token_bytes(self, width: int) -> int:
        cache = BatchCache(self.model, 1)
        self.model.feed_rows(mx.zeros((1, 1, width)), cache, [1])
        return cache.bytes_per_token()

    def join(self, row, sequence, hidden, state, common) -> None:
        """The context: every position but the last (the pending token's)."""
        context = len(sequence) - 1
        cache, fed = self._reuse(state, min(common, context))
        for start in range(fed, context, 2048):
            chunk = hidden[start : min(start + 2048, context)]
            self.model.feed_rows(chunk[None], cache, [chunk.shape[0]])
            mx.eval(cache.state)
        self._pending[row] = [sequence[-1]]
        self._hidden[row] = []
        self._add(row, cache)

    def draft(self, ks, configs, randoms) -> DraftBlock | None:
        want = [min(ks.get(row, 0), self.max_depth) for row in self.rows]
        if not any(want):
            return None
        self.cache.tidy()
        queued = [self._hidden[row] for row in self.rows]
        lengths = [sum(h.shape[0] for h in q) for q in queued]
        if any(lengths):  # every row's newly committed positions join its context
            rows = [concat_rows(q) for q in queued]
            size = next(h for h in rows if h is not None).shape[-1]
            self.model.feed_rows(_padded(rows, max(lengths), size), self.cache, lengths)
            for row in self.rows:
                self._hidden[row] = []
        k = max(want)
        mask = self.model.cfg.mask_token_id
        block = [[self._pending[row][0]] + [mask] * k for row in self.rows]
        sizes = [1 + n for n in want]
        logits = self.model.draft_rows(mx.array(block, mx.uint32), self.cache, sizes)
        configs = [configs.get(row, SamplingConfig()) for row in self.rows]
        randoms = [randoms.get(row) for row in self.rows]
        tokens, probs = [], []
        for j in range(k):  # each row draws once per draft it asked for, in order
            p = batch_probs(logits[:, j, : self.vocab], configs)
            drawing = [r if n > j else None for r, n in zip(randoms, want, strict=True)]
            tokens.append(draw(p, gumbel(drawing, (p.shape[-1],))))
            probs.append(p)
        greedy = all(c.greedy for c, n in zip(configs, want, strict=True) if n)
        dists = None if greedy else mx.stack(probs, axis=1)
        return DraftBlock(list(self.rows), want, mx.stack(tokens, axis=1), dists)

    def accept(self, row, drafted, accepted, emitted, hidden) -> None:
        """The committed positions (the old pending token and the kept drafts) queue their
        features; the last emitted token is pending."""
        if hidden is not None and hidden.shape[0]:
            self._hidden[row].append(hidden)
        self._pending[row] = [emitted[-1]]


def concat_rows(parts: list[mx.array]) -> mx.array | None:
    """Arrays of rows concatenated (None: there are none)."""
    return mx.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else None)


def _padded(rows: list[mx.array | None], width: int, size: int) -> mx.array:
    """`[B, width, size]`: each row's `[n, size]` array (None: none), then rows of zeros."""
    dtype = next((h.dtype for h in rows if h is not None), mx.float32)
    out = []
    for h in rows:
        n = 0 if h is None else h.shape[0]
        parts = ([] if h is None else [h]) + (
            [mx.zeros((width - n, size), dtype)] if width > n else []
        )
        out.append(concat_rows(parts))
    return mx.stack(out)


def _prefill(model: nn.Module, cache: BatchCache, tokens: list[int], hidden=None, step=2048):
    """Feed a one-row cache `tokens` (with their `[len, T]` hidden rows for MTP heads); the
    head projects one position per chunk (no logits are wanted)."""
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        cache.begin([len(chunk)])
        x = mx.array([chunk], mx.uint32)
        rows = None if hidden is None else hidden[None, start : start + step]
        _logits_at(model, x, cache.layers, rows, mx.zeros((1,), mx.int32))
        cache.end([len(chunk)])
        mx.eval(cache.state)


def _logits_at(model: nn.Module, x: mx.array, layers: list, hidden, at: mx.array) -> mx.array:
    """`[B, 1, V]`: the model's logits at row i's position `at[i]` only. Drafter heads of
    ours (MTP, EAGLE-3) narrow themselves; a draft model's head is narrowed from outside."""
    if hidden is not None:
        return model(x, cache=layers, hidden=hidden, at=at)
    return logits_at(model, at, x, cache=layers)
