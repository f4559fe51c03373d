"""One service's metrics: Prometheus (prometheus-client) served on --metrics-port,
and the same instruments over OTLP when OTEL_METRICS_EXPORTER asks for it.

Names are Prometheus names, `llmserve:<name>` with vLLM's meanings. OTel
instrument names cannot hold ':', so over OTLP they read `llmserve.<name>`.
Each service owns a registry (not prometheus-client's global one), so that
tests can run several services, or AsyncLLMs, in one process.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import grpc
from prometheus_client import (CollectorRegistry, Counter, Histogram, ProcessCollector,
                               start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common import tracing
from services.common.ports import add_optional_port_arg

logger = logging.getLogger(__name__)
_otlp_providers: list = []  # flushed at exit by shutdown_otlp_metrics()


def add_metrics_port_arg(parser: argparse.ArgumentParser) -> None:
    add_optional_port_arg(parser, "--metrics-port", None,
                          "serve Prometheus metrics at http://<host>:<port>/metrics")


@dataclass
class ScrapedMetric:
    """A gauge or counter whose value is read when scraped (not kept up to date)."""

    name: str
    documentation: str
    kind: str  # "gauge" or "counter"
    labelnames: Sequence[str] = ()


@dataclass
class Reading:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


class ServiceMetrics:
    def __init__(self, service_name: str):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, fds
        self._meter = _otlp_meter(service_name)
        self._http_server = None

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        """A counter family; `.labels(...)` gives the child to `.inc()`."""
        prom = Counter(name, documentation, labelnames, registry=self.registry)
        otel = self._meter and self._meter.create_counter(_otel_name(name),
                                                          description=documentation)
        return _Family(prom, otel, "add")

    def histogram(self, name: str, documentation: str, buckets: Sequence[float],
                  labelnames: Sequence[str] = ()):
        """A histogram family; `.labels(...)` gives the child to `.observe()`."""
        prom = Histogram(name, documentation, labelnames, buckets=buckets,
                         registry=self.registry)
        otel = self._meter and self._meter.create_histogram(
            _otel_name(name), description=documentation,
            explicit_bucket_boundaries_advisory=list(buckets))
        return _Family(prom, otel, "record")

    def read_when_scraped(self, metrics: list[ScrapedMetric],
                          read: Callable[[], list[Reading]]) -> None:
        """Metrics whose values `read` returns at each scrape (and OTLP export)."""
        self.registry.register(_ReadingCollector(metrics, read))
        if self._meter is None:
            return
        from opentelemetry.metrics import Observation
        for metric in metrics:
            def observe(_options, name=metric.name):
                return [Observation(r.value, r.labels) for r in read() if r.name == name]
            create = (self._meter.create_observable_gauge if metric.kind == "gauge"
                      else self._meter.create_observable_counter)
            create(_otel_name(metric.name), callbacks=[observe],
                   description=metric.documentation)

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics over HTTP on a thread; returns the port (0 picks one)."""
        self._http_server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._http_server.server_port
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def shutdown(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()


class _Family:
    """A Prometheus metric family, mirrored to an OTel instrument when OTLP is on."""

    def __init__(self, prom, otel, otel_method: str):
        self._prom, self._otel, self._otel_method = prom, otel, otel_method

    def labels(self, **values: str):
        child = self._prom.labels(**values) if values else self._prom
        if self._otel is None:
            return child  # the hot path pays for Prometheus only
        return _Mirrored(child, getattr(self._otel, self._otel_method), values)


class _Mirrored:
    def __init__(self, prom_child, record: Callable, attributes: dict[str, str]):
        self._prom_child, self._record, self._attributes = prom_child, record, attributes

    def inc(self, amount: float = 1) -> None:
        self._prom_child.inc(amount)
        self._record(amount, self._attributes)

    def observe(self, value: float) -> None:
        self._prom_child.observe(value)
        self._record(value, self._attributes)


class _ReadingCollector(Collector):
    def __init__(self, metrics: list[ScrapedMetric], read: Callable[[], list[Reading]]):
        self._metrics, self._read = metrics, read

    def describe(self) -> Iterable[Metric]:
        return [self._family(m) for m in self._metrics]

    def collect(self) -> Iterable[Metric]:
        families = {m.name: self._family(m) for m in self._metrics}
        for reading in self._read():
            metric = families[reading.name]
            metric.add_metric([reading.labels[n] for n in self._labelnames(reading.name)],
                              reading.value)
        return list(families.values())

    def _labelnames(self, name: str) -> Sequence[str]:
        return next(m.labelnames for m in self._metrics if m.name == name)

    @staticmethod
    def _family(metric: ScrapedMetric) -> Metric:
        kind = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
        return kind(metric.name, metric.documentation, labels=list(metric.labelnames))


def _otel_name(name: str) -> str:
    return name.replace(":", ".")


def _otlp_meter(service_name: str):
    """An OTel meter exporting over OTLP, or None unless OTEL_METRICS_EXPORTER
    names otlp."""
    exporters = os.environ.get("OTEL_METRICS_EXPORTER", "").lower().split(",")
    if "otlp" not in (e.strip() for e in exporters):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    provider = MeterProvider(resource=tracing.service_resource(service_name),
                             metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
    _otlp_providers.append(provider)
    return provider.get_meter("llmserve")


def rpc_error_counter(metrics: ServiceMetrics, service: str) -> Callable[[grpc.StatusCode], None]:
    """The on_error of an internal service's server (engine core, worker): counts
    its RPCs that ended with an error status, by code (the frontend counts its
    public API's in request_errors). INTERNAL's series is there from the start,
    so a dashboard's error panel shows 0, not "No data"."""
    errors = metrics.counter(
        "llmserve:rpc_errors", "RPCs this service ended with an error status, by gRPC "
        "code name (INTERNAL: a bug, its traceback in the service's log).", ["service", "code"])
    errors.labels(service=service, code="INTERNAL")
    return lambda code: errors.labels(service=service, code=code.name).inc()


def shutdown_otlp_metrics() -> None:
    """Flushes the last OTLP export (at process exit)."""
    while _otlp_providers:
        _otlp_providers.pop().shutdown()


def exponential_buckets(largest: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > largest:
                return buckets
            buckets.append(float(value))
        exponent += 1
