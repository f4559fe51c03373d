"""API keys on the public APIs: gRPC calls carry `authorization: Bearer <key>`
metadata, HTTP requests the same header. Health checks (and metrics) stay open,
so that probes and scrapers need no key."""
from __future__ import annotations

import argparse
import hmac
import os
from typing import Any, Awaitable, Callable

import grpc

API_KEY_ENV = "LLMSERVE_API_KEY"


def add_api_key_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""),
                        help=f"require this key on the public API (default: ${API_KEY_ENV}; "
                             "none: no key needed)")


def authorized(api_key: str, authorization: str | None) -> bool:
    """Whether an `authorization` header value carries the key (constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls to `protected_service` without the key."""

    def __init__(self, api_key: str, protected_service: str):
        self.api_key = api_key
        self.prefix = f"/{protected_service}/"

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if authorized(self.api_key, metadata.get("authorization")):
            return handler
        return _refusal(handler)


_MESSAGE = "a valid API key is required: send the metadata `authorization: Bearer <key>`"


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
        yield  # an async generator, as a server-streaming handler must be

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            refuse_stream, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        refuse_unary, handler.request_deserializer, handler.response_serializer)
