"""The embedded demo pair: a target trained on Python sources with its draft model and MTP head,
shipped in Hugging Face layout and converted by `mlx-spec convert` on first use."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from mlx_spec.core.paths import cache_root

PAIR_DIR = Path(__file__).parent / "demo_pair"
# Standard-library files held out of training, for evaluation (present in CPython 3.10-3.13).
HELDOUT = (
    "argparse.py",
    "textwrap.py",
    "csv.py",
    "string.py",
    "json/decoder.py",
    "difflib.py",
    "shlex.py",
    "fractions.py",
    "calendar.py",
    "heapq.py",
)
_SKIP_DIRS = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo")


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the running interpreter's standard library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not any(part in _SKIP_DIRS for part in p.relative_to(root).parts[:-1])
    )
    heldout = [root / name for name in HELDOUT]
    return [p for p in files if p not in heldout], heldout


def available(pair_dir: Path = PAIR_DIR) -> bool:
    return (pair_dir / "target" / "config.json").is_file()


def _fingerprint(folder: Path) -> str:
    """A digest of every file's name and bytes: retrained weights of the same shapes (same
    sizes) get a conversion of their own."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def converted_pair(pair_dir: Path = PAIR_DIR) -> tuple[Path, Path]:
    """(target dir, draft dir) in MLX format, converting the shipped checkpoints once; the
    shipped EAGLE-3 head and DFlash drafter (if any) go into the target's `eagle3/` and
    `dflash/`."""
    from convert import convert_checkpoint

    if not available(pair_dir):
        raise FileNotFoundError(
            "no --model given and the embedded demo pair is not installed; pass --model PATH"
        )
    out = []
    for name in ("target", "draft"):
        source = pair_dir / name
        dest = cache_root() / f"embedded-{name}-{_fingerprint(source)}"
        if not (dest / "config.json").is_file():
            convert_checkpoint(str(source), str(dest), force=dest.exists())
        out.append(dest)
    for name in ("eagle3", "dflash"):  # drafters shipped beside the target
        source = pair_dir / name
        if not (source / "config.json").is_file():
            continue
        dest, mark = out[0] / name, f"{_fingerprint(source)}\n"
        stamp = dest / "SOURCE_FINGERPRINT"
        if not stamp.is_file() or stamp.read_text() != mark:
            convert_checkpoint(str(source), str(dest), force=dest.exists())
            stamp.write_text(mark)
    return out[0], out[1]
