"""`llmserve serve` as a user runs it: prints the address, serves, and stops
all three processes on SIGTERM (or when killed) with no orphan left."""
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from llmserve.client import Client
from llmserve.launcher import free_port

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: only its parent's wait() is missing.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _start_serve(model_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "serve", "--port", "0", "--model", model_dir,
         "--dtype", "float32", "--kv-cache-gib", "0.1", "--http-port", str(free_port("127.0.0.1"))],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 180
    for line in process.stdout:
        match = re.search(r"serving \S+ on (\S+) \(gRPC\), OpenAI HTTP API on (\S+) ", line)
        if match:
            return process, match.group(1), match.group(2)
        assert time.monotonic() < deadline
    raise AssertionError(f"serve exited with {process.wait()} before serving")


def _wait_gone(pids, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL])
def test_serve_stops_every_service(model_dir, stop_signal):
    process, address, http_url = _start_serve(model_dir)
    try:
        children = _children(process.pid)
        assert len(children) == 3
        with Client(address) as client:
            assert list(client.generate(prompt="Hi", max_tokens=4))[-1].usage.completion_tokens == 4
        with urllib.request.urlopen(f"{http_url}/health", timeout=10) as response:
            assert response.status == 200
        process.send_signal(stop_signal)
        process.wait(timeout=30)
        _wait_gone(children)
    finally:  # a failed check must not leave a server running
        if process.poll() is None:
            process.kill()  # its services die with it (PR_SET_PDEATHSIG)
            process.wait()
