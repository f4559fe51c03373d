"""A service started by llmserve's launcher dies with the launcher."""
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
    if not launcher_pid:
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher_pid):  # it died before the prctl took effect
        sys.exit(f"the launcher (pid {launcher_pid}) exited before this service started")
