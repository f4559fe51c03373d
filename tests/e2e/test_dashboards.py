"""Prometheus itself (Debian's package, which `make test` installs) scrapes the
three services with deploy/observability/prometheus.yml, and evaluates every
query of the Grafana dashboards: each must return data."""
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests
import yaml

from llmserve.client import Client
from services.common.ports import free_port
from tests.e2e.conftest import address
from tests.e2e.test_observability import scrape

pytestmark = pytest.mark.e2e

OBSERVABILITY = Path(__file__).parents[2] / "deploy" / "observability"
# Grafana's variables, as the dashboard's defaults ("All") would expand them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*", "$instance": ".*"}


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((OBSERVABILITY / "grafana" / "llmserve-metrics.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def variable_queries() -> list[tuple[str, str]]:
    """label_values(metric, label) of the dashboard's variables, as PromQL."""
    dashboard = json.loads((OBSERVABILITY / "grafana" / "llmserve-metrics.json").read_text())
    queries = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)",
                                         variable["query"]["query"]).groups()
            queries.append((variable["name"], f"count by ({label}) ({metric})"))
    return queries


def dashboard_metrics() -> dict[str, str]:
    """Every llmserve metric a dashboard query or variable names -> a title naming it."""
    return {metric: title for title, expr in dashboard_queries() + variable_queries()
            for metric in re.findall(r"llmserve:[a-z0-9_]+", expr)}


def expand(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is missing: `make test` installs Debian's prometheus package"
    directory = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    jobs = {"llmserve-frontend": "frontend", "llmserve-engine-core": "engine-core",
            "llmserve-worker": "worker"}
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"] = [
        {**job, "static_configs": [{"targets": [stack.metrics_addresses[jobs[job["job_name"]]]]}]}
        for job in config["scrape_configs"] if job["job_name"] in jobs]
    assert len(config["scrape_configs"]) == len(jobs)
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port("127.0.0.1")
    process = subprocess.Popen(
        [binary, f"--config.file={directory / 'prometheus.yml'}",
         f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(directory / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, "prometheus exited"
        try:
            if requests.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "prometheus did not become ready"
        time.sleep(0.2)


def send_traffic(stack) -> None:
    """Requests that exercise every panel: shared prefixes (prefix-cache hits),
    several lengths, and one refused request (the errors panel)."""
    shared = "You are a helpful assistant. Answer in one short sentence. " * 4
    with Client(address(stack, "frontend")) as client:
        for question in ("What is 2+2?", "Name a colour.", "Say hello.", "Count to three."):
            list(client.generate(prompt=shared + question, max_tokens=8, temperature=0))
    response = requests.post(f"http://{stack.http_address}/v1/completions",
                             json={"prompt": "x", "temperature": -1}, timeout=10)
    assert response.status_code == 400


def query(url: str, expr: str) -> list[dict]:
    response = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert response["status"] == "success", (expr, response)
    return response["data"]["result"]


def has_data(result: list[dict]) -> bool:
    return any(sample["value"][1] != "NaN" for sample in result)


def test_dashboard_queries_name_only_exported_metrics(stack):
    """(test_cli_serve checks the same on a server that has seen no error.)"""
    exported = {name for addr in stack.metrics_addresses.values() for name, _ in scrape(addr)}
    for metric, title in dashboard_metrics().items():
        assert metric in exported, f"{title}: {metric} is not exported"


def test_prometheus_evaluates_every_dashboard_query(stack, prometheus):
    targets = requests.get(f"{prometheus}/api/v1/targets", timeout=10).json()
    _wait_targets_up(prometheus)
    send_traffic(stack)
    queries = dashboard_queries() + variable_queries()
    deadline = time.monotonic() + 30
    missing = queries
    while missing and time.monotonic() < deadline:
        time.sleep(1)  # a scrape every second: wait for those after the traffic
        missing = [(title, expr) for title, expr in missing if not has_data(query(
            prometheus, expand(expr)))]
    assert not missing, f"queries without data: {missing} (targets: {targets})"


def _wait_targets_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        active = requests.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        if active and all(t["health"] == "up" for t in active):
            return
        assert time.monotonic() < deadline, f"targets not up: {active}"
        time.sleep(0.5)
