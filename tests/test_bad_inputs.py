"""Bad input to the decode side gets a clear error up front, and nothing runs half way."""

from __future__ import annotations

import json
import random

import mlx_spec
from mlx_spec.caches.rollback import CacheRollback, UnsupportedCacheError

import mlx.core as mx
import pytest
import tinymodels as tm
from helpers import with_eos
from mlx_lm.models.cache import ChunkedKVCache

VOCAB = tm.tokenizer_size()


def write_llama(path, seed=0, tokenizer=None, weights=None, **overrides):
    """A tiny llama checkpoint at `path`; returns the directory."""
    config = tm.llama_config(overrides.pop("vocab_size", VOCAB), **overrides)
    weights = weights if weights is not None else tm.random_weights(config, seed=seed)
    return tm.write_checkpoint(path, config, weights, tokenizer=tokenizer)


class CountingModel:
    """Proxy of an mlx-lm model that counts forward passes."""

    def __init__(self, model):
        self._model = model
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._model(*args, **kwargs)


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "setting",
    [
        {"num_draft": -1},
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": -0.1},
        {"min_p": 1.0},
        {"max_tokens": -1},
    ],
    ids=lambda s: "{}={}".format(*next(iter(s.items()))),
)
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_invalid_setting_raises_value_error_naming_it(loaded, setting, drafter):
    """Each out-of-range setting is refused with a ValueError that names the setting."""
    model, tok = loaded["llama"][:2]
    name = next(iter(setting))
    with pytest.raises(ValueError, match=name):
        mlx_spec.generate(model, tok, "abc", drafter=drafter, **setting)


def test_invalid_setting_refused_before_any_work(loaded):
    """Validation happens before the model runs: the target is never called."""
    model, tok = loaded["llama"][:2]
    target = CountingModel(model)
    with pytest.raises(ValueError):
        mlx_spec.generate(target, tok, "abc", top_p=2.0)
    assert target.calls == 0


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-text", "empty-ids"])
def test_empty_prompt(loaded, prompt):
    """An empty prompt (text or ids) is a ValueError saying so."""
    model, tok = loaded["llama"][:2]
    with pytest.raises(ValueError, match="empty"):
        mlx_spec.generate(model, tok, prompt)


@pytest.mark.parametrize("bad_id", [-1, VOCAB, 999])
def test_prompt_ids_outside_vocabulary(loaded, bad_id):
    """Prompt token ids outside [0, vocab) are refused with a ValueError, not decoded as
    garbage (out-of-range embedding lookup) or a C++ bad_cast."""
    model, tok = loaded["llama"][:2]
    with pytest.raises(ValueError, match=str(bad_id)):
        mlx_spec.generate(model, tok, [3, 4, bad_id], max_tokens=3)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A llama with max_position_embeddings=24."""
    path = write_llama(tmp_path_factory.mktemp("short") / "m", max_position_embeddings=24)
    return mlx_spec.load(str(path))


@pytest.mark.parametrize("length", [24, 30])
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_prompt_longer_than_context(short_model, length, drafter):
    """A prompt that fills or exceeds the context is a ValueError naming both sizes."""
    model, tok = short_model
    prompt = [3 + i % 16 for i in range(length)]
    with pytest.raises(ValueError, match=rf"{length}.*24"):
        mlx_spec.generate(model, tok, prompt, drafter=drafter)


def test_unknown_drafter_string(loaded):
    """A misspelt drafter name is a ValueError listing the valid choices."""
    model, tok = loaded["llama"][:2]
    with pytest.raises(ValueError, match="unknown drafter.*ngram"):
        mlx_spec.generate(model, tok, "abc", drafter="ngarm")


def test_unknown_drafter_string_with_num_draft_zero(loaded):
    """A misspelt drafter name is refused even when num_draft=0 would not use it."""
    model, tok = loaded["llama"][:2]
    with pytest.raises(ValueError, match="unknown drafter"):
        mlx_spec.generate(model, tok, "abc", drafter="ngarm", num_draft=0)


# ------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("loader", [mlx_spec.load, mlx_spec.load_drafter])
def test_load_nonexistent_path(tmp_path, loader):
    """Loading a missing directory is a FileNotFoundError that names the path."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        loader(str(missing))


def test_load_directory_without_config(tmp_path):
    """A directory with no config.json is a FileNotFoundError naming the path and the file."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as info:
        mlx_spec.load(str(tmp_path))
    assert str(tmp_path) in str(info.value) and "config.json" in str(info.value)


def test_load_config_missing_fields(tmp_path):
    """A config.json without the architecture's required fields is a ValueError naming the
    directory, not a bare TypeError from mlx-lm's ModelArgs."""
    path = write_llama(tmp_path / "m")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=str(path)):
        mlx_spec.load(str(path))


# ------------------------------------------------------------------ draft/target tokenizers


def permuted_alphabet() -> str:
    letters = list(tm.ALPHABET)
    random.Random(0).shuffle(letters)
    return "".join(letters)


