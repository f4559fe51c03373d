"""The engine core's metrics: load and KV cache use read from EngineStats at each
scrape (what autoscalers and the Gateway API Inference Extension read), and step
histograms the busy loop observes."""
from __future__ import annotations

from typing import Callable

from services.common.metrics import (Reading, ScrapedMetric, ServiceMetrics, exponential_buckets,
                                     rpc_error_counter)
from services.common.request_types import EngineInfo, EngineStats

_STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0]
_QUEUE_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16]
_M = "model_name"
_SCRAPED = [
    ScrapedMetric("llmserve:num_requests_running", "Requests in the running batch.", "gauge", [_M]),
    ScrapedMetric("llmserve:num_requests_waiting",
                  "Requests waiting to be scheduled, preempted ones included.", "gauge", [_M]),
    ScrapedMetric("llmserve:kv_cache_usage_perc",
                  "Fraction of KV blocks in use, from 0 to 1.", "gauge", [_M]),
    ScrapedMetric("llmserve:num_preemptions", "Preemptions (requests sent back to wait, "
                  "their KV blocks freed).", "counter", [_M]),
    ScrapedMetric("llmserve:prefix_cache_queries",
                  "Prompt tokens looked up in the prefix cache.", "counter", [_M]),
    ScrapedMetric("llmserve:prefix_cache_hits",
                  "Prompt tokens found in the prefix cache.", "counter", [_M]),
    ScrapedMetric("llmserve:cache_config_info", "The KV cache's configuration (value 1).",
                  "gauge", [_M, "block_size", "num_kv_blocks"]),
    ScrapedMetric("llmserve:spec_decode_num_drafts",
                  "Speculative decoding: request steps that verified draft tokens.", "counter",
                  [_M]),
    ScrapedMetric("llmserve:spec_decode_num_draft_tokens",
                  "Speculative decoding: draft tokens verified.", "counter", [_M]),
    ScrapedMetric("llmserve:spec_decode_num_accepted_tokens",
                  "Speculative decoding: draft tokens accepted.", "counter", [_M]),
    ScrapedMetric("llmserve:spec_decode_num_accepted_tokens_per_pos",
                  "Speculative decoding: draft tokens accepted at each position (0: a step's "
                  "first draft).", "counter", [_M, "position"]),
]


class EngineCoreMetrics:
    def __init__(self, metrics: ServiceMetrics, model_name: str, info: EngineInfo,
                 max_num_batched_tokens: int, read_stats: Callable[[], EngineStats]):
        self._labels = {_M: model_name}
        self._info_labels = {**self._labels, "block_size": str(info.block_size),
                             "num_kv_blocks": str(info.num_kv_blocks)}
        self._read_stats = read_stats
        metrics.read_when_scraped(_SCRAPED, self._readings)
        self.count_rpc_error = rpc_error_counter(metrics, "engine-core")
        self.step_time = metrics.histogram(
            "llmserve:engine_step_duration_seconds",
            "Seconds per engine step: schedule, execute on the workers, update "
            "(with async scheduling, from the step before it being back to its own).",
            _STEP_BUCKETS, [_M]).labels(**self._labels)
        self.step_tokens = metrics.histogram(
            "llmserve:iteration_tokens_total", "Tokens computed per engine step.",
            exponential_buckets(max_num_batched_tokens), [_M]).labels(**self._labels)
        self.queue_depth = metrics.histogram(
            "llmserve:batch_queue_depth",
            "Steps in flight at the workers once each step is sent: 2 with async "
            "scheduling's overlap; up to the pipeline-parallel size with the batch queue.",
            _QUEUE_BUCKETS, [_M]).labels(**self._labels)

    def observe_step(self, seconds: float, num_tokens: int) -> None:
        self.step_time.observe(seconds)
        self.step_tokens.observe(num_tokens)

    def observe_step_sent(self, num_in_flight: int) -> None:
        self.queue_depth.observe(num_in_flight)

    def _readings(self) -> list[Reading]:
        stats = self._read_stats()
        usage = stats.num_used_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0
        values = {"num_requests_running": stats.num_running,
                  "num_requests_waiting": stats.num_waiting,
                  "kv_cache_usage_perc": usage,
                  "num_preemptions": stats.num_preemptions_total,
                  "prefix_cache_queries": stats.prefix_cache_queries,
                  "prefix_cache_hits": stats.prefix_cache_hits,
                  "spec_decode_num_drafts": stats.spec_decode_num_drafts,
                  "spec_decode_num_draft_tokens": stats.spec_decode_num_draft_tokens,
                  "spec_decode_num_accepted_tokens": stats.spec_decode_num_accepted_tokens}
        readings = [Reading(f"llmserve:{name}", value, self._labels)
                    for name, value in values.items()]
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        readings += [Reading("llmserve:spec_decode_num_accepted_tokens_per_pos", count,
                             {**self._labels, "position": str(position)})
                     for position, count in enumerate(per_pos)]
        return readings + [Reading("llmserve:cache_config_info", 1, self._info_labels)]
