"""Rollback is exact for every mlx-lm cache type: trim (or restore + replay), then re-feed,
gives the same logits as a fresh run on the kept tokens."""

from __future__ import annotations

from mlx_spec.caches.rollback import CacheRollback, RollbackError, UnsupportedCacheError
from mlx_spec.decoding.runner import ModelRunner

import mlx.core as mx
import pytest
from conftest import VOCAB
from mlx_lm.models.cache import (
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    trim_prompt_cache,
)

SEQ = [3, 4, 5, 19, 6, 7, 3, 4, 8, 9, 19, 10, 11, 3, 12, 13, 4, 5, 14, 15, 16, 3, 7, 9, 19, 8]


def fresh_logits(model, prefix, probe, quantized=False):
    runner = _runner(model, quantized)
    runner.prefill(prefix)
    return runner(mx.array(probe, mx.uint32))


def _runner(model, quantized):
    runner = ModelRunner(model, VOCAB)
    if quantized:  # QuantizedKVCache is what mlx-lm uses with kv_bits; 64-dim heads fit its groups
        runner.cache = [QuantizedKVCache(group_size=32, bits=8) for _ in runner.cache]
        runner._rollback = CacheRollback(runner.cache)
    return runner


def rolled_back_logits(model, prefix, fed, keep, probe, one_at_a_time, quantized=False):
    """Prefill, feed `fed` (as one call or token by token), keep `keep`, then feed `probe`."""
    runner = _runner(model, quantized)
    runner.prefill(prefix)
    runner.checkpoint(len(fed), single_call=not one_at_a_time)
    calls = [[t] for t in fed] if one_at_a_time else [fed]
    for call in calls:
        runner(mx.array(call, mx.uint32))
    runner.rollback(keep)
    assert runner.length == len(prefix) + keep
    return runner(mx.array(probe, mx.uint32))


CASES = [
    # family, prefix length, fed, kept: covers no wrap, wrap during the round, wrap long before
    ("llama", 5, 5, 2),
    ("llama", 5, 4, 0),
    ("gemma3", 3, 4, 1),
    ("gemma3", 6, 5, 2),
    ("gemma3", 14, 6, 3),
    ("gemma3", 14, 6, 0),
    ("qwen3_5", 7, 5, 2),
    ("qwen3_5", 7, 3, 0),
]


@pytest.mark.parametrize("one_at_a_time", [False, True], ids=["verify-pass", "draft-steps"])
@pytest.mark.parametrize("family,prefix,fed,keep", CASES)
def test_rollback_then_refeed_matches_fresh(loaded, family, prefix, fed, keep, one_at_a_time):
    """KVCache (llama), RotatingKVCache before/after its window wrapped (gemma3, window 8) and
    ArraysCache (qwen3_5): identical logits to a fresh run on the kept tokens."""
    model = loaded[family][0]
    tokens = SEQ[: prefix + fed]
    probe = SEQ[prefix + fed : prefix + fed + 3]
    kept = tokens[: prefix + keep]
    got = rolled_back_logits(model, tokens[:prefix], tokens[prefix:], keep, probe, one_at_a_time)
    want = fresh_logits(model, kept, probe)
    assert mx.allclose(got, want, atol=1e-4).item()


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_quantized_kv_cache_rollback(one_at_a_time, checkpoints):
    """QuantizedKVCache: trim then re-feed equals a fresh run (both quantize the same keys)."""
    import mlx_spec

    import tinymodels as tm

    config = tm.llama_config(VOCAB, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    path = tm.write_checkpoint(
        checkpoints["llama"][0].parent / "llama-q", config, tm.random_weights(config, seed=5)
    )
    model, _ = mlx_spec.load(str(path))
    got = rolled_back_logits(model, SEQ[:6], SEQ[6:11], 2, SEQ[11:14], one_at_a_time, True)
    want = fresh_logits(model, SEQ[:8], SEQ[11:14], quantized=True)
    assert mx.allclose(got, want, atol=1e-4).item()


def test_mlx_lm_trim_is_wrong_after_wrap_and_ours_is_not(loaded):
    """The anchor's bug: mlx-lm's trim on a wrapped RotatingKVCache trims nothing (returns 0),
    so rejected tokens stay in the window; our rollback removes them."""
    model = loaded["gemma3"][0]
    runner = ModelRunner(model, VOCAB)
    runner.prefill(SEQ[:12])
    runner(mx.array(SEQ[12:16], mx.uint32))
    rotating = [c for c in runner.cache if isinstance(c, RotatingKVCache)]
    assert rotating and trim_prompt_cache(runner.cache, 3) == 0
    runner = ModelRunner(model, VOCAB)
    runner.prefill(SEQ[:12])
    runner.checkpoint(4, single_call=True)
    runner(mx.array(SEQ[12:16], mx.uint32))
    runner.rollback(1)
    got = runner(mx.array(SEQ[20:22], mx.uint32))
    want = fresh_logits(model, SEQ[:13], SEQ[20:22])
    assert mx.allclose(got, want, atol=1e-4).item()


def test_unsupported_cache_refused_up_front():
    """A cache we cannot roll back is refused when the runner is built, naming its type."""
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        CacheRollback([KVCache(), ChunkedKVCache(8)])


def test_rollback_is_checked(loaded):
    """A cache that does not end where rollback says raises instead of decoding on."""
    runner = ModelRunner(loaded["llama"][0], VOCAB)
    runner.prefill(SEQ[:5])
    runner.checkpoint(4, single_call=True)
    runner(mx.array(SEQ[5:9], mx.uint32))
    runner.cache[0].offset += 1  # simulate a cache that drifted
    with pytest.raises(RollbackError, match="offset"):
        runner.rollback(2)


def test_replay_counted_for_recurrent_state(loaded):
    """Hybrid targets restore their recurrent state and replay the kept tokens."""
    runner = ModelRunner(loaded["qwen3_5"][0], VOCAB)
    runner.prefill(SEQ[:5])
    runner.checkpoint(4, single_call=True)
    runner(mx.array(SEQ[5:9], mx.uint32))
    runner.rollback(4)  # everything kept: nothing to undo
    assert runner.replays == 0
    runner.checkpoint(4, single_call=True)
    runner(mx.array(SEQ[9:13], mx.uint32))
    runner.rollback(1)
    assert runner.replays == 1 and runner.length == 10
