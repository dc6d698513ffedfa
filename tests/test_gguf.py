"""GGUF conversion: tiny files written here in every supported tensor type, compared with
transformers' own GGUF loading (logits) and its GGUF tokenizer (token ids)."""

from __future__ import annotations

import json

import mlx_spec
from convert import ConversionError, convert_checkpoint
from convert.gguf import affine_from_blocks
from convert.gguf_tokenizer import build_tokenizer

import gguf
import ggufmodels as gm
import mlx.core as mx
import numpy as np
import pytest
import torch

ATOL = 1e-4
IDS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 311, 12, 80]


def _reference_logits(folder, name, ids):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _our_logits(path, ids):
    model, _ = mlx_spec.load(str(path))
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _converted(tmp_path, **kwargs):
    source = gm.write_gguf(tmp_path / "model.gguf", **kwargs)
    dest = convert_checkpoint(str(source), str(tmp_path / "mlx")).path
    return source, dest


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"])
def test_llama_logits_match_transformers(tmp_path, kind):
    source, dest = _converted(tmp_path, kind=kind)
    want = _reference_logits(tmp_path, source.name, IDS)
    got = _our_logits(dest, IDS)
    assert np.abs(got - want).max() <= ATOL


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_are_dequantized_and_match_transformers(tmp_path, kind):
    """K-quants (blocks of 256) have no MLX layout: dequantized to float16, compared with
    transformers' float32 dequantization at float16's precision."""
    source, dest = _converted(tmp_path, kind=kind, hidden=256, intermediate=512, heads=4)
    record = json.loads((dest / "conversion.json").read_text())["gguf"]
    assert record["dequantized"] == {kind: 2 + 7 * 2}
    assert "quantization" not in json.loads((dest / "config.json").read_text())
    want = _reference_logits(tmp_path, source.name, IDS)
    got = _our_logits(dest, IDS)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_logits_match_transformers(tmp_path, arch):
    """qwen2 (attention biases) and qwen3 (query/key norms; heads of 128, wider than hidden /
    heads, as Qwen3's are, read from `qwen3.attention.key_length`): no rotary permutation in
    llama.cpp's layout for either."""
    shape = dict(heads=2, kv_heads=1, head_dim=128) if arch == "qwen3" else {}
    source, dest = _converted(tmp_path, arch=arch, kind="Q8_0", tied=True, **shape)
    want = _reference_logits(tmp_path, source.name, IDS)
    assert np.abs(_our_logits(dest, IDS) - want).max() <= ATOL


def test_kept_types_dequantize_exactly_as_llama_cpp():
    """Repacked into MLX's layout, Q4_0/Q4_1/Q8_0 blocks dequantize to llama.cpp's values
    bit for bit (float32 scales: q * scale + bias is exact)."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, size=(8, 96)).astype(np.float32)
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = gguf.GGMLQuantizationType[kind]
        blocks = gguf.quants.quantize(w, qtype)
        want = gguf.quants.dequantize(blocks, qtype)
        packed, scales, biases, bits = affine_from_blocks(blocks, kind, w.shape)
        got = mx.dequantize(
            mx.array(packed),
            mx.array(scales).astype(mx.float32),
            mx.array(biases).astype(mx.float32),
            group_size=32,
            bits=bits,
        )
        assert np.array_equal(np.array(got), want), kind


def test_quantized_layers_kept_and_recorded(tmp_path):
    _, dest = _converted(tmp_path, kind="Q4_1", tied=True)
    config = json.loads((dest / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    weights = mx.load(str(dest / "model.safetensors"))
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert "model.layers.0.mlp.up_proj.scales" in weights
    record = json.loads((dest / "conversion.json").read_text())["gguf"]
    assert record["architecture"] == "llama" and record["rotary_rows_unpermuted"]
    assert record["tensor_types"]["Q4_1"] == 1 + 7 * 2 and record["tensor_types"]["F32"] == 5
    assert record["tokenizer"]["chat_template"]


def test_dtype_dequantizes_every_tensor(tmp_path):
    source = gm.write_gguf(tmp_path / "model.gguf", kind="Q4_0")
    dest = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32").path
    config = json.loads((dest / "config.json").read_text())
    assert "quantization" not in config
    weights = mx.load(str(dest / "model.safetensors"))
    assert all(v.dtype == mx.float32 for v in weights.values())
    want = _reference_logits(tmp_path, source.name, IDS)
    assert np.abs(_our_logits(dest, IDS) - want).max() <= ATOL


# ---------------------------------------------------------------------------------- tokenizer


def _reference_tokenizer(folder, name):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


def _metadata(path):
    from convert.gguf import read_gguf

    return read_gguf(path).metadata


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_tokenizer_matches_transformers(tmp_path, pre):
    source = gm.write_gguf(tmp_path / "model.gguf", pre=pre, layers=1)
    ours, _ = build_tokenizer(_metadata(source))
    reference = _reference_tokenizer(tmp_path, source.name)
    for text in gm.TEXTS:
        want = reference.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == reference.decode(want), text


def test_smollm_splits_every_digit(tmp_path):
    """SmolLM's pre-tokenizer splits digits one by one before the GPT-2 split, as its original
    tokenizer does (Digits(individual_digits) + ByteLevel) and llama.cpp does for "smollm"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    source = gm.write_gguf(tmp_path / "model.gguf", pre="smollm", layers=1)
    ours, _ = build_tokenizer(_metadata(source))
    tokens, merges = gm.byte_level_vocab()
    original = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]
        )
    )
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    original.decoder = decoders.ByteLevel()
    for text in gm.TEXTS:
        if "<|" in text:
            continue
        assert ours.encode(text).ids == original.encode(text).ids, text
    assert len(ours.encode("12345").ids) == 5


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """Merges recovered from the scores; byte fallback for what the pieces cannot spell."""
    source = gm.write_gguf(tmp_path / "model.gguf", tokenizer="llama", layers=1)
    ours, config = build_tokenizer(_metadata(source))
    reference = _reference_tokenizer(tmp_path, source.name)
    for text in gm.TEXTS:
        if "<|" in text or text.startswith((" ", "\t")):  # conventions differ (next test)
            continue
        want = reference.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want).strip() == reference.decode(want).strip(), text
    assert config["add_bos_token"]
    assert ours.encode("Hello").ids[0] == 1  # BOS first, as the file's default asks


