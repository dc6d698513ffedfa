"""EAGLE-3 heads on a tiny random Llama target: the layer taps follow Hugging Face's
`hidden_states` numbering, the head computes the published formula (computed by hand in torch
here: the EAGLE repository's training module needs a GPU-sized target and speculators ships no
inference path), decoding stays lossless with a reduced draft vocabulary, and bad heads are
refused with the culprit named."""

from __future__ import annotations

import json

import mlx_spec
from convert import convert_checkpoint
from mlx_spec.caches.taps import tap_layers
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.eagle3 import Eagle3Drafter, load_eagle3_drafter

import hfmodels as hfm
import mlx.core as mx
import numpy as np
import pytest
import torch
from chisquare import chisquare_pvalue, exact_first_tokens, first_tokens
from helpers import EAGLE3_IDS, EAGLE3_LAYERS, EAGLE3_PROMPT, LAYOUTS, T, cli_here, write_eagle3
from safetensors.torch import save_file


def test_layer_taps_follow_hf_hidden_states(target):
    """Id i is Hugging Face's hidden_states[i]: the input of layer i, and id L the final
    hidden state after the norm. An off-by-one never crashes; this pins it."""
    model, _, torch_model, _ = target
    ids = [0, 1, 3, EAGLE3_LAYERS]
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=tuple(ids))
    got = np.array(runner.prefill(EAGLE3_PROMPT))
    with torch.no_grad():
        hs = torch_model(input_ids=torch.tensor([EAGLE3_PROMPT]), output_hidden_states=True)
    want = torch.cat([hs.hidden_states[i][0] for i in ids], dim=-1).numpy()
    assert got.shape == (len(EAGLE3_PROMPT), len(ids) * T)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="do not fit a target of 4 layers"):
        tap_layers(model, [EAGLE3_LAYERS + 1])


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, base=10000.0):
    """Hugging Face Llama's rotary embedding (rotate_half), x `[S, heads, hd]`."""
    hd = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2).float() / hd)
    angles = positions[:, None].float() * inv[None]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
    return x * cos + half * sin


