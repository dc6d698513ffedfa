"""Gemma 4 assistant drafter: the MLX port against transformers (numerical oracle), lossless
speculative decoding on a tiny gemma4_text target (past its sliding window), the K/V and hidden
state the drafter reads every round, distribution preservation and clear errors."""

from __future__ import annotations

import json
import shutil

import mlx_spec
import mlx_spec.decoding.chain
from mlx_spec import cli
from mlx_spec.caches.rollback import CacheRollback
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.gemma4_assistant import (
    Gemma4AssistantDrafter,
    load_gemma4_assistant,
    window_kv,
)
from mlx_spec.models.gemma4_assistant import AssistantArgs, load_assistant

import hfmodels as hfm
import mlx.core as mx
import numpy as np
import pytest
import tinymodels as tm
import torch
from chisquare import chisquare_pvalue, exact_sequences, reference_probs
from helpers import NEGATIVE_CONTROLS, ScriptedPolicy, with_eos
from mlx_lm.models.cache import RotatingKVCache
from safetensors.torch import load_file, save_file
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

WINDOW = 6  # target and assistant sliding window; generations run well past it
TARGET_VOCAB = 24  # tokenizer has 21 ids: the last rows are padding
PROMPT = [3, 4, 5, 19, 6, 3, 4]
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]


def _all_reuse_modes(original):
    # transformers 5.23 raises in `kv_sharing_modes` when every layer reuses K/V, which a
    # Gemma 4 assistant always does; this is the mode list it would build.
    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    return property(modes)


@pytest.fixture(scope="module", autouse=True)
def hf_assistant_builds():
    with pytest.MonkeyPatch.context() as mp:
        original = Gemma4TextConfig.kv_sharing_modes
        mp.setattr(Gemma4TextConfig, "kv_sharing_modes", _all_reuse_modes(original))
        yield


def write_assistant(path, *, vocab, backbone=32, ordered=False, centroids=4, seed=0):
    """A tiny random Gemma4AssistantForCausalLM saved with save_pretrained; (path, model)."""
    text = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        layer_types=LAYER_TYPES, sliding_window=WINDOW, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )  # fmt: skip
    config = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=backbone,
        use_ordered_embeddings=ordered,
        num_centroids=centroids,
        centroid_intermediate_top_k=2,
    )
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM._from_config(config, attn_implementation="eager")
    hfm.randomize(model, seed)
    if ordered:  # a real token order, so the centroid -> token mapping matters
        model.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
    return hfm.save(model, path), model


def target_config(vocab: int, **overrides) -> dict:
    """gemma4_text with KV sharing: layers 3-4 reuse the K/V of layers 1 (sliding) and 2 (full)."""
    config = {
        "model_type": "gemma4_text", "hidden_size": 32, "num_hidden_layers": 5,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "global_head_dim": 16, "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention", "full_attention"],
        "sliding_window": WINDOW, "hidden_size_per_layer_input": 4,
        "vocab_size_per_layer_input": vocab, "vocab_size": vocab,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "bos_token_id": tm.BOS_ID, "eos_token_id": tm.EOS_ID,
    }  # fmt: skip
    config.update(overrides)
    return config


@torch.no_grad()
def make_copy_assistant(model: torch.nn.Module, target) -> None:
    """Turn a random assistant into one that mostly drafts its input token again, so that on a
    target that often repeats itself drafts are sometimes accepted and sometimes rejected."""
    embed = torch.tensor(np.array(target.model.embed_tokens.weight))
    model.model.embed_tokens.weight.copy_(embed)
    model.pre_projection.weight.zero_()
    model.pre_projection.weight[:, :32].copy_(10 * torch.eye(32))
    for layer in model.model.layers:
        layer.post_attention_layernorm.weight.mul_(0.1)
        layer.post_feedforward_layernorm.weight.mul_(0.1)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """{"target": (model, tokenizer), "copy"/"centroid": (assistant dir, torch assistant)}."""
    root = tmp_path_factory.mktemp("gemma4")
    config = target_config(TARGET_VOCAB)
    tm.write_checkpoint(root / "target", config, tm.random_weights(config, seed=1, scale=0.5))
    model, tok = mlx_spec.load(str(root / "target"))
    copy_path, copy_model = write_assistant(root / "copy", vocab=TARGET_VOCAB, seed=2)
    make_copy_assistant(copy_model, model)
    hfm.save(copy_model, copy_path)
    centroid = write_assistant(root / "centroid", vocab=TARGET_VOCAB, ordered=True, seed=3)
    return {"target": (model, with_eos(tok)), "copy": (copy_path, copy_model), "centroid": centroid}


