"""Traces and metrics of the three real processes: one trace across them with the
request's phases, received by a real OTLP endpoint; Prometheus metrics on every
--metrics-port that count what was sent; and every dashboard query evaluated by
Prometheus itself."""
import random

import grpc
import pytest
import requests

from llmserve.client import Client
from tests.e2e.conftest import address, wait_all_blocks_free
from tests.metrics_scrape import scrape, value
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

SERVICES = {"frontend": "llmserve-frontend", "engine-core": "llmserve-engine-core",
            "worker": "llmserve-worker"}


def test_one_trace_across_three_services_with_the_request_phases(stack, otlp):
    with Client(address(stack, "frontend")) as client:
        list(client.generate(prompt="Trace me " * 20, max_tokens=4, ignore_eos=True,
                             request_id="traced-request"))
    frontend = wait_until(lambda: otlp.find_spans("frontend.request",
                                                  **{"gen_ai.request.id": "traced-request"}),
                          what="the frontend's span")[0]
    trace_id = frontend.trace_id
    wait_until(lambda: {s.name for s in otlp.spans_of_trace(trace_id)} >= {
        "engine_core.request", "worker.request", "queued", "prefill", "decode"},
               what="every span of the trace")
    spans = otlp.spans_of_trace(trace_id)
    assert {s.service_name for s in spans} == set(SERVICES.values())
    engine = next(s for s in spans if s.name == "engine_core.request")
    children = {s.name: s for s in spans if s.parent_span_id == engine.span_id}
    assert set(children) == {"queued", "prefill", "decode", "worker.request"}
    phases = {n: children[n] for n in ("queued", "prefill", "decode")}
    assert all(p.service_name == "llmserve-engine-core" for p in phases.values())
    assert phases["queued"].end_ns <= phases["prefill"].start_ns
    assert phases["prefill"].end_ns == phases["decode"].start_ns
    assert "prefill_chunk" in phases["prefill"].event_names
    for span in (frontend, engine):
        assert span.attributes["gen_ai.usage.output_tokens"] == 4
        assert span.attributes["gen_ai.usage.input_tokens"] > 20
        assert span.attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert not any(k.endswith(("prompt_tokens", "completion_tokens")) for k in span.attributes)
    steps = wait_until(lambda: [s for s in otlp.find_spans("engine_core.step")
                                if trace_id in s.linked_trace_ids], what="linked step spans")
    assert all(s.trace_id != trace_id for s in steps)  # their own traces, linked


def test_streamed_http_request_is_traced_like_grpc_and_logs_no_error(stack, otlp):
    """The caller's traceparent parents the frontend's span, which parents the engine
    core's, as over gRPC; and the frontend logs nothing at ERROR (it once logged "Failed
    to detach context" for every streamed HTTP response)."""
    trace_id, caller_span = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    log_path = next(s.log_path for s in stack.services if s.name == "frontend")
    log_start = log_path.stat().st_size  # other tests' lines are theirs
    for stream in (True, False):
        response = requests.post(
            f"http://{stack.http_address}/v1/completions",
            headers={"traceparent": f"00-{trace_id}-{caller_span}-01"}, stream=stream,
            json={"model": "SmolLM2-135M-Instruct", "prompt": "Trace me over HTTP",
                  "max_tokens": 3, "stream": stream}, timeout=60)
        assert response.status_code == 200
        assert response.text.rstrip().endswith("[DONE]") == stream

    def named(name: str) -> list:
        return [s for s in otlp.spans_of_trace(trace_id) if s.name == name]
    wait_until(lambda: len(named("frontend.request")) == len(named("engine_core.request")) == 2,
               what="both requests' frontend and engine core spans")
    frontends, engines = named("frontend.request"), named("engine_core.request")
    assert all(f.parent_span_id == caller_span for f in frontends)
    assert {e.parent_span_id for e in engines} == {f.span_id for f in frontends}
    wait_all_blocks_free(stack)
    with open(log_path) as log:
        log.seek(log_start)
        written = log.read()
    assert " ERROR " not in written and "Failed to detach" not in written, written[-3000:]


