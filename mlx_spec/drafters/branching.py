"""Drafters proposing a tree: their top candidates at the first position, each continued by
its own greedy chain, or (`dynamic`) EAGLE-2's dynamic tree, grown where the drafter is most
confident. Two kinds: a small draft model, and an MTP head or EAGLE-3 head (fed the target's
hidden states, and its own output hidden state down each branch).

The drafting network runs on its own one-row `TreeTarget`, so each drafting pass scores the
whole partial tree (every branch sees only its own ancestors); the pass's columns are dropped
afterwards and the cache keeps only the verified sequence. Greedy, the candidates are
chosen (one-hot for the verifier); sampling, they are drawn from the drafter and carry its
distribution. Either way the output stays exactly the target's.
"""

from __future__ import annotations

from mlx_spec.core.sampling import SamplingConfig, logits_to_probs, sample
from mlx_spec.core.tree_verify import TokenTree
from mlx_spec.decoding.tree import PREFILL_STEP, TreeDrafter, TreeTarget
from mlx_spec.models.mtp import MTPModule, target_hidden_size

import mlx.core as mx
import mlx.nn as nn


class _Branching(TreeDrafter):
    """The tree grown level by level: `width` candidates under the root, one under every other
    leaf; or, `dynamic`, EAGLE-2's tree (`_draft_dynamic`). Subclasses feed the network
    (`_feed_unfed`) and say what each pass takes beside the tokens (`_fed`)."""

    def __init__(self, width: int, max_depth: int, dynamic: bool = False):
        if width < 1 or max_depth < 1:
            raise ValueError(f"width and max_depth must be >= 1, got {width}, {max_depth}")
        self.width, self.max_depth, self.dynamic = width, max_depth, dynamic
        self.runner: TreeTarget | None = None
        self.pending: int | None = None

    def _feed_unfed(self) -> None:
        raise NotImplementedError

    def _fed(self, parents: list[int], feedback: mx.array | None) -> mx.array | None:
        """What a pass over the root and nodes with these parents takes beside the tokens,
        given the previous pass's feedback (None: tokens alone)."""
        return None

    def _feedback(self) -> mx.array | None:
        return None

    def draft_tree(self, depth: int, vocab_size: int, sampling: SamplingConfig) -> TokenTree:
        """Greedy: the best candidates (one-hot for the verifier). Sampling: `width` draws
        from the drafter's distribution at the root and one draw under every other leaf, each
        node with the distribution it was drawn from, so the multi-candidate rule accepts at
        least what a sampled chain would (chosen candidates would be accepted only with the
        target's probability of each). Every level's pass is queued on the tokens the one
        before chose, unread: one synchronisation per tree, when its tokens are read at the
        end (the dynamic tree, greedy only, ranks every level)."""
        if self.pending is None:
            return TokenTree([], [])
        self._feed_unfed()
        if self.dynamic and sampling.greedy:
            return self._draft_dynamic(depth, vocab_size)
        drawn = None if sampling.greedy else []  # the distributions the nodes were drawn from
        nodes = mx.zeros((0,), mx.uint32)
        parents: list[int] = []
        leaves = [-1]  # the nodes each next level grows from (-1: the root)
        feedback = None
        for level in range(depth):
            shape = TokenTree([0] * len(parents), parents)
            logits, _ = self.runner.score_graph(
                self.pending, nodes, shape.depths, shape.ancestors(), self._fed(parents, feedback)
            )
            feedback = self._feedback()
            rows = logits[mx.array([leaf + 1 for leaf in leaves]), :vocab_size]
            self.runner.settle_none()
            if drawn is not None:
                q = logits_to_probs(rows, sampling)
                if level == 0:  # `width` independent draws at the root
                    q = mx.repeat(q, self.width, axis=0)
                new, grown = sample(q), [-1] * self.width if level == 0 else leaves
                drawn.append(q)
            elif level == 0:  # the root's best `width`, best first
                width = min(self.width, vocab_size)
                top = mx.argpartition(-rows[0], kth=width - 1)[:width]
                new, grown = top[mx.argsort(-rows[0][top])], [-1] * width
            else:  # one more greedy token under every leaf
                new, grown = mx.argmax(rows, axis=-1), leaves
            nodes = mx.concatenate([nodes, new.astype(mx.uint32)])
            leaves = list(range(len(parents), len(parents) + len(grown)))
            parents += grown
        return TokenTree(nodes.tolist(), parents, None if drawn is None else mx.concatenate(drawn))

    def _draft_dynamic(self, depth: int, vocab_size: int) -> TokenTree:
        """EAGLE-2's dynamic tree. A candidate's score is its path's log-probability under the
        drafter (the sum from the root). Each level, the `width` best candidates of the level
        before are expanded (fed to the drafter, one pass for them all), each proposing its
        `width` most likely children; the tree is the `width * depth` best candidates of all
        (the size of the static tree), in which every ancestor of a node scores at least what
        the node does, so they form a tree. One synchronisation per level, to rank."""
        k = min(self.width, vocab_size)
        tokens: list[int] = []  # every candidate, in the order proposed (breadth first)
        parents: list[int] = []  # the candidate each was proposed under (-1: the root)
        scores: list[float] = []
        fed: list[int] = []  # the expanded candidates: the tree each drafting pass scores
        fed_parents: list[int] = []  # ... its shape (indices into `fed`; -1: the root)
        expand = [(-1, -1, 0.0)]  # (index in `fed`, candidate, score) of the nodes to expand
        feedback = None
        for level in range(depth):
            shape = TokenTree(fed, fed_parents)
            logits, _ = self.runner.score_graph(
                self.pending,
                mx.array(fed, mx.uint32),
                shape.depths,
                shape.ancestors(),
                self._fed(fed_parents, feedback),
            )
            feedback = self._feedback()
            rows = logits[mx.array([node + 1 for node, _, _ in expand]), :vocab_size]
            self.runner.settle_none()
            rows = rows.astype(mx.float32)
            logp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
            top = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
            ids, lps = top.tolist(), mx.take_along_axis(logp, top, axis=-1).tolist()
            level_start = len(tokens)
            for (_, candidate, score), row, row_lp in zip(expand, ids, lps, strict=True):
                for lp, token in sorted(zip(row_lp, row, strict=True), reverse=True):
                    tokens.append(token)  # best child first
                    parents.append(candidate)
                    scores.append(score + lp)
            if level == depth - 1:
                break
            new = sorted(range(level_start, len(tokens)), key=lambda c: -scores[c])[: self.width]
            feeds = {candidate: node for node, candidate, _ in expand}
            expand = []
            for c in sorted(new):  # proposal order keeps the expanded tree breadth first
                fed.append(tokens[c])
                fed_parents.append(feeds[parents[c]])
                expand.append((len(fed) - 1, c, scores[c]))
        # ties go to the earlier candidate, so a parent always ranks before its children
        keep = sorted(sorted(range(len(tokens)), key=lambda c: (-scores[c], c))[: k * depth])
        index = {c: i for i, c in enumerate(keep)}
        return TokenTree([tokens[c] for c in keep], [index.get(parents[c], -1) for c in keep])


