"""Tree verification: tree masks and per-node positions, the greedy and sampled tree rules,
Medusa heads (both published layouts) and the tree decode loop."""

from __future__ import annotations

import random

import mlx_spec
from convert import convert_checkpoint
from mlx_spec.core.sampling import logits_to_probs
from mlx_spec.core.tree_verify import TokenTree, greedy_tree_verify, tree_rejection_verify
from mlx_spec.decoding.tree import TreeDrafter, TreeTarget, merge_graph
from mlx_spec.drafters.branching import BranchingDraftModel
from mlx_spec.drafters.lookahead import LookaheadDrafter, trie
from mlx_spec.drafters.medusa import (
    MedusaDrafter,
    MedusaHeads,
    best_paths,
    load_medusa_heads,
    medusa_params,
    save_medusa_heads,
)
from mlx_spec.models.mtp import target_hidden_size

import hfmodels as hfm
import mlx.core as mx
import numpy as np
import pytest
from chisquare import chisquare_pvalue
from helpers import CONFIGS, CONTROL_RUNS, exact_distribution, sampled, with_eos
from mlx_lm.models.cache import make_prompt_cache

ALPHA = 1e-3
# Nodes in breadth-first order under the root: two children of the root, branches below.
SHAPE = [-1, -1, 0, 0, 1, 2, 4, 5]


def path_ids(tree: TokenTree, node: int) -> list[int]:
    """The tokens from the root's first child down to `node` (empty for the root, -1)."""
    out = []
    while node >= 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]


def plain_logits(model, ids: list[int], vocab: int) -> mx.array:
    return model(mx.array([ids]), cache=make_prompt_cache(model))[0, -1, :vocab]


@pytest.fixture(scope="module")
def hf_targets(tmp_path_factory):
    """Converted tiny checkpoints of further families: Qwen3, DeepSeek-V3 (MLA, rotary on a
    slice of each head), GLM-4-MoE (partial rotary), MiMo."""
    root = tmp_path_factory.mktemp("tree-hf")
    out = {}
    for i, family in enumerate(["qwen3", "deepseek_v3", "glm4_moe", "mimo"]):
        if family == "mimo":
            source, _ = hfm.write_mimo_checkpoint(root / family, seed=30 + i)
        else:
            source, _ = hfm.write_hf_checkpoint(root / family, family, seed=30 + i)
        path = convert_checkpoint(str(source), str(root / f"{family}-mlx"), dtype="float32").path
        out[family] = mlx_spec.load(str(path))
    return out


def _models(loaded, hf_targets, family):
    if family in ("llama", "gemma3"):
        return loaded[family][0]
    return hf_targets[family][0]


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3", "deepseek_v3", "glm4_moe", "mimo"])
def test_tree_logits_equal_path_logits(loaded, hf_targets, family):
    """Every node's logits equal those of its root-to-node path run as a plain sequence, past
    the sliding windows; after a path is kept, the next tree scores as if the sequence had
    been fed token by token."""
    model = _models(loaded, hf_targets, family)
    vocab = hfm.VOCAB
    rng = random.Random(1)
    seq = [rng.randrange(3, vocab) for _ in range(14)]
    target = TreeTarget(model, vocab)
    target.prefill(seq[:-1])
    for round_ in range(3):
        tree = TokenTree([rng.randrange(3, vocab) for _ in SHAPE], SHAPE)
        logits, _ = target.score(seq[-1], tree)
        for node in range(-1, len(tree)):
            want = plain_logits(model, seq + path_ids(tree, node), vocab)
            got = logits[node + 1]
            assert mx.allclose(want, got, atol=1e-4).item(), (family, round_, node)
        keep = [[], [1, 4], [0, 2]][round_]
        target.settle(keep)
        seq = seq + [tree.tokens[i] for i in keep] + [rng.randrange(3, vocab)]
        assert target.length == len(seq) - 1


def test_hybrid_targets_are_refused(loaded):
    model = loaded["qwen3_5"][0]
    with pytest.raises(ValueError, match="recurrent"):
        TreeTarget(model, hfm.VOCAB)


