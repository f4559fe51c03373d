"""Rendered Kubernetes manifests run as local processes, the way a kubelet runs them.

Each pod gets a loopback address of its own (127.0.0.x; Linux routes all of
127/8 to lo) standing in for its pod IP, so that pods can use the same ports as
in the manifests; inside a pod, localhost (127.0.0.1, and 0.0.0.0 to listen on)
becomes that address. A container's command runs from this virtual
environment, with the container's env (envFrom, then env, with $(VAR)
references expanded as the kubelet does) over this process's environment,
which stands in for the image's.
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from tests.e2e.conftest import health_status
from tests.k8s_render import find


@dataclass
class LocalPod:
    name: str
    ip: str
    spec: dict
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    # Container name -> (argv, env, log file): what the kubelet restarts it with.
    launches: dict[str, tuple[list[str], dict[str, str], Path]] = field(default_factory=dict)

    def container(self, name: str) -> dict:
        return next(c for c in self.spec["containers"] if c["name"] == name)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes.values())


def start_pod(objects: list[dict], template: dict, name: str, ip: str, log_dir: Path,
              env_overrides: dict[str, str], rewrite_arg=lambda arg: arg) -> LocalPod:
    """Starts every container of a pod template; rewrite_arg adapts an argument
    that names something outside the pod (a DNS server, say)."""
    pod = LocalPod(name, ip, template["spec"])
    for container in pod.spec["containers"]:
        env = container_env(objects, container, pod)
        env.update(env_overrides)
        argv = [_local_command(container["command"][0]), *container["command"][1:],
                *container.get("args", [])]
        argv = [rewrite_arg(_localize(_expand(arg, env), ip)) for arg in argv]
        pod.launches[container["name"]] = (argv, env, log_dir / f"{name}-{container['name']}.log")
        restart_container(pod, container["name"])
    return pod


def restart_container(pod: LocalPod, name: str) -> None:
    """(Re)starts one container, as the kubelet does after it exits."""
    argv, env, log_path = pod.launches[name]
    with open(log_path, "a") as log:
        pod.processes[name] = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                                               stderr=subprocess.STDOUT)


def container_env(objects: list[dict], container: dict, pod: LocalPod) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        value = _env_value(var, container, pod, env)
        if value is not None:
            env[var["name"]] = value
    return env


def _env_value(var: dict, container: dict, pod: LocalPod, env: dict) -> str | None:
    if "value" in var:
        return _expand(var["value"], env)
    source = var["valueFrom"]
    if "fieldRef" in source:
        return {"metadata.name": pod.name, "metadata.namespace": "default",
                "status.podIP": pod.ip}[source["fieldRef"]["fieldPath"]]
    if "resourceFieldRef" in source:
        ref = source["resourceFieldRef"]
        owner = pod.container(ref.get("containerName", container["name"]))
        kind, resource = ref["resource"].split(".")
        value = _cpus(owner["resources"][kind][resource]) / _cpus(ref.get("divisor", "1"))
        return str(math.ceil(value))  # the kubelet rounds up
    if "secretKeyRef" in source and source["secretKeyRef"].get("optional"):
        return None  # no Secret here: an optional one is absent
    raise AssertionError(f"no local stand-in for {var}")


def _cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) references, as the kubelet expands them ($$ escapes; unknown stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)


def _localize(arg: str, ip: str) -> str:
    """The pod's own addresses (localhost, and 0.0.0.0 to listen on) -> its IP."""
    return re.sub(r"(?<![\d.])(?:0\.0\.0\.0|127\.0\.0\.1)(?![\d])", ip, arg)


def _local_command(command: str) -> str:
    """The image's command (on its PATH) from this virtual environment."""
    local = Path(sys.executable).parent / command
    assert local.exists(), f"{command} is not installed in {local.parent}"
    return str(local)


def probe_ports(container: dict, probe: str) -> tuple[int, str] | None:
    grpc_probe = container.get(probe, {}).get("grpc")
    return (grpc_probe["port"], grpc_probe.get("service", "")) if grpc_probe else None


def wait_ready(pod: LocalPod, timeout_s: float) -> None:
    """Waits, as the kubelet does, for each container's startup and readiness probes."""
    deadline = time.monotonic() + timeout_s
    for container in pod.spec["containers"]:
        for probe in ("startupProbe", "readinessProbe"):
            target = probe_ports(container, probe)
            if target is not None:
                _wait_serving(pod, f"{pod.ip}:{target[0]}", target[1], deadline)


def _wait_serving(pod: LocalPod, address: str, service: str, deadline: float) -> None:
    while _status_or_none(address, service) != health_pb2.HealthCheckResponse.SERVING:
        assert pod.alive(), f"a container of {pod.name} exited; see its log"
        assert time.monotonic() < deadline, f"{pod.name}: {address} {service!r} never ready"
        time.sleep(0.2)


def _status_or_none(address: str, service: str) -> int | None:
    """The health status, or None while nothing answers there."""
    try:
        return health_status(address, service, timeout_s=1.0)
    except grpc.RpcError:
        return None


def stop_pod(pod: LocalPod, timeout_s: float | None = None) -> dict[str, int]:
    """SIGTERM to every container; SIGKILL after the pod's grace period. Exit codes."""
    grace = timeout_s or pod.spec.get("terminationGracePeriodSeconds", 30)
    for process in pod.processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in pod.processes.values():
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return {name: p.returncode for name, p in pod.processes.items()}
