"""AsyncLLM: the frontend's one transport-free core (vLLM's AsyncLLM).

generate() tokenizes (off the event loop), fans the n choices out to the engine,
merges their streams, and runs every engine output through the OutputProcessor
(detokenization, stop strings and their aborts, output kinds, timings). The gRPC
servicer and the HTTP server only convert requests in and GenerationOutputs out.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from opentelemetry import context as otel_context
from opentelemetry import trace

from services.common import tracing
from services.common.beam_search import BeamSearch
from services.common.errors import (FailedPrecondition, InvalidArgument, LLMServeError,
                                    Unavailable, request_id_in_use)
from services.common.pooling_params import PoolingParams
from services.common.request_types import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.frontend.async_merge import merge
from services.frontend.engine_client import EngineClient
from services.frontend.lora_adapters import LoRAAdapters
from services.frontend.metrics import FrontendMetrics
from services.frontend.output_processor import GenerationOutput, OutputProcessor, RequestState
from services.frontend.pooling import Embedding, check_embed_inputs, pool_all
from services.frontend.processor import ChatMessage, Processor

logger = logging.getLogger(__name__)
_tracer = tracing.tracer(__name__)
MAX_REQUEST_ID_CHARS = 256


def engine_request_id(request_id: str) -> str:
    """The id the engine core knows a request by: the caller's, made unique (as
    vLLM's internal request ids are). A caller may reuse its id the moment its
    request ends here, while the engine core has yet to hear of that end (the
    abort on its way there, the last output on its way back): the two
    incarnations must not be taken for one another, or an old abort ends the new
    request, or an old output ends its stream here while it runs on unread."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


@dataclass
class PromptInput:
    """Exactly one of text, token ids or chat messages (Processor.tokenize checks)."""

    prompt: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # for a text prompt (e.g. BOS)

    def tokenize_kwargs(self) -> dict:
        return {"prompt": self.prompt, "token_ids": self.token_ids, "chat": self.chat,
                "add_generation_prompt": self.add_generation_prompt,
                "add_special_tokens": self.add_special_tokens}


@dataclass
class RequestOptions:
    """What a request carries besides its input and sampling parameters."""

    priority: int = 0
    # A loaded LoRA adapter to run with; None: the base model.
    lora_name: str | None = None
    # The caller's trace context (from gRPC metadata or HTTP headers).
    trace_context: otel_context.Context | None = None
    # Beam search instead of sampling; None: sampling.
    beam_search: BeamSearch | None = None
    attributes: dict = field(default_factory=dict)  # extra span attributes