def test_tree_structure_is_checked():
    with pytest.raises(ValueError, match="parent"):
        TokenTree([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="breadth first"):
        TokenTree([1, 2, 3], [-1, 0, -1])
    tree = TokenTree([5, 6, 7], [-1, -1, 1])
    assert tree.depths == [1, 1, 2] and tree.children() == [[0, 1], [], [2], []]
    assert tree.ancestors()[3].tolist() == [True, False, True, True]


def test_greedy_tree_verify_walks_the_matching_branch():
    vocab = 10
    best = [6, 0, 3, 2, 4]  # argmax after the root and after each node
    logits = mx.array(np.eye(vocab)[best] * 5.0, mx.float32)
    tree = TokenTree([5, 6, 3, 9], [-1, -1, 1, 1])  # root -> {5, 6}; 6 -> {3, 9}
    assert greedy_tree_verify(logits, tree) == ([1, 2], 2)  # 6, then 3, then argmax after 3
    assert greedy_tree_verify(logits, TokenTree([1], [-1])) == ([], 6)


def test_tree_rejection_rule_is_exact_on_one_level():
    """One level, three candidates (two sampled from q, one deterministic): the token after
    the root is distributed as p, measured against the exact law by enumerating the draws."""
    rng = np.random.default_rng(0)
    vocab = 5
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab))
    counts = np.zeros(vocab)
    n = 20000
    gen = np.random.default_rng(1)
    for _ in range(n):
        x1, x2 = gen.choice(vocab, p=q), gen.choice(vocab, p=q)
        x3 = int(np.argmax(q))  # a deterministic candidate: one-hot
        probs = np.stack([q, q, np.eye(vocab)[x3]])
        tree = TokenTree([int(x1), int(x2), x3], [-1, -1, -1], mx.array(probs, mx.float32))
        path, nxt = tree_rejection_verify(
            mx.array(np.stack([p] * 4), mx.float32),
            tree,
            uniforms=gen.random,
            draw=lambda r: int(gen.choice(vocab, p=r / r.sum())),
        )
        counts[tree.tokens[path[0]] if path else nxt] += 1
    expected = p * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 25.0, (counts / n, p)  # df = 4: p-value ~ 5e-5


class RandomHeads:
    """Random Medusa heads for a target, written in a layout and read back."""

    @staticmethod
    def make(model, vocab: int, heads: int, layers: int, seed: int) -> MedusaHeads:
        mx.random.seed(seed)
        module = MedusaHeads(target_hidden_size(model), vocab, heads, layers)
        mx.eval(module.parameters())
        return module


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_greedy_medusa_equals_plain(loaded, tmp_path, family, depth):
    """Medusa heads (random, saved in the original layout and loaded back) drafting trees:
    greedy output equals plain decoding token for token, past the sliding window."""
    model, tok = loaded[family][:2]
    tok = with_eos(tok)
    heads = RandomHeads.make(model, hfm.VOCAB, 4, 1, seed=depth)
    save_medusa_heads(heads, tmp_path / "medusa")
    drafter = mlx_spec.load_medusa_drafter(str(tmp_path / "medusa"), tree_size=3 * depth)
    prompt = [1, 4, 5, 6, 7, 8, 9]
    result = mlx_spec.generate(model, tok, prompt, drafter=drafter, num_draft=depth, max_tokens=30)
    plain = mlx_spec.generate(model, tok, prompt, max_tokens=30)
    assert result.tokens == plain.tokens
    assert result.stats.drafter == "medusa" and result.stats.target_passes <= 30


