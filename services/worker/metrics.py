"""A worker's metrics: how long its steps take, and what it is (device, dtypes,
KV cache), so a dashboard can tell ranks and replicas apart."""
from __future__ import annotations

import time

from services.common.metrics import (Reading, ScrapedMetric, ServiceMetrics,
                                     rpc_error_counter)
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.worker.worker import Worker

_FORWARD_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
# pipeline_stage: join it with the forward time by rank for each stage's time (a
# stage after the first includes its wait for the stage before).
_INFO_LABELS = ["rank", "world_size", "pipeline_stage", "device", "dtype", "weight_dtype",
                "kv_cache_dtype", "attention_backend"]


class WorkerMetrics:
    def __init__(self, metrics: ServiceMetrics, worker: Worker):
        self.worker = worker
        self.count_rpc_error = rpc_error_counter(metrics, "worker")
        rank = {"rank": str(worker.rank)}
        self._rank = rank
        self.forward_time = metrics.histogram(
            "llmserve:worker_forward_time_seconds",
            "Seconds per step in the worker: inputs, forward pass, sampling.",
            _FORWARD_BUCKETS, ["rank"]).labels(**rank)
        metrics.read_when_scraped([
            ScrapedMetric("llmserve:worker_info", "What the worker runs (value 1).", "gauge",
                          _INFO_LABELS),
            ScrapedMetric("llmserve:worker_num_kv_blocks", "KV blocks this worker holds.",
                          "gauge", ["rank"]),
            ScrapedMetric("llmserve:worker_kv_cache_bytes", "Bytes of this worker's KV cache.",
                          "gauge", ["rank"]),
            ScrapedMetric("llmserve:worker_pipeline_wait_seconds",
                          "Seconds of its steps this rank spent waiting for the previous "
                          "pipeline stage's tensors (0 on the first stage): subtracted from "
                          "the forward time, what the stage computed.", "counter", ["rank"]),
        ], self._readings)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Worker.execute_model, timed when it runs the model (not for a step that
        only tells of finished requests)."""
        start = time.perf_counter()
        output = self.worker.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens:
            self.forward_time.observe(time.perf_counter() - start)
        return output

    def _readings(self) -> list[Reading]:
        description = self.worker.description
        if description is None:  # no model loaded yet
            return []
        info = {name: str(getattr(description, name)) for name in _INFO_LABELS}
        wait = self.worker.model_runner.stage.recv_wait_s
        return [Reading("llmserve:worker_info", 1, info),
                Reading("llmserve:worker_num_kv_blocks", description.num_kv_blocks, self._rank),
                Reading("llmserve:worker_kv_cache_bytes", description.kv_cache_bytes, self._rank),
                Reading("llmserve:worker_pipeline_wait_seconds", wait, self._rank)]
