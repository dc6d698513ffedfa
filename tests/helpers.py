"""Helpers shared by several test modules (no test module imports another): tokenizer and
drafter builders, the command line run in this process, the three-token distribution harness
and its negative controls, the batch engine drivers, and random EAGLE-3 heads and DFlash
drafters for the tiny targets. The fixtures built on them live in conftest.py."""

from __future__ import annotations

import copy
import io
import json
import random
import subprocess
from contextlib import redirect_stderr, redirect_stdout

import mlx_spec
import mlx_spec.core.verify
import mlx_spec.decoding.chain
from mlx_spec.cli import main as cli_main
from mlx_spec.core.compat import scored_vocab
from mlx_spec.core.sampling import SamplingConfig, sample
from mlx_spec.decoding.engine import BatchEngine, BatchRequest
from mlx_spec.decoding.policy import Choice, DraftPolicy
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.mtp import MTPModule, target_layers

import hfmodels as hfm
import mlx.core as mx
import numpy as np
import pytest
import torch
from chisquare import exact_sequences, reference_probs
from safetensors.torch import save_file


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """`mlx-spec ARGS` run by the CLI's `main` in this process, its output captured: the exit
    code, stdout and stderr a user sees, without a new interpreter's seconds of imports (the
    `python -m mlx_spec.cli` entry itself is tested in test_cli.py). An exception escapes to the
    test, as a traceback would reach the user."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli_main(list(args))
        except SystemExit as exit_:  # argparse's refusals and --help
            code = exit_.code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def with_eos(tokenizer, eos_ids=()):
    """A copy of the tokenizer whose EOS ids are `eos_ids` (none: generations of fixed length)."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = set(eos_ids)
    return tokenizer


# ------------------------------------------------------------------------- drafters, policies


def make_drafter(kind, family, entry):
    """A fresh drafter of `kind` for the fixture `family`; MTP heads are random ones built on
    the target (a mimo-layout head; Qwen3.5's own layout on the hybrid target)."""
    model, tok, draft, draft_tok = entry
    if kind == "none":
        return None
    if kind == "draft-model":
        return mlx_spec.DraftModelDrafter(draft, with_eos(draft_tok, tok.eos_token_ids))
    if kind == "ngram":
        return "ngram"
    layout = "qwen3_5" if family == "qwen3_5" else "mimo"
    mx.random.seed(0)
    module = MTPModule(layout, model, len(target_layers(model)) - 1, 1e-6)
    mx.eval(module.parameters())
    return MTPDrafter(module, model)


class ScriptedPolicy(DraftPolicy):
    """Random choices independent of the tokens: plain stretches of 1-5 steps (30%), else k in
    1..K with a random arm, so k moves between 0 and K all the time."""

    def __init__(self, max_draft: int = 4, arms: int = 1, seed: int = 0):
        self.max_draft, self.arms = max_draft, arms
        self.rng = random.Random(seed)
        self.choices: list[Choice] = []

    def choose(self, limit: int, available=None) -> Choice:
        if limit == 0 or self.rng.random() < 0.3:
            choice = Choice(plain_tokens=self.rng.randint(1, 5))
        else:
            arm = self.rng.randrange(self.arms)
            choice = Choice(arm, self.rng.randint(1, min(limit, self.max_draft)))
        self.choices.append(choice)
        return choice

    def describe(self) -> str:
        return "scripted"


# ---------------------------------------------------------------- three-token distribution

ALPHA = 1e-3  # stated false-positive rate of each test
# Samples per test: against the subtle negative control below (recovery from p instead of the
# residual) the statistic is about 390 on 26 degrees of freedom at 1000 samples (p ~ 1e-30), so
# the tests keep their power with room to spare at this size.
DISTRIBUTION_RUNS = 1000
# Samples per negative control: the test's power against a fixed wrong distribution grows with
# the sample count, so a broken verifier that fails at a quarter of the runs fails the full-size
# test too. At this size every control's p-value is below 1e-5 (the weakest, the one-hot
# drafter's subtle control, ~2e-6).
CONTROL_RUNS = 250
DISTRIBUTION_ALPHABET = "abcde"  # the vocabulary of the `pair` fixture's checkpoints
DISTRIBUTION_PROMPT = [3, 4, 5, 3]
DISTRIBUTION_LENGTH = 3  # tokens compared: with k = 2, round one can emit all three
CONFIGS = [
    SamplingConfig(temperature=1.0, top_k=3),
    SamplingConfig(temperature=0.7, top_p=0.8),
    SamplingConfig(temperature=1.0),
]