class OracleTree(TreeDrafter):
    """Knows the greedy continuation: each tree holds it as the second child at some depths
    and wrong branches elsewhere, so that rounds accept 0 .. depth tokens along branches that
    are not the first."""

    name = "oracle"

    def __init__(self, answer: list[int], vocab: int, seed: int = 0):
        self.answer, self.vocab, self.rng = answer, vocab, random.Random(seed)

    def begin(self, prompt, hidden):
        self.done = 0

    def accept(self, tokens, hidden):
        self.done += len(tokens)

    def draft_tree(self, depth, vocab_size, sampling):
        right = self.answer[self.done : self.done + depth]
        good = self.rng.randrange(len(right) + 1)  # correct up to this depth
        tokens, parents, on_path = [], [], -1
        for d in range(len(right)):
            wrong = (right[d] + 1 + self.rng.randrange(self.vocab - 4)) % self.vocab
            two = [wrong, right[d] if d < good else wrong]
            first = len(tokens)
            tokens += two
            parents += [on_path, on_path]
            on_path = first + 1
        return TokenTree(tokens, parents)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_accepts_along_any_branch(loaded, family):
    model, tok = loaded[family][:2]
    tok = with_eos(tok)
    prompt = [1, 4, 5, 6, 7, 8, 9, 10, 11]
    plain = mlx_spec.generate(model, tok, prompt, max_tokens=40)
    drafter = OracleTree(plain.tokens + [0] * 8, hfm.VOCAB)
    result = mlx_spec.generate(model, tok, prompt, drafter=drafter, num_draft=4, max_tokens=40)
    assert result.tokens == plain.tokens
    assert result.stats.accepted > 10  # branches were taken


class SampledTree(TreeDrafter):
    """Two children of the root drawn independently from the draft model's distribution, each
    with one child drawn the same way; every node carries the distribution it was drawn from."""

    name = "sampled-tree"

    def __init__(self, draft):
        self.draft = draft

    def begin(self, prompt, hidden):
        self.seq = list(prompt)

    def accept(self, tokens, hidden):
        self.seq += tokens

    def _q(self, ids, vocab, sampling):
        logits = self.draft(mx.array([ids]))[0, -1, :vocab]
        if sampling.greedy:
            return mx.softmax(logits)
        return logits_to_probs(logits, sampling)

    def draft_tree(self, depth, vocab_size, sampling):
        q0 = self._q(self.seq, vocab_size, sampling)
        firsts = mx.random.categorical(mx.log(q0), num_samples=2).tolist()
        tokens, parents, probs = list(firsts), [-1, -1], [q0, q0]
        if depth > 1:
            for i, first in enumerate(firsts):
                q1 = self._q(self.seq + [first], vocab_size, sampling)
                tokens.append(mx.random.categorical(mx.log(q1)).item())
                parents.append(i)
                probs.append(q1)
        return TokenTree(tokens, parents, mx.stack(probs))


def test_three_token_distribution_with_trees(pair):
    """Chi-square of DISTRIBUTION_RUNS tree-speculative samples (depth 2, two branches drawn
    from the draft model with their distributions) against the exact target distribution of
    the first three tokens (chosen branches, q one-hot, are tested through lookahead decoding
    below)."""
    model, tok, draft, _ = pair
    config = CONFIGS[0]
    samples = sampled(model, tok, lambda: SampledTree(draft), config)
    assert chisquare_pvalue(samples, exact_distribution(model, config)) > ALPHA


def test_tree_negative_control_fails(pair, monkeypatch):
    """Trying the next child against p itself instead of the residual after a rejection
    changes the distribution, and the test above sees it."""
    model, tok, draft, _ = pair
    import mlx_spec.core.tree_verify as tree_module

    monkeypatch.setattr(tree_module, "tree_residual", lambda p, q, x: p)
    config = CONFIGS[0]
    samples = sampled(model, tok, lambda: SampledTree(draft), config, runs=CONTROL_RUNS)
    assert chisquare_pvalue(samples, exact_distribution(model, config)) < ALPHA


# --- Medusa layouts --------------------------------------------------------------------------


def test_best_paths_grow_by_cumulative_probability():
    probs = np.array([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]])
    assert best_paths(probs, 4) == [(0,), (0, 0), (1,), (1, 0)]