# --------------------------------------------------------------------------- numerical oracle

ORACLE_CASES = [  # (query length, full K/V length, sliding K/V length, first position)
    (1, 11, 9, 11),  # sliding K/V longer than the window: the mask keeps the last WINDOW + 1
    (1, 3, 3, 3),  # short sequence: everything visible
    (1, 20, WINDOW + 1, 20),
    (3, 7, 10, 7),  # several queries at once (transformers' eager path)
]


@pytest.fixture(scope="module", params=[False, True], ids=["tied-head", "centroid-head"])
def oracle(request, tmp_path_factory):
    path, model = write_assistant(
        tmp_path_factory.mktemp("oracle"), vocab=256, backbone=24, ordered=request.param,
        centroids=16, seed=7,
    )  # fmt: skip
    return load_assistant(path), model


def _random_inputs(case, gen: torch.Generator):
    q_len, full_len, sliding_len, pos = case
    embeds = torch.randn(1, q_len, 48, generator=gen)
    positions = torch.arange(pos, pos + q_len)[None]
    shapes = {"full_attention": (full_len, 16), "sliding_attention": (sliding_len, 8)}
    kv = {
        kind: tuple(torch.randn(1, 2, length, dim, generator=gen) for _ in range(2))
        for kind, (length, dim) in shapes.items()
    }
    return embeds, positions, kv


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "case", ORACLE_CASES, ids=lambda c: "L{}-full{}-sliding{}-pos{}".format(*c)
)
def test_port_matches_transformers(oracle, case, attn):
    """Logits and projected hidden state of the MLX port equal transformers' float32 forward
    (same inputs_embeds, position_ids, shared_kv_states) within 1e-4."""
    mine, reference = oracle
    if attn == "sdpa" and case[0] > 1:
        pytest.skip("transformers' sdpa mask differs from its eager one for several queries")
    reference.set_attn_implementation(attn)
    embeds, positions, kv = _random_inputs(case, torch.Generator().manual_seed(sum(case)))
    with torch.no_grad():
        # output_hidden_states: transformers' KV-shared slicing fails for L > 1 without it
        out = reference(
            inputs_embeds=embeds, position_ids=positions, shared_kv_states=kv,
            output_hidden_states=case[0] > 1,
        )  # fmt: skip
    shared = {k: tuple(mx.array(t.numpy()) for t in pair) for k, pair in kv.items()}
    logits, projected = mine(mx.array(embeds.numpy()), mx.array(positions.numpy()), shared)
    np.testing.assert_allclose(np.array(logits), out.logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(
        np.array(projected), out.last_hidden_state.numpy(), atol=1e-4, rtol=0
    )


def test_config_head_dims_as_released(oracle):
    """A config without `per_layer_config` (as transformers before 5.x wrote it) takes
    `global_head_dim` for full-attention layers, like transformers does."""
    mine, _ = oracle
    config = {
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": 24,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "head_dim": 8, "global_head_dim": 16,
            "layer_types": LAYER_TYPES, "vocab_size": 256, "hidden_size_per_layer_input": 0,
        },
    }  # fmt: skip
    args = AssistantArgs.from_config(config)
    assert args.head_dims == mine.args.head_dims == (8, 8, 8, 16)
    assert args.rope_parameters["full_attention"]["rope_type"] == "proportional"


# --------------------------------------------------------------------------- lossless decoding


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_plain(gemma, k):
    """Greedy speculative output equals plain decoding, 40 tokens past a window of 6; the copy
    assistant has drafts both accepted and rejected."""
    model, tok = gemma["target"]
    drafter = load_gemma4_assistant(gemma["copy"][0], model)
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=40).tokens
    result = mlx_spec.generate(model, tok, PROMPT, drafter=drafter, num_draft=k, max_tokens=40)
    assert result.tokens == plain
    assert result.stats.drafter == "gemma4-assistant"
    assert 0 < result.stats.accepted < result.stats.drafted


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_plain_while_k_moves(gemma, seed):
    """Plain stretches between rounds of 1-4 drafts (the assistant follows the plain steps'
    tokens and hidden states), and the adaptive policy: still plain decoding's output."""
    model, tok = gemma["target"]
    drafter = load_gemma4_assistant(gemma["copy"][0], model)
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=60).tokens
    for num_draft in (ScriptedPolicy(seed=seed), "auto"):
        result = mlx_spec.generate(
            model, tok, PROMPT, drafter=drafter, num_draft=num_draft, max_tokens=60
        )
        assert result.tokens == plain
    assert result.stats.k_histogram.get(0, 0) >= 4


