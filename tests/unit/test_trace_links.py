"""A request's link for the step spans: parsed from its W3C headers once, and
none where the headers name no valid span."""
from __future__ import annotations

from services.common import tracing
from services.common.request_types import SamplingParams
from services.engine_core.request import Request

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _request(headers: dict[str, str]) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=4), trace_headers=headers)


def test_a_request_links_to_the_span_its_headers_name():
    link = _request({"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01"}).trace_link
    assert f"{link.context.trace_id:032x}" == TRACE_ID
    assert f"{link.context.span_id:016x}" == SPAN_ID


def test_no_link_without_a_valid_span():
    assert _request({}).trace_link is None
    assert _request({"traceparent": "00-not-a-trace-01"}).trace_link is None


def test_the_headers_are_parsed_once(monkeypatch):
    calls = []
    real = tracing.link_to
    monkeypatch.setattr(tracing, "link_to", lambda h: calls.append(h) or real(h))
    request = _request({"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01"})
    links = {id(request.trace_link) for _ in range(5)}
    assert len(links) == 1 and len(calls) == 1
