"""Starts the three services (worker, engine core, frontend) as local processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.auth import API_KEY_ENV
from services.common.config import EngineConfig
from services.common.config_cli import engine_args_to_argv
from services.common.launcher_link import LAUNCHER_PID_ENV
from services.common.ports import free_port, port_to_argv
from services.common.tls import TlsConfig, tls_to_argv
from services.worker.cpu_cores import format_cores, split_cores


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    log_path: Path | None
    address: str = ""
    module_args: list[str] = field(default_factory=list)  # how to start it again


@dataclass
class LocalStack:
    """worker -> engine core -> frontend, each in its own process, on loopback.

    Internal services listen on free ports; the frontend on `port` (0: a free one).
    Logs go to the terminal, or to files in `log_dir` when it is given.
    """

    config: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051
    log_dir: str | None = None
    env: dict[str, str] | None = None
    # Engine cores behind the frontend, each with its own worker.
    engine_replicas: int = 1
    # The OpenAI-compatible HTTP API: None: off; 0: a free port; else that port.
    http_port: int | None = None
    http_address: str = ""
    # Prometheus metrics: None: off; 0: a free port per service; else the
    # frontend's port, then engine core i on +1+i, then the workers.
    metrics_port: int | None = None
    metrics_addresses: dict[str, str] = field(default_factory=dict)  # service -> host:port
    # On stop, the frontend and engine cores finish what is in flight for this long.
    drain_timeout_s: float = 30.0
    # Start a worker or engine core that dies again, with backoff (see
    # supervisor.py); the requests it was serving go on.
    restart_dead: bool = False
    # TLS on every hop (mutual with a CA), and the public API's key.
    tls: TlsConfig = field(default_factory=TlsConfig)
    api_key: str = ""
    # LoRA adapters the frontend loads at start, as NAME=PATH.
    lora_modules: list[str] = field(default_factory=list)
    services: list[ServiceProcess] = field(default_factory=list)

    def start(self, timeout_s: float = 300.0) -> str:
        """Starts every service at once and waits until each serves; returns the
        frontend address. Each service is given the ports of those it calls, picked
        here, and waits for them as pods do: their imports and the model's load
        overlap, where one after the other they were most of a stack's start."""
        self._tmp = tempfile.TemporaryDirectory(prefix="llmserve-")
        deadline = time.monotonic() + timeout_s
        try:
            engines = [self._launch_engine_core(i) for i in range(self.engine_replicas)]
            frontend = self._launch("frontend", [
                "services.frontend", "--host", self.host,
                "--engine-core-addresses", ",".join(e.address for e in engines),
                "--engine-wait-timeout", str(timeout_s),
                "--model", self.config.model.model, *self._http_flags(),
                *self._metrics_flags("frontend", 0, self.host),
                "--drain-timeout", str(self.drain_timeout_s), *tls_to_argv(self.tls),
                *(["--lora-modules", *self.lora_modules] if self.lora_modules else [])],
                self.port)
            self._wait_serving(self.services, deadline)
        except BaseException:
            self.stop()
            raise
        if self.restart_dead:
            from llmserve.supervisor import Supervisor

            self._supervisor = Supervisor(self)
            self._supervisor.start()
        return frontend.address

    def stop(self, grace_s: float | None = None) -> None:
        """Stops the services in reverse start order (frontend first, so nothing
        calls a stopped service): SIGTERM, then SIGKILL after grace_s (default:
        the drain timeout and 10 s more)."""
        grace_s = self.drain_timeout_s + 10 if grace_s is None else grace_s
        if getattr(self, "_supervisor", None) is not None:
            self._supervisor.stop()  # before the services, or it would restart them
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
            try:
                service.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()

    def start_workers(self, timeout_s: float = 300.0) -> list[str]:
        """Starts only the first replica's workers (the offline API's engine core runs
        in the caller's process) and returns their addresses in rank order."""
        self._tmp = tempfile.TemporaryDirectory(prefix="llmserve-")
        try:
            workers = self._launch_workers(0)
            self._wait_serving(workers, time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return [w.address for w in workers]

    def _launch_workers(self, replica: int) -> list[ServiceProcess]:
        suffix = f"-{replica}" if self.engine_replicas > 1 else ""
        ranks = self.workers_per_replica
        workers = []
        for rank in range(ranks):  # global ranks, stage-major (services/worker/pipeline.py)
            name = f"worker{suffix}" + (f"-rank{rank}" if ranks > 1 else "")
            index = replica * ranks + rank
            workers.append(self._launch_internal(name, [
                "services.worker", "--host", "127.0.0.1", "--rank", str(rank),
                *self._cores_flag(index), *tls_to_argv(self.tls),
                *self._metrics_flags(name, 1 + self.engine_replicas + index)]))
        return workers

    def _launch_engine_core(self, replica: int) -> ServiceProcess:
        suffix = f"-{replica}" if self.engine_replicas > 1 else ""
        workers = self._launch_workers(replica)
        name = f"engine-core{suffix}"
        return self._launch_internal(name, [
            "services.engine_core", "--host", "127.0.0.1",
            "--worker-addresses", ",".join(w.address for w in workers),
            *self._metrics_flags(name, 1 + replica), "--drain-timeout", str(self.drain_timeout_s),
            *tls_to_argv(self.tls), *engine_args_to_argv(self.config)])

    def _http_flags(self) -> list[str]:
        """A free port is picked here, so that http_address is known at once."""
        port = None if self.http_port is None else self.http_port or free_port(self.host)
        if port is not None:
            self.http_address = f"{self.host}:{port}"
        return port_to_argv("--http-port", port)

    def _metrics_flags(self, service: str, offset: int, host: str = "127.0.0.1") -> list[str]:
        """--metrics-port for a service, the offset-th in the documented order."""
        if self.metrics_port is None:
            return []
        port = self.metrics_port + offset if self.metrics_port else free_port(host)
        self.metrics_addresses[service] = f"{host}:{port}"
        return ["--metrics-port", str(port)]

    def _cores_flag(self, worker_index: int) -> list[str]:
        """Each worker on its own cores when there are several (replicas, TP ranks)."""
        num_workers = self.engine_replicas * self.workers_per_replica
        if num_workers == 1:
            return []
        groups = split_cores(sorted(os.sched_getaffinity(0)), num_workers)
        return ["--cpu-cores", format_cores(groups[worker_index])]

    @property
    def workers_per_replica(self) -> int:
        """Worker processes per engine core: each pipeline stage's TP ranks."""
        parallel = self.config.parallel
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def restart(self, service: ServiceProcess, timeout_s: float = 120.0) -> None:
        """Starts a dead service again, on its old port (its clients reconnect)."""
        port = int(service.address.rsplit(":", 1)[1])
        service.process = self._process(service.name, service.module_args, port)
        self._wait_serving([service], time.monotonic() + timeout_s)

    def _launch_internal(self, name: str, module_args: list[str]) -> ServiceProcess:
        """A service only the stack calls, on loopback, at a port picked now so that
        its callers can be started with its address before it serves."""
        port = free_port("127.0.0.1")
        service = self._launch(name, module_args, port)
        service.address = f"127.0.0.1:{port}"
        return service

    def _launch(self, name: str, module_args: list[str], port: int) -> ServiceProcess:
        service = ServiceProcess(name, self._process(name, module_args, port),
                                 self._log_path(name), module_args=module_args)
        self.services.append(service)
        return service

    def _process(self, name: str, module_args: list[str], port: int) -> subprocess.Popen:
        port_file = self._port_file(name)
        port_file.unlink(missing_ok=True)
        log_path = self._log_path(name)
        out = open(log_path, "a") if log_path else None
        process = subprocess.Popen(
            [sys.executable, "-m", *module_args, "--port", str(port), "--port-file", str(port_file)],
            stdout=out, stderr=subprocess.STDOUT if out else None,
            env=self._environment())
        if out:
            out.close()
        return process

    def _log_path(self, name: str) -> Path | None:
        return Path(self.log_dir) / f"{name}.log" if self.log_dir else None

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, **(self.env or {}), LAUNCHER_PID_ENV: str(os.getpid())}
        if self.api_key:  # read by the frontend; not on its command line, for `ps` to show
            env[API_KEY_ENV] = self.api_key
        return env

    def _port_file(self, name: str) -> Path:
        return Path(self._tmp.name) / f"{name}.addr"

    def _wait_serving(self, services: list[ServiceProcess], deadline: float) -> None:
        """Until each service has written its address. The first, in start order,
        that exits or is late raises: a worker that failed is named before the
        engine core left waiting for it."""
        waiting = list(services)
        while True:
            for service in waiting:
                if service.process.poll() is not None:
                    raise RuntimeError(
                        f"{service.name} exited with code {service.process.returncode} before "
                        "serving" + (f"; see {service.log_path}" if service.log_path else ""))
            waiting = [s for s in waiting if not self._port_file(s.name).exists()]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{waiting[0].name} did not start serving in time")
            time.sleep(0.05)
        for service in services:
            service.address = self._port_file(service.name).read_text().strip()
