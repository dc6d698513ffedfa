"""Write the trained embedded pair in Hugging Face layout (float16) into the package.

The target becomes a MiMo checkpoint whose MTP layer sits under `model.mtp_layers.0.*`, exactly
where MiMo ships it, so `mlx-spec convert` extracts it like a real one. The draft model keeps
its llama layout. Both carry the byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx_spec  # noqa: F401  (optimized BLAS before mlx)

import mlx.core as mx


def _load(folder: Path) -> dict[str, mx.array]:
    weights = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    return weights


def _half(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k: v.astype(mx.float16) for k, v in weights.items()}


def _tokenizer(source: Path, dest: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, dest / name)


def _base_target(work: Path, shipped: Path) -> tuple[dict, dict[str, mx.array]]:
    """(config, weights) of the trained target without MTP tensors: `target-hf` from the
    target stage, else the target shipped in the package (when only the drafters were
    retrained)."""
    if (work / "target-hf" / "config.json").is_file():
        config = json.loads((work / "target-hf" / "config.json").read_text())
        return config, _load(work / "target-hf")
    config = json.loads((shipped / "config.json").read_text())
    weights = _load(shipped)
    return config, {k: v for k, v in weights.items() if not k.startswith("model.mtp_layers.")}


def export_target(work: Path, dest: Path, shipped: Path) -> None:
    """The trained target + mtp-mlx (MiMo MTP module) -> a MiMo checkpoint."""
    config, weights = _base_target(work, shipped)
    config.update(
        model_type="mimo",
        architectures=["MiMoForCausalLM"],
        num_nextn_predict_layers=1,
        torch_dtype="float16",
    )
    config.pop("dtype", None)
    mtp = _load(work / "mtp-mlx")
    for name, value in mtp.items():
        if not name.startswith("layers.0."):
            raise ValueError(f"unexpected MTP tensor {name}")
        weights["model.mtp_layers.0." + name[len("layers.0.") :]] = value
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), _half(weights), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(shipped, dest)


def export_draft(work: Path, dest: Path, shipped: Path) -> None:
    """draft-mlx (mlx-lm llama, names equal to Hugging Face's) -> a llama checkpoint."""
    config = json.loads((work / "draft-mlx" / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float16")
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(dest / "model.safetensors"), _half(_load(work / "draft-mlx")), metadata={"format": "pt"}
    )
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(shipped, dest)


def training_record(work: Path, previous: dict) -> dict:
    """How the pair was trained: the target's loss log and both distillation reports (each
    drafter's earlier rounds kept under `earlier` when it was trained further)."""
    if (work / "target-train.pt").is_file():
        import torch

        state = torch.load(work / "target-train.pt", weights_only=False)["state"]
        record = {"target": {"framework": "pytorch", "steps": state["step"], "log": state["log"]}}
    else:
        record = {"target": previous["target"]}
    for name in ("draft", "mtp"):
        report = json.loads((work / f"{name}-mlx" / "distill.json").read_text())
        keys = ("kind", "steps", "config", "seconds", "before", "after", "target_tokens", "init")
        record[name] = {k: report[k] for k in keys if k in report}
        if report.get("init"):  # a directory of this machine: say what it was instead
            record[name]["init"] = "the drafter shipped before (trained further)"
        old = dict(previous.get(name, {}))
        if report.get("init") and old.get("after") != report["after"]:  # not this run again
            record[name]["earlier"] = [*old.pop("earlier", []), old]
        elif "earlier" in old:
            record[name]["earlier"] = old["earlier"]
    return record


def export(work: Path, out: Path) -> None:
    record = out / "training.json"
    previous = json.loads(record.read_text()) if record.is_file() else {}
    staged = out / ".staged"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for name, writer in (("target", export_target), ("draft", export_draft)):
        writer(work, staged / name, out / "target")
    for name in ("target", "draft"):
        shutil.rmtree(out / name, ignore_errors=True)
        (staged / name).rename(out / name)
        size = sum(p.stat().st_size for p in (out / name).iterdir()) / 1e6
        print(f"wrote {out / name} ({size:.1f} MB)")
    staged.rmdir()
    record.write_text(json.dumps(training_record(work, previous), indent=1))
