"""The HF -> MLX converter refuses bad checkpoints with a named culprit and never leaves a
half-written output directory behind (docs/testing.md, "Bad input gets a clear error")."""

from __future__ import annotations

import json
import pathlib
import pickle
import runpy
import struct
import sys
from fnmatch import fnmatch
from pathlib import Path

import convert.core as core
import mlx_spec
from convert import ConversionError, Quantization, convert_checkpoint
from mlx_spec import cli

import huggingface_hub
import mlx.core as mx
import pytest
import tinymodels as tm
from helpers import cli_here

VOCAB = tm.tokenizer_size()
INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# Python-level file opens during a conversion (audit hook; mx.load reads in C++ and is not seen).
_OPENED: list[str] | None = None


def _audit(event, args):
    if event == "open" and _OPENED is not None:
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)


# --------------------------------------------------------------------------- helpers


def llama_weights(seed=0, **overrides):
    config = tm.llama_config(VOCAB, **overrides)
    return config, tm.random_weights(config, seed=seed)


def write_llama(path, seed=0, weights=None, config=None):
    """A tiny llama checkpoint (HF names equal mlx-lm names for llama) in one safetensors file."""
    if config is None or weights is None:
        config, weights = llama_weights(seed)
    return tm.write_checkpoint(path, config, weights)


def write_sharded(path, seed=0):
    """A tiny llama checkpoint in two shards with a model.safetensors.index.json."""
    config, weights = llama_weights(seed)
    path = tm.write_checkpoint(path, config, {})
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    weight_map = {}
    for shard, part in ((SHARD1, names[:half]), (SHARD2, names[half:])):
        mx.save_safetensors(str(path / shard), {n: weights[n] for n in part})
        weight_map.update({n: shard for n in part})
    write_index(path, weight_map)
    return path


def write_index(path, weight_map):
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def read_index(path):
    return json.loads((path / INDEX).read_text())["weight_map"]


def shard_tensors(path, shard):
    return dict(mx.load(str(path / shard)))


def leftovers(dest: Path) -> list[str]:
    """Temp (`.partial-`) or displaced (`.replaced-`) directories left beside `dest`."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


def assert_no_output(dest: Path) -> None:
    assert not dest.exists(), f"{dest} was created"
    assert leftovers(dest) == []


def refused(src, dest, *needles, **kwargs) -> str:
    """Convert `src` expecting a ConversionError naming every needle; nothing may be written."""
    with pytest.raises(ConversionError) as info:
        convert_checkpoint(str(src), str(dest), **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not named in: {message}"
    assert_no_output(Path(dest))
    return message


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- positive controls


def test_single_file_and_sharded_checkpoints_convert(tmp_path):
    """Control: the unbroken fixtures used below convert, so each refusal is the defect's doing."""
    for name, src in (
        ("single", write_llama(tmp_path / "single-src")),
        ("sharded", write_sharded(tmp_path / "sharded-src")),
    ):
        dest = tmp_path / f"{name}-out"
        result = convert_checkpoint(str(src), str(dest))
        assert result.path == dest and result.mtp_path is None
        assert (dest / "config.json").is_file() and (dest / "conversion.json").is_file()
        assert leftovers(dest) == []
        model, _ = mlx_spec.load(str(dest))
        assert model.args.vocab_size == VOCAB


# --------------------------------------------------------------------------- shards and index


def test_missing_shard(tmp_path):
    """A shard named in the index but absent is refused, naming the shard file."""
    src = write_sharded(tmp_path / "src")
    (src / SHARD2).unlink()
    refused(src, tmp_path / "out", SHARD2, "missing")


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("where", ["data", "header", "length-prefix"])
@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_truncated_shard(tmp_path, where, layout):
    """A safetensors file cut in its data, JSON header or length prefix is refused by name."""
    if layout == "sharded":
        src, victim = write_sharded(tmp_path / "src"), SHARD2
    else:
        src, victim = write_llama(tmp_path / "src"), "model.safetensors"
    path = src / victim
    size = {
        "data": path.stat().st_size - 16,
        "header": 8 + _header_len(path) // 2,
        "length-prefix": 5,
    }[where]
    with open(path, "r+b") as f:
        f.truncate(size)
    refused(src, tmp_path / "out", victim, "truncated")


