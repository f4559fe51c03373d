"""EngineSession: the engine core's end of one frontend's Session stream.

Requests arrive on the stream, and the outputs of a step leave on it as one
message for all of them: the session is a single OutputSink of the EngineLoop.
Each request's `engine_core.request` span starts when it is added and ends with
its last output; the steps that serve it link to that span.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from opentelemetry import trace

from services.common import convert, tracing
from services.common.errors import LLMServeError, error_with_status, request_id_in_use
from services.common.pb import engine_core_pb2
from services.common.request_types import EngineCoreOutput
from services.engine_core.engine_loop import EngineLoop
from services.engine_core.request_spans import record_phase_spans

logger = logging.getLogger(__name__)
_tracer = tracing.tracer(__name__)


@dataclass
class _LiveRequest:
    span: trace.Span
    num_prompt_tokens: int
    num_output_tokens: int = 0


class EngineSession:
    def __init__(self, engine: EngineLoop):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self._ready: asyncio.Queue[list[engine_core_pb2.EngineCoreOutput]] = asyncio.Queue()
        self._live: dict[str, _LiveRequest] = {}
        self._adding: dict[str, asyncio.Task] = {}  # requests on their way into the engine

    async def take(self, messages: AsyncIterator[engine_core_pb2.SessionRequest]) -> None:
        """Acts on what the frontend sends, until it stops sending."""
        async for message in messages:
            if message.HasField("add"):
                self._add(message.add)
            elif message.HasField("abort"):
                self.abort(list(message.abort.request_ids))

    async def outputs(self) -> AsyncIterator[engine_core_pb2.SessionOutputs]:
        """The stream's messages: one per step that produced something here."""
        while True:
            yield engine_core_pb2.SessionOutputs(outputs=await self._ready.get())

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self._adding:
                self._adding[request_id].cancel()
        self.engine.abort_soon(request_ids)

    def close(self) -> None:
        """The stream ended: aborts what still runs."""
        self.abort(list(self._live))
        for live in self._live.values():
            live.span.end()
        self._live.clear()

    # ---- OutputSink: called on self.loop once per step -------------------------

    def deliver(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            live.num_output_tokens += len(output.new_token_ids)
            if output.finished:
                del self._live[output.request_id]
                _end_request_span(live, output)
        self._ready.put_nowait([convert.engine_core_output_to_proto(o) for o in outputs])

    def fail(self, request_ids: list[str], error: LLMServeError) -> None:
        for request_id in request_ids:
            live = self._live.pop(request_id, None)
            if live is not None:
                live.span.set_status(trace.StatusCode.ERROR, str(error))
                live.span.end()
        self._ready.put_nowait([convert.request_error_to_proto(r, error) for r in request_ids])

    # ---- adding ----------------------------------------------------------------

    def _add(self, message: engine_core_pb2.EngineCoreRequest) -> None:
        request_id = message.request_id
        if request_id in self._live:
            self._ready.put_nowait([convert.request_error_to_proto(
                request_id, request_id_in_use(request_id))])
            return
        try:
            request = convert.engine_core_request_from_proto(message)
        except LLMServeError as e:
            self._ready.put_nowait([convert.request_error_to_proto(request_id, e)])
            return
        span = _tracer.start_span(
            "engine_core.request", context=tracing.context_from_headers(request.trace_headers),
            attributes={"gen_ai.request.id": request_id})
        request.trace_headers = tracing.span_headers(span)  # the steps link to this span
        self._live[request_id] = _LiveRequest(span, len(request.prompt_token_ids))
        adding = asyncio.create_task(self.engine.add_request(request, self))
        adding.add_done_callback(lambda task: self._added(request_id, task))
        self._adding[request_id] = adding

    def _added(self, request_id: str, task: asyncio.Task) -> None:
        """The add's outcome. A done callback, not the task's own except: a task
        cancelled before it began never runs its code, and its request would stay
        live here (and its id taken) for good."""
        self._adding.pop(request_id, None)
        if task.cancelled():
            # Aborted on its way in. If it got in anyway, the abort that cancelled
            # it (queued after the add) ends it in the engine.
            live = self._live.pop(request_id, None)
            if live is not None:
                live.span.end()
        elif (error := task.exception()) is not None:
            if not isinstance(error, LLMServeError):  # a bug: log it, and end the request
                logger.error("adding request %s failed", request_id, exc_info=error)
                error = error_with_status(grpc.StatusCode.INTERNAL,
                                          f"the engine core failed to add the request: {error}")
            self.fail([request_id], error)


def spec_decode_attributes(last: EngineCoreOutput) -> dict:
    """Tokens per step verifying drafts, as vLLM counts its mean acceptance length:
    1 + accepted drafts / request steps with drafts."""
    return {"llmserve.spec_decode.num_draft_tokens": last.num_draft_tokens,
            "llmserve.spec_decode.num_accepted_tokens": last.num_accepted_tokens,
            "llmserve.spec_decode.num_drafts": last.num_drafts,
            "llmserve.spec_decode.mean_acceptance_length":
                1 + last.num_accepted_tokens / max(1, last.num_drafts)}


def _end_request_span(live: _LiveRequest, last: EngineCoreOutput) -> None:
    """The request's usage and outcome, and its phases as child spans."""
    if tracing.is_exporting():
        live.span.set_attributes({"gen_ai.usage.input_tokens": live.num_prompt_tokens,
                                  "gen_ai.usage.output_tokens": live.num_output_tokens,
                                  "gen_ai.response.finish_reasons": [str(last.finish_reason)]})
        if last.num_draft_tokens:  # speculative decoding: what its drafts achieved
            live.span.set_attributes(spec_decode_attributes(last))
        with trace.use_span(live.span, end_on_exit=False):
            record_phase_spans(_tracer, last.events)
    live.span.end()
