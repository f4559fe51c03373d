"""The grammar compiler's zygote: a process that imports xgrammar and reads the
tokenizer's description once, then forks a compile child (grammar_child.py)
whenever the engine core asks, so that a new child is ready at once.

Why not multiprocessing: its start methods either fork the engine core, whose
gRPC threads make fork unsafe, or import the caller's __main__ again in every
child (a script without a `__name__ == "__main__"` guard would run twice).

The engine core holds one end of a Unix socket; the zygote exits when it
closes (or the engine core dies), and its children are killed with it.
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from services.common.launcher_link import die_with_parent

_PID = struct.Struct("<q")


class Zygote:
    """The engine core's handle on its zygote."""

    def __init__(self, max_threads: int):
        """Starts the process, which imports xgrammar meanwhile."""
        self._ctrl, theirs = socket.socketpair()
        self._lock = threading.Lock()
        # It imports this package from where this process does, installed or not.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), str(max_threads)],
            stdin=subprocess.PIPE, pass_fds=[theirs.fileno()],
            env={**os.environ, "PYTHONPATH": path})
        theirs.close()

    def hand_over(self, tokenizer_info_json: str, start_timeout_s: float) -> None:
        """Gives it the tokenizer's description and waits until it is ready."""
        try:
            with self.process.stdin:
                self.process.stdin.write(tokenizer_info_json.encode())
            self._ctrl.settimeout(start_timeout_s)
            ready = self._ctrl.recv(1) == b"R"
            self._ctrl.settimeout(None)
        except OSError:  # it exited (a broken pipe), or took too long
            ready = False
        if not ready:
            self.close()
            raise OSError(f"the grammar compiler's zygote did not start (exit code "
                          f"{self.process.poll()})")

    def fork(self) -> tuple[int, Connection]:
        """A new child: its pid, and a connection to it."""
        mine, theirs = socket.socketpair()
        try:
            with self._lock:
                socket.send_fds(self._ctrl, [b"F"], [theirs.fileno()])
                pid = _PID.unpack(_recv_exactly(self._ctrl, _PID.size))[0]
        finally:
            theirs.close()
        return pid, Connection(mine.detach())

    def close(self) -> None:
        self._ctrl.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("the grammar compiler's zygote exited")
        data += chunk
    return data


def main(ctrl_fd: int, max_threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine core's to handle
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    import xgrammar

    from services.engine_core.grammar_child import serve_compiles

    tokenizer_info_json = sys.stdin.read()
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    ctrl = socket.socket(fileno=ctrl_fd)
    ctrl.sendall(b"R")
    while True:
        message, fds, _, _ = socket.recv_fds(ctrl, 1, 1)
        if not message:  # the engine core is gone: the children die with this process
            return
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            ctrl.close()
            if not die_with_parent(zygote_pid, signal.SIGKILL):
                os._exit(1)
            serve_compiles(Connection(fds[0]), info, max_threads)
            os._exit(0)
        os.close(fds[0])
        ctrl.sendall(_PID.pack(pid))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