def test_index_lists_tensor_the_shard_lacks(tmp_path):
    """An index entry whose shard lacks the tensor is refused, naming tensor and shard."""
    src = write_sharded(tmp_path / "src")
    weight_map = read_index(src)
    weight_map["model.layers.0.ghost.weight"] = SHARD2
    write_index(src, weight_map)
    refused(src, tmp_path / "out", "model.layers.0.ghost.weight", SHARD2)


def test_shard_holds_tensor_the_index_omits(tmp_path):
    """A tensor in a shard but absent from the index is refused, naming it and the shard."""
    src = write_sharded(tmp_path / "src")
    weight_map = read_index(src)
    name = next(n for n, shard in weight_map.items() if shard == SHARD2)
    del weight_map[name]
    write_index(src, weight_map)
    refused(src, tmp_path / "out", name, SHARD2)


@pytest.mark.parametrize("indexed_in", [SHARD1, SHARD2])
def test_tensor_in_two_shards(tmp_path, indexed_in):
    """A tensor stored in both shards is refused by name, whichever shard the index names."""
    src = write_sharded(tmp_path / "src")
    weight_map = read_index(src)
    name = next(n for n, shard in weight_map.items() if shard == SHARD1)
    value = shard_tensors(src, SHARD1)[name]
    second = shard_tensors(src, SHARD2)
    second[name] = value
    mx.save_safetensors(str(src / SHARD2), second)
    weight_map[name] = indexed_in
    write_index(src, weight_map)
    message = refused(src, tmp_path / "out", name)
    assert SHARD1 in message or SHARD2 in message


def test_tensor_in_two_unindexed_files(tmp_path):
    """Without an index, a tensor in two model*.safetensors files is refused, naming both files."""
    config, weights = llama_weights()
    src = tm.write_checkpoint(tmp_path / "src", config, {})
    (src / "model.safetensors").unlink()
    names = sorted(weights)
    dup = names[0]
    mx.save_safetensors(str(src / "model-a.safetensors"), {n: weights[n] for n in names[:5]})
    rest = {n: weights[n] for n in names[5:]} | {dup: weights[dup]}
    mx.save_safetensors(str(src / "model-b.safetensors"), rest)
    refused(src, tmp_path / "out", dup, "model-a.safetensors", "model-b.safetensors")


# --------------------------------------------------------------------------- config and tensors


def test_unknown_architecture(tmp_path):
    """An architecture mlx-lm does not know is refused, naming the model_type."""
    config, weights = llama_weights()
    src = write_llama(
        tmp_path / "src", config=dict(config, model_type="not_a_model"), weights=weights
    )
    refused(src, tmp_path / "out", "not_a_model")


def test_missing_config(tmp_path):
    """A checkpoint without config.json is refused, naming config.json."""
    src = write_llama(tmp_path / "src")
    (src / "config.json").unlink()
    refused(src, tmp_path / "out", "config.json")


