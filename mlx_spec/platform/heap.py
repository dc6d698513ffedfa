"""Keeping freed memory for the next pass on Linux, where MLX allocates with glibc's malloc.

A pass over a prompt chunk of a length the process has not met needs buffers of sizes it has
not held yet. glibc's malloc serves a buffer over its mmap threshold (128 KiB at first,
rising up to 32 MiB as such buffers are freed) from a fresh mapping, and hands heap memory
above 128 KiB back to the system when it is freed: each such pass faults its pages in again.
That is every turn of a conversation (its new tokens over a longer cached prefix) and every
new request's prefill.

`install()` (when `mlx_spec` is imported, on Linux with glibc, unless `MLX_SPEC_HEAP=0`)
has malloc serve buffers up to 32 MiB from its heap (`M_MMAP_THRESHOLD`) and keep up to
`TRIM` bytes of freed heap memory for the next ones (`M_TRIM_THRESHOLD`), growing the heap
`PAD` bytes at a time (`M_TOP_PAD`). The memory kept is what the passes freed: a process
holds at most `TRIM` more than it uses. On macOS (Metal, unified memory) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from mlx_spec.platform.fastmath import env_allows

ENV = "MLX_SPEC_HEAP"  # 0: malloc's own settings
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP = 32 << 20  # glibc's largest mmap threshold on 64-bit
TRIM = 1 << 30
PAD = 64 << 20

_state = {"installed": False}


def install() -> bool:
    """Set glibc's malloc to keep freed memory (see the module); whether it did."""
    if _state["installed"]:
        return True
    if not sys.platform.startswith("linux") or not env_allows(ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [
        mallopt(M_MMAP_THRESHOLD, MMAP),
        mallopt(M_TRIM_THRESHOLD, TRIM),
        mallopt(M_TOP_PAD, PAD),
    ]
    _state["installed"] = all(done)
    return _state["installed"]
