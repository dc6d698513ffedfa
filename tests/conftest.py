"""Session fixtures: tiny random target/draft checkpoints written once per test run."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

# Every process of the suite (servers and CLIs it starts too) stores linear weights
# column-major without timing the layouts on the first model it loads: outputs compared
# across processes then come from the same products (tests/test_weight_layout.py times them).
os.environ.setdefault("MLX_SPEC_WEIGHT_LAYOUT", "column")
# ... and starts every "auto" policy from nothing (tests/test_policy_memory.py turns the
# memory across processes on).
os.environ.setdefault("MLX_SPEC_POLICY_MEMORY", "0")

import mlx_spec  # first: loads the optimized BLAS before mlx
from convert import convert_checkpoint

import hfmodels as hfm
import pytest
import tinymodels as tm
import uvicorn
from helpers import (
    DISTRIBUTION_ALPHABET,
    EAGLE3_LAYERS,
    LAYOUTS,
    FakeClock,
    with_eos,
    write_eagle3,
)
from huggingface_hub import constants as hf_constants

VOCAB = tm.tokenizer_size()

FAMILIES = {
    "llama": tm.llama_config,
    "gemma3": tm.gemma3_config,  # sliding window 8 on two of three layers
    "qwen3_5": tm.qwen3_5_config,  # hybrid: gated delta-net (ArraysCache) + attention
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family: (target_dir, draft_dir)}; the draft is a noisy copy of the target, so it agrees
    often but not always (both accepting and rejecting paths run)."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for i, (family, make_config) in enumerate(FAMILIES.items()):
        config = make_config(VOCAB)
        weights = tm.random_weights(config, seed=10 + i)
        target = tm.write_checkpoint(root / f"{family}-target", config, weights)
        draft = tm.write_checkpoint(
            root / f"{family}-draft", config, tm.perturb(weights, 0.3, seed=20 + i)
        )
        out[family] = (target, draft)
    return out


@pytest.fixture(scope="session")
def loaded(checkpoints):
    """{family: (target_model, tokenizer, draft_model, draft_tokenizer)} loaded once."""
    out = {}
    for family, (target_dir, draft_dir) in checkpoints.items():
        model, tok = mlx_spec.load(str(target_dir))
        draft, draft_tok = mlx_spec.load(str(draft_dir))
        out[family] = (model, tok, draft, draft_tok)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, tokenizer, draft, draft tokenizer) over a 5-letter vocabulary, for the
    three-token distribution tests (helpers.exact_distribution, helpers.sampled)."""
    root = tmp_path_factory.mktemp("dist")
    vocab = tm.tokenizer_size(DISTRIBUTION_ALPHABET)
    config = tm.llama_config(
        vocab,
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    weights = tm.random_weights(config, seed=1, scale=0.3)  # flat enough to sample widely
    tokenizer = tm.build_tokenizer(DISTRIBUTION_ALPHABET)
    tm.write_checkpoint(root / "t", config, weights, tokenizer)
    tm.write_checkpoint(root / "d", config, tm.perturb(weights, 1.0, seed=2), tokenizer)
    model, tok = mlx_spec.load(str(root / "t"))
    draft, draft_tok = mlx_spec.load(str(root / "d"))
    return model, with_eos(tok), draft, draft_tok


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(MLX model, tokenizer, torch model) of a 4-layer Llama, for the EAGLE-3 heads below
    (test_dflash.py and test_server.py define their own `target`)."""
    root = tmp_path_factory.mktemp("eagle3")
    source, torch_model = hfm.write_hf_checkpoint(
        root / "llama", "llama", seed=1, num_hidden_layers=EAGLE3_LAYERS
    )
    out = convert_checkpoint(str(source), str(root / "llama-mlx"), dtype="float32").path
    model, tok = mlx_spec.load(str(out))
    return model, with_eos(tok), torch_model, root


@pytest.fixture(scope="module")
def heads(target):
    root = target[3]
    return {layout: write_eagle3(root / f"head-{layout}", layout) for layout in LAYOUTS}


@contextmanager
def serving(app):
    """Run `app` with uvicorn on a free loopback port in a background thread; yields the URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture
def fake_clock(monkeypatch):
    """Generation's clock replaced by a `FakeClock` for the test."""
    from mlx_spec.core import clock

    fake = FakeClock()
    monkeypatch.setattr(clock, "now", fake.now)
    return fake


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 with an empty hub cache, for this process and its children."""
    cache = tmp_path / "hf-home"
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(cache), "HF_HUB_CACHE": str(cache / "hub")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache / "hub"))
    monkeypatch.chdir(tmp_path)  # a relative "org/name" must not resolve to a local directory
    return env
