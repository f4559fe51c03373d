"""Serves the HTTP API with uvicorn inside the frontend's own event loop, next to
the gRPC server (one process, one loop, one AsyncLLM)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from fastapi import FastAPI

from services.common.tls import TlsConfig

logger = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the frontend's handler stops both
    servers (uvicorn would otherwise take SIGTERM and re-raise it when done)."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, tls: TlsConfig = TlsConfig()):
        # One log line per request comes from AsyncLLM; uvicorn's access log would
        # be a second one. Stopped once AsyncLLM has drained: what is still open
        # then is cut soon. TLS without client certificates (callers use API keys).
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=2,
                                ssl_certfile=tls.cert_file or None,
                                ssl_keyfile=tls.key_file or None)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        """Listens; returns host:port."""
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():  # e.g. the port is taken
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        logger.info("serving the OpenAI-compatible HTTP API on %s:%d", host, port)
        return f"{host}:{port}"

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
