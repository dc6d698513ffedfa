"""HF -> MLX conversion against transformers as the oracle: logits of converted targets, sharded
checkpoints, exact MTP extraction, the quantized path and the `convert` command line."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlx_spec  # first: loads the optimized BLAS before mlx
from convert import ConversionResult, Quantization, convert_checkpoint

import mlx.core as mx
import numpy as np
import pytest
from helpers import cli_here

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hfmodels as hfm  # noqa: E402  (needs torch)

IDS = [1, 5, 9, 3, 12, 7, 7, 4, 15, 20, 6, 11]  # longer than gemma3's sliding window (4)
ATOL = 1e-4
CONVERSION_KEYS = {"source", "dtype", "quantization", "converter", "revision"}
MTP_FAMILY = {
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "deepseek_v3",
    "qwen3_5": "qwen3_5",
    "mimo": "mimo",
}


def _gemma3(path):
    # hidden 64: mlx-lm scales embeddings by sqrt(hidden) rounded to bfloat16 (exact for 64)
    return hfm.write_hf_checkpoint(
        path, "gemma3_text", hidden_size=64, sliding_window=4, sliding_window_pattern=3
    )


# name -> (writer, MTP options or None)
CASES = {
    "llama": (lambda p: hfm.write_hf_checkpoint(p, "llama", seed=1), None),
    "qwen3": (lambda p: hfm.write_hf_checkpoint(p, "qwen3", seed=2), None),
    "gemma3_text": (_gemma3, None),
    "deepseek_v3": (
        lambda p: hfm.write_hf_checkpoint(p, "deepseek_v3", seed=4),
        dict(family="deepseek_v3", num_layers=2),
    ),
    "qwen3_5": (lambda p: hfm.write_qwen3_5_checkpoint(p, seed=5), dict(family="qwen3_5")),
    "glm4_moe": (  # GLM-4.5 style: DeepSeek's MTP layout on a GLM MoE target
        lambda p: hfm.write_hf_checkpoint(p, "glm4_moe", seed=10),
        dict(family="deepseek_v3"),
    ),
    "mimo": (lambda p: hfm.write_mimo_checkpoint(p, seed=6), dict(family="mimo", num_layers=2)),
    "deepseek_v3-own-copies": (
        lambda p: hfm.write_hf_checkpoint(p, "deepseek_v3", seed=7),
        dict(family="deepseek_v3", own_copies=True),
    ),
    "llama-sharded": (
        lambda p: hfm.write_hf_checkpoint(p, "llama", seed=8, max_shard_size="20KB"),
        None,
    ),
    "deepseek_v3-sharded": (
        lambda p: hfm.write_hf_checkpoint(p, "deepseek_v3", seed=9, max_shard_size="20KB"),
        dict(family="deepseek_v3"),
    ),
}
ROUND_TRIP = ["llama", "qwen3", "gemma3_text", "deepseek_v3", "glm4_moe", "qwen3_5", "mimo"]
MTP_CASES = ["deepseek_v3", "glm4_moe", "qwen3_5", "mimo"]


@dataclass
class Case:
    source: Path
    torch_model: torch.nn.Module
    mtp_added: dict  # checkpoint name -> tensor appended by hfm.add_mtp
    result: ConversionResult

    @property
    def config(self) -> dict:
        return json.loads((self.source / "config.json").read_text())


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """case(name) -> Case: the checkpoint written and converted (float32) once per module."""
    root = tmp_path_factory.mktemp("hf")
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            writer, mtp = CASES[name]
            source, model = writer(root / name)
            added = hfm.add_mtp(source, **mtp) if mtp else {}
            result = convert_checkpoint(str(source), str(root / f"{name}-mlx"), dtype="float32")
            cache[name] = Case(source, model, added, result)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference():
    """reference(case) -> transformers' logits on IDS, computed once per case."""
    cache = {}

    def get(c: Case) -> np.ndarray:
        if id(c) not in cache:
            cache[id(c)] = hfm.hf_logits(c.torch_model, IDS)
        return cache[id(c)]

    return get