def test_sentencepiece_puts_a_space_after_special_tokens(tmp_path):
    """As llama.cpp and the original Llama tokenizers: the text after a special token is
    tokenized as if it began the text (a space prefix)."""
    source = gm.write_gguf(tmp_path / "model.gguf", tokenizer="llama", layers=1)
    ours, _ = build_tokenizer(_metadata(source))
    alone = ours.encode("Hello", add_special_tokens=False).ids
    after = ours.encode("</s>Hello", add_special_tokens=False).ids
    assert after == [2, *alone]


def test_converted_tokenizer_loads_in_mlx_lm(tmp_path):
    """The tokenizer mlx-lm loads from the output: special tokens whole, the chat template,
    EOS from the file."""
    _, dest = _converted(tmp_path, kind="Q8_0", layers=1)
    _, tokenizer = mlx_spec.load(str(dest))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    tokens, _ = gm.byte_level_vocab()
    assert prompt[0] == tokens.index("<|im_start|>")
    assert tokens.index("<|im_end|>") in tokenizer.eos_token_ids
    text = "Hello world! café"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


# -------------------------------------------------------------------------------- bad files


def test_truncated_file_is_refused(tmp_path):
    source = gm.write_gguf(tmp_path / "model.gguf", kind="Q8_0")
    data = source.read_bytes()
    source.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConversionError, match="truncated"):
        convert_checkpoint(str(source), str(tmp_path / "mlx"))
    assert not (tmp_path / "mlx").exists()


def test_not_a_gguf_file_is_refused(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConversionError, match="not a GGUF file"):
        convert_checkpoint(str(source), str(tmp_path / "mlx"))


def test_unknown_architecture_is_refused(tmp_path):
    source = gm.write_gguf(tmp_path / "model.gguf", arch="gemma", layers=1)
    with pytest.raises(ConversionError, match="'gemma' is not converted"):
        convert_checkpoint(str(source), str(tmp_path / "mlx"))


def test_shape_that_contradicts_the_metadata_is_refused(tmp_path):
    meta = {"llama.feed_forward_length": (96, gguf.GGUFValueType.UINT32)}
    source = gm.write_gguf(tmp_path / "model.gguf", layers=1, metadata=meta)
    with pytest.raises(ConversionError, match="mlp.gate_proj.weight has shape"):
        convert_checkpoint(str(source), str(tmp_path / "mlx"))


def test_cli_converts_a_gguf_file_of_a_folder(tmp_path):
    """`--hf-path DIR --gguf FILE` (a hub repo is fetched the same way, then read locally)."""
    from mlx_spec.cli import main

    gm.write_gguf(tmp_path / "model.gguf", kind="Q8_0", layers=1)
    assert main(["convert", "--hf-path", str(tmp_path), "--gguf", "model.gguf",
                 "--mlx-path", str(tmp_path / "mlx")]) == 0  # fmt: skip
    assert (
        json.loads((tmp_path / "mlx" / "conversion.json").read_text())["gguf"]["file"]
        == "model.gguf"
    )
    assert main(["convert", "--hf-path", str(tmp_path), "--gguf", "absent.gguf",
                 "--mlx-path", str(tmp_path / "other")]) == 2  # fmt: skip


def test_a_hub_gguf_offline_and_not_cached_is_refused_by_name(tmp_path, offline_hub):
    with pytest.raises(ConversionError, match="org/repo/model.gguf: cannot fetch.*HF_HUB_OFFLINE"):
        convert_checkpoint("org/repo", str(tmp_path / "mlx"), gguf_file="model.gguf")