def test_metrics_count_what_was_sent_and_gauges_return_to_zero(stack, otlp):
    ports = stack.metrics_addresses
    frontend_http = stack.http_address
    before = {name: scrape(addr) for name, addr in ports.items()}
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 40000) for _ in range(length)] for length in (5, 17, 40)]
    max_tokens = [3, 6, 9]
    with Client(address(stack, "frontend")) as client:
        for ids, n in zip(prompts, max_tokens):
            list(client.generate(token_ids=ids, max_tokens=n, ignore_eos=True, temperature=0))
        with pytest.raises(grpc.RpcError):
            list(client.generate(prompt="x", max_tokens=4, top_p=7.0))
    assert requests.post(f"http://{frontend_http}/v1/completions",
                         json={"prompt": "x", "max_tokens": -1}, timeout=10).status_code == 400
    # A message that is not one, to each internal service (it fails before any handler).
    for service, method in (("engine-core", "/llmserve.engine.v1.EngineCore/GetStats"),
                            ("worker", "/llmserve.worker.v1.Worker/RemoveLora")):
        with grpc.insecure_channel(address(stack, service)) as channel, \
                pytest.raises(grpc.RpcError) as bad:
            channel.unary_unary(method)(b"\xff\xff", timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_all_blocks_free(stack)
    after = {name: scrape(addr) for name, addr in ports.items()}

    def delta(service, name, **labels):
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    sent_prompt, sent_generated = sum(map(len, prompts)), sum(max_tokens)
    assert delta("frontend", "llmserve:prompt_tokens_total") == sent_prompt
    assert delta("frontend", "llmserve:generation_tokens_total") == sent_generated
    assert delta("frontend", "llmserve:request_success_total", finished_reason="length") == 3
    assert delta("frontend", "llmserve:time_to_first_token_seconds_count") == 3
    assert delta("frontend", "llmserve:inter_token_latency_seconds_count") == sent_generated - 3
    for phase in ("queue", "prefill", "decode"):
        assert delta("frontend", f"llmserve:request_{phase}_time_seconds_count") >= 3
    assert delta("frontend", "llmserve:request_errors_total", api="grpc",
                 code="INVALID_ARGUMENT") == 1
    assert delta("frontend", "llmserve:request_errors_total", api="http", code="400") == 1
    for service in ("engine-core", "worker"):
        assert delta(service, "llmserve:rpc_errors_total", code="INVALID_ARGUMENT") == 1
        internal = [v for (n, labels), v in after[service].items()
                    if n == "llmserve:rpc_errors_total" and ("code", "INTERNAL") in labels]
        assert internal == [0], internal  # there from the start, and no bug met
    # Every token computed once: the prompts (no prefix shared) and the decodes.
    assert delta("engine-core", "llmserve:iteration_tokens_total_sum") == \
        sent_prompt + sent_generated - 3
    assert delta("engine-core", "llmserve:prefix_cache_queries_total") == sent_prompt
    steps = delta("engine-core", "llmserve:engine_step_duration_seconds_count")
    assert steps >= max(max_tokens) and \
        delta("worker", "llmserve:worker_forward_time_seconds_count") == steps
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(after["engine-core"], f"llmserve:{gauge}") == 0, gauge
    info = engine_info_labels(after["engine-core"])
    assert info["block_size"] == "16" and int(info["num_kv_blocks"]) > 0
    worker = next(dict(ls) for (n, ls) in after["worker"] if n == "llmserve:worker_info")
    assert worker["device"] == "cpu" and worker["dtype"] == "float32"
    # The HTTP port serves the same frontend registry.
    assert value(scrape(frontend_http), "llmserve:generation_tokens_total") == \
        value(after["frontend"], "llmserve:generation_tokens_total")
    # And the same instruments reach the OTLP endpoint.
    wait_until(lambda: {"llmserve.generation_tokens", "llmserve.time_to_first_token_seconds"}
               <= otlp.metric_names.get("llmserve-frontend", set())
               and "llmserve.num_requests_running" in otlp.metric_names.get(
                   "llmserve-engine-core", ())
               and "llmserve.worker_forward_time_seconds" in otlp.metric_names.get(
                   "llmserve-worker", ()), what="OTLP metrics of all three services")


def engine_info_labels(samples: dict) -> dict:
    return next(dict(ls) for (n, ls) in samples if n == "llmserve:cache_config_info")
