"""Tree verification: the target scores a whole tree of drafts in one pass.

A drafter may propose several candidates per position: a `TokenTree` under the pending token
(the root, the last token of the sequence, not yet in the target's cache). `TreeTarget` feeds
the root and every node in one pass over a one-row `BatchCache`: node j sits at position
`offset + depth(j)` and attends to the sequence so far and to its own ancestors only (an
ancestor mask over the pass's columns; sliding windows stay masks over positions). The
model's rotary embeddings are given per-node positions by swapping each RoPE module's class
for a subclass (no fork of mlx-lm's model files, as the hidden-state tap does). After
verification only the accepted path's columns stay: they hold positions `offset + 1 ..`, so
the sequence in the cache is contiguous, and the other columns are marked empty (squeezed out
by a compaction once they are a large part of the cache).

The accepted path and the token after it: `core/tree_verify.py` (greedy, or multi-candidate
speculative sampling).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mlx_spec.caches.batch import EMPTY, BatchCache, batchable
from mlx_spec.caches.taps import tap_for
from mlx_spec.core import clock
from mlx_spec.core.sampling import SamplingConfig, pick
from mlx_spec.core.stats import SpecStats
from mlx_spec.core.tree_verify import TokenTree, verify_tree
from mlx_spec.decoding.chain import Round
from mlx_spec.decoding.policy import DraftPolicy
from mlx_spec.decoding.runner import context_limit
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.models.mtp import target_hidden_size

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PREFILL_STEP = 512


# --- per-node positions for rotary embeddings --------------------------------------------------


class _TreePositions:
    """The depths `[L]` of the pass being fed (None: an ordinary pass), read by the swapped
    RoPEs."""

    depths: mx.array | None = None


_ACTIVE = _TreePositions()
_ROPE_SUBCLASSES: dict[type, type] = {}


def _tree_rope_subclass(cls: type) -> type:
    if cls not in _ROPE_SUBCLASSES:
        original = cls.__call__

        def __call__(self, x, offset=0):
            depths = _ACTIVE.depths
            if depths is None or x.ndim != 4 or x.shape[-2] != depths.shape[0]:
                return original(self, x, offset)
            return _rope_by_depth(lambda part, off: original(self, part, off), x, offset, depths)

        _ROPE_SUBCLASSES[cls] = type(f"Tree{cls.__name__}", (cls,), {"__call__": __call__})
    return _ROPE_SUBCLASSES[cls]


def _rope_by_depth(rope, x: mx.array, offset, depths: mx.array) -> mx.array:
    """`x` `[B, H, L, D]` with token j at position offset + depths[j]: rotated in one call as
    a batch of B * L one-token sequences, each with its own offset."""
    b, h, n, d = x.shape
    flat = x.transpose(0, 2, 1, 3).reshape(b * n, h, 1, d)
    if isinstance(offset, mx.array) and offset.ndim:  # per-row offsets `[B]`
        positions = (offset[:, None] + depths[None]).reshape(-1)
    else:
        positions = mx.broadcast_to((offset + depths)[None], (b, n)).reshape(-1)
    out = rope(flat, positions)
    return out.reshape(b, n, h, d).transpose(0, 2, 1, 3)


def rope_modules(model: nn.Module) -> list[nn.Module]:
    """The model's rotary-embedding modules (attributes named `rope` or `rotary_emb`)."""
    return [
        m
        for name, m in model.named_modules()
        if name.split(".")[-1] in ("rope", "rotary_emb") and callable(m)
    ]


def enable_tree_positions(model: nn.Module) -> None:
    """Let the model's RoPEs take per-token positions during tree passes (idempotent)."""
    for module in rope_modules(model):
        if type(module) not in _ROPE_SUBCLASSES.values():
            module.__class__ = _tree_rope_subclass(type(module))


# --- the target ----------------------------------------------------------------------------


