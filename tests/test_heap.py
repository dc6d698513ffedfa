"""malloc keeping freed memory for the next pass (`mlx_spec.platform.heap`, Linux with glibc)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)"
)

# A 16 MiB buffer written then freed: how much the process's resident memory drops.
PROBE = """
import ctypes, os
import mlx_spec
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
size = 16 << 20
buffer = libc.malloc(size)
ctypes.memset(buffer, 1, size)
before = resident()
libc.free(buffer)
print(mlx_spec.platform.heap._state["installed"], before - resident())
"""


def _probe(env: dict) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    installed, dropped = out.stdout.split()
    return installed == "True", int(dropped)


def test_freed_buffers_stay_with_the_process_for_the_next_pass():
    """With the settings a freed 16 MiB buffer stays in malloc's heap (the next pass's
    buffers reuse it without faulting pages in); with malloc's own settings (`MLX_SPEC_HEAP=0`)
    it went back to the system."""
    installed, dropped = _probe({"MLX_SPEC_HEAP": "1"})
    if not installed:
        pytest.skip("no glibc mallopt here")
    assert dropped < 1 << 20, dropped
    installed, dropped = _probe({"MLX_SPEC_HEAP": "0"})
    assert not installed and dropped > 8 << 20, dropped