def test_invalid_json_config(tmp_path):
    """A config.json that is not JSON is refused, naming config.json."""
    src = write_llama(tmp_path / "src")
    (src / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,,')
    refused(src, tmp_path / "out", "config.json", "JSON")


def test_unknown_tensor_name(tmp_path):
    """A tensor the architecture has no place for is refused, naming tensor and architecture."""
    config, weights = llama_weights()
    weights["model.layers.0.foo.weight"] = mx.zeros((32, 32))
    src = write_llama(tmp_path / "src", config=config, weights=weights)
    refused(src, tmp_path / "out", "model.layers.0.foo.weight", "llama")


def test_missing_tensor(tmp_path):
    """A tensor the architecture needs but the checkpoint lacks is refused, naming it."""
    config, weights = llama_weights()
    del weights["model.layers.1.mlp.down_proj.weight"]
    src = write_llama(tmp_path / "src", config=config, weights=weights)
    refused(src, tmp_path / "out", "model.layers.1.mlp.down_proj.weight", "missing")


def test_tensor_shape_mismatch(tmp_path):
    """A tensor whose shape contradicts config.json is refused, naming it and both shapes."""
    config, weights = llama_weights()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert weights[name].shape == (32, 32)
    weights[name] = mx.zeros((16, 32))
    src = write_llama(tmp_path / "src", config=config, weights=weights)
    refused(src, tmp_path / "out", name, "[16, 32]", "[32, 32]")


# --------------------------------------------------------------------------- MTP (MiMo layout)


def mimo_checkpoint(path, mtp_layers=1, declared=1, edit=None):
    """A tiny MiMo target with `mtp_layers` MTP layers (`model.mtp_layers.i.*`)."""
    config = tm.llama_config(VOCAB, model_type="mimo", num_nextn_predict_layers=declared)
    weights = tm.random_weights(config, seed=3)
    hidden = config["hidden_size"]
    layer0 = {k[len("model.layers.0.") :]: v for k, v in weights.items() if ".layers.0." in k}
    for i in range(mtp_layers):
        prefix = f"model.mtp_layers.{i}."
        weights[prefix + "token_layernorm.weight"] = mx.ones((hidden,))
        weights[prefix + "hidden_layernorm.weight"] = mx.ones((hidden,))
        weights[prefix + "input_proj.weight"] = mx.random.normal((hidden, 2 * hidden))
        weights[prefix + "final_layernorm.weight"] = mx.ones((hidden,))
        weights.update({prefix + suffix: v for suffix, v in layer0.items()})
    if edit is not None:
        edit(weights, hidden)
    return tm.write_checkpoint(path, config, weights)


def test_mimo_with_mtp_converts(tmp_path):
    """Control: a well-formed MiMo checkpoint converts and gets its MTP drafter directory."""
    dest = tmp_path / "out"
    result = convert_checkpoint(str(mimo_checkpoint(tmp_path / "src")), str(dest))
    assert result.mtp_path == dest / "mtp"
    drafter = json.loads((dest / "mtp" / "config.json").read_text())
    assert drafter["num_mtp_layers"] == 1 and drafter["mtp_family"] == "mimo"


def test_mtp_tensor_wrong_shape(tmp_path):
    """An MTP projection of the wrong shape is refused, naming the tensor."""

    def edit(weights, hidden):
        weights["model.mtp_layers.0.input_proj.weight"] = mx.zeros((hidden, hidden))

    src = mimo_checkpoint(tmp_path / "src", edit=edit)
    refused(src, tmp_path / "out", "model.mtp_layers.0.input_proj.weight", "[32, 32]", "[32, 64]")


def test_unknown_mtp_tensor(tmp_path):
    """An MTP tensor name that fits neither the MTP head nor a decoder layer is refused by name."""

    def edit(weights, hidden):
        weights["model.mtp_layers.0.mystery_proj.weight"] = mx.zeros((hidden, hidden))

    src = mimo_checkpoint(tmp_path / "src", edit=edit)
    refused(src, tmp_path / "out", "model.mtp_layers.0.mystery_proj.weight")


def test_mtp_layer_count_disagrees_with_config(tmp_path):
    """A config declaring 2 MTP layers over a checkpoint holding 1 is refused."""
    src = mimo_checkpoint(tmp_path / "src", mtp_layers=1, declared=2)
    message = refused(src, tmp_path / "out", "MTP")
    assert "2" in message and "1" in message


# --------------------------------------------------------------------------- output directory


def test_existing_output_refused_unless_forced(tmp_path):
    """An existing output directory is left alone without force and fully replaced with it."""
    src = write_llama(tmp_path / "src")
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "stale.txt").write_text("old")
    with pytest.raises(ConversionError, match="already exists"):
        convert_checkpoint(str(src), str(dest))
    assert snapshot(dest) == {"stale.txt": b"old"}
    assert leftovers(dest) == []

    convert_checkpoint(str(src), str(dest), force=True)
    assert not (dest / "stale.txt").exists()
    assert (dest / "model.safetensors").is_file() and (dest / "conversion.json").is_file()
    assert leftovers(dest) == []


