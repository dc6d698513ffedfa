"""HF checkpoint -> MLX model directory (+ MTP drafter directory), written atomically."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from convert.classes import model_classes
from convert.errors import ConversionError
from convert.fetch import resolve_gguf, resolve_source
from convert.layouts import rewrite
from convert.mtp import MTPTensors, check_mtp_shapes, extract_mtp, split_mtp, text_config
from convert.mtp_build import build_mtp_module
from convert.normalize import normalize_config
from convert.safetensors_check import list_tensors
from mlx_spec.core.compat import copy_tokenizer_files
from mlx_spec.core.version import VERSION
from mlx_spec.drafters.medusa import (
    MedusaHeads,
    load_medusa_heads,
    medusa_heads,
    medusa_params,
    save_medusa_heads,
)
from mlx_spec.drafters.mtp import save_mtp_drafter
from mlx_spec.models.dflash import (
    dflash_weights,
    is_dflash_config,
    read_dflash,
    read_dflash_config,
    save_dflash,
)
from mlx_spec.models.eagle3 import (
    eagle3_weights,
    is_eagle3_config,
    read_eagle3,
    read_eagle3_config,
    save_eagle3,
)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import quantize_model, save_config, save_model

DTYPES = ("float16", "bfloat16", "float32")
MTP_DIR = "mtp"
MEDUSA_DIR = "medusa"
MEDUSA_PREFIX = "medusa_head."
PROVENANCE = "conversion.json"


@dataclass(frozen=True)
class Quantization:
    bits: int = 4
    group_size: int = 64

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ConversionError(f"--q-bits must be one of 2, 3, 4, 5, 6, 8, got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ConversionError(f"--q-group-size must be 32, 64 or 128, got {self.group_size}")


@dataclass
class ConversionResult:
    path: Path
    mtp_path: Path | None


def _log(message: str) -> None:
    print(f"[convert] {message}", file=sys.stderr, flush=True)


@contextmanager
def atomic_directory(dest: Path, force: bool):
    """Yield a temp directory beside `dest`; it becomes `dest` only if the block succeeds."""
    if dest.exists() and not force:
        raise ConversionError(f"{dest}: already exists (use --force to replace it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.replaced-", dir=dest.parent))
            old.rmdir()
            dest.rename(old)
            try:
                tmp.rename(dest)
            except BaseException:
                old.rename(dest)  # put the previous output back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_loadable(config: dict) -> None:
    if "quantization" in config:
        raise ConversionError("this is already an MLX checkpoint (config has 'quantization')")
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "fp8"):
        raise ConversionError(
            f"{method}-quantized checkpoints are not converted; use the full-precision one"
        )


def build_target(config: dict, weights: dict[str, mx.array]) -> nn.Module:
    """The mlx-lm model of `config` holding `weights`; every name and shape is checked."""
    model_cls, args_cls = model_classes(config)
    try:
        model = model_cls(args_cls.from_dict(config))
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as exc:
        raise ConversionError(f"config.json does not fit {config['model_type']}: {exc}") from exc
    weights = _sanitized(model, rewrite(config, weights))
    expected = dict(tree_flatten(model.parameters()))
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ConversionError(f"unknown tensor {unknown[0]}{more} for {config['model_type']}")
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ConversionError(f"tensor {missing[0]} is missing ({len(missing)} missing)")
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ConversionError(
                f"tensor {name} has shape {list(value.shape)}, the config implies "
                f"{list(expected[name].shape)}"
            )
    model.load_weights(list(weights.items()), strict=True)
    return model


def _sanitized(model: nn.Module, weights: dict) -> dict:
    """The model's own renaming of `weights`; where names are left over, the same with the
    transformers base-model prefix (e.g. `transformer.`) removed, if that makes them fit: mlx-lm
    models written against base-model checkpoints do not know the prefix a causal-LM class adds."""
    sanitize = getattr(model, "sanitize", None)
    names = _names(model)

    def fit(named: dict) -> dict:
        return _stack_experts(sanitize(dict(named)) if sanitize else named, names)

    out = fit(weights)
    if set(out) <= names:  # (sanitize may drop parameters, e.g. an untied head)
        return out
    heads = {name.split(".", 1)[0] for name in weights if "." in name}
    for prefix in sorted(heads - {"model", "lm_head"}):
        cut = len(prefix) + 1
        retry = fit({k[cut:] if k.startswith(prefix + ".") else k: v for k, v in weights.items()})
        if set(retry) <= names:
            return retry
    return out


_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.(\w+)$")


def _stack_experts(weights: dict, names: set[str]) -> dict:
    """Per-expert tensors (`...experts.3.up_proj.weight`, the layout transformers writes for
    several mixture-of-experts families) stacked into the `...switch_mlp.up_proj.weight` the
    mlx-lm model holds, where its sanitize left them per expert. Only complete sets of experts
    whose stacked name the model has are stacked; anything else is left for the name check."""
    groups: dict[str, dict[int, str]] = {}
    for name in weights:
        match = _EXPERT.match(name)
        if match and name not in names:
            prefix, index, proj, kind = match.groups()
            target = f"{prefix}.switch_mlp.{proj}.{kind}"
            if target in names:
                groups.setdefault(target, {})[int(index)] = name
    if not groups:
        return weights
    weights = dict(weights)
    for target, members in groups.items():
        if target in weights or sorted(members) != list(range(len(members))):
            continue
        weights[target] = mx.stack([weights.pop(members[i]) for i in range(len(members))])
    return weights


def _names(model: nn.Module) -> set[str]:
    return {name for name, _ in tree_flatten(model.parameters())}


def _cast(model: nn.Module, dtype) -> None:
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path, value):
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))


def _pick_dtype(requested: str | None, config: dict) -> str:
    if requested is not None:
        if requested not in DTYPES:
            raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}, got {requested}")
        return requested
    declared = config.get("torch_dtype") or config.get("dtype")
    declared = (
        declared or text_config(config).get("torch_dtype") or text_config(config).get("dtype")
    )
    return declared if declared in DTYPES else "float16"


def _load_weights(tensors: dict) -> dict[str, mx.array]:
    weights = {}
    for path in sorted({file for file, _, _ in tensors.values()}):
        try:
            weights.update(mx.load(str(path)))
        except (RuntimeError, ValueError) as exc:
            raise ConversionError(f"{path.name}: cannot read ({exc})") from exc
    return weights


def _own_copies(mtp: MTPTensors, weights: dict[str, mx.array]) -> tuple[str, ...]:
    """Drop MTP copies of the target's embedding/head that are identical to the target's; keep
    (and return the names of) those that differ."""
    targets = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "shared_head.head.weight": "lm_head.weight",
    }
    own = set()
    for name, value in mtp.shared_copies.items():
        suffix = name.split(".", 2)[2]
        original = weights.get(targets[suffix])
        if original is None or not mx.array_equal(original, value).item():
            mtp.tensors[name] = value  # differs from the target (or the target ties it)
            own.add(suffix)
    return tuple(sorted(own))


def _copy_side_files(source: Path, out: Path) -> None:
    if not {"tokenizer.json", "tokenizer.model"} & set(copy_tokenizer_files(source, out)):
        _log("warning: no tokenizer files found in the checkpoint")


def _own_version() -> str:
    """mlx-spec's version, installed or run from a checkout."""
    try:
        return version("mlx-spec")
    except PackageNotFoundError:
        return VERSION


