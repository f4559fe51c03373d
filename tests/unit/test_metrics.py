"""ServiceMetrics over a real registry and HTTP endpoint, and the engine core's
scrape-time readings of EngineStats."""
from services.common.metrics import ServiceMetrics, exponential_buckets
from services.common.request_types import EngineInfo, EngineStats
from services.engine_core.metrics import EngineCoreMetrics
from tests.metrics_scrape import scrape


def stats(**changes) -> EngineStats:
    values = dict(num_running=3, num_waiting=2, num_preempted=1, num_preemptions_total=4,
                  num_kv_blocks=100, num_used_kv_blocks=25, num_cached_kv_blocks=5,
                  prefix_cache_queries=64, prefix_cache_hits=16, num_steps=9,
                  num_scheduled_tokens_last_step=7, spec_decode_num_drafts=5,
                  spec_decode_num_draft_tokens=20, spec_decode_num_accepted_tokens=9,
                  spec_decode_num_accepted_tokens_per_pos=[5, 3, 1, 0])
    return EngineStats(**{**values, **changes})


# What Prometheus 2.x asks for: names must keep their colons in this format too.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_engine_core_metrics_read_stats_at_each_scrape():
    current = {"stats": stats()}
    service = ServiceMetrics("test-engine-core")
    metrics = EngineCoreMetrics(service, "m", EngineInfo("/m", 2048, 16, 100, "float32", 49152),
                                2048, lambda: current["stats"])
    metrics.observe_step(0.03, 64)
    port = service.serve("127.0.0.1", 0)
    try:
        m = (("model_name", "m"),)
        first = scrape(f"127.0.0.1:{port}")
        assert first[("llmserve:num_requests_running", m)] == 3
        assert first[("llmserve:num_requests_waiting", m)] == 2
        assert first[("llmserve:kv_cache_usage_perc", m)] == 0.25
        assert first[("llmserve:num_preemptions_total", m)] == 4
        assert first[("llmserve:prefix_cache_hits_total", m)] == 16
        assert first[("llmserve:spec_decode_num_drafts_total", m)] == 5
        assert first[("llmserve:spec_decode_num_draft_tokens_total", m)] == 20
        assert first[("llmserve:spec_decode_num_accepted_tokens_total", m)] == 9
        for position, count in enumerate([5, 3, 1, 0]):
            assert first[("llmserve:spec_decode_num_accepted_tokens_per_pos_total",
                          (("model_name", "m"), ("position", str(position))))] == count
        assert first[("llmserve:cache_config_info", (("block_size", "16"), ("model_name", "m"),
                                                     ("num_kv_blocks", "100")))] == 1
        assert first[("llmserve:iteration_tokens_total_count", m)] == 1
        assert first[("llmserve:iteration_tokens_total_bucket", (("le", "50.0"),) + m)] == 0
        assert first[("llmserve:iteration_tokens_total_bucket", (("le", "100.0"),) + m)] == 1
        assert first[("llmserve:engine_step_duration_seconds_sum", m)] == 0.03
        current["stats"] = stats(num_running=0, num_waiting=0, num_used_kv_blocks=0)
        idle = scrape(f"127.0.0.1:{port}")
        assert idle[("llmserve:num_requests_running", m)] == 0
        assert idle[("llmserve:kv_cache_usage_perc", m)] == 0
        assert ("process_cpu_seconds_total", ()) in idle
        names = {name for name, _ in scrape(f"127.0.0.1:{port}", PROMETHEUS_ACCEPT)}
        assert "llmserve:num_requests_running" in names and not any(
            n.startswith("llmserve_") for n in names)
    finally:
        service.shutdown()


def test_each_service_has_its_own_registry():
    a, b = ServiceMetrics("a"), ServiceMetrics("b")
    a.counter("llmserve:things", "Things.").labels().inc(2)
    b.counter("llmserve:things", "Things.").labels().inc(5)  # no clash in one process
    assert a.registry.get_sample_value("llmserve:things_total") == 2
    assert b.registry.get_sample_value("llmserve:things_total") == 5


def test_exponential_buckets_are_vllms_1_2_5_series():
    assert exponential_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert exponential_buckets(1) == [1]
