"""Make MLX's Linux CPU backend use an optimized BLAS.

The Linux `mlx-cpu` wheel links a single-threaded reference BLAS. `libmlx.so` resolves
`cblas_sgemm` through the global symbol scope first, so an optimized BLAS opened with
RTLD_GLOBAL *before* the first `import mlx.core` takes over every float32 matmul (~90x faster).
This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

DISABLE_ENV = "MLX_SPEC_NO_BLAS"  # set to 1 to keep MLX's bundled BLAS
PATH_ENV = "MLX_SPEC_BLAS"  # path of a BLAS library to load instead of the default search

# Shared libraries that export unprefixed `cblas_sgemm` (numpy's bundled OpenBLAS does not).
_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "libopenblas.so",
    "libmkl_rt.so.2",
    "libmkl_rt.so",
)

_state: dict = {"attempted": False, "loaded": None, "error": None, "late": False, "warned": False}


def _try_load(name: str) -> str | None:
    try:
        lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    if not hasattr(lib, "cblas_sgemm"):
        return None
    return name


def preload() -> str | None:
    """Load an optimized BLAS with RTLD_GLOBAL (Linux only, once). Returns its name or None."""
    if _state["attempted"]:
        return _state["loaded"]
    _state["attempted"] = True
    if not sys.platform.startswith("linux") or os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    _state["late"] = "mlx.core" in sys.modules
    override = os.environ.get(PATH_ENV)
    names = (override,) if override else _CANDIDATES
    for name in names:
        if _try_load(name):
            _state["loaded"] = name
            return name
    if override:
        _state["error"] = f"{PATH_ENV}={override} could not be loaded or has no cblas_sgemm"
    return None


def provider_of(symbol: bytes) -> str | None:
    """Path of the library that the global scope resolves `symbol` to, or None."""

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(getattr(libc, symbol.decode()), ctypes.c_void_p).value
        info = _DlInfo()
        if libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        return None
    return None


def _openblas_version() -> str:
    try:
        get_config = ctypes.CDLL(None).openblas_get_config
        get_config.restype = ctypes.c_char_p
        return get_config().decode().split()[1]
    except (AttributeError, OSError, IndexError):
        return ""


def describe() -> str:
    """One line naming the BLAS that MLX's CPU matmuls use."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if not sys.platform.startswith("linux"):
        return "platform default"
    provider = provider_of(b"cblas_sgemm")
    if _state["late"]:
        return "reference BLAS bundled with mlx-cpu, slow (mlx was imported before mlx_spec)"
    if provider is None:
        why = " (disabled by " + DISABLE_ENV + ")" if os.environ.get(DISABLE_ENV) else ""
        return "reference BLAS bundled with mlx-cpu, slow" + why
    if "openblas" in os.path.basename(provider).lower():
        version = _openblas_version()
        return f"OpenBLAS {version} ({provider})".replace("  ", " ")
    return provider


def uses_reference_blas() -> bool:
    """True when MLX resolved its BLAS before an optimized one could be loaded, or none exists."""
    if not sys.platform.startswith("linux"):
        return False
    return _state["late"] or provider_of(b"cblas_sgemm") is None


def warn_if_slow(stream=None) -> None:
    """Warn once, on stderr, when MLX's CPU matmuls will use the reference BLAS."""
    if _state["warned"] or not uses_reference_blas():
        return
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return
    _state["warned"] = True
    hint = (
        "install an optimized BLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread)"
        if not os.environ.get(DISABLE_ENV)
        else f"unset {DISABLE_ENV} to let mlx-spec load an optimized BLAS"
    )
    if _state["error"]:
        hint = _state["error"]
    if _state["late"]:
        hint += "; import mlx_spec before mlx so the BLAS is loaded first"
    print(
        f"mlx-spec: warning: MLX is using its reference BLAS (very slow on CPU): {hint}",
        file=stream or sys.stderr,
    )