def _original_layout(heads: int, layers: int, hidden: int, vocab: int, prefix: str = ""):
    out = {}
    for k in range(heads):
        for j in range(layers):
            out[f"{prefix}{k}.{j}.linear.weight"] = mx.random.normal((hidden, hidden))
            out[f"{prefix}{k}.{j}.linear.bias"] = mx.random.normal((hidden,))
        out[f"{prefix}{k}.{layers}.weight"] = mx.random.normal((vocab, hidden))
    return out


def _vllm_layout(original: dict, heads: int, layers: int, prefix: str = "") -> dict:
    out = {}
    for k in range(heads):
        for j in range(layers):
            out[f"blocks.{k}.layers.{j}.weight"] = original[f"{prefix}{k}.{j}.linear.weight"]
            out[f"blocks.{k}.layers.{j}.bias"] = original[f"{prefix}{k}.{j}.linear.bias"]
        out[f"lm_heads.{k}.weight"] = original[f"{prefix}{k}.{layers}.weight"]
    return out


@pytest.mark.parametrize("layout", ["original", "bundled", "vllm"])
def test_medusa_layouts_give_the_same_heads(tmp_path, layout):
    """The original Medusa layout, Medusa-2's `medusa_head.` prefix beside base-model tensors,
    and vLLM's `blocks` / `lm_heads` load to the same heads (their outputs compared with the
    formula computed by hand)."""
    heads, layers, hidden, vocab = 3, 2, 16, 40
    mx.random.seed(0)
    original = _original_layout(heads, layers, hidden, vocab)
    if layout == "original":
        tensors, config = original, {"medusa_num_heads": heads, "medusa_num_layers": layers}
        name = "medusa_lm_head.safetensors"
    elif layout == "bundled":
        tensors = {f"medusa_head.{k}": v for k, v in original.items()}
        tensors["model.embed_tokens.weight"] = mx.zeros((vocab, hidden))
        config, name = {"medusa_num_heads": heads}, "model.safetensors"
    else:
        tensors = _vllm_layout(original, heads, layers)
        config = {"model_type": "medusa", "num_heads": heads, "num_hidden_layers": layers}
        name = "model.safetensors"
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    mx.save_safetensors(str(tmp_path / name), tensors)
    module = load_medusa_heads(str(tmp_path))
    h = mx.random.normal((hidden,))
    out = module(h)
    for k in range(heads):
        x = h
        for j in range(layers):
            w, b = original[f"{k}.{j}.linear.weight"], original[f"{k}.{j}.linear.bias"]
            y = x @ w.T + b
            x = x + y * mx.sigmoid(y)
        want = x @ original[f"{k}.{layers}.weight"].T
        assert mx.allclose(out[k], want, atol=1e-4).item()


def test_medusa_bad_inputs(tmp_path, loaded):
    mx.random.seed(0)
    broken = _original_layout(2, 1, 16, 40)
    broken["1.0.linear.weight"] = mx.zeros((16, 8))
    mx.save_safetensors(str(tmp_path / "medusa_lm_head.safetensors"), broken)
    with pytest.raises(ValueError, match=r"heads\.1\.blocks\.0\.linear\.weight has shape"):
        load_medusa_heads(str(tmp_path))
    missing = _original_layout(2, 1, 16, 40)
    del missing["1.0.linear.bias"]
    with pytest.raises(ValueError, match="head 1 misses its block 0 bias"):
        medusa_params(missing)
    with pytest.raises(ValueError, match="no Medusa head tensors"):
        medusa_params({"model.norm.weight": mx.zeros((4,))})
    model, tok = loaded["llama"][:2]
    wrong = MedusaDrafter(MedusaHeads(target_hidden_size(model) + 8, hfm.VOCAB, 2))
    with pytest.raises(ValueError, match="wide hidden states"):
        mlx_spec.generate(model, tok, [1, 4, 5], drafter=wrong, max_tokens=4)