class BranchingDraftModel(_Branching):
    """Args:
    model: the draft model (the target's tokenizer).
    width: candidates at the first position (dynamic: candidates expanded per level, and
        children each proposes).
    max_depth: the deepest tree drafted.
    dynamic: EAGLE-2's dynamic tree instead of the best first tokens' chains.
    """

    name = "draft-tree"

    def __init__(self, model: nn.Module, width: int = 2, max_depth: int = 4, dynamic: bool = False):
        super().__init__(width, max_depth, dynamic)
        self.model = model

    def begin(self, prompt: list[int], hidden) -> None:
        self.runner = TreeTarget(self.model, self.model.args.vocab_size)
        self.unfed = list(prompt[:-1])  # fed to the draft model when it next drafts
        self.pending = prompt[-1]

    def accept(self, tokens: list[int], hidden) -> None:
        """Queue the new tokens: a plain stretch costs the draft model nothing until it
        drafts again."""
        self.unfed += [self.pending] + tokens[:-1]
        self.pending = tokens[-1]

    def _feed_unfed(self) -> None:
        if self.unfed:
            self.runner.prefill(self.unfed, sync=len(self.unfed) > PREFILL_STEP)
            self.unfed = []


class BranchingMTP(_Branching):
    """An MTP head (or an EAGLE-3 head, on its target layers' features) proposing a tree.
    Its cache holds the pairs (h_p, t_{p+1}) of the verified sequence; the root of each
    drafting pass is the newest pair (the target's hidden state before the pending token, the
    pending token), and a node is fed with its parent's output hidden state, as a chain step
    is fed with the step before it.

    Args:
        module: the MTP module (e.g. `load_mtp_drafter(...).module`), built on its target.
        width: candidates at the first position (dynamic: candidates expanded per level, and
            children each proposes).
        max_depth: the deepest tree drafted.
        dynamic: EAGLE-2's dynamic tree instead of the best first tokens' chains.
    """

    name = "mtp-tree"
    needs_hidden = True

    def __init__(
        self, module: MTPModule, width: int = 2, max_depth: int = 4, dynamic: bool = False
    ):
        super().__init__(width, max_depth, dynamic)
        self.module = module
        cfg = getattr(module, "cfg", None)  # an EAGLE-3 head: the layers it reads
        if cfg is not None:
            self.name, self.hidden_layers = "eagle3-tree", cfg.layer_ids
        self._vocab = cfg.vocab_size if cfg is not None else module._embed.weight.shape[0]
        self.unfed: list[int] = []
        self.unfed_hidden: list[mx.array] = []
        self.root_hidden: mx.array | None = None

    def check_compatible(self, hidden_size: int, vocab_size: int) -> None:
        width = target_hidden_size(self.module)
        if width != hidden_size:
            raise ValueError(
                f"the MTP head reads {width}-wide hidden states; the target's are {hidden_size}"
            )

    def begin(self, prompt: list[int], hidden: mx.array | None) -> None:
        self.runner = TreeTarget(self.module, self._vocab)
        nexts = prompt[1:]  # the token after each position that has a hidden state
        self.unfed, self.unfed_hidden = list(nexts[:-1]), [hidden[:-1]] if nexts else []
        self.pending = nexts[-1] if nexts else None
        self.root_hidden = hidden[-1] if nexts else None

    def accept(self, tokens: list[int], hidden: mx.array | None) -> None:
        """Pair i of the round is (hidden[i], tokens[i]); the last becomes the next root, the
        old root and the others wait to be fed when the head next drafts."""
        if self.pending is not None:
            self.unfed.append(self.pending)
            self.unfed_hidden.append(self.root_hidden[None])
        self.unfed += tokens[:-1]
        self.unfed_hidden.append(hidden[:-1])
        self.pending, self.root_hidden = tokens[-1], hidden[-1]

    def _feed_unfed(self) -> None:
        if self.unfed:
            fed, sync = mx.concatenate(self.unfed_hidden), len(self.unfed) > PREFILL_STEP
            self.runner.prefill(self.unfed, fed=fed, sync=sync)
        self.unfed, self.unfed_hidden = [], []

    def _fed(self, parents: list[int], feedback: mx.array | None) -> mx.array:
        root = self.root_hidden[None]
        if hasattr(self.module, "g_of"):  # EAGLE-3: features and fed-back outputs differ in width
            root = self.module.g_of(root)
        rows = [root]
        if parents:
            rows.append(feedback[mx.array([p + 1 for p in parents])])
        return mx.concatenate(rows).astype(self.root_hidden.dtype)

    def _feedback(self) -> mx.array:
        return self.module.feedback[0]