def tree_unsupported(model: nn.Module) -> str | None:
    """Why this model cannot score a tree in one pass (None: it can)."""
    if not batchable(model):
        return (
            f"tree verification needs a model whose layers all use attention caches; "
            f"{type(model).__module__.split('.')[-1]} has recurrent state, which cannot "
            "score several branches in one pass"
        )
    if not rope_modules(model):
        return (
            f"tree verification needs the model's rotary embeddings; "
            f"{type(model).__module__} has none named rope / rotary_emb"
        )
    return None


class TreeTarget:
    """The target over a one-row `BatchCache`, scoring trees in one pass.

    Args:
        model: an mlx-lm model whose caches `BatchCache` can stand in for (attention with full
            or sliding-window caches).
        vocab_size: logits are cut to the tokenizer's vocabulary.
        keep_hidden: record the final hidden states of every pass (for drafters reading them).
    """

    def __init__(self, model: nn.Module, vocab_size: int, *, keep_hidden: bool | tuple = False):
        reason = tree_unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        enable_tree_positions(model)
        self.model, self.vocab_size = model, vocab_size
        self.context_limit = context_limit(model)
        self.cache = BatchCache(model, 1)
        self._tap = tap_for(model, keep_hidden)
        self._pending = False  # a scored graph waits for `settle`

    @property
    def length(self) -> int:
        """Tokens in the cache."""
        return self.cache.lengths[0]

    def _forward(self, tokens: list[int] | mx.array, fed: mx.array | None) -> mx.array:
        x = tokens if isinstance(tokens, mx.array) else mx.array(tokens, mx.uint32)
        x = x.astype(mx.uint32).reshape(1, -1)
        if fed is None:
            return self.model(x, cache=self.cache.layers)
        return self.model(x, cache=self.cache.layers, hidden=fed[None])

    def prefill(
        self, tokens: list[int], fed: mx.array | None = None, *, sync: bool = True
    ) -> mx.array | None:
        """Feed tokens whose logits are not needed; returns their `[len, hidden]` final hidden
        states when kept, else None. `fed`: `[len, T]` hidden states the model takes beside
        the tokens (an MTP head run as the model). `sync=False`: leave the work queued (a
        few tokens that ride along with the pass after them)."""
        kept = []
        for start in range(0, len(tokens), PREFILL_STEP):
            chunk = tokens[start : start + PREFILL_STEP]
            self.cache.begin([len(chunk)])
            self._forward(chunk, None if fed is None else fed[start : start + len(chunk)])
            self.cache.end([len(chunk)])
            kept += [self._tap.hidden[0]] if self._tap is not None else []
            if sync:
                mx.eval(self.cache.state, kept[-1:])
        if self._tap is None:
            return None
        return mx.concatenate(kept) if kept else mx.zeros((0, 1))

    def score(
        self, root: int, tree: TokenTree, fed: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Feed the root and every node in one pass: `[N + 1, vocab]` logits (row 0: after the
        root, row 1 + i: after node i) and the `[N + 1, hidden]` hidden states (if kept).
        `fed`: as in `prefill`, `[N + 1, T]`. `settle` must follow before the next pass."""
        return self.score_graph(root, tree.tokens, tree.depths, tree.ancestors(), fed)

    def score_graph(
        self, root: int, tokens: list[int], depths: list[int], visible, fed=None
    ) -> tuple[mx.array, mx.array | None]:
        """`score` for any graph of nodes under the root: node j at position offset +
        depths[j] (non-decreasing), seeing row c when `visible[1 + j, c]` (row 0: the root,
        seen by every node)."""
        depths = [0] + list(depths)
        self.cache.begin_tree(depths, visible)
        _ACTIVE.depths = mx.array(depths, mx.int32)
        if isinstance(tokens, mx.array):  # queued tokens (a drafter's own, not yet read)
            tokens = mx.concatenate([mx.array([root], mx.uint32), tokens.astype(mx.uint32)])
        else:
            tokens = [root] + list(tokens)
        try:
            logits = self._forward(tokens, fed)[0, :, : self.vocab_size]
        finally:
            _ACTIVE.depths = None
        self.cache.end_tree()
        self._pending = True
        hidden = self._tap.hidden[0] if self._tap is not None else None
        return logits, hidden

    def settle(self, path: Sequence[int]) -> None:
        """Keep the root and the nodes of `path` (a root-to-node path) in the cache."""
        if not self._pending:
            raise RuntimeError("settle() without a scored tree")
        self.cache.keep_tree([0] + [node + 1 for node in path])
        self._pending = False
        if self.cache.waste() > 0.5:
            self.cache.compact()

    def settle_none(self) -> None:
        """Drop the whole scored pass, the root included (a drafter scoring what it may
        propose)."""
        if not self._pending:
            raise RuntimeError("settle_none() without a scored tree")
        self.cache.drop_tree()
        self._pending = False

    def plain_step(self, token, sampling: SamplingConfig) -> tuple[mx.array, mx.array | None]:
        """Queue one plain pass over `token` (an id or a lazy `[]` array): its next token (lazy,
        evaluation started) and the `[T]` hidden state at `token` (if kept)."""
        x = mx.array([[token]], mx.uint32) if isinstance(token, int) else token.reshape(1, 1)
        self.cache.begin([1])
        logits = self.model(x.astype(mx.uint32), cache=self.cache.layers)[0, -1, : self.vocab_size]
        self.cache.end([1])
        nxt = pick(logits, sampling)
        hidden = self._tap.hidden[0, -1] if self._tap is not None else None
        mx.async_eval(nxt)
        return nxt, hidden

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        self.cache.truncate([length])

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes


__all__ = [
    "EMPTY",
    "TreeDrafter",
    "TreeAsChain",
    "TreeTarget",
    "enable_tree_positions",
    "tree_rounds",
    "tree_unsupported",
]


# --- the decode loop ---------------------------------------------------------------------------


class TreeDrafter:
    """Anything that proposes a token tree each round (the tree counterpart of `Drafter`)."""

    name = "tree"
    # True: `begin` and `accept` receive the target's final hidden states (or, with
    # `hidden_layers`, those layers' features; see `Drafter`).
    needs_hidden = False
    hidden_layers: tuple[int, ...] | None = None
    max_depth = 8

    def check_compatible(self, hidden_size: int, vocab_size: int) -> None:
        """Raise ValueError if this drafter cannot serve a target of these sizes."""

    def begin(self, prompt: list[int], hidden: mx.array | None) -> None:
        """A new sequence: every token so far (the last is pending), and with `needs_hidden`
        the target's `[len(prompt) - 1, T]` hidden states of the others."""
        raise NotImplementedError

    def draft_tree(self, depth: int, vocab_size: int, sampling: SamplingConfig) -> TokenTree:
        """A tree of at most `depth` levels under the pending token."""
        raise NotImplementedError

    def accept(self, tokens: list[int], hidden: mx.array | None) -> None:
        """After a round: the tokens that joined the sequence after the old pending token
        (the last is the new pending one) and, with `needs_hidden`, the target's
        `[len(tokens), T]` hidden states at the positions whose next token each of them is
        (row 0: the old pending token's; the last row: the last token now in the cache)."""
        raise NotImplementedError

    def side_branch(self) -> SideBranch | None:
        """Nodes to feed beside the next tree (None: none)."""
        return None

    def observe_side(self, best: mx.array) -> None:
        """The target's argmax after each node of the side branch, in its order."""


class TreeAsChain(Drafter):
    """A tree drafter drafting chains, for targets that cannot score trees: each round its
    tree's first branch (each node's first child), verified as an ordinary chain."""

    def __init__(self, tree_drafter: TreeDrafter):
        self.tree_drafter = tree_drafter
        self.name = tree_drafter.name
        self.needs_hidden = tree_drafter.needs_hidden
        self.hidden_layers = tree_drafter.hidden_layers
        self.vocab_size = 0

    def check_compatible(self, target: nn.Module, tokenizer, vocab_size: int) -> None:
        self.tree_drafter.check_compatible(target_hidden_size(target), vocab_size)

    def begin(self, prompt: list[int], vocab_size: int, hidden: mx.array | None = None) -> None:
        self.vocab_size = vocab_size
        self.tree_drafter.begin(prompt, hidden)

    def draft(self, k: int, sampling: SamplingConfig) -> Draft:
        depth = min(k, self.tree_drafter.max_depth)
        tree = self.tree_drafter.draft_tree(depth, self.vocab_size, sampling) if depth else None
        if not tree:
            return Draft.empty()
        children, path = tree.children(), []
        while children[path[-1] + 1 if path else 0]:
            path.append(children[path[-1] + 1 if path else 0][0])
        probs = None if tree.probs is None else tree.probs[mx.array(path)]
        return Draft(mx.array([tree.tokens[i] for i in path], mx.uint32), probs)

    def accept(self, num_accepted: int, emitted: list[int], hidden: mx.array | None = None) -> None:
        self.tree_drafter.accept(emitted, hidden)


def tree_rounds(
    target: TreeTarget,
    drafter: TreeDrafter,
    last: int,
    *,
    sampling: SamplingConfig,
    max_tokens: int,
    policy: DraftPolicy,
    stats: SpecStats | None = None,
) -> Iterator[Round]:
    """Tree rounds (draft a tree of the policy's depth -> verify it in one pass -> keep the
    accepted path) and, when the policy finds they do not pay, stretches of plain steps,
    until `max_tokens` or the context is used up. `target` holds every token but `last`; the
    drafter has been begun on the same sequence. A round is settled when the consumer asks
    for the next one or closes the generator (after cutting it with `Round.keep`)."""
    state = {"last": last, "produced": 0}
    start = target.length
    while state["produced"] < max_tokens:
        _check_length(target, start + state["produced"])
        room = None if target.context_limit is None else target.context_limit - target.length - 1
        if room is not None and room <= 0:
            return
        limit = min(policy.max_draft, max_tokens - state["produced"] - 1)
        if room is not None:
            limit = min(limit, room - 1)  # the deepest node sits `limit` positions on
        choice = policy.choose(max(limit, 0)) if limit > 0 else None
        if choice is None or choice.plain_tokens:
            count = 1 if choice is None else choice.plain_tokens
            count = min(count, max_tokens - state["produced"], room or count)
            yield from _plain_stretch(target, drafter, state, count, sampling, policy, stats)
        else:
            yield from _tree_round(
                target, drafter, state, choice.num_draft, sampling, policy, stats
            )


@dataclass
class SideBranch:
    """Nodes a drafter adds to a round's pass beside its tree, whose outputs it reads but
    which are never candidates (lookahead decoding's Jacobi window): node j at depth
    `depths[j]` sees the root and the nodes c with `visible[j, c]` (itself included)."""

    tokens: list[int]
    depths: list[int]
    visible: np.ndarray


def merge_graph(tree: TokenTree, side: SideBranch):
    """One pass over a tree and a side branch that cannot see each other, ordered by depth:
    (tokens, depths, visibility `[1 + n, 1 + n]` with the root first, each tree node's index
    in the pass, each side node's)."""
    items = [(d, 0, j) for j, d in enumerate(tree.depths)]
    items += [(d, 1, j) for j, d in enumerate(side.depths)]
    items.sort()
    where = {(kind, j): i for i, (_, kind, j) in enumerate(items)}
    n = len(items)
    visible = np.zeros((n + 1, n + 1), dtype=bool)
    visible[:, 0] = True
    own = tree.ancestors()
    for (kind, j), i in where.items():
        if kind == 0:
            for c in range(len(tree)):
                if own[1 + j, 1 + c]:
                    visible[1 + i, 1 + where[(0, c)]] = True
        else:
            for c in np.flatnonzero(side.visible[j]):
                visible[1 + i, 1 + where[(1, int(c))]] = True
    tokens = [tree.tokens[j] if kind == 0 else side.tokens[j] for _, kind, j in items]
    depths = [d for d, _, _ in items]
    tree_at = [where[(0, j)] for j in range(len(tree))]
    side_at = [where[(1, j)] for j in range(len(side.tokens))]
    return tokens, depths, visible, tree_at, side_at


def _tree_round(target, drafter, state, depth, sampling, policy, stats) -> Iterator[Round]:
    tic = clock.now()
    tree = drafter.draft_tree(depth, target.vocab_size, sampling)
    side = drafter.side_branch()
    if side is None:
        logits, hidden = target.score(state["last"], tree)
        tree_at = list(range(len(tree)))
    else:
        tokens, depths, visible, tree_at, side_at = merge_graph(tree, side)
        logits, hidden = target.score_graph(state["last"], tokens, depths, visible)
        drafter.observe_side(mx.argmax(logits[mx.array([1 + i for i in side_at])], axis=-1))
        logits = logits[mx.array([0] + [1 + i for i in tree_at])]
    path, nxt = verify_tree(logits, tree, sampling)
    tokens = [tree.tokens[i] for i in path] + [nxt]
    rnd = Round(tokens, tree.depth, len(path), clock.now() - tic, drafter=drafter.name)
    try:
        yield rnd
    finally:
        keep = len(tokens) if rnd.keep is None else max(1, min(rnd.keep, len(tokens)))
        kept = [tree_at[i] for i in path[: keep - 1]]  # the last kept token stays pending
        target.settle(kept)
        rows = mx.array([0] + [i + 1 for i in kept])
        drafter.accept(tokens[:keep], None if hidden is None else hidden[rows])
        state["produced"] += keep
        state["last"] = tokens[keep - 1]
        policy.observe_round(0, depth, tree.depth, len(kept), clock.now() - tic)
        if stats is not None:
            stats.observe_choice(drafter.name, depth)


def _check_length(target: TreeTarget, expected: int) -> None:
    """The checked-length invariant, every round: the cache holds exactly the sequence so far
    (its count, and the positions its columns hold: 0 .. expected - 1; once each where no
    window drops old columns). One synchronisation for all of it."""
    groups = [g for g in target.cache.groups.values() if g.idx]
    stats = [
        mx.stack([(g.pos[0, : g.idx] >= 0).sum(), g.pos[0, : g.idx].max() + 1]) for g in groups
    ]
    found = mx.stack(stats).tolist() if stats else []
    held = [h for (h, _), g in zip(found, groups, strict=True) if g.window is None]
    last = [n for _, n in found]
    if target.length != expected or any(n != expected for n in last + held):
        raise RuntimeError(
            f"tree cache out of step: it holds {target.length} tokens (positions up to "
            f"{last}), the sequence {expected}"
        )


def _plain_stretch(target, drafter, state, count, sampling, policy, stats) -> Iterator[Round]:
    """`count` plain steps, pipelined: each step's pass is queued before the token of the step
    before it is read. A consumer that closes early gets the pass queued over the token it
    stopped at taken back out, so that token stays pending."""
    start = tic = clock.now()
    token, hidden = target.plain_step(state["last"], sampling)
    rnd, ahead, settled, done = None, None, True, 0

    def follow() -> None:
        drafter.accept(rnd.tokens, None if hidden is None else hidden[None])
        state["produced"] += 1
        state["last"] = rnd.tokens[0]
        if stats is not None:
            stats.observe_choice(None, 0)

    try:
        for i in range(count):
            ahead = target.plain_step(token, sampling) if i < count - 1 else None
            rnd = Round([token.item()], 0, 0, clock.now() - tic)
            settled = False
            yield rnd
            follow()
            settled, done = True, done + 1
            tic = clock.now()
            if ahead is not None:
                token, hidden = ahead
    finally:
        if not settled:  # closed after `rnd`: its token stays pending
            if ahead is not None:
                target.truncate(target.length - 1)  # undo the pass queued over it
            follow()
            done += 1
        if done:
            policy.observe_plain(done, clock.now() - start)
