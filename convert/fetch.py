"""Find a checkpoint: a local directory as is, or a hub repo fetched with huggingface_hub."""

from __future__ import annotations

import os
from pathlib import Path

from convert.errors import ConversionError

# Weights, configs and tokenizer files only: never pickles, never remote code.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]


def resolve_source(hf_path: str, revision: str | None = None) -> tuple[Path, str | None]:
    """Local directory of the checkpoint and the hub revision it came from (None if local).

    Hub downloads show huggingface_hub's progress bars; HF_HUB_OFFLINE=1 uses the local cache
    only.
    """
    local = Path(os.path.expanduser(hf_path))
    if local.exists():
        if not local.is_dir():
            raise ConversionError(f"{hf_path}: not a directory")
        return local, None
    if hf_path.startswith((".", "/", "~")) or hf_path.count("/") != 1:
        raise ConversionError(f"{hf_path}: no such directory, and not a hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(hf_path, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # network, auth, offline-cache misses: name the repo either way
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise ConversionError(f"{hf_path}: cannot fetch from the hub{hint}: {exc}") from exc
    return path, path.name  # snapshots/<commit>


def resolve_gguf(
    hf_path: str, gguf_file: str | None, revision: str | None = None
) -> tuple[Path, str | None]:
    """The local path of a GGUF file (`hf_path` itself, or `gguf_file` inside local directory or
    hub repo `hf_path`) and the hub revision it came from (None if local)."""
    local = Path(os.path.expanduser(hf_path))
    if gguf_file is None:
        return local, None
    if local.is_dir():
        path = local / gguf_file
        if not path.is_file():
            raise ConversionError(f"{path}: no such file")
        return path, None
    if hf_path.startswith((".", "/", "~")) or hf_path.count("/") != 1:
        raise ConversionError(f"{hf_path}: no such directory, and not a hub id (org/name)")
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(hf_path, gguf_file, revision=revision))
    except Exception as exc:  # network, auth, offline-cache misses: name the file either way
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise ConversionError(
            f"{hf_path}/{gguf_file}: cannot fetch from the hub{hint}: {exc}"
        ) from exc
    return path, path.parent.name  # snapshots/<commit>/<file>
