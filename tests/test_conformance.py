"""Conformance against transformers: a fast slice of the matrix (benchmarks/conformance.py runs all
of it), quantized conversions, a negative control, refusals, and speculative decoding on a family
exact only thanks to a load-time fix (Gemma 2's sliding window)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before mlx

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import conformance_matrix as cm  # noqa: E402  (needs torch)
import hfmodels as hfm  # noqa: E402

# the first converter failures reported, the families mlx-lm fixes at load time, and one family
# with an MTP head
SLICE = ["llama", "gemma2", "qwen3_moe", "gpt2", "gpt_neox", "exaone4", "olmo3", "deepseek_v3"]
# load-time and tensor-layout fixes: GPT-OSS's unquantized experts and unrounded YaRN, GLM's
# partial rotary, Qwen3.5-MoE's per-expert tensors
SLICE += ["gpt_oss", "glm", "qwen3_5_moe"]


@pytest.mark.parametrize("family", SLICE)
def test_family_matches_transformers(tmp_path, family):
    """Converted float32 logits equal transformers' (1e-4) over 20 tokens, past any window of 8,
    in one pass and in verification-sized chunks through the cache."""
    result = cm.run_family(family, tmp_path)
    assert result.status == "exact", cm.format_row(result)
    assert result.max_diff <= cm.ATOL


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_quantized_close_to_float(tmp_path, family):
    """4- and 8-bit conversions stay within the bounds justified in conformance_matrix, and are
    really quantized (not float weights under another name)."""
    result = cm.run_family(family, tmp_path, quant_bits=(4, 8))
    assert result.status == "exact", cm.format_row(result)
    assert cm.quant_ok(result), result.quantized
    assert 0 < result.quantized[8] < result.quantized[4]


def _perturb_one_weight(dest: Path) -> None:
    """Add 0.05 to one element of one attention weight of the converted model."""
    for file in sorted(dest.glob("model*.safetensors")):
        weights = mx.load(str(file))
        names = [n for n in weights if "layers.1.self_attn.q_proj.weight" in n]
        if names:
            value = np.array(weights[names[0]])
            value[0, 0] += 0.05
            weights[names[0]] = mx.array(value)
            mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
            return
    raise AssertionError("no q_proj weight to perturb")


def test_negative_control_detects_a_wrong_weight(tmp_path):
    """The comparison catches one wrong weight: the matrix reports it, with the position."""
    result = cm.run_family("llama", tmp_path, perturb=_perturb_one_weight)
    assert result.status == "MISMATCH"
    assert result.max_diff > cm.ATOL and result.first_diverging is not None


def _batch_engine_agrees(model, tokenizer, prompt, plain, windows):
    """The batch engine learns the windows from the model's caches and masks by position: with
    n-gram drafts its greedy tokens equal plain decoding (two rows, past the window)."""
    from mlx_spec.caches.batch import BatchCache
    from mlx_spec.core.compat import scored_vocab
    from mlx_spec.core.sampling import SamplingConfig
    from mlx_spec.decoding.engine import BatchEngine, BatchRequest
    from mlx_spec.drafters.batch import BatchNgram

    assert set(BatchCache(model, 1).groups) == windows
    engine = BatchEngine(model, tokenizer, scored_vocab(model, tokenizer), {"ngram": BatchNgram()})
    prompts = [prompt, [1, 9, 4, 9, 4, 9, 4, 9, 4, 9]]
    out: list[list[int]] = [[], []]
    for i, p in enumerate(prompts):

        def emit(item, i=i):
            if isinstance(item, Exception):
                raise item
            if item.token is not None:
                out[i].append(item.token)

        engine.add(
            BatchRequest(
                prompt=p,
                sampling=SamplingConfig(),
                max_tokens=24,
                drafter="ngram",
                num_draft=3,
                emit=emit,
            )
        )
    while engine.busy:
        engine.step()
    assert out[0] == plain
    assert out[1] == mlx_spec.generate(model, tokenizer, prompts[1], max_tokens=24).tokens


def test_window_on_every_layer_is_exact(tmp_path):
    """Mistral's sliding window covers every layer (mlx-lm's model has none): conversion marks
    the layers sliding, the load-time fix runs the window, and the logits are transformers'."""
    import json

    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    result = cm.run_family("mistral", tmp_path)
    assert result.status == "exact", cm.format_row(result)
    source, _ = cm.write_checkpoint("mistral", tmp_path / "hf")
    from convert import convert_checkpoint

    dest = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32").path
    config = json.loads((dest / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * config["num_hidden_layers"]
    model, _ = mlx_spec.load(str(dest))
    caches = make_prompt_cache(model)
    assert all(type(c) is RotatingKVCache and c.max_size == cm.WINDOW for c in caches)
    assert cm.run_family("mistral/no-window", tmp_path).status == "exact"


def test_original_config_kept(tmp_path):
    """conversion.json keeps the checkpoint's config.json as written (renamed keys included)."""
    import json

    from convert import convert_checkpoint

    source, _ = cm.write_checkpoint("qwen3_moe", tmp_path / "hf")
    out = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32").path
    original = json.loads((source / "config.json").read_text())
    assert json.loads((out / "conversion.json").read_text())["source_config"] == original
    assert "num_experts" not in original  # transformers 5 writes num_local_experts
    assert json.loads((out / "config.json").read_text())["num_experts"] == 4


@pytest.mark.parametrize(
    "family, windows",
    [("mistral", {cm.WINDOW}), ("gemma2", {cm.WINDOW, None})],
    ids=["mistral-every-layer", "gemma2-alternate-layers"],
)
def test_speculative_decoding_past_the_window(tmp_path, family, windows):
    """A sliding window of 8 (Mistral: every layer; Gemma 2: alternate layers, fixed at load
    time): plain greedy decoding equals transformers' argmax at every step past the window, and
    speculative decoding (n-gram drafts, rejected often, so the sliding caches are rolled back)
    and the batch engine give the same tokens."""
    from convert import convert_checkpoint

    source, torch_model = cm.write_checkpoint(family, tmp_path / "hf")
    dest = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32").path
    model, tokenizer = mlx_spec.load(str(dest))
    tokenizer.eos_token_ids = set()  # fixed-length generations
    prompt = [1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    plain = mlx_spec.generate(model, tokenizer, prompt, max_tokens=24).tokens
    spec = mlx_spec.generate(
        model, tokenizer, prompt, drafter="ngram", num_draft=3, max_tokens=24
    ).tokens
    assert spec == plain
    reference = hfm.hf_logits(torch_model, prompt + plain[:-1]).argmax(-1)[len(prompt) - 1 :]
    assert list(reference) == plain
    _batch_engine_agrees(model, tokenizer, prompt, plain, windows=windows)


def test_mlx_spec_installs_the_load_time_fixes():
    """A fresh process that imports mlx_spec (not the converter) runs Gemma 2 with its window."""
    code = textwrap.dedent(
        """
        import mlx_spec, dataclasses
        from mlx_lm.models import gemma2
        fields = {f.name for f in dataclasses.fields(gemma2.ModelArgs)}
        assert "sliding_window" in fields, "mlx_spec does not install reference_fixes"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _full_matrix_selected(config) -> bool:
    return os.environ.get("MLX_SPEC_CONFORMANCE") == "1" or "conformance" in (
        config.getoption("-m") or ""
    )


@pytest.mark.conformance
def test_full_matrix(request):
    """Every family both transformers and mlx-lm implement: exact, refused with a reason, or
    skipped because transformers cannot run it; never a silent mismatch."""
    if not _full_matrix_selected(request.config):
        pytest.skip("the full matrix runs with MLX_SPEC_CONFORMANCE=1 or -m conformance")
    results = cm.run_matrix()
    silent = [cm.format_row(r) for r in results if r.status == "MISMATCH"]
    assert not silent, "\n".join(silent)
    assert all(r.reason for r in results if r.status != "exact")
    assert all(cm.quant_ok(r) for r in results)


def _edited_config_matches(tmp_path, family: str, **edits) -> None:
    """Write the tiny `family` checkpoint, set `edits` in its config.json, and check that its
    conversion computes what transformers computes from the edited checkpoint."""
    from convert import convert_checkpoint

    from transformers import AutoModelForCausalLM

    source, _ = cm.write_checkpoint(family, tmp_path / "hf")
    hfm.edit_config(source, **edits)
    with cm._quiet():
        reference = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        dest = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32").path
        model, _ = mlx_spec.load(str(dest))
    ids = cm.token_ids()
    with torch.no_grad():
        want = hfm.hf_logits(reference, ids)
    max_diff, first = cm.compare(cm.mlx_logits(model, ids), want)
    assert max_diff <= cm.ATOL and first is None, (max_diff, first)


def test_gemma_legacy_gelu_means_tanh(tmp_path):
    """Gemma's published configs say `hidden_act: "gelu"` and mean the tanh approximation
    (transformers rewrites it); the converted model computes the same as transformers."""
    _edited_config_matches(tmp_path, "gemma", hidden_act="gelu")


@pytest.mark.parametrize("family", ["llama", "nemotron_h"])
def test_window_the_reference_ignores_is_ignored(tmp_path, family):
    """A `sliding_window` where transformers' model has none (Llama's config class has no such
    field; Nemotron-H's has one its model never reads) converts, and the model attends to the
    whole context as transformers' does."""
    _edited_config_matches(tmp_path, family, sliding_window=4)


def test_nemotron_h_clamps_the_step_to_the_configured_limit(tmp_path):
    """Nemotron-H clamps its Mamba step size to `time_step_limit` (not `time_step_min`), as the
    published implementation and transformers do; a limit that bites changes the logits."""
    _edited_config_matches(tmp_path, "nemotron_h", time_step_limit=[0.05, 0.2])


def test_gpt_neox_mlp_width_comes_from_the_config(tmp_path):
    """GPT-NeoX checkpoints whose MLP is not four times the hidden size (mlx-lm's fixed width)
    convert to the width the config gives, computing what transformers computes."""
    from convert import convert_checkpoint

    source, reference = cm.write_checkpoint("gpt_neox", tmp_path / "hf", intermediate_size=96)
    with cm._quiet():
        dest = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32").path
        model, _ = mlx_spec.load(str(dest))
    ids = cm.token_ids()
    with torch.no_grad():
        want = hfm.hf_logits(reference, ids)
    max_diff, first = cm.compare(cm.mlx_logits(model, ids), want)
    assert max_diff <= cm.ATOL and first is None, (max_diff, first)


@pytest.mark.parametrize("family", ["exaone4", "olmo3"])
def test_all_sliding_layers_are_refused_with_the_reason(tmp_path, family):
    """A checkpoint whose every layer has a sliding window (two layers of a period of four):
    mlx-lm's model needs a full-attention layer too; the refusal says so (not a Python
    exception's text)."""
    from convert import ConversionError, convert_checkpoint

    types = ["sliding_attention", "sliding_attention"]
    source, _ = cm.write_checkpoint(
        family, tmp_path / "hf", sliding_window=4, num_hidden_layers=2, layer_types=types
    )
    with pytest.raises(ConversionError, match="every layer is sliding-window attention"):
        convert_checkpoint(str(source), str(tmp_path / "mlx"))
    assert not (tmp_path / "mlx").exists()


def test_reference_window_is_read_from_the_model():
    """Whether transformers applies a window follows its modeling code, not its config class."""
    from convert.normalize import _reference_reads_window

    assert not _reference_reads_window({"model_type": "llama"})  # no field at all
    assert not _reference_reads_window({"model_type": "nemotron_h"})  # a field, never read
    assert _reference_reads_window({"model_type": "mistral"})
    assert _reference_reads_window({"model_type": "not_a_family"})  # unknown: assume a window
