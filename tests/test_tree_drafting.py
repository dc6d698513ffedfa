"""How the branching drafters draft. Greedy, EAGLE-2's dynamic tree (`dynamic=True`): the
tree drafted is the expansion computed by brute force from the draft model's own
distributions, and decoding with it (draft model, EAGLE-3 head) gives plain decoding's greedy
output. Sampling: the candidates are draws from the drafter's distribution, verified by the
multi-candidate rule, and the output follows the target's exact distribution."""

from __future__ import annotations

import mlx_spec
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.drafters.branching import BranchingDraftModel, BranchingMTP
from mlx_spec.drafters.eagle3 import load_eagle3_drafter

import mlx.core as mx
import pytest
from chisquare import chisquare_pvalue
from helpers import (
    ALPHA,
    CONFIGS,
    CONTROL_RUNS,
    EAGLE3_PROMPT,
    exact_distribution,
    sampled,
    with_eos,
)
from mlx_lm.models.cache import make_prompt_cache


def recording(cls):
    """`cls` recording (sequence so far, depth asked, vocabulary, tree) of every round."""

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rounds = []

        def begin(self, prompt, hidden):
            self.sequence = list(prompt)
            super().begin(prompt, hidden)

        def draft_tree(self, depth, vocab_size, sampling):
            tree = super().draft_tree(depth, vocab_size, sampling)
            self.rounds.append((list(self.sequence), depth, vocab_size, tree))
            return tree

        def accept(self, tokens, hidden):
            self.sequence += tokens
            super().accept(tokens, hidden)

    return Recording


def paths(tree) -> set[tuple[int, ...]]:
    """Every node's tokens from the root down."""
    out = set()
    for node in range(len(tree)):
        path, at = [], node
        while at >= 0:
            path.append(tree.tokens[at])
            at = tree.parents[at]
        out.add(tuple(path[::-1]))
    return out


def eagle2_by_brute_force(draft, sequence, depth, width, vocab) -> set[tuple[int, ...]]:
    """EAGLE-2 from scratch: each expanded path's distribution from a plain forward pass over
    the whole sequence; each level expands the `width` best-scoring new candidates; the tree is
    the `width * depth` best of all (score: the path's summed log-probability)."""

    def children(path, score):
        logits = draft(mx.array([sequence + list(path)]), cache=make_prompt_cache(draft))
        logp = (logits[0, -1, :vocab] - mx.logsumexp(logits[0, -1, :vocab])).tolist()
        best = sorted(range(vocab), key=lambda t: -logp[t])[:width]
        return [(path + (t,), score + logp[t]) for t in best]

    everything, expand = [], [((), 0.0)]
    for _ in range(depth):
        new = [child for path, score in expand for child in children(path, score)]
        everything += new
        expand = sorted(new, key=lambda c: -c[1])[:width]
    return {path for path, _ in sorted(everything, key=lambda c: -c[1])[: width * depth]}


@pytest.mark.parametrize("width", [2, 3])
def test_dynamic_tree_is_eagle2s_expansion(loaded, width):
    """Every round's tree equals the brute-force expansion on the same sequence, and greedy
    output equals plain decoding."""
    model, tok, draft, _ = loaded["llama"]
    tok = with_eos(tok)
    prompt = [1, 4, 5, 6, 7, 8, 9]
    drafter = recording(BranchingDraftModel)(draft, width=width, max_depth=3, dynamic=True)
    plain = mlx_spec.generate(model, tok, prompt, max_tokens=24)
    result = mlx_spec.generate(model, tok, prompt, drafter=drafter, num_draft=3, max_tokens=24)
    assert result.tokens == plain.tokens and result.stats.accepted > 0
    assert len(drafter.rounds) >= 3
    for sequence, depth, vocab, tree in drafter.rounds[:4]:
        assert len(tree) == width * depth and max(tree.depths) <= depth
        assert paths(tree) == eagle2_by_brute_force(draft, sequence, depth, width, vocab)
    # the drafter's cache holds only the verified sequence
    assert drafter.runner.length + len(drafter.unfed) == len(prompt) + len(result.tokens) - 1


@pytest.mark.parametrize("depth", [1, 4])
def test_eagle3_dynamic_tree_equals_plain(target, heads, depth):
    """An EAGLE-3 head (fed its own output states down each path) growing dynamic trees:
    greedy output equals plain decoding; the trees reach the depth asked."""
    model, tok, _, _ = target
    head = load_eagle3_drafter(heads["eagle3"][0], model).module
    drafter = recording(BranchingMTP)(head, width=2, max_depth=depth, dynamic=True)
    plain = mlx_spec.generate(model, tok, EAGLE3_PROMPT, max_tokens=24).tokens
    result = mlx_spec.generate(
        model, tok, EAGLE3_PROMPT, drafter=drafter, num_draft=depth, max_tokens=24
    )
    assert result.tokens == plain and result.stats.drafter == "eagle3-tree"
    assert any(max(tree.depths) == depth for *_, tree in drafter.rounds)


def test_sampled_trees_keep_the_target_distribution(pair):
    """Sampling (a tree asked to be dynamic too), the root's two candidates and the chains
    under them are draws from the draft model, each carrying its distribution: chi-square of
    the first three tokens against the target's exact distribution."""
    model, tok, draft, _ = pair
    config = CONFIGS[0]
    assert config.temperature > 0
    tree = BranchingDraftModel(draft, width=2, max_depth=2, dynamic=True)
    tree.begin([3, 4, 5, 3], None)
    drawn = tree.draft_tree(2, 8, SamplingConfig(temperature=1.0))
    assert drawn.parents == [-1, -1, 0, 1] and drawn.probs.shape == (4, 8)
    make = lambda: BranchingDraftModel(draft, width=2, max_depth=2, dynamic=True)  # noqa: E731
    samples = sampled(model, tok, make, config)
    assert chisquare_pvalue(samples, exact_distribution(model, config)) > ALPHA


def test_sampled_tree_negative_control_fails(pair, monkeypatch):
    """Trying the second drawn candidate against p itself instead of the residual after the
    first is rejected changes the distribution, and the test above sees it."""
    import mlx_spec.core.tree_verify as tree_module

    model, tok, draft, _ = pair
    monkeypatch.setattr(tree_module, "tree_residual", lambda p, q, x: p)
    config = CONFIGS[0]
    make = lambda: BranchingDraftModel(draft, width=2, max_depth=2)  # noqa: E731
    samples = sampled(model, tok, make, config, runs=CONTROL_RUNS)
    assert chisquare_pvalue(samples, exact_distribution(model, config)) < ALPHA
