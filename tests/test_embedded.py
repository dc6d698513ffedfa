"""The embedded demo pair ships in the package, converts on first use (offline), and decodes
losslessly with each of its drafters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx_spec
from mlx_spec.embedded import PAIR_DIR, available, converted_pair, stdlib_files

import pytest
from helpers import with_eos

PROMPT = "def parse_args(argv):"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    os.environ["MLX_SPEC_CACHE"] = str(cache)
    try:
        yield converted_pair()
    finally:
        os.environ.pop("MLX_SPEC_CACHE", None)


def test_pair_is_small_and_held_out_files_exist():
    """The committed checkpoints (the target with its MTP layer and Medusa heads, the draft
    model, the EAGLE-3 head and the DFlash drafter, float16) stay under 75 MB; the held-out
    files exist on this Python."""
    assert available()
    size = sum(p.stat().st_size for p in PAIR_DIR.rglob("*") if p.is_file())
    assert 0 < size <= 75e6
    train, heldout = stdlib_files()
    assert all(p.is_file() for p in heldout) and not set(train) & set(heldout)


def test_converts_once_into_the_cache(pair):
    """First use converts both checkpoints (the target's MTP head beside it, and the shipped
    EAGLE-3 head and DFlash drafter into it); later uses reuse."""
    target, draft = pair
    assert (target / "mtp" / "config.json").is_file() and (draft / "config.json").is_file()
    for name in ("eagle3", "dflash"):
        assert (target / name / "config.json").is_file() == (PAIR_DIR / name).is_dir()
    assert converted_pair() == pair


@pytest.mark.parametrize("drafter", ["draft-model", "mtp", "ngram", "eagle3", "dflash"])
def test_greedy_speculative_equals_plain(pair, drafter):
    """Each drafter of the pair reproduces plain greedy decoding token for token."""
    target, draft = pair
    if drafter in ("eagle3", "dflash") and not (target / drafter).is_dir():
        pytest.skip(f"this build of the pair ships no {drafter} drafter")
    model, tok = mlx_spec.load(str(target))
    tok = with_eos(tok)
    chosen = mlx_spec.load_drafter(str(draft)) if drafter == "draft-model" else drafter
    plain = mlx_spec.generate(model, tok, PROMPT, max_tokens=48)
    spec = mlx_spec.generate(model, tok, PROMPT, drafter=chosen, num_draft=3, max_tokens=48)
    assert spec.tokens == plain.tokens
    assert spec.stats.accepted > 0


def test_cli_without_model_flags(pair):
    """`mlx-spec generate --prompt ...` alone runs the pair offline, offering its three
    drafters to the adaptive policy, and reports acceptance, what it chose and the speedup;
    nothing but its own output reaches the terminal (no third-party notices)."""
    env = {**os.environ, "MLX_SPEC_CACHE": str(pair[0].parent), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec.cli",
            "generate",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "24",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert all(line.startswith("mlx-spec:") for line in proc.stderr.splitlines()), proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["drafter"] == "ngram+draft-model+mtp" and stats["num_draft"] == "auto"
    assert stats["speedup"] > 0 and "acceptance_rate" in stats
    assert sum(stats["k_histogram"].values()) == stats["target_passes"]


def test_retrained_weights_of_the_same_shapes_are_converted_again(tmp_path):
    """The conversion cache is keyed by the files' bytes, not their sizes: a drafter trained
    further (same shapes) must not be served from the old conversion."""
    from mlx_spec import embedded

    pair = tmp_path / "pair"
    for name in ("target", "draft"):
        (pair / name).mkdir(parents=True)
        (pair / name / "config.json").write_text("{}")
        (pair / name / "model.safetensors").write_bytes(b"\0" * 64)
    before = embedded._fingerprint(pair / "target")
    (pair / "target" / "model.safetensors").write_bytes(b"\1" * 64)  # same size, new weights
    assert embedded._fingerprint(pair / "target") != before