def formula_logits(torch_model, tensors: dict, prefix: str, ids: list[int]) -> np.ndarray:
    """The head's logits over the target vocabulary for every pair (g_p, t_{p+1}) of
    EAGLE3_PROMPT, computed by hand: features of the target's hidden_states, fc, the decoder
    layer over [input_layernorm(e), hidden_norm(g)] with residual g, norm, lm_head, d2t."""
    w = {k: v.float() for k, v in tensors.items()}
    p = f"{prefix}."
    with torch.no_grad():
        hs = torch_model(input_ids=torch.tensor([EAGLE3_PROMPT]), output_hidden_states=True)
        feats = torch.cat([hs.hidden_states[i][0] for i in EAGLE3_IDS], dim=-1)[:-1]  # pairs p
        e = torch_model.model.embed_tokens(torch.tensor(EAGLE3_PROMPT[1:]))
        g = feats @ w["fc.weight"].T
        h = _rms(g, w[p + "hidden_norm.weight"])
        x = torch.cat([_rms(e, w[p + "input_layernorm.weight"]), h], dim=-1)
        s, heads, kv = x.shape[0], 4, 2
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(s, heads, -1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(s, kv, -1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(s, kv, -1)
        pos = torch.arange(s)
        q, k = _rope(q, pos), _rope(k, pos)
        k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -1e30)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)
        y = g + attn @ w[p + "self_attn.o_proj.weight"].T
        z = _rms(y, w[p + "post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(z @ w[p + "mlp.gate_proj.weight"].T)) * (
            z @ w[p + "mlp.up_proj.weight"].T
        )
        y = y + mlp @ w[p + "mlp.down_proj.weight"].T
        draft = _rms(y, w["norm.weight"]) @ w["lm_head.weight"].T
        full = torch.full((s, hfm.VOCAB), float("-inf"))
        target_ids = torch.arange(draft.shape[1]) + tensors["d2t"]
        full[:, target_ids] = draft
    return full.numpy()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eagle3_logits_follow_the_formula(target, heads, layout):
    """Both published layouts load to the same function: the formula computed by hand in
    torch from transformers' hidden states, within 1e-4 (the draft vocabulary mapped by d2t,
    -inf elsewhere)."""
    model, _, torch_model, _ = target
    path, tensors = heads[layout]
    drafter = load_eagle3_drafter(path, model)
    prefix = "midlayer" if layout == "eagle3" else "layers.0"
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
    feats = runner.prefill(EAGLE3_PROMPT)[:-1]
    head = drafter.module
    got = np.array(
        head(mx.array([EAGLE3_PROMPT[1:]]), cache=head.make_cache(), hidden=feats[None])[0]
    )
    want = formula_logits(torch_model, tensors, prefix, EAGLE3_IDS)
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all()
    np.testing.assert_allclose(got[finite], want[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_eagle3_equals_plain(target, heads, k):
    model, tok, _, _ = target
    plain = mlx_spec.generate(model, tok, EAGLE3_PROMPT, max_tokens=30).tokens
    drafter = load_eagle3_drafter(heads["eagle3"][0], model)
    result = mlx_spec.generate(
        model, tok, EAGLE3_PROMPT, drafter=drafter, num_draft=k, max_tokens=30
    )
    assert result.tokens == plain
    assert result.stats.drafter == "eagle3" and result.stats.drafted > 0


def fresh_draft(drafter: Eagle3Drafter, model, sequence, k):
    """A brand-new drafter's drafts on `sequence` (what the running one must draft)."""
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
    fresh = Eagle3Drafter(drafter.module, model)
    fresh.begin(sequence, hfm.VOCAB, runner.prefill(sequence[:-1]))
    return fresh.draft(k, SamplingConfig()).tokens.tolist()


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_eagle3_state_after_forced_outcomes(target, heads, accepted):
    """Rounds forced to keep 0, 1 or all 3 drafts: each next draft equals a fresh drafter's on
    the same sequence (its cache rolls back with the target's)."""
    model = target[0]
    drafter = load_eagle3_drafter(heads["speculators"][0], model)
    sequence = list(EAGLE3_PROMPT)
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
    drafter.begin(sequence, hfm.VOCAB, runner.prefill(sequence[:-1]))
    for _ in range(4):
        drafts = drafter.draft(3, SamplingConfig()).tokens.tolist()
        assert drafts == fresh_draft(drafter, model, sequence, 3)
        emitted = drafts[:accepted] + [(drafts[accepted] + 1) % hfm.VOCAB if accepted < 3 else 5]
        runner(mx.array([sequence[-1]] + emitted[:-1], mx.uint32))  # the verify pass
        drafter.accept(accepted, emitted, runner.last_hidden)
        sequence += emitted


DIST = SamplingConfig(temperature=1.0, top_k=3)


def test_distribution_with_a_reduced_draft_vocabulary(target, heads):
    """Temperature 1, top-k 3: the first three tokens with the EAGLE-3 head (k = 2), whose q is
    zero outside its half of the vocabulary, follow the target's exact distribution. 500
    samples: a verifier that recovers from p instead of the residual gives p ~ 1e-15 here."""
    model, tok, _, _ = target
    drafter = load_eagle3_drafter(heads["eagle3"][0], model)
    samples = first_tokens(model, tok, EAGLE3_PROMPT, drafter, DIST, 500)
    assert (
        chisquare_pvalue(samples, exact_first_tokens(model, EAGLE3_PROMPT, DIST, hfm.VOCAB)) > 1e-3
    )


def test_eagle3_bad_heads(target, tmp_path):
    model = target[0]
    far = {"eagle_aux_hidden_state_layer_ids": [2, 9]}
    path, _ = write_eagle3(tmp_path / "far", eagle_config=far)
    with pytest.raises(ValueError, match=r"reads target layers \[2, 9\]; the target has 4"):
        load_eagle3_drafter(path, model)
    path, tensors = write_eagle3(tmp_path / "wide", target_hidden_size=2 * T)
    with pytest.raises(ValueError, match=f"{2 * T}-wide target features.*hidden size is {T}"):
        load_eagle3_drafter(path, model)
    path, tensors = write_eagle3(tmp_path / "nomap")
    tensors.pop("d2t")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor d2t is missing"):
        load_eagle3_drafter(path, model)
    path, tensors = write_eagle3(tmp_path / "shape")
    tensors["midlayer.self_attn.q_proj.weight"] = tensors["midlayer.self_attn.q_proj.weight"][:, :T]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor midlayer.self_attn.q_proj.weight has shape"):
        load_eagle3_drafter(path, model)
    with pytest.raises(FileNotFoundError, match="no EAGLE-3 head here"):
        load_eagle3_drafter(tmp_path / "nothing", model)


def test_convert_eagle3_head_and_use_it(target, heads, tmp_path):
    """`mlx-spec convert` takes an EAGLE-3 head alone (speculators format here) to one layout
    that loads to the same function; beside a converted target (`eagle3/`) it is what
    drafter="eagle3" and `generate --eagle` find."""
    import shutil

    model, tok, _, root = target
    path, _ = heads["speculators"]
    out = convert_checkpoint(str(path), str(tmp_path / "head-mlx"), dtype="float32").path
    assert json.loads((out / "config.json").read_text())["model_type"] == "eagle3"
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=tuple(EAGLE3_IDS))
    feats = runner.prefill(EAGLE3_PROMPT)[:-1][None]
    tokens = mx.array([EAGLE3_PROMPT[1:]])
    logits = []
    for source in (path, out):
        head = load_eagle3_drafter(source, model).module
        logits.append(np.array(head(tokens, cache=head.make_cache(), hidden=feats)))
    np.testing.assert_array_equal(logits[0], logits[1])

    shutil.copytree(out, root / "llama-mlx" / "eagle3")
    plain = mlx_spec.generate(model, tok, EAGLE3_PROMPT, max_tokens=12).tokens
    result = mlx_spec.generate(
        model, tok, EAGLE3_PROMPT, drafter="eagle3", num_draft=2, max_tokens=12
    )
    assert result.tokens == plain and result.stats.drafter == "eagle3"
    run = cli_here(
        "generate", "--model", str(root / "llama-mlx"), "--eagle", str(out), "--prompt", "abcab",
        "--max-tokens", "6", "--num-draft", "2", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["stats"]["drafter"] == "eagle3"


@pytest.mark.parametrize("depth", [2, 4])
def test_eagle3_tree_equals_plain_and_its_first_branch_is_the_chain(target, heads, depth):
    """The head's two best first tokens, each continued by the head (verified as a tree on
    the tapped features): greedy output equals plain decoding, and every round's first branch
    is what a fresh chain drafter drafts on the same sequence."""
    from mlx_spec.drafters.branching import BranchingMTP

    model, tok, _, _ = target
    head = load_eagle3_drafter(heads["eagle3"][0], model).module
    rounds = []

    class Recording(BranchingMTP):
        def begin(self, prompt, hidden):
            self.sequence = list(prompt)
            super().begin(prompt, hidden)

        def draft_tree(self, depth, vocab_size, sampling):
            tree = super().draft_tree(depth, vocab_size, sampling)
            rounds.append((list(self.sequence), depth, tree))
            return tree

        def accept(self, tokens, hidden):
            self.sequence += tokens
            super().accept(tokens, hidden)

    drafter = Recording(head, width=2, max_depth=depth)
    plain = mlx_spec.generate(model, tok, EAGLE3_PROMPT, max_tokens=24).tokens
    result = mlx_spec.generate(
        model, tok, EAGLE3_PROMPT, drafter=drafter, num_draft=depth, max_tokens=24
    )
    assert result.tokens == plain and result.stats.drafter == "eagle3-tree"
    chain = Eagle3Drafter(head, model)
    assert len(rounds) > 3
    for sequence, k, tree in rounds:
        first = [tree.tokens[0]] + [tree.tokens[i] for i in range(2, len(tree), 2)]
        assert fresh_draft(chain, model, sequence, k) == first


def test_wrappers_ask_for_the_same_features(target, heads):
    """A wrapped drafter (the bench's timing wrapper, a group) makes the runner record the
    layers the drafter reads, not the final hidden states."""
    from mlx_spec.bench.harness import TimedDrafter
    from mlx_spec.drafters.base import hidden_wanted
    from mlx_spec.drafters.group import DrafterGroup
    from mlx_spec.drafters.ngram import NgramDrafter

    drafter = load_eagle3_drafter(heads["eagle3"][0], target[0])
    for wrapped in (TimedDrafter(drafter), DrafterGroup([NgramDrafter(), drafter])):
        assert hidden_wanted(wrapped) == tuple(EAGLE3_IDS)