@pytest.mark.parametrize(
    "alphabet", [permuted_alphabet(), tm.ALPHABET + "q"], ids=["permuted", "one-more"]
)
def test_draft_tokenizer_differs(loaded, tmp_path, alphabet):
    """A draft model whose tokenizer has other token texts (same size or not) is refused
    before any token is generated."""
    assert sorted(alphabet) != list(tm.ALPHABET)
    model, tok = loaded["llama"][:2]
    vocab = tm.tokenizer_size(alphabet)
    path = write_llama(tmp_path / "draft", tokenizer=tm.build_tokenizer(alphabet), vocab_size=vocab)
    drafter = mlx_spec.load_drafter(str(path))
    with pytest.raises(ValueError, match="tokenizers differ"):
        next(mlx_spec.stream_generate(model, tok, "abc", drafter=drafter))


# ------------------------------------------------------------------------- padded vocabulary

HIDDEN = tm.llama_config(VOCAB)["hidden_size"]
NUM_PAD = 2 * HIDDEN


def padded_weights(weights: dict) -> dict:
    """`weights` with embedding and head padded by NUM_PAD rows; the padded head rows are
    +-1000 * e_i, so some padded logit beats every real one whatever the hidden state."""
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    extra_embed = mx.random.normal((NUM_PAD, HIDDEN), key=mx.random.key(0))
    extra_head = 1000.0 * mx.concatenate([mx.eye(HIDDEN), -mx.eye(HIDDEN)])
    return {
        **weights,
        "model.embed_tokens.weight": mx.concatenate([embed, extra_embed]),
        "lm_head.weight": mx.concatenate([head, extra_head]),
    }


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(target, tok, padded copy of the target, its tok): the copy has VOCAB + NUM_PAD rows
    and its padded rows dominate the logits."""
    root = tmp_path_factory.mktemp("padded")
    weights = tm.random_weights(tm.llama_config(VOCAB), seed=5)
    target_dir = write_llama(root / "target", weights=weights)
    pad = padded_weights(weights)
    padded_dir = write_llama(root / "padded", weights=pad, vocab_size=VOCAB + NUM_PAD)
    model, tok = mlx_spec.load(str(target_dir))
    padded_model, padded_tok = mlx_spec.load(str(padded_dir))
    return model, with_eos(tok, ()), padded_model, with_eos(padded_tok, ())


def test_padded_rows_would_win(padded):
    """Precondition: the padded model's raw argmax is always a padded id."""
    _, tok, padded_model, _ = padded
    logits = padded_model(mx.array([tok.encode("abcabc")]))[0]
    assert (mx.argmax(logits, axis=-1) >= VOCAB).all().item()


def test_padded_draft_model_is_accepted(padded):
    """A draft model with a padded head (same tokenizer) is accepted; padded rows never get
    drafted, so a padded copy of the target is accepted at every position."""
    model, tok, padded_model, padded_tok = padded
    ref = mlx_spec.generate(model, tok, "abc", max_tokens=20)
    drafter = mlx_spec.DraftModelDrafter(padded_model, padded_tok)
    out = mlx_spec.generate(model, tok, "abc", drafter=drafter, num_draft=4, max_tokens=20)
    assert out.tokens == ref.tokens
    assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["plain", "ngram", "draft"])
def test_ids_stay_in_vocabulary_with_padded_target(padded, kind, temperature):
    """With a padded target whose padded rows dominate, every emitted id is below the
    tokenizer's vocabulary size (plain, n-gram and draft-model paths, greedy and sampled)."""
    _, _, padded_model, padded_tok = padded
    drafter = {"plain": None, "ngram": "ngram"}.get(kind)
    if kind == "draft":
        drafter = mlx_spec.DraftModelDrafter(padded_model, padded_tok)
    out = mlx_spec.generate(
        padded_model,
        padded_tok,
        "abcabc",
        drafter=drafter,
        temperature=temperature,
        seed=0,
        max_tokens=24,
    )
    assert len(out.tokens) == 24
    assert all(0 <= t < VOCAB for t in out.tokens)


# ------------------------------------------------------------------------ rollback refusal


class ChunkedCacheModel(CountingModel):
    """A model whose cache is mlx-lm's ChunkedKVCache (cannot be rolled back)."""

    def make_cache(self):
        return [ChunkedKVCache(8) for _ in self._model.layers]


def test_chunked_cache_refused_by_rollback():
    """CacheRollback refuses ChunkedKVCache with UnsupportedCacheError naming the type."""
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        CacheRollback([ChunkedKVCache(8)])


def test_unrollbackable_draft_cache_refused_before_decoding(loaded):
    """A draft model with an unsupported cache is refused before any token is produced."""
    model, tok = loaded["llama"][:2]
    draft = ChunkedCacheModel(model)
    drafter = mlx_spec.DraftModelDrafter(draft, tok)
    stream = mlx_spec.stream_generate(model, tok, "abc", drafter=drafter, max_tokens=8)
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        next(stream)
    assert draft.calls == 0


def test_unrollbackable_target_cache_refused_before_decoding(loaded):
    """A target with an unsupported cache is refused for speculative decoding before it runs."""
    model, tok = loaded["llama"][:2]
    target = ChunkedCacheModel(model)
    stream = mlx_spec.stream_generate(target, tok, "abc", drafter="ngram", max_tokens=8)
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        next(stream)
    assert target.calls == 0
