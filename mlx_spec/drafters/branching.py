"""A draft model proposing a tree: its top candidates at the first position, each continued
by its own greedy chain.

The draft model runs on its own one-row `TreeTarget`, so each drafting pass scores the whole
partial tree (every branch sees only its own ancestors); the pass's columns are dropped
afterwards and the cache keeps only the verified sequence. The candidates are chosen, not
sampled, so the verifier treats them as one-hot: the output stays exactly the target's at any
temperature.
"""

from __future__ import annotations

from mlx_spec.sampling import SamplingConfig
from mlx_spec.tree import TokenTree, TreeDrafter, TreeTarget

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class BranchingDraftModel(TreeDrafter):
    """Args:
    model: the draft model (the target's tokenizer).
    width: candidates at the first position.
    max_depth: the deepest tree drafted.
    """

    name = "draft-tree"

    def __init__(self, model: nn.Module, width: int = 2, max_depth: int = 4):
        if width < 1 or max_depth < 1:
            raise ValueError(f"width and max_depth must be >= 1, got {width}, {max_depth}")
        self.model, self.width, self.max_depth = model, width, max_depth
        self.runner: TreeTarget | None = None
        self.pending = 0

    def begin(self, prompt: list[int], hidden) -> None:
        vocab = self.model.args.vocab_size
        self.runner = TreeTarget(self.model, vocab)
        self.unfed = list(prompt[:-1])  # fed to the draft model when it next drafts
        self.pending = prompt[-1]

    def accept(self, tokens: list[int], hidden) -> None:
        """Queue the new tokens: a plain stretch costs the draft model nothing until it
        drafts again."""
        self.unfed += [self.pending] + tokens[:-1]
        self.pending = tokens[-1]

    def draft_tree(self, depth: int, vocab_size: int, sampling: SamplingConfig) -> TokenTree:
        if self.unfed:
            self.runner.prefill(self.unfed)
            self.unfed = []
        tokens: list[int] = []
        parents: list[int] = []
        leaves = [-1]  # the nodes each next level grows from (-1: the root)
        for level in range(depth):
            tree = TokenTree(tokens, parents)
            logits, _ = self.runner.score(self.pending, tree)
            self.runner.settle_none()
            rows = mx.array([leaf + 1 for leaf in leaves])
            scores = np.array(logits[rows, :vocab_size])
            grown = []
            for leaf, row in zip(leaves, scores, strict=True):
                count = self.width if level == 0 else 1
                for token in np.argsort(-row)[:count].tolist():
                    tokens.append(int(token))
                    parents.append(leaf)
                    grown.append(len(tokens) - 1)
            leaves = grown
        return TokenTree(tokens, parents)
