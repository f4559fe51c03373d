"""One way to run a gRPC service: asyncio server, health, reflection, graceful stop."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import metrics, tracing
from services.common.errors import ErrorMappingInterceptor
from services.common.grpc_options import SERVER_OPTIONS

logger = logging.getLogger(__name__)


class ServiceServer:
    """A grpc.aio server for one llmserve service, plus health and reflection.

    Health: "" reports liveness and `service_name` readiness; both turn
    NOT_SERVING before a graceful stop.
    """

    def __init__(self, service_name: str, register: Callable[[grpc.aio.Server], None],
                 on_error: Callable[[grpc.StatusCode], None] | None = None):
        """on_error sees the status of every RPC that fails with an LLMServeError."""
        self.service_name = service_name
        self.server = grpc.aio.server(options=SERVER_OPTIONS,
                                      interceptors=[ErrorMappingInterceptor(on_error)])
        register(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)

    async def start(self, host: str, port: int, port_file: str | None = None) -> str:
        """Binds (port 0 picks a free one) and starts; returns host:port."""
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        await self.server.start()
        address = f"{host}:{bound}"
        for name in ("", self.service_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if port_file:
            _write_atomically(port_file, address)
        logger.info("%s serving on %s", self.service_name, address)
        return address

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        logger.info("%s stopped", self.service_name)

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
    setup_logging(log_name)
    tracing.init_tracing(default_otel_name)
    try:
        asyncio.run(serve())
    finally:
        tracing.shutdown_tracing()
        metrics.shutdown_otlp_metrics()


def setup_logging(service: str) -> None:
    level = os.environ.get("LLMSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level,
                        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
