"""`mlx-spec distill`: a drafter trained against the frozen target gets closer to it, writes a
directory `generate` loads, and resumes after an interruption at the same step count."""

from __future__ import annotations

import json

import mlx_spec
from mlx_spec.training.config import DistillConfig
from mlx_spec.training.distill import run_distill
from mlx_spec.training.distiller import CHECKPOINT, Distiller

import mlx.core as mx
import numpy as np
import pytest
import tinymodels as tm
from conftest import VOCAB
from helpers import cli_here, with_eos
from mlx.utils import tree_flatten

SMALL = dict(batch_size=8, seq_len=64, learning_rate=3e-3, hidden_size=64, num_layers=1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    config = tm.llama_config(VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    return tm.write_checkpoint(root / "target", config, tm.random_weights(config, 3, scale=0.7))


TEXT = 8000  # tokens of the target's own text every run here trains on


@pytest.fixture(scope="module", autouse=True)
def target_writes_once():
    """The target writes its text once: every run here distills the same target with the same
    seed, and `generate_tokens` is deterministic, so each later run gets exactly the tokens it
    would have written itself (a run still goes through its own data cache and resume)."""
    import mlx_spec.training.distill as distill

    original, written = distill.generate_tokens, {}

    def once(model, tokenizer, count, seed, **kwargs):
        key = (count, seed, tuple(sorted(kwargs.items())))
        if key not in written:
            written[key] = original(model, tokenizer, count, seed, **kwargs)
        return written[key].copy()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distill, "generate_tokens", once)
        yield


@pytest.mark.parametrize("kind", ["draft-model", "mtp", "medusa", "eagle3", "dflash"])
def test_distill_moves_the_drafter_towards_the_target(target_dir, tmp_path, kind):
    """On text the target writes, 80 steps cut the held-out KL and raise the acceptance rate at
    temperature 1; the drafter written loads and decodes losslessly."""
    out = tmp_path / kind
    config = DistillConfig(kind=kind, steps=80, checkpoint_every=20, **SMALL)
    report = run_distill(str(target_dir), str(out), config, generate=TEXT, progress=False)
    before, after = report["before"], report["after"]
    assert report["steps"] == 80
    assert after["heldout_kl"] < 0.6 * before["heldout_kl"]
    assert after["acceptance_t1"] > before["acceptance_t1"]
    assert json.loads((out / "distill.json").read_text())["after"] == after
    assert not (out / CHECKPOINT).exists()
    model, tok = mlx_spec.load(str(target_dir))
    tok = with_eos(tok)
    if kind == "mtp":
        drafter = mlx_spec.load_mtp_drafter(str(out), model)
    elif kind == "medusa":
        drafter = mlx_spec.load_medusa_drafter(str(out))
    elif kind == "eagle3":
        drafter = mlx_spec.load_eagle3_drafter(str(out), model)
    elif kind == "dflash":
        drafter = mlx_spec.load_dflash_drafter(str(out), model)
    else:
        drafter = mlx_spec.load_drafter(str(out))
    plain = mlx_spec.generate(model, tok, "abcab", max_tokens=20).tokens
    spec = mlx_spec.generate(model, tok, "abcab", drafter=drafter, num_draft=3, max_tokens=20)
    assert spec.tokens == plain


def _weights(out, kind):
    name = "medusa_lm_head.safetensors" if kind == "medusa" else "model.safetensors"
    return {k: np.array(v) for k, v in mx.load(str(out / name)).items()}


@pytest.mark.parametrize("kind", ["draft-model", "mtp"])
def test_interrupted_run_resumes_to_the_same_result(target_dir, tmp_path, monkeypatch, kind):
    """Ctrl-C at step 13 leaves a checkpoint; running again finishes at 30 steps with the same
    weights as an uninterrupted run (same batches, optimizer state restored), and reports the
    untrained drafter's scores that the first run measured."""
    config = DistillConfig(kind=kind, steps=30, checkpoint_every=10, **SMALL)
    whole = tmp_path / "whole"
    first = run_distill(str(target_dir), str(whole), config, generate=TEXT, progress=False)

    original, calls = Distiller.step, {"n": 0}

    def interrupted(self, tokens):
        calls["n"] += 1
        if calls["n"] == 14:
            raise KeyboardInterrupt
        return original(self, tokens)

    resumed = tmp_path / "resumed"
    monkeypatch.setattr(Distiller, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_distill(str(target_dir), str(resumed), config, generate=TEXT, progress=False)
    state = json.loads((resumed / CHECKPOINT / "state.json").read_text())
    assert state["step"] == 13
    monkeypatch.setattr(Distiller, "step", original)
    report = run_distill(str(target_dir), str(resumed), config, generate=TEXT, progress=False)
    assert report["steps"] == 30
    assert report["before"] == first["before"] and report["before"] is not None
    assert not any(p.name.startswith(".distill") for p in resumed.iterdir())
    got, want = _weights(resumed, kind), _weights(whole, kind)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)


def test_refuses_to_overwrite_and_bad_settings(target_dir, tmp_path):
    """A finished output is not overwritten without --force; bad settings and paths get a
    one-line error from the CLI."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="already exists"):
        run_distill(str(target_dir), str(out), DistillConfig(steps=1, **SMALL), progress=False)
    assert (out / "keep.txt").read_text() == "user data"
    with pytest.raises(ValueError, match="steps"):
        DistillConfig(steps=0)

    def cli(*args):
        return cli_here("distill", *args)

    bad = cli("--model", str(target_dir), "--out", str(tmp_path / "x"), "--data", "/nonexistent")
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr
    text = tmp_path / "corpus.txt"
    text.write_text("abc abd abe abf\n" * 400)
    ok = cli(
        "--model",
        str(target_dir),
        "--out",
        str(tmp_path / "cli"),
        "--data",
        str(text),
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--hidden-size",
        "32",
    )
    assert ok.returncode == 0, ok.stderr
    assert "heldout_kl" in ok.stdout and (tmp_path / "cli" / "config.json").exists()
    params = dict(tree_flatten(mlx_spec.load(str(tmp_path / "cli"))[0].parameters()))
    assert params
