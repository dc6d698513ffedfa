"""MTP drafters (DeepSeek-V3, Qwen3.5 on a hybrid target, MiMo) from checkpoints converted by
`mlx-spec convert`: lossless, state exact, formula checked, errors clear."""

from __future__ import annotations

import json

import mlx_spec
import mlx_spec.decoding.chain
from convert import Quantization, convert_checkpoint
from mlx_spec.core.sampling import SamplingConfig
from mlx_spec.decoding.runner import ModelRunner
from mlx_spec.drafters.branching import BranchingMTP
from mlx_spec.drafters.mtp import MTPDrafter, load_mtp_drafter

import hfmodels as hfm
import mlx.core as mx
import numpy as np
import pytest
from chisquare import chisquare_pvalue, exact_sequences, reference_probs
from helpers import CONTROL_RUNS, NEGATIVE_CONTROLS, cli_here, with_eos
from mlx.nn import RMSNorm
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

WRITERS = {
    "deepseek_v3": lambda p: hfm.write_hf_checkpoint(p, "deepseek_v3", seed=4),
    "glm4_moe": lambda p: hfm.write_hf_checkpoint(p, "glm4_moe", seed=7),
    "qwen3_5": lambda p: hfm.write_qwen3_5_checkpoint(p, seed=5),
    "mimo": lambda p: hfm.write_mimo_checkpoint(p, seed=6),
}
LAYOUT = {
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "deepseek_v3",
    "qwen3_5": "qwen3_5",
    "mimo": "mimo",
}  # the published MTP layout each target family ships
FAMILIES = list(WRITERS)
# The seed of each family's random MTP head. Most seeds give qwen3_5 and glm4_moe heads whose
# drafts the target almost never accepts (0.00-0.03 at T = 1, top-k 3), which leaves their
# distribution tests little power over the acceptance rule; these seeds' heads are accepted
# 0.30 (qwen3_5) and 0.26 (glm4_moe) of the time.
HEAD_SEEDS = {"deepseek_v3": 50, "glm4_moe": 51, "qwen3_5": 69, "mimo": 50}
PROMPT = [3, 4, 5, 19, 6, 3, 4]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: converted target dir}, each with an `mtp/` drafter; plus a plain llama."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for family, writer in WRITERS.items():
        source, _ = writer(root / family)
        hfm.add_mtp(source, family=LAYOUT[family], seed=HEAD_SEEDS[family])
        out[family] = convert_checkpoint(
            str(source), str(root / f"{family}-mlx"), dtype="float32"
        ).path
    source, _ = hfm.write_hf_checkpoint(root / "llama", "llama", seed=1)
    out["llama"] = convert_checkpoint(str(source), str(root / "llama-mlx"), dtype="float32").path
    return out


@pytest.fixture(scope="module")
def loaded(converted):
    out = {}
    for family in FAMILIES:
        model, tok = mlx_spec.load(str(converted[family]))
        out[family] = (model, with_eos(tok))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_plain(loaded, family, k):
    """drafter='mtp' (found beside the converted target) at temperature 0 == plain decoding."""
    model, tok = loaded[family]
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=30).tokens
    result = mlx_spec.generate(model, tok, PROMPT, drafter="mtp", num_draft=k, max_tokens=30)
    assert result.tokens == plain
    assert result.stats.drafter == "mtp" and result.stats.drafted > 0


class Recording(MTPDrafter):
    """An MTP drafter that records (sequence so far, draft) for every round."""

    def begin(self, prompt, vocab_size, hidden=None):
        self.sequence, self.rounds = list(prompt), []
        super().begin(prompt, vocab_size, hidden)

    def draft(self, k, sampling):
        out = super().draft(k, sampling)
        self.rounds.append((list(self.sequence), k, out.tokens.tolist()))
        return out

    def accept(self, num_accepted, emitted, hidden=None):
        self.sequence += emitted
        super().accept(num_accepted, emitted, hidden)


