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
from tests.e2e.test_dashboards import dashboard_metrics
from tests.metrics_scrape import scrape

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        # A zombie is dead too: only its parent's wait() is missing.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # gone, or reaped between the two looks
        return False


def _start_serve(model_dir):
    """`llmserve serve` on free ports (0: every port flag's "pick one"); its
    process, gRPC address, HTTP URL and metrics URLs by service, as it prints them."""
    process = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "serve", "--port", "0", "--model", model_dir,
         "--dtype", "float32", "--kv-cache-gib", "0.1", "--http-port", "0",
         "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    serving = None
    for line in process.stdout:
        serving = serving or re.search(
            r"serving \S+ on (\S+) \(gRPC\), OpenAI HTTP API on (\S+) ", line)
        if line.startswith("llmserve: metrics at "):
            metrics = dict(re.findall(r"([\w-]+) (http://[^\s,]+)", line))
            return process, serving.group(1), serving.group(2), metrics
    raise AssertionError(f"serve exited with {process.wait()} before serving")


def _every_dashboard_metric_is_scraped(metrics: dict[str, str]) -> None:
    """On a server that has served only successful requests, every metric a
    dashboard query names is there already (an error panel shows 0, not "No
    data")."""
    assert set(metrics) == {"frontend", "engine-core", "worker"}
    scraped = {name for url in metrics.values()
               for name, _ in scrape(url.removeprefix("http://").removesuffix("/metrics"))}
    named = set(dashboard_metrics())
    assert named and named <= scraped, sorted(named - scraped)


def _wait_gone(pids, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL])
def test_serve_stops_every_service(model_dir, stop_signal):
    process, address, http_url, metrics = _start_serve(model_dir)
    try:
        children = _children(process.pid)
        assert len(children) == 3
        with Client(address) as client:
            assert list(client.generate(prompt="Hi", max_tokens=4))[-1].usage.completion_tokens == 4
        with urllib.request.urlopen(f"{http_url}/health", timeout=10) as response:
            assert response.status == 200
        _every_dashboard_metric_is_scraped(metrics)
        process.send_signal(stop_signal)
        process.wait(timeout=30)
        _wait_gone(children)
    finally:  # a failed check must not leave a server running
        if process.poll() is None:
            process.kill()  # its services die with it (PR_SET_PDEATHSIG)
            process.wait()