def test_convert_carries_medusa_heads(tmp_path):
    """A Medusa-2 style checkpoint (heads as `medusa_head.*` beside the base model) converts to
    a target with its heads in `medusa/`, and `drafter="medusa"` decodes losslessly with them;
    heads alone (the original layout as a PyTorch file, and vLLM's layout) convert to a
    directory `--medusa` loads, equal to the source."""
    import torch

    source, _ = hfm.write_hf_checkpoint(tmp_path / "llama", "llama", seed=4)
    hidden = hfm.CONFIGS["llama"]["hidden_size"]
    mx.random.seed(2)
    heads = {
        k: torch.tensor(np.array(v)) for k, v in _original_layout(2, 1, hidden, hfm.VOCAB).items()
    }
    hfm.append_shard(source, {f"medusa_head.{k}": v for k, v in heads.items()})
    out = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32").path
    assert (out / "medusa" / "medusa_lm_head.safetensors").is_file()
    model, tok = mlx_spec.load(str(out))
    tok = with_eos(tok)
    plain = mlx_spec.generate(model, tok, [1, 4, 5, 6], max_tokens=16)
    spec = mlx_spec.generate(model, tok, [1, 4, 5, 6], drafter="medusa", max_tokens=16)
    assert spec.tokens == plain.tokens and spec.stats.drafter == "medusa"

    alone = tmp_path / "heads"
    alone.mkdir()
    torch.save(heads, alone / "medusa_lm_head.pt")
    (alone / "config.json").write_text('{"medusa_num_heads": 2, "medusa_num_layers": 1}')
    converted = convert_checkpoint(str(alone), str(tmp_path / "heads-mlx"), dtype="float32").path
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    mx.save_safetensors(
        str(vllm / "model.safetensors"),
        _vllm_layout({k: mx.array(v.numpy()) for k, v in heads.items()}, 2, 1),
    )
    (vllm / "config.json").write_text('{"model_type": "medusa", "num_heads": 2}')
    converted_vllm = convert_checkpoint(str(vllm), str(tmp_path / "vllm-mlx"), dtype="float32").path
    h = mx.random.normal((hidden,))
    want = load_medusa_heads(str(out / "medusa"))(h)
    for path in (converted, converted_vllm):
        assert mx.allclose(load_medusa_heads(str(path))(h), want, atol=1e-5).item()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_auto_depth_and_stops_equal_plain(loaded, family):
    """With `num_draft="auto"` the policy mixes plain stretches (pipelined) and tree rounds of
    the depth it finds best; output cut by a stop string or EOS inside a round or a stretch
    equals plain decoding's, and the caches stay consistent for the next round."""
    model, tok = loaded[family][:2]
    prompt = [1, 4, 5, 6, 7, 8, 9, 10, 11]
    plain = mlx_spec.generate(model, with_eos(tok), prompt, max_tokens=48)
    oracle = OracleTree(plain.tokens + [0] * 8, hfm.VOCAB)
    oracle.max_depth = 4
    result = mlx_spec.generate(model, with_eos(tok), prompt, drafter=oracle, max_tokens=48)
    assert result.tokens == plain.tokens
    assert result.stats.k_histogram.get(0, 0) > 0 and result.stats.accepted > 0
    for cut in (5, 17, 30):
        stop = plain.text[cut : cut + 2]
        want = mlx_spec.generate(model, with_eos(tok), prompt, max_tokens=48, stop=[stop])
        oracle = OracleTree(plain.tokens + [0] * 8, hfm.VOCAB)
        got = mlx_spec.generate(
            model, with_eos(tok), prompt, drafter=oracle, num_draft=3, max_tokens=48, stop=[stop]
        )
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
        eos = with_eos(tok, [plain.tokens[cut]])
        want = mlx_spec.generate(model, eos, prompt, max_tokens=48)
        oracle = OracleTree(plain.tokens + [0] * 8, hfm.VOCAB)
        got = mlx_spec.generate(model, eos, prompt, drafter=oracle, max_tokens=48)
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)


