"""Verification of a tree of drafts: the path the target accepts and the token after it.

A `TokenTree` holds drafts under the root (the pending token); the target's logits at the root
and at every node (one pass: `decoding/tree.py`) decide which path stays.

- greedy: the longest path whose tokens equal the target's argmax at their parents, then the
  target's argmax after it;
- sampling: multi-candidate speculative sampling (SpecInfer, Miao et al. 2024, Algorithm 2;
  the same rule as "multi-draft speculative sampling"): at each node its children are tried in
  turn, child x drawn from q is accepted with probability min(1, p(x) / q(x)); on rejection p
  becomes norm(max(0, p - q)) before the next child; when every child is rejected the token is
  drawn from the last residual. Each child must be drawn independently of its siblings (from
  its own q, or chosen deterministically, which is q one-hot on it); then every emitted token
  is distributed exactly as the target's sampling distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mlx_spec.core.sampling import SamplingConfig, logits_to_probs

import mlx.core as mx
import numpy as np


@dataclass
class TokenTree:
    """Draft tokens as a tree under the root (the pending token).

    Attributes:
        tokens: `[N]` node ids.
        parents: `[N]` each node's parent: -1 for the root, else an earlier node's index.
        probs: `[N, vocab]` the distribution each node was drawn from, or None: every node was
            chosen deterministically (one-hot for the verifier).
    """

    tokens: list[int]
    parents: list[int]
    probs: mx.array | None = None
    depths: list[int] = field(init=False)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        self.depths = []
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} is not an earlier node or the root")
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        if any(b < a for a, b in zip(self.depths, self.depths[1:], strict=False)):
            raise ValueError("tree nodes must be ordered by depth (breadth first)")

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: mx.array | None = None) -> TokenTree:
        """A chain of drafts: a tree with one child per node."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def children(self) -> list[list[int]]:
        """Per row (0: the root, 1 + i: node i), its children's node indices in order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return out

    def ancestors(self) -> np.ndarray:
        """`[N + 1, N + 1]` bool: row r sees row c (rows: the root, then the nodes) when c is r
        or one of its ancestors."""
        n = len(self) + 1
        seen = np.eye(n, dtype=bool)
        seen[:, 0] = True
        for i, parent in enumerate(self.parents):
            seen[i + 1] |= seen[parent + 1]
        return seen


# --- verification --------------------------------------------------------------------------


def greedy_tree_verify(logits: mx.array, tree: TokenTree) -> tuple[list[int], int]:
    """Temperature 0: the accepted path (node indices, root to leaf) and the next token.

    Args:
        logits: `[N + 1, vocab]` the target's logits at the root and at every node.
    """
    best = np.array(mx.argmax(logits, axis=-1)).tolist()
    children = tree.children()
    path, row = [], 0
    while True:
        match = next((c for c in children[row] if tree.tokens[c] == best[row]), None)
        if match is None:
            return path, best[row]
        path.append(match)
        row = match + 1


def tree_rejection_verify(
    probs: mx.array, tree: TokenTree, uniforms=None, draw=None
) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over the tree (see the module's docstring).

    Args:
        probs: `[N + 1, vocab]` the target's sampling distributions at the root and the nodes.
        uniforms: a function returning one U(0, 1) draw (default: MLX's random stream).
        draw: a function drawing a token from a `[vocab]` numpy distribution (default: MLX's).
    Returns:
        (accepted path of node indices, next token).
    """
    uniforms = uniforms or (lambda: mx.random.uniform().item())
    draw = draw or _draw
    p_all = np.array(probs, dtype=np.float64)
    q_all = None if tree.probs is None else np.array(tree.probs, dtype=np.float64)
    children = tree.children()
    path, row = [], 0
    while True:
        p = p_all[row]
        accepted = None
        for child in children[row]:
            x = tree.tokens[child]
            q_x = 1.0 if q_all is None else q_all[child, x]
            if q_x > 0 and uniforms() * q_x < p[x]:
                accepted = child
                break
            p = tree_residual(p, None if q_all is None else q_all[child], x)
        if accepted is None:
            return path, draw(p)
        path.append(accepted)
        row = accepted + 1


def tree_residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """What the next child is verified against once child x (drawn from q; None: chosen,
    one-hot) was rejected: norm(max(0, p - q)). Where that leaves no mass (p == q up to
    rounding), p itself is the answer."""
    if q is None:
        left = p.copy()
        left[x] = 0.0
    else:
        left = np.maximum(p - q, 0.0)
    mass = left.sum()
    return left / mass if mass > 0 else p


def _draw(p: np.ndarray) -> int:
    logp = mx.log(mx.array(p.astype(np.float32)))
    return int(mx.random.categorical(logp).item())


def verify_tree(
    logits: mx.array, tree: TokenTree, sampling: SamplingConfig
) -> tuple[list[int], int]:
    """The path the target accepts and the token after it, greedy or sampled."""
    if sampling.greedy:
        return greedy_tree_verify(logits, tree)
    return tree_rejection_verify(logits_to_probs(logits, sampling), tree)
