"""OpenTelemetry set-up and W3C trace-context propagation over gRPC metadata.

Exporting is configured by the standard OTEL_* variables: OTEL_TRACES_EXPORTER
(otlp, console or none) and OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT. With none of
them set nothing is exported and spans cost next to nothing.
"""
from __future__ import annotations

import os
from typing import Iterable

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter,
                                            SimpleSpanProcessor)

_TRACE_HEADERS = ("traceparent", "tracestate")
_exporting = False


def is_exporting() -> bool:
    """Whether spans go anywhere; extra per-step tracing work is skipped otherwise."""
    return _exporting


def service_resource(default_service_name: str) -> Resource:
    """The service's OTel resource: OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
    win over the default name."""
    attributes = {} if "OTEL_SERVICE_NAME" in os.environ else {"service.name": default_service_name}
    return Resource.create(attributes)


def init_tracing(default_service_name: str) -> None:
    """Installs a TracerProvider whose exporter the OTEL_* environment chooses."""
    provider = TracerProvider(resource=service_resource(default_service_name))
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporter and ("OTEL_EXPORTER_OTLP_ENDPOINT" in os.environ
                         or "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in os.environ):
        exporter = "otlp"
    global _exporting
    _exporting = exporter in ("otlp", "console")
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def current_trace_headers() -> dict[str, str]:
    """The current span's W3C headers (traceparent, tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def span_headers(span: trace.Span) -> dict[str, str]:
    """A span's W3C headers, for a span that is not the current one."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def trace_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata for an outgoing call."""
    return list(current_trace_headers().items())


def context_from_headers(headers: dict[str, str]) -> context.Context:
    return propagate.extract(headers)


def link_to(headers: dict[str, str]) -> trace.Link | None:
    """A link to the span whose W3C headers are given (a batched step links to the
    requests it serves rather than having one parent); None for no valid span."""
    span_context = trace.get_current_span(context_from_headers(headers)).get_span_context()
    return trace.Link(span_context) if span_context.is_valid else None


def context_from_metadata(metadata: Iterable[tuple[str, str]] | None) -> context.Context:
    """The caller's trace context from incoming gRPC metadata."""
    return propagate.extract({k: v for k, v in (metadata or ()) if k in _TRACE_HEADERS})
