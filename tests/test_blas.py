"""The optimized-BLAS preload on Linux: what is reported, the warning, and unchanged numerics.

Each check runs in a fresh interpreter, because the BLAS is chosen once, at the first import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
needs_openblas = pytest.mark.skipif(not OPENBLAS.exists(), reason=f"{OPENBLAS} not installed")

# Prints the BLAS description, warns if slow, and saves a float32 matmul to argv[1].
PROBE = """
import sys
if sys.argv[2] == "late":
    import mlx.core  # before mlx_spec: too late to swap the BLAS in
import mlx_spec
from mlx_spec.platform import blas as _blas
import mlx.core as mx
import numpy as np

rng = np.random.default_rng(0)
a = rng.standard_normal((64, 300)).astype(np.float32)
b = rng.standard_normal((300, 48)).astype(np.float32)
np.save(sys.argv[1], np.array(mx.array(a) @ mx.array(b)))
print(_blas.describe())
_blas.warn_if_slow()
"""


def clean_env(**extra: str) -> dict:
    """The current environment without mlx-spec's BLAS variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_SPEC_NO_BLAS", "MLX_SPEC_BLAS")}
    return {**env, **extra}


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=clean_env(**env)
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def probe(out: Path, mode: str = "early", **env: str) -> tuple[str, str, np.ndarray]:
    """(describe() line, stderr, matmul result) from a fresh interpreter; `mode` 'late'
    imports mlx before mlx_spec; the result is saved to `out`."""
    proc = run(["-c", PROBE, str(out), mode], **env)
    return proc.stdout.strip(), proc.stderr, np.load(out)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """{'default', 'reference', 'late'}: probe results with the optimized BLAS, with
    MLX_SPEC_NO_BLAS=1, and with mlx imported before mlx_spec."""
    root = tmp_path_factory.mktemp("blas")
    return {
        "default": probe(root / "default.npy"),
        "reference": probe(root / "reference.npy", MLX_SPEC_NO_BLAS="1"),
        "late": probe(root / "late.npy", "late"),
    }


def expected_matmul() -> np.ndarray:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.standard_normal((300, 48)).astype(np.float32)
    return a.astype(np.float64) @ b.astype(np.float64)


@needs_openblas
def test_default_reports_openblas(probes):
    """With the system OpenBLAS installed, `import mlx_spec` makes MLX use it, and says so."""
    described, stderr, _ = probes["default"]
    assert described.startswith("OpenBLAS"), described
    assert "reference BLAS" not in stderr


def test_no_blas_env_reports_reference(probes):
    """MLX_SPEC_NO_BLAS=1 keeps MLX's bundled reference BLAS and describe() says so."""
    described, _, _ = probes["reference"]
    assert "reference BLAS" in described, described
    assert "MLX_SPEC_NO_BLAS" in described


def test_info_warns_once_about_reference_blas():
    """`info` under MLX_SPEC_NO_BLAS=1 prints exactly one stderr warning about the reference
    BLAS, and its blas row names it."""
    proc = run(["-m", "mlx_spec.cli", "info"], MLX_SPEC_NO_BLAS="1")
    warnings = [line for line in proc.stderr.splitlines() if "reference BLAS" in line]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("mlx-spec: warning:")
    blas_rows = [line for line in proc.stdout.splitlines() if line.startswith("blas")]
    assert len(blas_rows) == 1 and "reference BLAS" in blas_rows[0], proc.stdout


@needs_openblas
def test_info_does_not_warn_with_openblas():
    """`info` with the optimized BLAS loaded prints no BLAS warning."""
    proc = run(["-m", "mlx_spec.cli", "info"])
    assert "reference BLAS" not in proc.stderr + proc.stdout, proc.stderr


def test_matmul_same_with_and_without_optimized_blas(probes):
    """A float32 matmul gives the same numbers (to float32 rounding) under either BLAS, and
    both match a float64 reference."""
    default, reference = probes["default"][2], probes["reference"][2]
    np.testing.assert_allclose(default, reference, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(default, expected_matmul(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(reference, expected_matmul(), rtol=1e-4, atol=1e-4)


@needs_openblas
def test_late_import_reports_the_blas_actually_used(probes):
    """When mlx is imported before mlx_spec, describe() and the warning tell the truth about
    which BLAS computed the matmul (told apart by bitwise-different float32 results)."""
    default, reference = probes["default"][2], probes["reference"][2]
    if np.array_equal(default, reference):
        pytest.skip("OpenBLAS and the reference BLAS give bitwise-equal results here")
    described, stderr, late = probes["late"]
    if np.array_equal(late, reference):
        assert "reference BLAS" in described + stderr, (described, stderr)
        assert "import mlx_spec before mlx" in stderr, stderr
    else:
        assert np.array_equal(late, default)
        assert described.startswith("OpenBLAS"), described
