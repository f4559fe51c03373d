"""A real OTLP/gRPC endpoint inside this process (the benchmark's or the tests'):
it keeps every span and metric the services export, as a collector would
receive them."""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import (metrics_service_pb2,
                                                      metrics_service_pb2_grpc)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service_name: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    event_names: list[str]
    linked_trace_ids: list[str]
    resource: dict  # the exporting process's resource attributes


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    # service.name -> names of the metrics it exported.
    metric_names: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None)

    def spans_of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def find_spans(self, name: str, **attributes) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name
                    and all(s.attributes.get(k) == v for k, v in attributes.items())]

    def add_spans(self, request) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = resource.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(
                    service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                    s.start_time_unix_nano, s.end_time_unix_nano, _attributes(s.attributes),
                    [e.name for e in s.events], [link.trace_id.hex() for link in s.links],
                    resource)
                    for s in scope_spans.spans]
        with self._lock:
            self.spans += received

    def add_metrics(self, request) -> None:
        with self._lock:
            for resource_metrics in request.resource_metrics:
                service = _attributes(resource_metrics.resource.attributes).get("service.name", "")
                names = self.metric_names.setdefault(service, set())
                for scope_metrics in resource_metrics.scope_metrics:
                    names.update(m.name for m in scope_metrics.metrics)


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.add_spans(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _attributes(key_values) -> dict:
    result = {}
    for kv in key_values:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            result[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        elif kind is not None:
            result[kv.key] = getattr(value, kind)
    return result