def interrupting_save_model(exc: BaseException, seen: dict):
    """A save_model that writes the weights into the temp directory, then raises `exc`."""
    real = core.save_model

    def save_then_fail(out, model, **kwargs):
        real(out, model, **kwargs)
        seen["tmp"] = Path(out)
        seen["files"] = sorted(p.name for p in Path(out).iterdir())
        raise exc

    return save_then_fail


@pytest.mark.parametrize(
    "exc",
    [KeyboardInterrupt(), OSError(28, "No space left on device")],
    ids=["KeyboardInterrupt", "ENOSPC"],
)
def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, exc):
    """A conversion interrupted after writing some files propagates and leaves no output at all."""
    src = write_llama(tmp_path / "src")
    dest = tmp_path / "out"
    seen = {}
    monkeypatch.setattr(core, "save_model", interrupting_save_model(exc, seen))
    with pytest.raises(type(exc)):
        convert_checkpoint(str(src), str(dest))
    assert "model.safetensors" in seen["files"]  # the interruption came after a partial write
    assert seen["tmp"].name.startswith(".out.partial-")
    assert not seen["tmp"].exists()
    assert_no_output(dest)


@pytest.mark.parametrize(
    "exc",
    [KeyboardInterrupt(), OSError(28, "No space left on device")],
    ids=["KeyboardInterrupt", "ENOSPC"],
)
def test_interrupted_forced_conversion_keeps_old_output(tmp_path, monkeypatch, exc):
    """With force, an interrupted conversion leaves the previous output byte-for-byte intact."""
    dest = tmp_path / "out"
    convert_checkpoint(str(write_llama(tmp_path / "old-src", seed=0)), str(dest))
    before = snapshot(dest)
    monkeypatch.setattr(core, "save_model", interrupting_save_model(exc, {}))
    with pytest.raises(type(exc)):
        convert_checkpoint(str(write_llama(tmp_path / "new-src", seed=1)), str(dest), force=True)
    assert snapshot(dest) == before
    assert leftovers(dest) == []


def test_failure_during_final_swap_keeps_old_output(tmp_path, monkeypatch):
    """With force, an interrupt while the temp dir is renamed into place keeps the old output."""
    dest = tmp_path / "out"
    convert_checkpoint(str(write_llama(tmp_path / "old-src", seed=0)), str(dest))
    before = snapshot(dest)
    real_rename = pathlib.Path.rename

    def rename(self, target):
        if ".partial-" in self.name and Path(target) == dest:
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(str(write_llama(tmp_path / "new-src", seed=1)), str(dest), force=True)
    monkeypatch.undo()
    assert dest.is_dir(), f"old output gone; left beside it: {leftovers(dest)}"
    assert snapshot(dest) == before
    assert [n for n in leftovers(dest) if ".partial-" in n] == []


# --------------------------------------------------------------------------- pickles