@pytest.mark.parametrize("prompt", [PROMPT, [3]], ids=["prompt", "one-token-prompt"])
def test_greedy_equals_plain_centroid_head(gemma, prompt):
    """Same with the centroid head; a one-token prompt has no hidden state for round one."""
    model, tok = gemma["target"]
    drafter = load_gemma4_assistant(gemma["centroid"][0], model)
    plain = mlx_spec.generate(model, tok, prompt, max_tokens=30).tokens
    result = mlx_spec.generate(model, tok, prompt, drafter=drafter, num_draft=3, max_tokens=30)
    assert result.tokens == plain and result.stats.drafted > 0


def test_session_turns_reuse_the_cache(gemma):
    """In a session the assistant follows the target's cache across turns: turn two (turn one's
    prompt + reply + new tokens, and then a prompt that is a prefix of the cached tokens)
    decodes what plain decoding does, prefilling only the new tokens."""
    from mlx_spec.serving.session import Session

    model, tok = gemma["target"]
    session = Session(model, tok, drafter=load_gemma4_assistant(gemma["copy"][0], model))
    first = session.generate(PROMPT, num_draft=3, max_tokens=20)
    prompt = PROMPT + first.tokens + [5, 6, 7]
    second = session.generate(prompt, num_draft=3, max_tokens=20)
    assert second.tokens == mlx_spec.generate(model, tok, prompt, max_tokens=20).tokens
    assert second.stats.drafted > 0 and not second.stats.cache_reset
    assert second.stats.prefilled_tokens == 4  # the 3 new tokens and the pending last one
    third = session.generate(prompt[:12], num_draft=3, max_tokens=20)  # a rewind: cut back
    assert third.tokens == mlx_spec.generate(model, tok, prompt[:12], max_tokens=20).tokens


class LoggingAssistant:
    """Wraps the assistant model and keeps every (inputs, outputs) of its calls."""

    def __init__(self, inner):
        self.inner, self.args, self.calls = inner, inner.args, []

    def __call__(self, x, positions, shared):
        logits, projected = self.inner(x, positions, shared)
        self.calls.append((positions, shared, logits, projected))
        return logits, projected


class Recording(Gemma4AssistantDrafter):
    """Records (sequence, assistant calls, drafts) for every round."""

    def begin(self, prompt, vocab_size, hidden=None):
        self.sequence, self.rounds = list(prompt), []
        super().begin(prompt, vocab_size, hidden)

    def draft(self, k, sampling):
        first = len(self.assistant.calls)
        out = super().draft(k, sampling)
        calls = self.assistant.calls[first:]
        self.rounds.append((list(self.sequence), calls, out.tokens.tolist()))
        return out

    def accept(self, num_accepted, emitted, hidden=None):
        self.sequence += emitted
        super().accept(num_accepted, emitted, hidden)


@torch.no_grad()
def _transformers_round(reference, model, fresh, hidden, sequence, drafts):
    """transformers' assistant over the K/V and hidden state of a fresh target pass, driven
    like its candidate generator (teacher-forced with `drafts`): [(logits, projected)]."""
    pos, text = len(sequence) - 1, model.model
    n = min(WINDOW, pos)
    owned = {"sliding_attention": fresh.cache[1], "full_attention": fresh.cache[2]}
    spans = {"sliding_attention": slice(pos - n, pos), "full_attention": slice(0, pos)}
    kv = {
        kind: tuple(torch.tensor(np.array(t[..., spans[kind], :])) for t in (c.keys, c.values))
        for kind, c in owned.items()
    }
    embed = torch.tensor(np.array(text.embed_tokens.weight)) * 32**0.5
    h, token, out = torch.tensor(np.array(hidden[pos - 1]))[None, None], sequence[-1], []
    for nxt in drafts:
        step = reference(
            inputs_embeds=torch.cat([embed[token][None, None], h], dim=-1),
            position_ids=torch.tensor([[pos]]), shared_kv_states=kv,
        )  # fmt: skip
        out.append((step.logits[0, 0].numpy(), step.last_hidden_state[0, 0].numpy()))
        h, token = step.last_hidden_state, nxt
    return out