# --- lookahead decoding ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_lookahead_window_sees_its_causal_sequence(loaded, family):
    """Each node of the lookahead window (level l, column i) gets the logits of the plain
    sequence root, level 0's columns up to i, its column's levels 1..l; the verification tree
    beside it keeps its own logits (the branches never see each other)."""
    model = loaded[family][0]
    rng = random.Random(5)
    seq = [rng.randrange(3, hfm.VOCAB) for _ in range(12)]
    drafter = LookaheadDrafter(window=3, ngram=4, candidates=2)
    drafter.begin(seq, None)
    drafter.levels = [[rng.randrange(3, hfm.VOCAB) for _ in range(3)] for _ in range(3)]
    side = drafter.side_branch()
    tree = TokenTree([7, 8, 9], [-1, -1, 0])
    target = TreeTarget(model, hfm.VOCAB)
    target.prefill(seq[:-1])
    tokens, depths, visible, tree_at, side_at = merge_graph(tree, side)
    logits, _ = target.score_graph(seq[-1], tokens, depths, visible)
    for lv in range(3):
        for i in range(3):
            ids = (
                seq + drafter.levels[0][: i + 1] + [drafter.levels[u][i] for u in range(1, lv + 1)]
            )
            got = logits[1 + side_at[lv * 3 + i]]
            assert mx.allclose(plain_logits(model, ids, hfm.VOCAB), got, atol=1e-4).item()
    for node in range(len(tree)):
        want = plain_logits(model, seq + path_ids(tree, node), hfm.VOCAB)
        assert mx.allclose(want, logits[1 + tree_at[node]], atol=1e-4).item()
    target.settle([tree_at[0], tree_at[2]])
    assert target.length == len(seq) + 2


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("window, ngram, candidates", [(1, 2, 1), (3, 3, 2), (4, 5, 4)])
def test_greedy_lookahead_equals_plain(loaded, family, window, ngram, candidates):
    model, tok = loaded[family][:2]
    tok = with_eos(tok)
    prompt = [1, 4, 5, 6, 4, 5, 6, 4, 5]  # repeats: the pool has candidates from the start
    plain = mlx_spec.generate(model, tok, prompt, max_tokens=40)
    drafter = LookaheadDrafter(window, ngram, candidates)
    result = mlx_spec.generate(
        model, tok, prompt, drafter=drafter, num_draft=ngram - 1, max_tokens=40
    )
    assert result.tokens == plain.tokens
    assert result.stats.drafter == "lookahead"
    auto = mlx_spec.generate(model, tok, prompt, drafter="lookahead", max_tokens=40)
    assert auto.tokens == plain.tokens


def test_three_token_distribution_with_lookahead(pair):
    """Lookahead's candidates are chosen (verified as one-hot) at temperature 0.7 + top-p."""
    model, tok = pair[:2]
    config = CONFIGS[1]
    samples = sampled(model, tok, lambda: LookaheadDrafter(2, 3, 2), config)
    assert chisquare_pvalue(samples, exact_distribution(model, config)) > ALPHA


def test_lookahead_bad_settings():
    with pytest.raises(ValueError, match="ngram-size >= 2"):
        LookaheadDrafter(window=4, ngram=1)
    assert trie([(1, 2), (1, 3), (4,)]).parents == [-1, -1, 0, 0]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_branching_draft_model_equals_plain(loaded, family, depth):
    """The draft model's top two candidates at the first position, each continued greedily:
    greedy output equals plain decoding; its own cache keeps only the verified sequence."""
    model, tok, draft, _ = loaded[family]
    tok = with_eos(tok)
    prompt = [1, 4, 5, 6, 7, 8, 9]
    plain = mlx_spec.generate(model, tok, prompt, max_tokens=40)
    drafter = BranchingDraftModel(draft, width=2, max_depth=depth)
    result = mlx_spec.generate(model, tok, prompt, drafter=drafter, num_draft=depth, max_tokens=40)
    assert result.tokens == plain.tokens and result.stats.accepted > 0
    assert drafter.runner.length + len(drafter.unfed) == len(prompt) + len(result.tokens) - 1
