"""Read and cross-check safetensors shards before any tensor is loaded.

Each file's header is parsed by hand (8-byte length, JSON table) so that a truncated shard, a
shard missing from the index, or an index that disagrees with the shards is refused with the
file named, instead of failing deep inside a loader.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from convert.errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of one safetensors file, after checking its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConversionError(f"{path.name}: truncated safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise ConversionError(f"{path.name}: truncated safetensors file (header cut short)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{path.name}: corrupt safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    data_end, table = 0, {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        expected = math.prod(shape) * _DTYPE_BYTES.get(info["dtype"], 0)
        if _DTYPE_BYTES.get(info["dtype"]) and end - begin != expected:
            raise ConversionError(
                f"{path.name}: tensor {name} has {end - begin} bytes, "
                f"its shape {list(shape)} needs {expected}"
            )
        data_end = max(data_end, end)
        table[name] = (info["dtype"], shape)
    if 8 + header_len + data_end > size:
        raise ConversionError(
            f"{path.name}: truncated safetensors file ({size} bytes, header says "
            f"{8 + header_len + data_end})"
        )
    return table


def _shards_from_index(root: Path) -> tuple[list[Path], dict[str, str]]:
    try:
        weight_map = json.loads((root / INDEX_NAME).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConversionError(f"{INDEX_NAME}: unreadable index ({exc})") from exc
    files = sorted(set(weight_map.values()))
    for name in files:
        if not (root / name).is_file():
            raise ConversionError(f"{name}: shard named in {INDEX_NAME} is missing")
    return [root / name for name in files], weight_map


def _refuse_pickles(root: Path) -> None:
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ConversionError(
            f"{root}: only pickled weights ({', '.join(pickles[:3])}); pickle can run arbitrary "
            "code, so mlx-spec never loads it. Convert the checkpoint to safetensors first."
        )
    raise ConversionError(f"{root}: no safetensors weights found")


def list_tensors(root: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Every tensor of the checkpoint: {name: (file, dtype, shape)}, index checked both ways."""
    if (root / INDEX_NAME).is_file():
        files, weight_map = _shards_from_index(root)
    else:
        files = sorted(root.glob("model*.safetensors")) or sorted(
            p for p in root.glob("*.safetensors") if not p.name.startswith("consolidated")
        )
        weight_map = None
    if not files:
        _refuse_pickles(root)
    tensors: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for path in files:
        for name, (dtype, shape) in read_header(path).items():
            if name in tensors:
                raise ConversionError(f"{path.name}: tensor {name} also in {tensors[name][0].name}")
            if weight_map is not None and weight_map.get(name) != path.name:
                raise ConversionError(
                    f"{path.name}: contains tensor {name} that {INDEX_NAME} does not list there"
                )
            tensors[name] = (path, dtype, shape)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise ConversionError(
                    f"{file}: {INDEX_NAME} lists tensor {name} but the shard does not contain it"
                )
    return tensors
