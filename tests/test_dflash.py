"""DFlash block drafters on a tiny random Qwen3 target, against z-lab's own `dflash` package
(torch + transformers, run on CPU) as the numerical oracle: the block's logits match within
1e-4 on the first round and after rounds have grown the drafter's context cache, which pins
the tap convention (`target_layer_ids` are layer *outputs*, `hidden_states[id + 1]`);
decoding stays lossless; bad drafters are refused with the culprit named."""

from __future__ import annotations

import json

import mlx_spec
from convert import convert_checkpoint
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.dflash import DFlashDrafter, load_dflash_drafter

import hfmodels as hfm
import mlx.core as mx
import numpy as np
import pytest
import torch
from chisquare import chisquare_pvalue, exact_first_tokens, first_tokens
from helpers import BLOCK, DFLASH_IDS, DFLASH_LAYERS, MASK, cli_here, with_eos, write_dflash

dflash_model = pytest.importorskip("dflash.model")  # installed by the README's test command

PROMPT = [3, 4, 5, 19, 6, 3, 4, 9, 11]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    source, torch_model = hfm.write_hf_checkpoint(
        root / "qwen3", "qwen3", seed=2, num_hidden_layers=DFLASH_LAYERS
    )
    out = convert_checkpoint(str(source), str(root / "qwen3-mlx"), dtype="float32").path
    model, tok = mlx_spec.load(str(out))
    # seed 5: a random drafter whose drafts the target accepts 0.18 of the time at T = 1, top-k 3
    # (seed 3: 0.07), which gives the distribution test below its power at 500 samples
    drafter_dir, torch_drafter = write_dflash(root / "dflash", seed=5)
    return model, with_eos(tok), torch_model, torch_drafter, drafter_dir, root


def zlab_block_logits(torch_model, torch_drafter, sequence: list[int], k: int) -> np.ndarray:
    """z-lab's draft logits for the block [sequence[-1], mask x k] with every earlier
    position as context (`extract_context_feature` on transformers' hidden states)."""
    n = len(sequence) - 1
    with torch.no_grad():
        out = torch_model(input_ids=torch.tensor([sequence[:-1]]), output_hidden_states=True)
        feats = dflash_model.extract_context_feature(out.hidden_states, DFLASH_IDS)
        block = torch.tensor([[sequence[-1]] + [MASK] * k])
        noise = torch_model.get_input_embeddings()(block)
        hidden = torch_drafter(
            target_hidden=feats,
            noise_embedding=noise,
            position_ids=torch.arange(n + k + 1)[None],
            past_key_values=None,
            use_cache=False,
        )[:, 1:]
        logits = torch_drafter.compute_logits(hidden, torch_model.lm_head)
    return logits[0].numpy()


def _drafter_logits(drafter: DFlashDrafter, k: int) -> np.ndarray:
    """The next block's logits from the running drafter (as `draft` computes them)."""
    features = mx.concatenate(drafter._queued)[None] if drafter._queued else None
    drafter._queued = []
    block = mx.array([[drafter.pending] + [MASK] * k], mx.uint32)
    return np.array(drafter.model(block, features, drafter.caches, drafter.position)[0])


def test_block_logits_equal_zlab(target):
    """First round, then two rounds later (the context cache grown by accepted tokens and a
    plain step): the block's logits equal z-lab's computed afresh on the whole sequence."""
    model, _, torch_model, torch_drafter, path, _ = target
    drafter = load_dflash_drafter(path, model)
    assert drafter.hidden_layers == (2, 3)
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
    sequence = list(PROMPT)
    drafter.begin(sequence, hfm.VOCAB, runner.prefill(sequence[:-1]))
    for emitted in ([8, 2, 15], [4], [10, 12]):
        got = _drafter_logits(drafter, 5)
        want = zlab_block_logits(torch_model, torch_drafter, sequence, 5)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        runner(mx.array([sequence[-1]] + emitted[:-1], mx.uint32))  # the verify pass
        drafter.accept(len(emitted) - 1, emitted, runner.last_hidden)
        sequence += emitted


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_dflash_equals_plain(target, k):
    model, tok, *_, path, _ = target
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=30).tokens
    drafter = load_dflash_drafter(path, model)
    result = mlx_spec.generate(model, tok, PROMPT, drafter=drafter, num_draft=k, max_tokens=30)
    assert result.tokens == plain
    assert result.stats.drafter == "dflash" and result.stats.drafted > 0


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_dflash_state_after_forced_outcomes(target, accepted):
    """Rounds forced to keep 0, 1 or all 3 drafts: each next block equals a fresh drafter's
    on the same sequence (nothing of a rejected block stays in the cache)."""
    model, *_, path, _ = target
    drafter = load_dflash_drafter(path, model)
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
    sequence = list(PROMPT)
    drafter.begin(sequence, hfm.VOCAB, runner.prefill(sequence[:-1]))
    for _ in range(4):
        drafts = drafter.draft(3, SamplingConfig()).tokens.tolist()
        fresh = DFlashDrafter(drafter.model, model)
        check = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
        fresh.begin(sequence, hfm.VOCAB, check.prefill(sequence[:-1]))
        assert drafts == fresh.draft(3, SamplingConfig()).tokens.tolist()
        emitted = drafts[:accepted] + [(drafts[accepted] + 1) % hfm.VOCAB if accepted < 3 else 5]
        runner(mx.array([sequence[-1]] + emitted[:-1], mx.uint32))
        drafter.accept(accepted, emitted, runner.last_hidden)
        sequence += emitted
        for _ in range(5):  # plain steps: the context piles up, then is caught up on
            token = int(mx.argmax(runner(mx.array([sequence[-1]], mx.uint32))[-1]).item())
            drafter.accept(0, [token], runner.last_hidden)
            sequence.append(token)
        drafter.catch_up()
        assert not drafter._queued and drafter.caches[0].offset == len(sequence) - 1


