"""Request lifecycle events: what the scheduler records, the phases they give,
and the phase spans the engine core makes from them."""
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.request_events import RequestEvent, RequestEventKind as K, request_phases
from services.engine_core.request_spans import record_phase_spans
from tests.unit.test_scheduler import make_scheduler, request, run_step

S = 1_000_000_000  # ns per second


def final_events(scheduler) -> dict[str, list[RequestEvent]]:
    events = {}
    while scheduler.has_work():
        _, outputs = run_step(scheduler)
        events.update({o.request_id: o.events for o in outputs if o.finished})
    return events


def test_chunked_prefill_then_decode_is_recorded_in_order():
    s = make_scheduler(budget=8)
    s.add_request(request("a", 20, max_tokens=3))
    events = final_events(s)["a"]
    kinds = [e.kind for e in events]
    assert kinds == [K.QUEUED, K.SCHEDULED, K.PREFILL_CHUNK, K.PREFILL_CHUNK, K.PREFILL_CHUNK,
                     K.FIRST_TOKEN, K.FINISHED]
    assert [e.num_tokens for e in events if e.kind is K.PREFILL_CHUNK] == [8, 8, 4]
    assert [e.time_ns for e in events] == sorted(e.time_ns for e in events)


def test_preemption_is_recorded_with_its_recomputation():
    s = make_scheduler(num_blocks=25, budget=256, max_model_len=64)
    for i in range(6):
        s.add_request(request(f"r{i}", 10 + i, max_tokens=30, first_token=100 * (i + 1)))
    events = final_events(s)
    assert s.num_preemptions > 0
    preempted = [e for e in events.values() if any(x.kind is K.PREEMPTED for x in e)]
    assert len(preempted) >= 1
    for request_events in preempted:
        kinds = [e.kind for e in request_events]
        after = kinds[kinds.index(K.PREEMPTED):]
        # Waits, is scheduled again and recomputes prompt + generated tokens in a chunk.
        assert after[1:3] == [K.SCHEDULED, K.PREFILL_CHUNK]
        assert kinds.count(K.FIRST_TOKEN) == 1 and kinds[-1] is K.FINISHED
    assert sum(request_phases(e).num_preemptions for e in events.values()) == s.num_preemptions


def test_abort_while_queued_has_only_a_queue_phase():
    s = make_scheduler(max_seqs=1)
    s.add_request(request("running", 4))
    s.add_request(request("queued", 4))
    run_step(s)
    [output] = s.abort_requests(["queued"])
    assert [e.kind for e in output.events] == [K.QUEUED, K.FINISHED]
    phases = request_phases(output.events)
    assert phases.queued_s is None and phases.prefill_s is None and phases.decode_s is None


def test_phases_follow_vllms_definitions():
    events = [RequestEvent(K.QUEUED, 1 * S), RequestEvent(K.SCHEDULED, 3 * S),
              RequestEvent(K.PREFILL_CHUNK, 3 * S, 16), RequestEvent(K.FIRST_TOKEN, 4 * S),
              RequestEvent(K.PREEMPTED, 5 * S, 20), RequestEvent(K.SCHEDULED, 7 * S),
              RequestEvent(K.PREFILL_CHUNK, 7 * S, 20), RequestEvent(K.FINISHED, 9 * S)]
    phases = request_phases(events)
    assert (phases.queued_s, phases.prefill_s, phases.decode_s) == (2.0, 1.0, 5.0)
    assert phases.num_preemptions == 1


def test_phase_spans_are_children_of_the_current_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    events = [RequestEvent(K.QUEUED, 1 * S), RequestEvent(K.SCHEDULED, 3 * S),
              RequestEvent(K.PREFILL_CHUNK, 3 * S, 8), RequestEvent(K.PREFILL_CHUNK, 3 * S + 5, 4),
              RequestEvent(K.FIRST_TOKEN, 4 * S), RequestEvent(K.PREEMPTED, 5 * S, 20),
              RequestEvent(K.SCHEDULED, 7 * S), RequestEvent(K.PREFILL_CHUNK, 7 * S, 20),
              RequestEvent(K.FINISHED, 9 * S)]
    with tracer.start_as_current_span("engine_core.request") as parent:
        record_phase_spans(tracer, events)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"engine_core.request", "queued", "prefill", "decode", "preempted"}
    for name in ("queued", "prefill", "decode", "preempted"):
        assert spans[name].parent.span_id == parent.get_span_context().span_id
    windows = {n: (spans[n].start_time, spans[n].end_time) for n in spans if n != parent.name}
    assert windows == {"queued": (1 * S, 3 * S), "prefill": (3 * S, 4 * S),
                       "decode": (4 * S, 9 * S), "preempted": (5 * S, 7 * S)}
    assert [(e.name, e.attributes["llmserve.chunk.num_tokens"]) for e in spans["prefill"].events] \
        == [("prefill_chunk", 8), ("prefill_chunk", 4)]
    assert [e.name for e in spans["decode"].events] == ["recompute_chunk"]
    assert spans["preempted"].attributes["llmserve.preemption.num_tokens_to_recompute"] == 20