def fresh_draft(drafter: MTPDrafter, model, sequence, k, vocab):
    """Drafts of a brand-new drafter begun on `sequence` (the state the running one must have)."""
    target = ModelRunner(model, vocab, keep_hidden=True)
    hidden = target.prefill(sequence[:-1])
    fresh = MTPDrafter(drafter.module, model)
    fresh.begin(sequence, vocab, hidden)
    return fresh.draft(k, SamplingConfig()).tokens.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_state_is_exact_every_round(loaded, converted, family):
    """After every round (rejections, full acceptances, rollback of self-fed steps) the running
    MTP drafter drafts exactly what a fresh one begun on the same sequence drafts."""
    model, tok = loaded[family]
    plain = load_mtp_drafter(str(converted[family]), model)
    drafter = Recording(plain.module, model)
    mlx_spec.generate(model, tok, PROMPT, drafter=drafter, num_draft=3, max_tokens=24)
    vocab = hfm.VOCAB
    assert len(drafter.rounds) > 3
    for sequence, k, tokens in drafter.rounds:
        assert fresh_draft(drafter, model, sequence, k, vocab) == tokens, len(sequence)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_drafter_state_after_forced_outcomes(loaded, converted, family, accepted):
    """Rounds forced to accept 0, 1 or all 3 drafts (then a recovered/bonus token): each next
    draft equals a fresh drafter's on the same sequence, so catch-up and rollback are exact."""
    model, _ = loaded[family]
    vocab = hfm.VOCAB
    drafter = load_mtp_drafter(str(converted[family]), model)
    sequence = list(PROMPT)
    target = ModelRunner(model, vocab, keep_hidden=True)
    drafter.begin(sequence, vocab, target.prefill(sequence[:-1]))
    for _ in range(4):
        drafts = drafter.draft(3, SamplingConfig()).tokens.tolist()
        assert drafts == fresh_draft(drafter, model, sequence, 3, vocab)
        emitted = drafts[:accepted] + [(drafts[accepted] + 1) % vocab if accepted < 3 else 5]
        target(mx.array([sequence[-1]] + emitted[:-1], mx.uint32))  # the verify pass
        drafter.accept(accepted, emitted, target.last_hidden)
        sequence += emitted


def _rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * np.asarray(w)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_follows_published_formula(loaded, converted, family):
    """One MTP step computed by hand from the published formula (concat order, which norms,
    projection, shared head) equals the module: x = P([norm_a(.), norm_b(.)]), layer, norm, head."""
    model, _ = loaded[family]
    module = load_mtp_drafter(str(converted[family]), model).module
    layer = module.layers[0]
    mx.random.seed(0)
    hidden_size = layer.input_layernorm.weight.shape[0]
    h = mx.random.normal((1, 3, hidden_size))
    tokens = mx.array([[4, 7, 9]])
    e = np.array(module._embed(tokens))
    eps = layer.input_layernorm.eps
    if LAYOUT[family] == "deepseek_v3":
        joined = np.concatenate(
            [_rms(e, layer.enorm.weight, eps), _rms(h, layer.hnorm.weight, eps)], -1
        )
        proj, final = layer.eh_proj.weight, layer.shared_head.norm
    elif family == "mimo":  # hidden first
        joined = np.concatenate(
            [
                _rms(h, layer.hidden_layernorm.weight, eps),
                _rms(e, layer.token_layernorm.weight, eps),
            ],
            -1,
        )
        proj, final = layer.input_proj.weight, layer.final_layernorm
    else:
        joined = np.concatenate(
            [
                _rms(e, module.pre_fc_norm_embedding.weight, eps),
                _rms(h, module.pre_fc_norm_hidden.weight, eps),
            ],
            -1,
        )
        proj, final = module.fc.weight, module.norm
    assert proj.shape == (hidden_size, 2 * hidden_size)
    x = mx.array((joined @ np.asarray(proj, np.float64).T).astype(np.float32))
    cache = KVCache()
    x = layer(x, create_attention_mask(x, cache, return_array=True), cache)
    z = final(x)
    head, method = module._head
    want = np.array(getattr(head, method)(z))
    got = np.array(module(tokens, cache=module.make_cache(), hidden=h))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    fed_back = x if LAYOUT[family] == "deepseek_v3" else z  # DeepSeek feeds back before the norm
    np.testing.assert_allclose(np.array(module.feedback), np.array(fed_back), atol=2e-4, rtol=1e-4)
    assert isinstance(final, RMSNorm)


