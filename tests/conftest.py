"""Session fixtures: tiny random target/draft checkpoints written once per test run."""

from __future__ import annotations

import copy
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

import pytest
import tinymodels as tm
import uvicorn

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


def with_eos(tokenizer, eos_ids=()):
    """A copy of the tokenizer whose EOS ids are `eos_ids` (none: generations of fixed length)."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = set(eos_ids)
    return tokenizer


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
