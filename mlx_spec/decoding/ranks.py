"""The process of a launched rank (`mlx.launch`): rank 0 alone prints, a rank stopped by a
signal or left alone by a lost peer ends with one line instead of hanging, and a finished rank
leaves without tearing down the group."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import traceback

import mlx.core as mx


def quiet_other_ranks(group: mx.distributed.Group | None) -> None:
    """Rank 0 prints; the other ranks print nothing: their output, summaries and warnings go
    nowhere, their errors (written to `sys.__stderr__`, and uncaught ones) still show."""
    if group is None or group.rank() == 0:
        return
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

    def show(kind, value, tb):
        traceback.print_exception(kind, value, tb, file=sys.__stderr__)

    sys.excepthook = show


def stop_on_signal() -> None:
    """A rank the launcher stops (another rank failed) says so in one line and exits."""

    def handler(signum, _frame):
        rank = os.environ.get("MLX_RANK", "?")
        line = (
            f"mlx-spec: rank {rank}: stopped ({signal.Signals(signum).name}): another rank of "
            "this distributed run failed or was interrupted\n"
        )
        os.write(_TERMINAL[0], line.encode())
        os._exit(1)

    signal.signal(signal.SIGTERM, handler)


_BACKEND_NOISE = (b"[ring]", b"[jaccl]", b"[mpi]")
_TERMINAL = [2]  # the file descriptor of the real standard error


def watch_for_lost_ranks(rank: int, grace: float = 3.0) -> None:
    """Bound the time a rank can hang once the group is broken.

    When a peer dies, MLX's backends print their socket errors and fail the collective under
    way, but a pass queued behind it can wait forever. Standard error (file descriptor 2) is
    passed through a pipe that drops those lines; after the first of them the process has
    `grace` seconds to stop on its own (the failed collective's RuntimeError, reported in one
    line), else it says so in one line and exits.
    """
    real = _TERMINAL[0] = os.dup(2)
    read_end, write_end = os.pipe()
    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)
    message = (
        f"mlx-spec: error: rank {rank}: a rank of the distributed run was lost (its "
        "connection closed); stopping\n"
    ).encode()

    def give_up() -> None:
        os.write(real, message)
        os._exit(1)

    def pump() -> None:
        timer, pending = None, b""
        with os.fdopen(read_end, "rb", buffering=0) as source:
            while chunk := source.read(4096):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.startswith(_BACKEND_NOISE):
                        if timer is None:
                            timer = threading.Timer(grace, give_up)
                            timer.daemon = True
                            timer.start()
                        continue
                    os.write(real, line + b"\n")
        if pending:
            os.write(real, pending)

    thread = threading.Thread(target=pump, name="mlx-spec-stderr", daemon=True)
    thread.start()

    def restore() -> None:  # at exit: everything written reaches the terminal
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the pump drains and ends
        thread.join(timeout=2.0)

    atexit.register(restore)


def abort(message: str, delay: float = 0.0) -> None:
    """End this process after `delay` seconds (from a thread that cannot raise to the
    command: the server's engine), with one line on the terminal."""
    rank = os.environ.get("MLX_RANK", "?")
    line = f"mlx-spec: error: rank {rank}: {message}\n".encode()

    def end() -> None:
        os.write(_TERMINAL[0], line)
        os._exit(1)

    if delay <= 0:
        end()
    timer = threading.Timer(delay, end)
    timer.daemon = True
    timer.start()


def leave(code: int) -> None:
    """End a launched rank's process with `code` once its command is done: Python's exit
    handlers run and the output is flushed, but not the C++ teardown of the group, whose
    backend threads can abort the process (SIGABRT) when the other ranks close their
    connections at the same moment (seen once in about twenty 2-rank server stops)."""
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def lost_peer(exc: BaseException) -> bool:
    """Whether an exception from MLX means a rank of the group is gone."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "[ring]" in text or "[jaccl]" in text or "[mpi]" in text or "peer" in text
    )
