"""A service started by llmserve's launcher dies with the launcher; any child can
ask to die with its parent."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID_ENV = "LLMSERVE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """If the launcher started this process, the kernel sends it SIGTERM when the
    launcher dies, even by SIGKILL, so no service outlives it.

    Set here, after exec, and not in a Popen preexec_fn: a preexec_fn makes CPython
    start the child with fork() instead of vfork(), fork() runs gRPC's fork handlers,
    and they can abort the child before it execs (grpc/grpc#43055; a frontend start
    in CI died of SIGABRT that way)."""
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    if launcher_pid and not die_with_parent(int(launcher_pid), signal.SIGTERM):
        sys.exit(f"the launcher (pid {launcher_pid}) exited before this service started")


def die_with_parent(parent_pid: int, sig: int) -> bool:
    """Asks the kernel for `sig` when the parent (parent_pid) dies; False when it
    died already, before the request took effect."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    return os.getppid() == parent_pid