@pytest.mark.parametrize("which", ["copy", "centroid"])
def test_every_round_matches_transformers_on_fresh_state(gemma, which):
    """Each round's assistant calls (k steps, one fixed position) equal transformers' assistant
    run on the target K/V and hidden state of a fresh pass over the same sequence: the drafter's
    view of the target's (rotating) cache is exact after every rollback."""
    model, tok = gemma["target"]
    path, reference = gemma[which]
    reference.set_attn_implementation("eager")
    drafter = Recording(LoggingAssistant(load_assistant(path)), model)
    result = mlx_spec.generate(model, tok, PROMPT, drafter=drafter, num_draft=3, max_tokens=30)
    fresh = ModelRunner(model, tm.tokenizer_size(), rollback=False, keep_hidden=True)
    hidden = fresh.prefill(PROMPT + result.tokens)  # one pass: every position stays cached
    assert len(drafter.rounds) > 5
    for sequence, calls, drafts in drafter.rounds:
        assert len(calls) == len(drafts)
        expected = _transformers_round(reference, model, fresh, hidden, sequence, drafts)
        for (positions, _, logits, projected), (ref_logits, ref_projected) in zip(
            calls, expected, strict=True
        ):
            assert positions.item() == len(sequence) - 1
            # float32 on either side; BLAS kernels differ by CPU (seen: 1.4e-4 on a 0.46 logit)
            np.testing.assert_allclose(np.array(logits[0, 0]), ref_logits, atol=1e-4, rtol=5e-4)
            np.testing.assert_allclose(
                np.array(projected[0, 0]), ref_projected, atol=1e-4, rtol=5e-4
            )


def test_window_kv_reads_rotating_cache_in_order():
    """window_kv returns a sliding cache's valid entries oldest-first, ending at the newest,
    through one- and many-token writes, ring wrap-around and exact rollbacks as the target's
    runner does them; at least a window's worth is always there."""
    cache, rng, written = RotatingKVCache(max_size=WINDOW), np.random.default_rng(0), 0
    rollback = CacheRollback([cache])
    for _ in range(60):
        fed = int(rng.integers(1, 5))
        rollback.checkpoint(fed, single_call=True)
        keys = mx.arange(written, written + fed, dtype=mx.float32).reshape(1, 1, fed, 1)
        cache.update_and_fetch(keys, keys)
        keep = int(rng.integers(1, fed + 1))  # a round keeps at least the last token it fed
        if rollback.rollback(fed, keep, single_call=fed > 1) and keep:
            cache.update_and_fetch(keys[..., :keep, :], keys[..., :keep, :])  # the replay
        written += keep
        got = np.array(window_kv(cache)[0]).ravel().tolist()
        assert got == list(range(written - len(got), written)), got
        assert len(got) >= min(WINDOW, written)


# --------------------------------------------------------------------------- distribution


ALPHABET = "abcde"
SMALL_PROMPT = [3, 4, 5, 3]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """An 8-token target with flat next-token distributions and a random assistant for it."""
    root, vocab = tmp_path_factory.mktemp("small"), tm.tokenizer_size(ALPHABET)
    config = target_config(vocab)
    weights = tm.random_weights(config, seed=4, scale=0.2)
    tm.write_checkpoint(root / "t", config, weights, tm.build_tokenizer(ALPHABET))
    model, tok = mlx_spec.load(str(root / "t"))
    # seed 11: an assistant whose drafts the target accepts half the time at T = 1, top-k 3
    # (seed 5: a tenth), which gives the tests below their power at 300 samples
    drafter = load_gemma4_assistant(write_assistant(root / "a", vocab=vocab, seed=11)[0], model)
    return model, with_eos(tok), drafter


DIST_CONFIG = SamplingConfig(temperature=1.0, top_k=3)
# Samples per test; the negative controls below use as many, so they show the power the test
# has: the subtle one (recovery from p instead of the residual) gives p ~ 3e-14 at 300.
RUNS = 300


def exact_three_tokens(model, vocab: int) -> dict:
    """P(t1, t2, t3 | prompt) of the target at temperature 1, top-k 3, by enumeration."""

    def next_probs(ids):
        return reference_probs(np.array(model(mx.array([ids]))[0, -1, :vocab]), DIST_CONFIG)

    return exact_sequences(next_probs, SMALL_PROMPT, 3)


def three_token_samples(model, tok, drafter, runs: int) -> list:
    """First three tokens of `runs` speculative generations (k = 2: round one drafts two)."""
    return [
        tuple(
            mlx_spec.generate(
                model,
                tok,
                SMALL_PROMPT,
                drafter=drafter,
                num_draft=2,
                max_tokens=3,
                seed=seed,
                temperature=DIST_CONFIG.temperature,
                top_k=DIST_CONFIG.top_k,
            ).tokens
        )  # fmt: skip
        for seed in range(runs)
    ]


