"""One way to run a gRPC service: asyncio server, health, reflection, graceful stop."""
from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import time
from typing import Awaitable, Callable, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import metrics, tracing
from services.common.auth import ApiKeyInterceptor
from services.common.errors import ErrorMappingInterceptor
from services.common.grpc_options import SERVER_OPTIONS
from services.common.launcher_link import die_with_launcher
from services.common.ports import add_optional_port_arg
from services.common.tls import TlsConfig

logger = logging.getLogger(__name__)


DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_drain_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="on SIGTERM, seconds to let requests in flight finish while "
                             "refusing new ones (match Kubernetes' terminationGracePeriodSeconds)")


def add_health_port_arg(parser: argparse.ArgumentParser) -> None:
    add_optional_port_arg(parser, "--health-port", None,
                          "also serve grpc.health.v1, alone and without TLS, on this port: "
                          "for Kubernetes' gRPC probes, which cannot speak TLS")


class Drainable(Protocol):
    """A service core that can refuse new work and count what it still runs."""

    def start_draining(self) -> None: ...

    def num_in_flight(self) -> int: ...


class ServiceServer:
    """A grpc.aio server for one llmserve service, plus health and reflection.

    Health: "" reports liveness and `service_name` readiness; both turn
    NOT_SERVING when a graceful stop begins. A service that is not ready when it
    starts listening (a worker before its model is loaded) passes
    ready_at_start=False and calls set_ready() later.
    """

    def __init__(self, service_name: str, register: Callable[[grpc.aio.Server], None],
                 on_error: Callable[[grpc.StatusCode], None] | None = None,
                 drainable: Drainable | None = None,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 tls: TlsConfig = TlsConfig(), require_client_cert: bool = True,
                 api_key: str = "", ready_at_start: bool = True):
        """on_error sees the status of every RPC that fails with an LLMServeError;
        drainable is drained on stop (see stop()); tls, when enabled, serves TLS
        (mutual when it has a CA and require_client_cert); api_key, when set, is
        required on service_name's methods."""
        self.service_name = service_name
        self.drainable = drainable
        self.drain_timeout_s = drain_timeout_s
        self.tls, self.require_client_cert = tls, require_client_cert
        self.ready_at_start = ready_at_start
        self.health_server: grpc.aio.Server | None = None
        interceptors = [ErrorMappingInterceptor(on_error)]
        if api_key:
            interceptors.insert(0, ApiKeyInterceptor(api_key, service_name))
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        register(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)

    async def start(self, host: str, port: int, port_file: str | None = None,
                    health_port: int | None = None) -> str:
        """Binds (port 0 picks a free one) and starts; returns host:port. health_port,
        when not None, serves the health service alone there, in plaintext."""
        credentials = (self.tls.server_credentials(self.require_client_cert)
                       if self.tls.enabled else None)
        bound = _bind(self.server, f"{host}:{port}", credentials)
        await self.server.start()
        if health_port is not None:
            await self._start_health_server(host, health_port)
        address = f"{host}:{bound}"
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.ready_at_start:
            await self.set_ready()
        else:
            await self.health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if port_file:
            _write_atomically(port_file, address)
        logger.info("%s serving on %s", self.service_name, address)
        return address

    async def set_ready(self) -> None:
        await self.health.set(self.service_name, health_pb2.HealthCheckResponse.SERVING)

    async def _start_health_server(self, host: str, port: int) -> None:
        self.health_server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        bound = _bind(self.health_server, f"{host}:{port}", None, "--health-port")
        await self.health_server.start()
        logger.info("health (plaintext) on %s:%d", host, bound)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Graceful: health turns NOT_SERVING; a drainable core refuses new work and
        finishes what it runs, for up to drain_timeout_s, while the server still
        answers (health, the streams in flight); then the server stops."""
        await self.health.enter_graceful_shutdown()
        if self.drainable is not None:
            await self._drain()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        logger.info("%s stopped", self.service_name)

    async def _drain(self) -> None:
        self.drainable.start_draining()
        deadline = time.monotonic() + self.drain_timeout_s
        logger.info("%s draining: %d requests in flight, up to %.0f s", self.service_name,
                    self.drainable.num_in_flight(), self.drain_timeout_s)
        while self.drainable.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.drainable.num_in_flight()
        if left:
            logger.warning("%s: drain timeout; %d requests still in flight are cut",
                           self.service_name, left)

    async def serve_until_signal(self) -> None:
        """Waits for SIGINT/SIGTERM (this loop must run on the main thread), then
        stops gracefully."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.serve_until(stop)

    async def serve_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        await self.stop()


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def run_service(log_name: str, default_otel_name: str,
                serve: Callable[[], Awaitable[None]]) -> None:
    """A service's main(): logging, tracing, the asyncio server until it stops."""
    start_process(log_name, default_otel_name)
    try:
        asyncio.run(serve())
    finally:
        tracing.shutdown_tracing()
        metrics.shutdown_otlp_metrics()


def _bind(server: grpc.aio.Server, address: str, credentials, flag: str = "--port") -> int:
    """The port bound (a free one for port 0). grpcio reports a failed bind by 0 or,
    in newer versions, a RuntimeError; either is an OSError here that names the
    address and the flag that chose it."""
    try:
        bound = (server.add_secure_port(address, credentials) if credentials
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address} ({flag}): in use by another process, or "
                      "not an address of this host")
    return bound


def start_process(log_name: str, default_otel_name: str) -> None:
    """What every service process does first. A crash in native code (gRPC,
    torch) prints every thread's Python stack to the log before the process dies."""
    faulthandler.enable()
    die_with_launcher()
    setup_logging(log_name)
    tracing.init_tracing(default_otel_name)


def setup_logging(service: str) -> None:
    level = os.environ.get("LLMSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level,
                        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
