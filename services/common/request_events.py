"""What happened to a request in the engine core, and when: its lifecycle events,
and the phases (queued, prefill, decode) they delimit.

The engine core records events as they happen and sends them with the request's
last output. It makes the request's phase spans from them; the frontend makes
its queue, prefill and decode histograms from them. Times are Unix nanoseconds
(spans need them); each duration is between two times of the same clock.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestEventKind(enum.IntEnum):
    # Values are those of RequestEvent.Kind in engine_core.proto.
    QUEUED = 1  # added to the waiting queue
    SCHEDULED = 2  # taken from the waiting queue (first time, or after a preemption)
    PREFILL_CHUNK = 3  # a step computes num_tokens of its prompt (or a recomputation)
    FIRST_TOKEN = 4  # its first output token was sampled
    PREEMPTED = 5  # its KV blocks were freed; it waits to be recomputed
    FINISHED = 6


@dataclass(slots=True)
class RequestEvent:
    kind: RequestEventKind
    time_ns: int
    num_tokens: int = 0  # PREFILL_CHUNK: the chunk's tokens; PREEMPTED: tokens to recompute


@dataclass
class RequestPhases:
    """Seconds spent in each phase (vLLM's definitions); None when a phase was
    never reached (an abort while queued has no prefill)."""

    queued_s: float | None
    prefill_s: float | None
    decode_s: float | None
    num_preemptions: int


def request_phases(events: list[RequestEvent]) -> RequestPhases:
    """queued: QUEUED to the first SCHEDULED; prefill: from there to FIRST_TOKEN;
    decode: FIRST_TOKEN to FINISHED (preemptions included)."""
    first = {}
    for event in events:
        first.setdefault(event.kind, event.time_ns)
    return RequestPhases(
        queued_s=_seconds(first, RequestEventKind.QUEUED, RequestEventKind.SCHEDULED),
        prefill_s=_seconds(first, RequestEventKind.SCHEDULED, RequestEventKind.FIRST_TOKEN),
        decode_s=_seconds(first, RequestEventKind.FIRST_TOKEN, RequestEventKind.FINISHED),
        num_preemptions=sum(e.kind is RequestEventKind.PREEMPTED for e in events))


def _seconds(first: dict, start: RequestEventKind, end: RequestEventKind) -> float | None:
    if start not in first or end not in first:
        return None
    return (first[end] - first[start]) / 1e9