class AsyncLLM:
    def __init__(self, engine: EngineClient, processor: Processor, model_name: str,
                 metrics: FrontendMetrics | None = None):
        self.engine = engine
        self.processor = processor
        self.model_name = model_name
        self.metrics = metrics
        self.output_processor = OutputProcessor(processor.tokenizer, metrics)
        self.loras = LoRAAdapters(engine)
        # Ids reserved from the moment a request arrives (before tokenization ends).
        self._live_request_ids: set[str] = set()
        self.draining = False  # shutting down: new requests are refused

    def start_draining(self) -> None:
        self.draining = True

    def num_in_flight(self) -> int:
        return len(self._live_request_ids)

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    async def tokenize(self, prompt: PromptInput) -> list[int]:
        """Token ids, computed on a thread: a long input or chat template does not
        hold up the event loop that streams other requests."""
        return await asyncio.to_thread(self.processor.tokenize, **prompt.tokenize_kwargs())

    async def generate(self, prompt: PromptInput, params: SamplingParams, request_id: str,
                       options: RequestOptions | None = None) -> AsyncIterator[GenerationOutput]:
        """The request's outputs as they come; leaving early aborts it in the engine.
        Raises LLMServeError subclasses (InvalidArgument, ResourceExhausted, ...)."""
        options = options or RequestOptions()
        self._check_runner("generate")
        self._reserve(request_id)
        arrival_time = time.monotonic()
        span = _tracer.start_span("frontend.request", context=options.trace_context,
                                  attributes=self._span_attributes(request_id, params, options))
        state, outcome = None, "cancelled"
        try:
            # Current only until the first yield: a streamed HTTP response resumes this
            # generator in other contexts, where detaching it would fail. The engine
            # requests carry the span's context in their trace headers.
            with trace.use_span(span, end_on_exit=False):
                lora = self.loras.get(options.lora_name)
                prompt_ids = await self.tokenize(prompt)
                engine_requests = self.processor.make_requests(
                    engine_request_id(request_id), prompt_ids, params,
                    tracing.current_trace_headers(), options.priority, lora, options.beam_search)
                beams = options.beam_search
                state = self.output_processor.add_request(
                    request_id, prompt.prompt, prompt_ids, params,
                    [r.request_id for r in engine_requests], arrival_time,
                    beams.beam_width if beams else 0)
            async for output in self._outputs(engine_requests, span):
                yield output
            outcome = ",".join(str(c.finish_reason) for c in state.choices)
        except LLMServeError as e:
            outcome = f"failed ({e.code.name})"
            raise
        finally:
            self._live_request_ids.discard(request_id)
            self.output_processor.abort_request(request_id)  # forgets it if still there
            self._record(span, request_id, state, outcome)

    def _check_runner(self, wanted: str) -> None:
        """vLLM's rule: a model is served for generation or for embeddings (--runner)."""
        runner = self.processor.engine_info.runner
        if runner == wanted:
            return
        if runner == "pooling":
            raise FailedPrecondition(
                f"this server runs {self.model_name} as an embedding model (--runner pooling): "
                "it embeds (Embed, POST /v1/embeddings, /v1/score) and does not generate")
        raise FailedPrecondition(
            f"this server runs {self.model_name} for generation (--runner generate); a server "
            "started with --runner pooling embeds")

    def _reserve(self, request_id: str) -> None:
        """Takes the id for a new request, or says why it cannot start."""
        if self.draining:
            raise Unavailable("this server is shutting down; send the request to another one")
        if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise InvalidArgument("request_id", f"must have 1 to {MAX_REQUEST_ID_CHARS} characters")
        if request_id in self._live_request_ids:
            raise request_id_in_use(request_id)
        self._live_request_ids.add(request_id)

    async def embed(self, inputs: list[PromptInput], params: PoolingParams, request_id: str,
                    options: RequestOptions | None = None) -> list[Embedding]:
        """One vector per input, in the inputs' order: a pooling request each (prefill
        only), all in the engine at once; one failing cancels the others."""
        options = options or RequestOptions()
        self._check_runner("pooling")
        self._reserve(request_id)
        span = _tracer.start_span("frontend.embed", context=options.trace_context, attributes={
            "gen_ai.request.id": request_id, "gen_ai.operation.name": "embeddings",
            "gen_ai.request.model": self.model_name, **options.attributes})
        start, outcome, results = time.monotonic(), "cancelled", []
        try:
            with trace.use_span(span, end_on_exit=False):  # no yield inside: no detach issue
                requests = await self._pooling_requests(inputs, params, request_id, options)
                results = await pool_all(self.engine, requests)
            if self.metrics is not None:
                for embedding in results:
                    self.metrics.on_pooled(embedding.num_prompt_tokens, time.monotonic() - start)
            outcome = "embedded"
            return results
        except LLMServeError as e:
            outcome = f"failed ({e.code.name})"
            raise
        finally:
            self._live_request_ids.discard(request_id)
            num_prompt = sum(r.num_prompt_tokens for r in results)
            span.set_attribute("gen_ai.usage.input_tokens", num_prompt)
            span.end()
            logger.info("request %s %s: %d inputs, %d prompt tokens, e2e %.3f s", request_id,
                        outcome, len(inputs), num_prompt, time.monotonic() - start)

    async def _pooling_requests(self, inputs: list[PromptInput], params: PoolingParams,
                                request_id: str, options: RequestOptions
                                ) -> list[EngineCoreRequest]:
        check_embed_inputs(inputs)
        lora = self.loras.get(options.lora_name)
        ids = [await self.tokenize(p) for p in inputs]
        engine_id = engine_request_id(request_id)
        return [self.processor.make_pooling_request(
            engine_id if len(ids) == 1 else f"{engine_id}-{i}", prompt_ids, params,
            tracing.current_trace_headers(), options.priority, lora)
            for i, prompt_ids in enumerate(ids)]

    async def abort(self, request_id: str) -> None:
        """Aborts a running request in the engine (its stream then ends)."""
        engine_ids = self.output_processor.abort_request(request_id)
        if engine_ids:
            await self.engine.abort(engine_ids)

    async def _outputs(self, requests: list[EngineCoreRequest],
                       span: trace.Span) -> AsyncIterator[GenerationOutput]:
        """The choices' engine streams merged and run through the output processor.
        One choice failing ends them all (the others would have nobody reading)."""
        async for _, engine_output in merge([self.engine.generate(r) for r in requests]):
            processed = self.output_processor.process_outputs([engine_output])
            if processed.engine_ids_to_abort:
                with trace.use_span(span, end_on_exit=False):  # no yield inside
                    await self.engine.abort(processed.engine_ids_to_abort)
            for output in processed.outputs:
                yield output

    def _span_attributes(self, request_id: str, params: SamplingParams,
                         options: RequestOptions) -> dict:
        return {"gen_ai.request.id": request_id, "gen_ai.request.n": params.n,
                "gen_ai.request.max_tokens": params.max_tokens or 0,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.model": self.model_name, **options.attributes}

    def _record(self, span, request_id: str, state: RequestState | None, outcome: str) -> None:
        """Ends the request's span, and logs its one line."""
        now = time.monotonic()
        num_prompt = len(state.prompt_token_ids) if state else 0
        generated = sum(len(c.token_ids) for c in state.choices) if state else 0
        start = state.choices[0].arrival_time if state else now
        first = min((c.first_token_time for c in state.choices if c.first_token_time),
                    default=now) if state else now
        span.set_attributes({
            "gen_ai.usage.input_tokens": num_prompt, "gen_ai.usage.output_tokens": generated,
            "gen_ai.response.finish_reasons": outcome.split(","),
            "gen_ai.response.model": self.model_name})
        span.end()
        logger.info("request %s %s: %d prompt + %d generated tokens, ttft %.3f s, e2e %.3f s",
                    request_id, outcome, num_prompt, generated, first - start, now - start)
