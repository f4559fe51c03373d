"""A request's phases as child spans of its engine-core span, made when it ends
from the events the scheduler recorded (spans take explicit start and end times,
so the busy loop pays only for appending events)."""
from __future__ import annotations

from opentelemetry import trace

from services.common.request_events import RequestEvent, RequestEventKind as Kind

_CHUNK_TOKENS = "llmserve.chunk.num_tokens"


def record_phase_spans(tracer: trace.Tracer, events: list[RequestEvent]) -> None:
    """queued; prefill, with an event per chunk; decode, with an event per chunk
    recomputed after a preemption; and a `preempted` span per preemption (out of
    the cache until scheduled again). All under the current span."""
    if not events:
        return
    end = events[-1].time_ns
    scheduled = _first(events, Kind.SCHEDULED)
    first_token = _first(events, Kind.FIRST_TOKEN)
    chunks = [e for e in events if e.kind is Kind.PREFILL_CHUNK]
    _span(tracer, "queued", events[0].time_ns, scheduled or end)
    if scheduled is not None:
        _span(tracer, "prefill", scheduled, first_token or end,
              [c for c in chunks if first_token is None or c.time_ns < first_token],
              "prefill_chunk")
    if first_token is not None:
        _span(tracer, "decode", first_token, end,
              [c for c in chunks if c.time_ns >= first_token], "recompute_chunk")
    for i, event in enumerate(events):
        if event.kind is Kind.PREEMPTED:
            resumed = _first(events[i:], Kind.SCHEDULED) or end
            _span(tracer, "preempted", event.time_ns, resumed, attributes={
                "llmserve.preemption.num_tokens_to_recompute": event.num_tokens})


def _first(events: list[RequestEvent], kind: Kind) -> int | None:
    return next((e.time_ns for e in events if e.kind is kind), None)


def _span(tracer: trace.Tracer, name: str, start_ns: int, end_ns: int,
          chunks: list[RequestEvent] = (), chunk_event: str = "",
          attributes: dict | None = None) -> None:
    span = tracer.start_span(name, start_time=start_ns, attributes=attributes)
    for chunk in chunks:
        span.add_event(chunk_event, {_CHUNK_TOKENS: chunk.num_tokens}, timestamp=chunk.time_ns)
    span.end(end_time=end_ns)
