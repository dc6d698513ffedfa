"""What an "auto" policy learned, kept between processes: one small file per target, drafter,
sampling settings and machine."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

from mlx_spec.core.paths import SOURCE_ATTR, cache_root
from mlx_spec.decoding.policy import AdaptiveDraftLength
from mlx_spec.drafters.base import Drafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.platform import blas as _blas

import mlx.core as mx

MEMORY_ENV = "MLX_SPEC_POLICY_MEMORY"  # 0: nothing learned is kept across processes


class PolicyFile:
    """Where an "auto" policy's learning is kept between processes: one small JSON file per
    target, drafter, sampling settings and machine (`key`), so a short reply in a new process
    does not pay again for what earlier runs measured (acceptance, costs, that plain decoding
    wins here)."""

    def __init__(self, folder, key: object):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
        self.path = Path(folder) / f"{digest.hexdigest()[:24]}.json"

    def load(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or written by an interrupted process
            return None

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(state, out)
        os.replace(tmp, self.path)


def remembered(max_draft: int, model, drafter: Drafter, sampling) -> AdaptiveDraftLength:
    """A new "auto" policy, taking up what earlier processes learned with the same target,
    drafter, sampling settings and machine (`PolicyFile`), and keeping its own there."""
    policy = AdaptiveDraftLength(max_draft, len(drafter.arm_names))
    kept = policy_file(model, drafter, sampling, max_draft)
    if kept is not None:
        state = kept.load()
        if state is not None:
            policy.restore(state)
        object.__setattr__(policy, "kept", kept)
    return policy


def policy_file(model, drafter: Drafter, sampling, max_draft: int) -> PolicyFile | None:
    """Where the policy of this target, drafter and settings is kept on this machine; None when
    it is not kept (`MLX_SPEC_POLICY_MEMORY=0`, a target or drafter not loaded from a folder)."""
    if os.environ.get(MEMORY_ENV, "1").strip() == "0":
        return None
    source = getattr(model, SOURCE_ATTR, None)
    arms = lasting_identity(drafter)
    if source is None or arms is None:
        return None
    key = {
        "machine": machine_key(),
        "target": _stamped(source),
        "drafter": arms,
        "sampling": dataclasses.asdict(sampling),
        "max_draft": max_draft,
    }
    return PolicyFile(cache_root() / "policies", key)


def lasting_identity(drafter: Drafter):
    """What names `drafter` across processes (its kind and the folder it was loaded from; a
    group: its members'); None when something of it was not loaded from a folder."""
    members = getattr(drafter, "drafters", None)
    if members is not None:
        parts = [lasting_identity(d) for d in members]
        return None if any(p is None for p in parts) else parts
    if isinstance(drafter, NgramDrafter):
        return list(drafter.identity)
    source = getattr(drafter, "source", None)
    return None if source is None else [drafter.name, _stamped(source)]


def _stamped(source) -> list:
    """A folder and its weight files' sizes and times: what was learned with weights since
    replaced (a drafter trained again into the same folder) is not taken up."""
    folder = Path(source).resolve()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return [str(folder), [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]]


def machine_key() -> dict:
    """The machine and how MLX computes on it (what the measured costs depend on)."""
    import platform

    return {
        "node": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "device": str(mx.default_device()),
        "blas": _blas.describe(),
    }