def exact_distribution(model, config: SamplingConfig) -> dict:
    """P(t1, t2, t3 | prompt) under `model` with these sampling settings, by enumeration."""

    def next_probs(ids):
        return reference_probs(np.array(model(mx.array([ids]))[0, -1]), config)

    return exact_sequences(next_probs, DISTRIBUTION_PROMPT, DISTRIBUTION_LENGTH)


def sampled(
    model, tok, make_drafter, config: SamplingConfig, num_draft=lambda: 2, runs=DISTRIBUTION_RUNS
) -> list:
    """The first three tokens of `runs` seeded generations."""
    out = []
    for seed in range(runs):
        result = mlx_spec.generate(
            model,
            tok,
            DISTRIBUTION_PROMPT,
            drafter=make_drafter(),
            num_draft=num_draft(),
            max_tokens=DISTRIBUTION_LENGTH,
            seed=seed,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
        )
        out.append(tuple(result.tokens))
    return out


def always_accept(target_probs, draft_probs, draft_tokens):
    k = draft_tokens.shape[0]
    return mx.array(k), sample(target_probs[k])


def recover_from_target(target_probs, draft_probs):
    """A stand-in for `verify.residual` with one bug: a rejected position's token is drawn
    from the target's distribution, not from norm(max(0, p - q))."""
    return target_probs


NEGATIVE_CONTROLS = {  # (module, name, stand-in)
    "gross": (mlx_spec.decoding.chain, "rejection_verify", always_accept),
    "subtle": (mlx_spec.core.verify, "residual", recover_from_target),
}


# ------------------------------------------------------------------------------ batch engine


def engine_for(model, tok, drafters, **kwargs) -> BatchEngine:
    return BatchEngine(model, tok, scored_vocab(model, tok), drafters, **kwargs)


def run_all(engine: BatchEngine, requests: list[dict]) -> list:
    """Queue every request, step until done; returns (tokens, final chunk) per request."""
    outputs = [[] for _ in requests]
    finals = [None] * len(requests)

    def emitter(i):
        def emit(item):
            if isinstance(item, Exception):
                raise item
            if item.token is None:
                finals[i] = item
            else:
                outputs[i].append(item.token)

        return emit

    for i, req in enumerate(requests):
        engine.add(BatchRequest(emit=emitter(i), **req))
    while engine.busy:
        engine.step()
    return list(zip(outputs, finals, strict=True))


def busy_requests(vocab: int, drafter, num_draft, n: int = 7) -> list[dict]:
    """Requests of different prompt and output lengths (more than the batch holds at once)."""
    rng = random.Random(3)
    lengths = [(5, 40), (30, 25), (12, 60), (50, 8), (3, 33), (20, 45), (9, 1)][:n]
    return [
        dict(
            prompt=[1] + [rng.randrange(3, vocab) for _ in range(p)],
            sampling=SamplingConfig(),
            max_tokens=m,
            drafter=drafter,
            num_draft=num_draft,
        )
        for p, m in lengths
    ]


# ---------------------------------------------------------------------------- EAGLE-3 heads