class _OpensMarker:
    """Unpickling this calls open(marker, "w"): proof that a pickle was executed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_malicious_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"model.embed_tokens.weight": _OpensMarker(marker)}))


def test_malicious_pickle_payload_is_live(tmp_path):
    """Control: the pickle payload used below really does create its marker when unpickled."""
    marker = tmp_path / "marker"
    write_malicious_pickle(tmp_path / "payload.bin", marker)
    loaded = pickle.loads((tmp_path / "payload.bin").read_bytes())
    loaded["model.embed_tokens.weight"].close()
    assert marker.exists()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_only_checkpoint_refused_without_unpickling(tmp_path, name):
    """A checkpoint with only pickled weights is refused (naming pickle), never unpickled."""
    marker = tmp_path / "PICKLE_RAN"
    config, _ = llama_weights()
    src = tm.write_checkpoint(tmp_path / "src", config, {})
    (src / "model.safetensors").unlink()
    write_malicious_pickle(src / name, marker)
    message = refused(src, tmp_path / "out", name)
    assert "pickle" in message.lower()
    assert not marker.exists()


def test_safetensors_preferred_and_pickle_never_opened(tmp_path):
    """Beside safetensors, a malicious .bin is never opened, never unpickled, never copied."""
    global _OPENED
    marker = tmp_path / "PICKLE_RAN"
    src = write_llama(tmp_path / "src")
    write_malicious_pickle(src / "pytorch_model.bin", marker)
    dest = tmp_path / "out"
    _OPENED = []
    try:
        convert_checkpoint(str(src), str(dest))
        opened = _OPENED
    finally:
        _OPENED = None
    assert not marker.exists()
    assert [p for p in opened if p.endswith(".bin")] == []
    assert any(p.endswith("config.json") for p in opened)  # the hook does see the converter's opens
    assert not list(dest.glob("*.bin"))
    assert (dest / "model.safetensors").is_file()


# --------------------------------------------------------------------------- remote code

REMOTE_CODE = """
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "REMOTE_CODE_RAN"), "w").close()


class ModelArgs:
    pass


class Model:
    pass
"""


def write_remote_code_checkpoint(path: Path, model_type: str) -> Path:
    config, weights = llama_weights()
    config.update(
        model_type=model_type,
        model_file="modeling_evil.py",
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilModel",
        },
        architectures=["EvilModel"],
    )
    src = tm.write_checkpoint(path, config, weights)
    for module in ("modeling_evil.py", "configuration_evil.py", "__init__.py"):
        (src / module).write_text(REMOTE_CODE)
    return src


def test_remote_code_payload_is_live(tmp_path):
    """Control: the remote-code module used below creates its marker when executed."""
    src = write_remote_code_checkpoint(tmp_path / "src", "llama")
    runpy.run_path(str(src / "modeling_evil.py"))
    assert (src / "REMOTE_CODE_RAN").exists()


def test_remote_code_never_run_for_known_architecture(tmp_path):
    """auto_map/model_file are ignored for a known model_type: built-in class, code never run."""
    src = write_remote_code_checkpoint(tmp_path / "src", "llama")
    dest = tmp_path / "out"
    convert_checkpoint(str(src), str(dest))
    assert not (src / "REMOTE_CODE_RAN").exists()
    assert not list(dest.glob("*.py"))
    # The output must load with mlx-lm's own llama class, without trust_remote_code.
    model, _ = mlx_spec.load(str(dest))
    assert type(model).__module__ == "mlx_lm.models.llama"
    assert not (src / "REMOTE_CODE_RAN").exists() and not (dest / "REMOTE_CODE_RAN").exists()


def test_remote_code_for_unknown_architecture_refused(tmp_path):
    """An unknown model_type that only remote code could build is refused; the code never runs."""
    src = write_remote_code_checkpoint(tmp_path / "src", "evil_custom")
    refused(src, tmp_path / "out", "evil_custom")
    assert not (src / "REMOTE_CODE_RAN").exists()


# --------------------------------------------------------------------------- hub


def test_offline_hub_miss_names_the_repo(tmp_path, offline_hub):
    """Offline, an uncached hub id gives a ConversionError naming the repo and HF_HUB_OFFLINE."""
    refused("nobody/not-cached", tmp_path / "out", "nobody/not-cached", "HF_HUB_OFFLINE")


def test_cli_offline_hub_miss_is_one_line(tmp_path, offline_hub):
    """`mlx-spec convert` of an uncached hub id offline exits 2 with one line, no traceback."""
    out = tmp_path / "out"
    proc = cli_here("convert", "--hf-path", "nobody/not-cached", "--mlx-path", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mlx-spec: error: ") and "nobody/not-cached" in lines[0]
    assert_no_output(out)


def test_local_directory_converts_offline(tmp_path, offline_hub):
    """Offline, a local directory converts and records no hub revision."""
    src = write_llama(tmp_path / "src")
    dest = tmp_path / "out"
    convert_checkpoint(str(src), str(dest))
    provenance = json.loads((dest / "conversion.json").read_text())
    assert provenance["source"] == str(src) and provenance["revision"] is None


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """snapshot_download replaced by a prepared snapshot dir; returns the list of its calls."""
    snapshot_dir = write_llama(tmp_path / "hub" / "snapshots" / COMMIT)
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append(dict(kwargs, repo_id=repo_id))
        return str(snapshot_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    return calls


def test_hub_conversion_records_snapshot_revision(tmp_path, fake_hub):
    """A hub id is fetched with its revision, and conversion.json records the snapshot commit."""
    dest = tmp_path / "out"
    convert_checkpoint("some-org/some-model", str(dest), revision="main")
    assert len(fake_hub) == 1
    assert fake_hub[0]["repo_id"] == "some-org/some-model"
    assert fake_hub[0]["revision"] == "main"
    provenance = json.loads((dest / "conversion.json").read_text())
    assert provenance["source"] == "some-org/some-model"
    assert provenance["revision"] == COMMIT
    patterns = fake_hub[0].get("allow_patterns")
    assert patterns, "no allow_patterns: the whole repo (pickles, code) would be downloaded"
    for needed in ("config.json", INDEX, SHARD1, "tokenizer.json", "tokenizer.model"):
        assert any(fnmatch(needed, p) for p in patterns), needed


@pytest.mark.parametrize(
    "name",
    [
        "pytorch_model.bin",
        "pytorch_model-00001-of-00002.bin",
        "training_args.bin",
        "model.pt",
        "modeling_evil.py",
        "configuration_evil.py",
        "tokenization_evil.py",
        "tokenizer.py",
    ],
)
def test_hub_fetch_never_requests_pickles_or_code(tmp_path, fake_hub, name):
    """The hub download's allow_patterns match no pickle and no Python file."""
    convert_checkpoint("some-org/some-model", str(tmp_path / "out"))
    patterns = fake_hub[0]["allow_patterns"]
    assert patterns
    assert [p for p in patterns if fnmatch(name, p)] == []


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"bits": 7}, "7"), ({"bits": 1}, "1"), ({"group_size": 48}, "48"), ({"group_size": 0}, "0")],
)
def test_invalid_quantization(kwargs, needle):
    """Unsupported quantization bits or group size are refused, naming the value."""
    with pytest.raises(ConversionError, match=needle):
        Quantization(**kwargs)