def _provenance(hf_path: str, revision, dtype: str, quant, mtp_dir: str | None) -> dict:
    return {
        "source": hf_path,
        "revision": revision,
        "dtype": dtype,
        "quantization": None
        if quant is None
        else {"bits": quant.bits, "group_size": quant.group_size},
        "mtp_drafter": mtp_dir,
        "converter": f"mlx-spec {_own_version()}",
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def convert_checkpoint(
    hf_path: str,
    mlx_path: str,
    *,
    dtype: str | None = None,
    quantization: Quantization | None = None,
    force: bool = False,
    revision: str | None = None,
    gguf_file: str | None = None,
) -> ConversionResult:
    """Convert a Hugging Face checkpoint (hub id or local directory), or a GGUF file (local, or
    `gguf_file` of hub repo `hf_path`), into an MLX directory.

    Args:
        hf_path: hub id (`org/name`), local checkpoint directory or local `.gguf` file.
        mlx_path: output directory; refused if it exists unless `force`.
        dtype: float16, bfloat16 or float32 (default: the checkpoint's).
        quantization: quantize linear weights (None: keep `dtype`).
        force: replace an existing output directory.
        revision: hub revision.
        gguf_file: the name of a GGUF file in hub repo (or local directory) `hf_path`.
    Returns:
        Paths of the target directory and of its MTP drafter directory (None if it has none).
    """
    dest = Path(mlx_path)
    if dest.exists() and not force:
        raise ConversionError(f"{dest}: already exists (use --force to replace it)")
    if gguf_file is not None or Path(os.path.expanduser(hf_path)).is_file():
        return _convert_gguf_file(hf_path, gguf_file, dest, dtype, quantization, force, revision)
    source, resolved_revision = resolve_source(hf_path, revision)
    original = _read_config(source)
    if is_medusa_config(original):
        return _convert_medusa(source, dest, original, dtype, force, hf_path, resolved_revision)
    if is_eagle3_config(original):
        return _convert_eagle3(source, dest, original, dtype, force, hf_path, resolved_revision)
    if is_dflash_config(original):
        return _convert_dflash(source, dest, original, dtype, force, hf_path, resolved_revision)
    config = normalize_config(original)
    _check_loadable(config)
    chosen = _pick_dtype(dtype, config)
    built = _build(source, config, getattr(mx, chosen), quantization)
    with atomic_directory(dest, force) as out:
        _log(f"writing {dest} ({chosen}{', quantized' if quantization else ''})")
        save_model(out, built.model, donate_model=True)
        save_config(_without_remote_code(built.config), config_path=out / "config.json")
        _copy_side_files(source, out)
        if built.mtp is not None:
            save_mtp_drafter(
                out / MTP_DIR, built.mtp_module, built.config, quantization=built.mtp_quantization
            )
        if built.medusa is not None:
            save_medusa_heads(built.medusa, out / MEDUSA_DIR)
            _log(f"Medusa heads: {built.medusa.num_heads} -> {MEDUSA_DIR}/")
        provenance = _provenance(
            hf_path,
            resolved_revision or revision,
            chosen,
            quantization,
            MTP_DIR if built.mtp else None,
        )
        provenance["source_config"] = original  # config.json as the checkpoint had it
        (out / PROVENANCE).write_text(json.dumps(provenance, indent=2))
    return ConversionResult(dest, dest / MTP_DIR if built.mtp else None)


def _convert_gguf_file(hf_path, gguf_file, dest, dtype, quantization, force, revision):
    """A GGUF file: local, or `gguf_file` in hub repo (or local directory) `hf_path`."""
    from convert.gguf import convert_gguf

    path, resolved = resolve_gguf(hf_path, gguf_file, revision)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    with atomic_directory(dest, force) as out:
        record = convert_gguf(path, out, dtype, quantization)
        stored = dtype or "as stored"
        provenance = _provenance(hf_path, resolved or revision, stored, quantization, None)
        provenance.update(record)
        (out / PROVENANCE).write_text(json.dumps(provenance, indent=2))
    _log(f"wrote {dest}")
    return ConversionResult(dest, None)


@dataclass
class _Built:
    model: nn.Module
    config: dict
    mtp: MTPTensors | None = None
    mtp_module: nn.Module | None = None
    mtp_quantization: dict | None = None
    own_copies: tuple[str, ...] = ()
    medusa: MedusaHeads | None = None


def _build(source: Path, config: dict, dtype, quantization: Quantization | None) -> _Built:
    """Read, check and build the target (and its MTP module), cast and maybe quantized."""
    tensors = list_tensors(source)
    shapes = {name: shape for name, (_, _, shape) in tensors.items()}
    mtp_names = split_mtp(config, shapes)
    num_mtp = check_mtp_shapes(config, shapes, mtp_names) if mtp_names else 0
    _log(f"{config['model_type']}: {len(tensors)} tensors, {num_mtp} MTP layer(s)")
    weights = _load_weights(tensors)
    built = _Built(model=None, config=config)
    medusa = {
        n[len(MEDUSA_PREFIX) :]: weights.pop(n)
        for n in list(weights)
        if n.startswith(MEDUSA_PREFIX)
    }
    if medusa:  # Medusa-2 checkpoints: the heads beside the base model's tensors
        built.medusa = _medusa_module(medusa, dtype)
    if num_mtp:
        built.mtp = extract_mtp(config, weights, mtp_names, num_mtp)
        built.own_copies = _own_copies(built.mtp, weights)
    built.model = build_target(config, weights)
    _cast(built.model, dtype)
    if built.mtp is not None:
        target_names = [n for n in shapes if n not in mtp_names]
        built.mtp_module = build_mtp_module(
            built.model, config, built.mtp, target_names, built.own_copies
        )
        _cast(built.mtp_module, dtype)
    if quantization is not None:
        _quantize(built, quantization)
    return built


def _quantize(built: _Built, quant: Quantization) -> None:
    predicate = getattr(built.model, "quant_predicate", None)
    built.model, built.config = quantize_model(
        built.model, built.config, quant.group_size, quant.bits
    )
    if built.mtp_module is not None:
        built.mtp_module, mtp_config = quantize_model(
            built.mtp_module, {}, quant.group_size, quant.bits, quant_predicate=predicate
        )
        built.mtp_quantization = mtp_config["quantization"]


def is_medusa_config(config: dict) -> bool:
    """Medusa heads alone (the original `medusa_num_heads` config with no base model type,
    or vLLM's `model_type: medusa`)."""
    if config.get("model_type") == "medusa":
        return True
    return "medusa_num_heads" in config and "model_type" not in config


def _medusa_module(tensors: dict, dtype) -> MedusaHeads:
    try:
        return medusa_heads(*medusa_params(tensors), dtype)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc


def _convert_medusa(source, dest, config, dtype, force, hf_path, revision) -> ConversionResult:
    """Medusa heads alone: written in the original layout (what `--medusa DIR` loads)."""
    chosen = _pick_dtype(dtype, config)
    try:
        module = load_medusa_heads(str(source), getattr(mx, chosen))
    except ValueError as exc:
        raise ConversionError(f"{source}: {exc}") from exc
    _log(f"Medusa heads: {module.num_heads} x {module.num_layers} block(s), hidden {module.hidden}")
    with atomic_directory(dest, force) as out:
        save_medusa_heads(module, out)
        provenance = _provenance(hf_path, revision, chosen, None, None)
        provenance["source_config"] = config
        (out / PROVENANCE).write_text(json.dumps(provenance, indent=2))
    return ConversionResult(dest, None)


def _convert_eagle3(source, dest, config, dtype, force, hf_path, revision) -> ConversionResult:
    """An EAGLE-3 head alone (either published layout): renamed to one layout and cast; the
    checks against a target happen when it is loaded for one."""

    def summary(cfg) -> str:
        vocab = f"draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size}"
        return (
            f"EAGLE-3 head: hidden {cfg.hidden_size}, target layers {list(cfg.layer_ids)}, {vocab}"
        )

    reader = (read_eagle3_config, read_eagle3, lambda w, cfg: eagle3_weights(w, cfg.layout))
    return _convert_drafter(
        source, dest, config, dtype, force, hf_path, revision, reader, save_eagle3, summary
    )


def _convert_dflash(source, dest, config, dtype, force, hf_path, revision) -> ConversionResult:
    """A DFlash drafter alone (z-lab's layout or speculators'): renamed and cast; its fit to
    a target is checked when it is loaded for one."""

    def summary(cfg) -> str:
        return (
            f"DFlash drafter: {cfg.num_layers} layer(s), hidden {cfg.hidden_size}, target "
            f"layers {list(cfg.target_layer_ids)}, block {cfg.block_size}"
        )

    reader = (read_dflash_config, read_dflash, lambda w, cfg: dflash_weights(w))
    return _convert_drafter(
        source, dest, config, dtype, force, hf_path, revision, reader, save_dflash, summary
    )


def _convert_drafter(
    source, dest, config, dtype, force, hf_path, revision, reader, save, summary
) -> ConversionResult:
    """A drafter that ships as a repository of its own: its config read, its tensors renamed
    (refusing what cannot be used) and cast, written atomically with its provenance."""
    read_config, read_tensors, rename = reader
    chosen = _pick_dtype(dtype, {**config, **(config.get("transformer_layer_config") or {})})
    try:
        cfg = read_config(config)
        _, weights = read_tensors(source)
        rename(weights, cfg)
    except (ValueError, KeyError) as exc:
        raise ConversionError(f"{source}: {exc}") from exc
    _log(summary(cfg))
    with atomic_directory(dest, force) as out:
        save(out, cfg, weights, getattr(mx, chosen))
        provenance = _provenance(hf_path, revision, chosen, None, None)
        provenance["source_config"] = config
        (out / PROVENANCE).write_text(json.dumps(provenance, indent=2))
    return ConversionResult(dest, None)


def _without_remote_code(config: dict) -> dict:
    """The config minus pointers to custom code: the output runs on mlx-lm's own classes."""
    return {k: v for k, v in config.items() if k not in ("auto_map", "model_file")}


def _read_config(source: Path) -> dict:
    try:
        return json.loads((source / "config.json").read_text())
    except FileNotFoundError as exc:
        raise ConversionError(f"{source}: no config.json") from exc
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{source}/config.json: invalid JSON ({exc})") from exc