def mlx_logits(model) -> np.ndarray:
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def assert_close(got: np.ndarray, want: np.ndarray, atol: float = ATOL) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert want.std() > 0.3, "oracle logits too flat to tell a wrong conversion apart"
    diff = np.abs(got - want)
    assert diff.max() <= atol, f"max |mlx - transformers| = {diff.max():.3g} at {diff.argmax()}"


def drafter_name(family: str, name: str, num_hidden_layers: int) -> str:
    """Independent statement of the documented renaming (checkpoint name -> drafter name)."""
    if family == "deepseek_v3":
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        return f"layers.{int(m[1]) - num_hidden_layers}.{m[2]}"
    if family == "qwen3_5":
        assert name.startswith("mtp.")
        return name[len("mtp.") :]
    m = re.fullmatch(r"model\.mtp_layers\.(\d+)\.(.+)", name)
    return f"layers.{m[1]}.{m[2]}"


def is_norm(name: str) -> bool:
    """A normalization weight (enorm, q_norm, input_layernorm, pre_fc_norm_hidden, ...)."""
    return name.endswith(".weight") and "norm" in name.split(".")[-2]


SHARED_SUFFIXES = ("embed_tokens.weight", "shared_head.head.weight")


def expected_mtp_names(c: Case, family: str) -> dict[str, str]:
    """{drafter name: checkpoint name} of every MTP tensor the drafter file should hold."""
    n_layers = hfm.text_config(c.config)["num_hidden_layers"]
    return {drafter_name(family, n, n_layers): n for n in c.mtp_added}


_EXPERT = re.compile(r"(layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight")
_KV_B = re.compile(r"(layers\.\d+\.self_attn)\.kv_b_proj\.weight")


def expected_mtp_tensors(c: Case, family: str) -> dict[str, np.ndarray]:
    """{drafter name: value} in the target's own mlx-lm layout, derived independently: DeepSeek
    experts stacked into `switch_mlp`, `kv_b_proj` split into per-head `embed_q`/`unembed_out`;
    everything else renamed only. Norms are left raw (their convention is tested separately)."""
    names = expected_mtp_names(c, family)
    source = hfm.read_tensors(c.source, set(names.values()))
    out, experts = {}, {}
    text = hfm.text_config(c.config)
    for new, old in names.items():
        value = source[old].numpy()
        if m := _EXPERT.fullmatch(new):
            experts.setdefault(f"{m[1]}.switch_mlp.{m[3]}.weight", {})[int(m[2])] = value
        elif m := _KV_B.fullmatch(new):
            nope = text["qk_nope_head_dim"]
            heads = value.reshape(text["num_attention_heads"], nope + text["v_head_dim"], -1)
            out[f"{m[1]}.embed_q.weight"] = heads[:, :nope, :].swapaxes(-1, -2)
            out[f"{m[1]}.unembed_out.weight"] = heads[:, nope:, :]
        else:
            out[new] = value
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def stored_weights(directory: Path) -> dict[str, mx.array]:
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


# ------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_logits_match_transformers(case, reference, name):
    """The converted float32 target computes transformers' logits (1e-4) on a 12-token sequence."""
    c = case(name)
    model, _ = mlx_spec.load(str(c.result.path))
    assert_close(mlx_logits(model), reference(c))
    assert (c.result.mtp_path is not None) == (name in MTP_CASES)


def test_gemma3_sliding_window_is_exercised(case, reference):
    """Gemma3's 4-token window changes the oracle's logits, so the match above covers it."""
    c = case("gemma3_text")
    config = c.torch_model.config
    assert config.sliding_window < len(IDS)
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    want = reference(c)
    config.sliding_window = 64
    try:
        wide = hfm.hf_logits(c.torch_model, IDS)
    finally:
        config.sliding_window = 4
    assert np.abs(wide - want).max() > 100 * ATOL


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "deepseek_v3"])
def test_mlx_lm_loads_converted(case, reference, name):
    """mlx_lm.load opens the converted directory and gives the same logits as transformers."""
    from mlx_lm import load as mlx_lm_load

    c = case(name)
    model, tokenizer = mlx_lm_load(str(c.result.path))
    model.set_dtype(mx.float32)
    assert_close(mlx_logits(model), reference(c))
    assert tokenizer.encode("abc", add_special_tokens=False) == [3, 4, 5]