def test_three_token_distribution_matches_target(small):
    """The first three tokens follow the target's exact distribution (chi-square over RUNS
    samples)."""
    model, tok, drafter = small
    samples = three_token_samples(model, tok, drafter, RUNS)
    expected = exact_three_tokens(model, tm.tokenizer_size(ALPHABET))
    assert chisquare_pvalue(samples, expected) > 1e-3


@pytest.mark.parametrize("control", NEGATIVE_CONTROLS)
def test_negative_controls_fail(small, monkeypatch, control):
    """The same test rejects a verifier that accepts every draft (the assistant's own
    distribution then leaks into the output) and one that recovers from the target's
    distribution instead of the residual."""
    model, tok, drafter = small
    monkeypatch.setattr(*NEGATIVE_CONTROLS[control])
    samples = three_token_samples(model, tok, drafter, RUNS)
    expected = exact_three_tokens(model, tm.tokenizer_size(ALPHABET))
    assert chisquare_pvalue(samples, expected) < 1e-3


# --------------------------------------------------------------------------- errors


def test_mismatched_assistant_refused(gemma, tmp_path):
    """An assistant trained for another backbone width, or another vocabulary, is refused."""
    model, _ = gemma["target"]
    narrow, _ = write_assistant(tmp_path / "narrow", vocab=TARGET_VOCAB, backbone=24)
    with pytest.raises(ValueError, match="backbone_hidden_size 24 does not match .* 32"):
        load_gemma4_assistant(narrow, model)
    wide_vocab, _ = write_assistant(tmp_path / "vocab", vocab=48)
    with pytest.raises(ValueError, match="vocabulary 48 does not match the target's 24"):
        load_gemma4_assistant(wide_vocab, model)


def test_non_gemma_target_refused(gemma, tmp_path):
    config = tm.llama_config(tm.tokenizer_size())
    tm.write_checkpoint(tmp_path / "llama", config, tm.random_weights(config, seed=0))
    llama, _ = mlx_spec.load(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match="needs a Gemma 4 .* not 'llama'"):
        load_gemma4_assistant(gemma["copy"][0], llama)


def _edit_weights(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


BAD_CHECKPOINTS = {
    "unknown": (
        lambda t: t.update({"model.layers.0.self_attn.gate.weight": torch.zeros(2)}),
        "unexpected tensor model.layers.0.self_attn.gate.weight",
    ),
    "missing": (lambda t: t.pop("model.norm.weight"), "missing tensor model.norm.weight"),
    "shape": (
        lambda t: t.update({"post_projection.weight": torch.zeros(32, 31)}),
        r"tensor post_projection.weight has shape \(32, 31\), expected \(32, 32\)",
    ),
}


@pytest.mark.parametrize("kind", [*BAD_CHECKPOINTS, "model_type"])
def test_bad_checkpoint_names_the_problem(gemma, tmp_path, kind):
    model, _ = gemma["target"]
    path = shutil.copytree(gemma["copy"][0], tmp_path / "bad")
    if kind == "model_type":
        hfm.edit_config(path, model_type="gemma4_text")
        message = "model_type is 'gemma4_text', expected 'gemma4_assistant'"
    else:
        change, message = BAD_CHECKPOINTS[kind]
        _edit_weights(path, change)
    with pytest.raises(ValueError, match=message):
        load_gemma4_assistant(path, model)


def test_cli_assistant(gemma, tmp_path, capsys):
    """`generate --assistant DIR` prints plain decoding's tokens, alone and grouped with n-gram
    lookup (several drafter flags: chosen between every round)."""
    target_dir = tmp_path / "target"
    config = target_config(TARGET_VOCAB)
    tm.write_checkpoint(target_dir, config, tm.random_weights(config, seed=1, scale=0.5))
    base = ["generate", "--model", str(target_dir), "--prompt", "abcab", "--max-tokens", "12"]
    assert cli.main([*base, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main([*base, "--json", "--assistant", str(gemma["copy"][0])]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["tokens"] == plain["tokens"]
    assert record["stats"]["drafter"] == "gemma4-assistant"
    assert cli.main([*base, "--json", "--assistant", str(gemma["copy"][0]), "--ngram"]) == 0
    grouped = json.loads(capsys.readouterr().out)
    assert grouped["tokens"] == plain["tokens"]
    assert grouped["stats"]["drafter"] == "ngram+gemma4-assistant"