def test_valid_quantization_converts(tmp_path):
    """Control: a supported quantization converts and is recorded in conversion.json."""
    dest = tmp_path / "out"
    convert_checkpoint(
        str(write_llama(tmp_path / "src")), str(dest), quantization=Quantization(4, 32)
    )
    provenance = json.loads((dest / "conversion.json").read_text())
    assert provenance["quantization"] == {"bits": 4, "group_size": 32}


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp16"])
def test_invalid_dtype(tmp_path, dtype):
    """An unsupported dtype is refused, naming it, before anything is written."""
    refused(write_llama(tmp_path / "src"), tmp_path / "out", dtype, dtype=dtype)


@pytest.mark.parametrize(
    "flags", [["--q-bits", "7"], ["--q-group-size", "48"]], ids=["bits7", "group48"]
)
def test_cli_invalid_quantization_is_one_line(tmp_path, capsys, flags):
    """`mlx-spec convert -q` with bad quantization exits 2 with one `mlx-spec: error:` line."""
    src = write_llama(tmp_path / "src")
    out = tmp_path / "out"
    code = cli.main(["convert", "--hf-path", str(src), "--mlx-path", str(out), "-q"] + flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("mlx-spec: error: ") and flags[1] in err[0]
    assert_no_output(out)


def test_cli_rejects_existing_output(tmp_path, capsys):
    """`mlx-spec convert` onto an existing directory exits 2 naming it, and leaves it untouched."""
    src = write_llama(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code = cli.main(["convert", "--hf-path", str(src), "--mlx-path", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("mlx-spec: error: ") and str(out) in err[0]
    assert snapshot(out) == {"keep.txt": b"mine"}