EAGLE3_LAYERS = 4  # target decoder layers
EAGLE3_IDS = [0, 2, 3]  # the inputs of layers 0, 2 and 3 (Hugging Face hidden_states indices)
T = hfm.CONFIGS["llama"]["hidden_size"]
EAGLE3_PROMPT = [3, 4, 5, 19, 6, 3, 4, 9, 11]
HEAD = dict(hidden_size=T, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
LAYOUTS = ["eagle3", "speculators"]


def draft_vocab(seed: int = 0) -> np.ndarray:
    """Target ids of the draft vocabulary: half the target's, sorted, the specials included."""
    rng = np.random.default_rng(seed)
    rest = rng.choice(np.arange(3, hfm.VOCAB), size=hfm.VOCAB // 2 - 3, replace=False)
    return np.sort(np.concatenate([np.arange(3), rest]))


def head_tensors(seed: int, vocab_ids: np.ndarray, prefix: str = "midlayer") -> dict:
    gen = torch.Generator().manual_seed(seed)

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=gen) * cols**-0.5

    def vec(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    d, inner, heads, kv = T, HEAD["intermediate_size"], 4, 2
    hd = d // heads
    out = {
        "fc.weight": mat(d, len(EAGLE3_IDS) * T),
        f"{prefix}.self_attn.q_proj.weight": mat(heads * hd, 2 * d),
        f"{prefix}.self_attn.k_proj.weight": mat(kv * hd, 2 * d),
        f"{prefix}.self_attn.v_proj.weight": mat(kv * hd, 2 * d),
        f"{prefix}.self_attn.o_proj.weight": mat(d, heads * hd),
        f"{prefix}.mlp.gate_proj.weight": mat(inner, d),
        f"{prefix}.mlp.up_proj.weight": mat(inner, d),
        f"{prefix}.mlp.down_proj.weight": mat(d, inner),
        f"{prefix}.input_layernorm.weight": vec(d),
        f"{prefix}.hidden_norm.weight": vec(d),
        f"{prefix}.post_attention_layernorm.weight": vec(d),
        "norm.weight": vec(d),
        "lm_head.weight": mat(len(vocab_ids), d),
        "d2t": torch.tensor(vocab_ids - np.arange(len(vocab_ids)), dtype=torch.int64),
    }
    t2d = torch.zeros(hfm.VOCAB, dtype=torch.bool)
    t2d[torch.tensor(vocab_ids)] = True
    out["t2d"] = t2d
    return out


def write_eagle3(path, layout: str = "eagle3", seed: int = 7, **config_changes):
    """A random EAGLE-3 head for the tiny target, in the EAGLE repository's layout or the
    speculators format."""
    path.mkdir(parents=True, exist_ok=True)
    vocab_ids = draft_vocab(seed)
    layer = {
        "model_type": "llama",
        **HEAD,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": hfm.VOCAB,
    }
    if layout == "eagle3":
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer,
            "draft_vocab_size": len(vocab_ids),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE3_IDS},
        }
        tensors = head_tensors(seed, vocab_ids)
    else:
        config = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer,
            "draft_vocab_size": len(vocab_ids),
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": EAGLE3_IDS,
        }
        tensors = head_tensors(seed, vocab_ids, prefix="layers.0")
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path, tensors


# --------------------------------------------------------------------------- DFlash drafters

DFLASH_LAYERS = 4
DFLASH_IDS = [1, 2]  # target layer outputs: hidden_states[2] and [3]
BLOCK = 8
MASK = 7


def write_dflash(path, seed: int = 3, **changes):
    """A random z-lab DFlash drafter (2 Qwen3-style layers) for the tiny target."""
    from transformers import Qwen3Config

    # Here, not at import: a module importing helpers runs without z-lab's package installed.
    dflash_model = pytest.importorskip("dflash.model")
    base = hfm.CONFIGS["qwen3"]
    settings = dict(
        hidden_size=base["hidden_size"],
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        vocab_size=hfm.VOCAB,
        num_target_layers=DFLASH_LAYERS,
        dflash_config={"target_layer_ids": DFLASH_IDS, "mask_token_id": MASK, "block_size": BLOCK},
    )
    settings.update(changes)
    torch.manual_seed(seed)
    model = dflash_model.DFlashDraftModel(Qwen3Config(**settings))
    hfm.randomize(model.float(), seed)
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model


class FakeClock:
    """Simulated time for what generation measures (`mlx_spec.core.clock.now`): every reading
    moves it on by `tick` seconds, and `advance(s)` stands for work that took s seconds, so
    timings, and the choices made from them, do not depend on the machine's load."""

    def __init__(self, tick: float = 1e-4):
        self.time, self.tick = 0.0, tick

    def now(self) -> float:
        self.time += self.tick
        return self.time

    def advance(self, seconds: float) -> None:
        self.time += seconds