@pytest.mark.parametrize("name", ["llama-sharded", "deepseek_v3-sharded"])
def test_sharded_checkpoint(case, reference, name):
    """A checkpoint saved in many shards with an index (plus an MTP shard) converts and matches."""
    c = case(name)
    index = json.loads((c.source / hfm.INDEX_NAME).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and all((c.source / s).is_file() for s in shards)
    model, _ = mlx_spec.load(str(c.result.path))
    assert_close(mlx_logits(model), reference(c))
    if c.mtp_added:
        drafted = mx.load(str(c.result.mtp_path / "model.safetensors"))
        expected = expected_mtp_tensors(c, "deepseek_v3")
        assert set(drafted) == {k for k in expected if not k.endswith(SHARED_SUFFIXES)}


# ---------------------------------------------------------------------------------- MTP drafters


@pytest.mark.parametrize("name", MTP_CASES)
def test_mtp_tensors_exact(case, name):
    """Every MTP tensor lands in <out>/mtp under its documented name, in the target's mlx-lm
    layout (DeepSeek experts stacked, kv_b_proj split), non-norm values bit-exact."""
    c = case(name)
    family = MTP_FAMILY[name]
    drafted = mx.load(str(c.result.mtp_path / "model.safetensors"))
    expected = expected_mtp_tensors(c, family)
    dropped = {k for k in expected if k.endswith(SHARED_SUFFIXES)}  # identical copies: referenced
    assert set(drafted) == set(expected) - dropped
    for new, want in expected.items():
        if new in dropped or is_norm(new):
            continue
        got = np.array(drafted[new])
        assert got.dtype == np.float32 and got.shape == want.shape, new
        assert np.array_equal(got, want), f"{new} differs from the checkpoint"


@pytest.mark.parametrize("name", MTP_CASES)
def test_mtp_norm_convention(case, name):
    """MTP norms are stored as x*w: Qwen's x*(1+w) norms (all of them) get +1, others unchanged."""
    c = case(name)
    family = MTP_FAMILY[name]
    drafted = mx.load(str(c.result.mtp_path / "model.safetensors"))
    names = {k: v for k, v in expected_mtp_names(c, family).items() if is_norm(k)}
    assert len(names) >= 4
    source = hfm.read_tensors(c.source, set(names.values()))
    offset = 1.0 if family == "qwen3_5" else 0.0
    wrong = []
    for new, old in sorted(names.items()):
        want = source[old].numpy() + np.float32(offset)
        if new not in drafted or not np.array_equal(np.array(drafted[new]), want):
            shift = (
                np.mean(np.array(drafted[new]) - source[old].numpy()) if new in drafted else None
            )
            wrong.append(f"{new} (stored - checkpoint = {shift}, want {offset})")
    assert not wrong, "norms in the wrong convention: " + "; ".join(wrong)


@pytest.mark.parametrize("name", MTP_CASES)
def test_mtp_config(case, name):
    """The drafter config.json records family, layer count, x*w norms, sharing and the target."""
    c = case(name)
    config = json.loads((c.result.mtp_path / "config.json").read_text())
    source_config = c.config
    declared = CASES[name][1].get("num_layers", 1)
    assert config["model_type"] == "mtp"
    assert config["mtp_family"] == MTP_FAMILY[name]
    assert config["num_mtp_layers"] == declared
    assert config["norm_convention"] == "x*w"
    assert set(config["shared_with_target"]) == {"embed_tokens", "lm_head"}
    assert config["target_config"]["model_type"] == source_config["model_type"]
    text = hfm.text_config(config["target_config"])
    assert text["num_hidden_layers"] == hfm.text_config(source_config)["num_hidden_layers"]
    drafted = mx.load(str(c.result.mtp_path / "model.safetensors"))
    layers = {int(k.split(".")[1]) for k in drafted if k.startswith("layers.")}
    assert layers == set(range(declared))


@pytest.mark.parametrize("name", MTP_CASES)
def test_target_without_mtp(case, name):
    """The target directory holds no MTP tensor and loads as a plain mlx-lm model."""
    c = case(name)
    weights = stored_weights(c.result.path)
    text = hfm.text_config(c.config)
    n_layers = text["num_hidden_layers"]
    layer_ids = {int(m[1]) for k in weights if (m := re.search(r"layers\.(\d+)\.", k))}
    assert layer_ids == set(range(n_layers))
    assert not [k for k in weights if k.startswith("mtp.") or ".mtp." in k or "mtp_layers" in k]
    assert not [k for k in weights if re.search(r"(enorm|hnorm|eh_proj|shared_head)", k)]
    model, _ = mlx_spec.load(str(c.result.path))
    assert len(model.layers) == n_layers


def test_shared_copies_dropped_only_when_identical(case):
    """DeepSeek embed/head copies equal to the target's are dropped; differing ones are kept."""
    same = case("deepseek_v3")
    config = json.loads((same.result.mtp_path / "config.json").read_text())
    drafted = mx.load(str(same.result.mtp_path / "model.safetensors"))
    assert not [k for k in drafted if k.endswith(SHARED_SUFFIXES)]
    assert config["own_copies"] == []

    own = case("deepseek_v3-own-copies")
    config = json.loads((own.result.mtp_path / "config.json").read_text())
    drafted = mx.load(str(own.result.mtp_path / "model.safetensors"))
    n_layers = own.config["num_hidden_layers"]
    source = hfm.read_tensors(own.source)
    for suffix in SHARED_SUFFIXES:
        got = np.array(drafted[f"layers.0.{suffix}"])
        assert np.array_equal(got, source[f"model.layers.{n_layers}.{suffix}"].numpy())
    assert sorted(config["own_copies"]) == sorted(SHARED_SUFFIXES)


# ------------------------------------------------------------------------------------- quantized


def _dequantized(weights: dict, base: str, quant: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """(dequantized weight, quantization step per element) of module `base`."""
    w = mx.dequantize(
        weights[f"{base}.weight"],
        weights[f"{base}.scales"],
        weights[f"{base}.biases"],
        group_size=quant.group_size,
        bits=quant.bits,
    )
    step = np.abs(np.array(weights[f"{base}.scales"]))  # mlx scales may be negative
    return np.array(w), np.repeat(step, quant.group_size, -1)


@pytest.mark.parametrize("name", ["llama", "mimo"])
def test_quantized_conversion(case, reference, tmp_path, name):
    """4-bit/group-32 conversion loads, generates, stays near transformers and near the source."""
    c = case(name)
    quant = Quantization(bits=4, group_size=32)
    result = convert_checkpoint(
        str(c.source), str(tmp_path / "q"), dtype="float32", quantization=quant
    )
    config = json.loads((result.path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    provenance = json.loads((result.path / "conversion.json").read_text())
    assert provenance["quantization"] == {"bits": 4, "group_size": 32}

    model, tokenizer = mlx_spec.load(str(result.path))
    tokenizer = copy.copy(tokenizer)
    tokenizer.eos_token_ids = set()  # fixed-length generation
    out = mlx_spec.generate(model, tokenizer, "abc", max_tokens=5)
    assert len(out.tokens) == 5 and isinstance(out.text, str)

    got, want = mlx_logits(model), reference(c)
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.8
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.5

    # every quantized linear dequantizes to its source within one quantization step
    weights, source = stored_weights(result.path), hfm.read_tensors(c.source)
    bases = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    assert any(".mlp.down_proj" in b for b in bases) and any("q_proj" in b for b in bases)
    for base in bases:
        deq, step = _dequantized(weights, base, quant)
        src = source[f"{base}.weight"].numpy()
        assert np.all(np.abs(deq - src) <= step + 1e-6), base

    if name == "mimo":  # the MTP drafter is quantized the same way
        mtp_config = json.loads((result.mtp_path / "config.json").read_text())
        assert mtp_config["quantization"]["bits"] == 4
        assert mtp_config["quantization"]["group_size"] == 32
        drafted = mx.load(str(result.mtp_path / "model.safetensors"))
        names = expected_mtp_names(c, "mimo")
        modules = [k[: -len(".scales")] for k in drafted if k.endswith(".scales")]
        assert "layers.0.input_proj" in modules and "layers.1.mlp.down_proj" in modules
        for base in modules:
            deq, step = _dequantized(drafted, base, quant)
            src = source[names[f"{base}.weight"]].numpy()
            assert np.all(np.abs(deq - src) <= step + 1e-6), base


# ------------------------------------------------------------------------------- dtype and config


def test_default_dtype_is_the_checkpoints(case, tmp_path):
    """Without --dtype the checkpoint's declared dtype (transformers 5 `dtype`: float32) is kept."""
    c = case("qwen3")
    assert c.config.get("dtype") == "float32"
    result = convert_checkpoint(str(c.source), str(tmp_path / "out"))
    assert json.loads((result.path / "conversion.json").read_text())["dtype"] == "float32"
    assert {str(v.dtype) for v in stored_weights(result.path).values()} == {"mlx.core.float32"}


@pytest.mark.parametrize(
    "model_type,overrides",
    [("llama", dict(rope_theta=500000.0)), ("qwen2", {})],
    ids=["llama-theta-5e5", "qwen2-default-theta"],
)
def test_rope_parameters_reach_mlx(tmp_path, model_type, overrides):
    """transformers>=5 configs nest rope_theta in rope_parameters; the MLX model must use it."""
    source, model = hfm.write_hf_checkpoint(tmp_path / "hf", model_type, seed=11, **overrides)
    config = json.loads((source / "config.json").read_text())
    assert "rope_theta" not in config and "rope_theta" in config["rope_parameters"]
    result = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32")
    converted, _ = mlx_spec.load(str(result.path))
    assert_close(mlx_logits(converted), hfm.hf_logits(model, IDS))


# ------------------------------------------------------------------------------------------- CLI


def run_convert(*args: str) -> subprocess.CompletedProcess:
    return cli_here("convert", *args)


def test_cli_convert(case, reference, tmp_path):
    """`mlx-spec convert --dtype float32` exits 0, writes target + MTP dirs and full provenance."""
    c = case("mimo")
    out = tmp_path / "cli"
    proc = run_convert("--hf-path", str(c.source), "--mlx-path", str(out), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout and "MTP drafter" in proc.stdout
    assert (out / "config.json").is_file() and (out / "mtp" / "config.json").is_file()
    assert (out / "tokenizer.json").is_file()
    provenance = json.loads((out / "conversion.json").read_text())
    assert CONVERSION_KEYS <= set(provenance)
    assert provenance["source"] == str(c.source) and provenance["dtype"] == "float32"
    assert provenance["quantization"] is None and provenance["revision"] is None
    assert provenance["converter"].startswith("mlx-spec")
    assert not list(tmp_path.glob(".cli.partial-*"))
    model, _ = mlx_spec.load(str(out))
    assert_close(mlx_logits(model), reference(c))


def test_cli_existing_output(case, tmp_path):
    """The CLI refuses an existing output (exit 2, untouched) and replaces it with --force."""
    c = case("llama")
    out = tmp_path / "cli"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ("--hf-path", str(c.source), "--mlx-path", str(out), "--dtype", "float32")
    proc = run_convert(*args)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    proc = run_convert(*args, "--force", "-q", "--q-bits", "4", "--q-group-size", "32")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "keep.txt").exists()
    provenance = json.loads((out / "conversion.json").read_text())
    assert provenance["quantization"] == {"bits": 4, "group_size": 32}