DIST = SamplingConfig(temperature=1.0, top_k=3)


def test_distribution_with_dflash(target):
    """Temperature 1, top-k 3: the first three tokens with block drafts (k = 2, each position
    with its own q) follow the target's exact distribution."""
    model, tok, *_, path, _ = target
    drafter = load_dflash_drafter(path, model)
    # power: a verifier that recovers from p instead of the residual gives p ~ 2e-22 at 500
    samples = first_tokens(model, tok, PROMPT, drafter, DIST, 500)
    assert chisquare_pvalue(samples, exact_first_tokens(model, PROMPT, DIST, hfm.VOCAB)) > 1e-3


def test_dflash_bad_drafters(target, tmp_path):
    model = target[0]
    far = {"target_layer_ids": [1, 6], "mask_token_id": MASK, "block_size": BLOCK}
    path, _ = write_dflash(tmp_path / "far", dflash_config=far)
    with pytest.raises(ValueError, match=r"reads target layers \[1, 6\]; the target has 4"):
        load_dflash_drafter(path, model)
    path, _ = write_dflash(tmp_path / "wide", hidden_size=48)
    with pytest.raises(ValueError, match="48 wide; it embeds with the target's 32-wide"):
        load_dflash_drafter(path, model)
    nomask = {"target_layer_ids": DFLASH_IDS, "block_size": BLOCK}
    path, _ = write_dflash(tmp_path / "nomask", dflash_config=nomask)
    with pytest.raises(ValueError, match="no mask_token_id"):
        load_dflash_drafter(path, model)
    path, _ = write_dflash(tmp_path / "shape")
    weights = dict(mx.load(str(path / "model.safetensors")))
    weights["fc.weight"] = weights["fc.weight"][:, :8]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"tensor fc.weight has shape \(32, 8\)"):
        load_dflash_drafter(path, model)


def test_convert_dflash_and_use_it(target, tmp_path):
    """`mlx-spec convert` takes a DFlash drafter alone to an MLX layout with the same logits;
    `generate --dflash` and drafter="dflash" (beside a converted target) use it."""
    import shutil

    model, tok, *_, path, root = target
    out = convert_checkpoint(str(path), str(tmp_path / "dflash-mlx"), dtype="float32").path
    assert json.loads((out / "config.json").read_text())["model_type"] == "dflash"
    logits = []
    for source in (path, out):
        drafter = load_dflash_drafter(source, model)
        runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
        drafter.begin(PROMPT, hfm.VOCAB, runner.prefill(PROMPT[:-1]))
        logits.append(_drafter_logits(drafter, 4))
    np.testing.assert_array_equal(logits[0], logits[1])
    shutil.copytree(out, root / "qwen3-mlx" / "dflash")
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=12).tokens
    result = mlx_spec.generate(model, tok, PROMPT, drafter="dflash", num_draft=3, max_tokens=12)
    assert result.tokens == plain and result.stats.drafter == "dflash"
    run = cli_here(
        "generate", "--model", str(root / "qwen3-mlx"), "--dflash", str(out), "--prompt",
        "abcab", "--max-tokens", "6", "--num-draft", "3", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["stats"]["drafter"] == "dflash"


def test_training_blocks_equal_inference_blocks(target):
    """Distillation scores every block of a sequence in one pass (block-sparse mask, per-token
    positions); each block's logits equal the inference pass's for that round."""
    from mlx_spec.models.dflash import train_logits, training_anchors

    model, *_, path, _ = target
    drafter = load_dflash_drafter(path, model)
    tokens = mx.array([list(range(3, 20)) + list(range(4, 12))])
    runner = ModelRunner(model, hfm.VOCAB, keep_hidden=drafter.hidden_layers)
    features = runner.prefill(tokens[0].tolist())[None]
    got = np.array(train_logits(drafter.model, tokens, features))
    anchors = training_anchors(tokens.shape[1], BLOCK)
    assert got.shape[:3] == (1, len(anchors), BLOCK - 1) and len(anchors) >= 2
    for j, a in enumerate(anchors):
        block = mx.array([[tokens[0, a].item()] + [MASK] * (BLOCK - 1)], mx.uint32)
        caches = drafter.model.make_cache()
        want = drafter.model(block, features[:, :a], caches, a)[0]
        np.testing.assert_allclose(got[0, j], np.array(want), atol=1e-4, rtol=1e-4)