def mtp_samples(model, tok, drafter, config: SamplingConfig, runs: int) -> list:
    """The first three tokens of `runs` seeded generations with the MTP drafter, k = 2 (round
    one drafts two, so both draft positions, the residual and the bonus token are exercised)."""
    return [
        tuple(
            mlx_spec.generate(
                model,
                tok,
                PROMPT,
                drafter=drafter,
                num_draft=2,
                max_tokens=3,
                temperature=config.temperature,
                top_k=config.top_k,
                seed=s,
            ).tokens
        )
        for s in range(runs)
    ]


def exact_three_tokens(model, config: SamplingConfig) -> dict:
    def next_probs(ids):
        return reference_probs(np.array(model(mx.array([ids]))[0, -1, : hfm.VOCAB]), config)

    return exact_sequences(next_probs, PROMPT, 3)


DIST_CONFIG = SamplingConfig(temperature=1.0, top_k=3)
# Samples per family, from the power each has against a verifier that recovers from p instead
# of the residual (the control below): mimo p ~ 1e-20 at 500, deepseek_v3 p ~ 1e-13 at 750,
# qwen3_5 p ~ 3e-16 at 500, glm4_moe p ~ 2e-7 at 600.
DIST_RUNS = {"deepseek_v3": 750, "glm4_moe": 600, "qwen3_5": 500, "mimo": 500}


@pytest.mark.parametrize("family", FAMILIES)
def test_distribution_preserved_with_mtp(loaded, converted, family):
    """Temperature 1.0, top-k 3: the first three tokens with the MTP drafter (k = 2) follow the
    target's exact distribution (chi-square, false-positive rate 1e-3)."""
    model, tok = loaded[family]
    drafter = load_mtp_drafter(str(converted[family]), model)
    samples = mtp_samples(model, tok, drafter, DIST_CONFIG, DIST_RUNS[family])
    assert chisquare_pvalue(samples, exact_three_tokens(model, DIST_CONFIG)) > 1e-3


def test_mtp_negative_control_fails(loaded, converted, monkeypatch):
    """The same test rejects a verifier that recovers from the target's distribution instead
    of the residual."""
    model, tok = loaded["mimo"]
    monkeypatch.setattr(*NEGATIVE_CONTROLS["subtle"])
    drafter = load_mtp_drafter(str(converted["mimo"]), model)
    samples = mtp_samples(model, tok, drafter, DIST_CONFIG, CONTROL_RUNS)
    assert chisquare_pvalue(samples, exact_three_tokens(model, DIST_CONFIG)) < 1e-3


def test_mtp_requested_without_mtp_layers(converted):
    """A converted checkpoint without MTP layers: a clear error, not a traceback."""
    model, tok = mlx_spec.load(str(converted["llama"]))
    with pytest.raises(ValueError, match="no MTP drafter"):
        mlx_spec.generate(model, tok, PROMPT, drafter="mtp", max_tokens=3)


def test_mtp_drafter_for_another_target(loaded, converted):
    """A drafter converted for one target is refused for another (layer kinds, sizes)."""
    model, tok = loaded["mimo"]
    with pytest.raises(ValueError, match="does not match the target"):
        load_mtp_drafter(str(converted["deepseek_v3"]), model)
    other, _ = mlx_spec.load(str(converted["mimo"]))
    drafter = load_mtp_drafter(str(converted["mimo"]), other)
    with pytest.raises(ValueError, match="another target"):
        mlx_spec.generate(model, tok, PROMPT, drafter=drafter, max_tokens=3)


def test_cli_mtp_default_directory(converted):
    """`mlx-spec generate --model DIR --mtp` finds DIR/mtp and matches plain decoding."""

    def run(*extra):
        args = ["--model", str(converted["mimo"]), "--prompt", "abcab", "--max-tokens", "12"]
        proc = cli_here("generate", *args, "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    spec, plain = run("--mtp"), run()
    assert spec["stats"]["drafter"] == "mtp"
    assert spec["tokens"] == plain["tokens"]
    bad = cli_here("generate", "--model", str(converted["llama"]), "--prompt", "ab", "--mtp")
    assert bad.returncode == 2 and "no MTP drafter" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "family,options,quantization",
    [
        ("deepseek_v3", dict(own_copies=True), None),  # its own embedding/head copies
        ("mimo", dict(num_layers=2), Quantization(bits=4, group_size=32)),  # 4-bit, 2 layers
    ],
)
def test_other_mtp_checkpoint_shapes(tmp_path, family, options, quantization):
    """MTP heads with their own embedding/head copies, with several layers, and quantized ones
    load through drafter='mtp' and stay lossless."""
    source, _ = WRITERS[family](tmp_path / "src")
    hfm.add_mtp(source, family=LAYOUT[family], seed=60, **options)
    out = convert_checkpoint(
        str(source), str(tmp_path / "out"), dtype="float32", quantization=quantization
    ).path
    model, tok = mlx_spec.load(str(out))
    tok = with_eos(tok)
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=16).tokens
    spec = mlx_spec.generate(model, tok, PROMPT, drafter="mtp", num_draft=3, max_tokens=16)
    assert spec.tokens == plain and spec.stats.drafted > 0


class RecordingTree(BranchingMTP):
    """A branching MTP drafter recording (sequence so far, its tree) every round."""

    def begin(self, prompt, hidden):
        self.sequence, self.rounds = list(prompt), []
        super().begin(prompt, hidden)

    def draft_tree(self, depth, vocab_size, sampling):
        tree = super().draft_tree(depth, vocab_size, sampling)
        self.rounds.append((list(self.sequence), depth, tree))
        return tree

    def accept(self, tokens, hidden):
        self.sequence += tokens
        super().accept(tokens, hidden)


@pytest.mark.parametrize(
    ("family", "depth"), [("deepseek_v3", 1), ("deepseek_v3", 4), ("glm4_moe", 2), ("mimo", 4)]
)
def test_branching_mtp_equals_plain_and_chains(loaded, converted, family, depth):
    """The MTP head's two best first tokens, each continued by the head: greedy output equals
    plain decoding, and every round's first branch is exactly the chain a fresh chain drafter
    begun on the same sequence drafts (pairs and fed-back hidden states line up, through
    rounds and plain stretches)."""
    model, tok = loaded[family]
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=30).tokens
    module = load_mtp_drafter(str(converted[family]), model).module
    drafter = RecordingTree(module, width=2, max_depth=depth)
    result = mlx_spec.generate(model, tok, PROMPT, drafter=drafter, num_draft=depth, max_tokens=30)
    assert result.tokens == plain and result.stats.drafter == "mtp-tree"
    assert len(drafter.rounds) > 3
    chain = MTPDrafter(module, model)
    for sequence, k, tree in drafter.rounds:
        assert len(tree) == 2 * k and tree.parents[:2] == [-1, -1]
        first = [tree.tokens[0]] + [tree.tokens[i] for i in range(2, len(tree), 2)]
        assert fresh_draft(chain, model, sequence, k, hfm.VOCAB) == first, len(sequence)


def test_branching_mtp_on_a_hybrid_target_drafts_chains(loaded, converted):
    """Qwen3.5 (recurrent layers) cannot score a tree in one pass: the tree drafter falls back
    to chains with the reason stated, and stays lossless."""
    model, tok = loaded["qwen3_5"]
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=20).tokens
    drafter = mlx_spec.load_branching_mtp(str(converted["qwen3_5"]), model)
    with pytest.warns(UserWarning, match="recurrent state.*drafts chains"):
        result = mlx_spec.generate(model, tok, PROMPT, drafter=drafter, num_draft=3, max_tokens=20)
    assert result.tokens == plain and result.stats.drafted > 0
