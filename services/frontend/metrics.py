"""The frontend's metrics: what callers see (latencies, tokens, outcomes), with
vLLM's names and buckets under `llmserve:`. The OutputProcessor reports to it as
engine outputs arrive; the gRPC and HTTP servers count the errors they return."""
from __future__ import annotations

import time

from services.common.metrics import ServiceMetrics, exponential_buckets
from services.common.request_events import RequestEvent, request_phases
from services.common.request_types import FinishReason
from services.frontend.choice import ChoiceState
from services.frontend.openai_api.errors import ERROR_STATUSES

# The codes the servers answer errors with: gRPC code names, HTTP statuses.
_ERROR_CODES = {
    "grpc": sorted({code.name for code in ERROR_STATUSES} | {"INTERNAL"}),
    "http": sorted({str(status) for status, _ in ERROR_STATUSES.values()} | {"500"})}
TASKS = ("generate", "embed")
# vLLM's buckets, in seconds.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class FrontendMetrics:
    def __init__(self, metrics: ServiceMetrics, model_name: str, max_model_len: int):
        self.registry = metrics.registry
        model = {"model_name": model_name}

        def histogram(name: str, doc: str, buckets: list[float]):
            return metrics.histogram(f"llmserve:{name}", doc, buckets, ["model_name"]).labels(**model)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Seconds from arrival to the first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Seconds between a choice's consecutive tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Seconds from arrival to the last token.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Seconds waiting in the engine core before first scheduled.",
                               _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Seconds from first scheduled to the first token.",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Seconds from the first token to the last.", _REQUEST_BUCKETS)
        lengths = exponential_buckets(max_model_len)
        self.prompt_length = histogram("request_prompt_tokens",
                                       "Prompt tokens per finished request.", lengths)
        self.generation_length = histogram("request_generation_tokens",
                                           "Generated tokens per finished request.", lengths)
        self.prompt_tokens = metrics.counter(
            "llmserve:prompt_tokens", "Prompt tokens of finished requests.",
            ["model_name"]).labels(**model)
        self.generation_tokens = metrics.counter(
            "llmserve:generation_tokens", "Tokens generated, counted as they stream.",
            ["model_name"]).labels(**model)
        self._success = metrics.counter(
            "llmserve:request_success", "Finished requests (each of n choices counts).",
            ["model_name", "finished_reason"])
        self._by_task = metrics.counter(
            "llmserve:request_success_by_task", "Finished requests by task: generate (each "
            "of n choices counts) or embed (each input of an embedding call counts).",
            ["model_name", "task"])
        self._errors = metrics.counter(
            "llmserve:request_errors", "Requests that ended with an error status: the gRPC "
            "code name, or the HTTP status.", ["model_name", "api", "code"])
        self._model = model
        self._start_known_series()

    def _start_known_series(self) -> None:
        """Every series of a known label value, at 0 from the start: a dashboard's
        error panel then shows 0, not "No data", on a server with no error yet
        (Prometheus' advice on missing series; vLLM does it too)."""
        for reason in FinishReason:
            self._success.labels(**self._model, finished_reason=str(reason))
        for task in TASKS:
            self._by_task.labels(**self._model, task=task)
        for api, codes in _ERROR_CODES.items():
            for code in codes:
                self._errors.labels(**self._model, api=api, code=code)

    # ---- called by the OutputProcessor -------------------------------------------

    def on_tokens(self, choice: ChoiceState, num_new: int, previous_token_time: float | None
                  ) -> None:
        """A choice got num_new tokens (choice.last_token_time is now)."""
        if previous_token_time is None:
            self.ttft.observe(choice.last_token_time - choice.arrival_time)
        else:
            self.itl.observe(choice.last_token_time - previous_token_time)
        self.generation_tokens.inc(num_new)

    def on_finished(self, choice: ChoiceState, num_prompt_tokens: int) -> None:
        self.e2e.observe((choice.finish_time or time.monotonic()) - choice.arrival_time)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_length.observe(num_prompt_tokens)
        self.generation_length.observe(len(choice.token_ids))
        self._success.labels(**self._model, finished_reason=str(choice.finish_reason)).inc()
        self._by_task.labels(**self._model, task="generate").inc()

    def on_pooled(self, num_prompt_tokens: int, e2e_s: float) -> None:
        """One input of an embedding call got its vector."""
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_length.observe(num_prompt_tokens)
        self._by_task.labels(**self._model, task="embed").inc()

    def on_engine_events(self, events: list[RequestEvent]) -> None:
        """An engine request ended; its events date its phases."""
        phases = request_phases(events)
        for histogram, seconds in ((self.queue, phases.queued_s), (self.prefill, phases.prefill_s),
                                   (self.decode, phases.decode_s)):
            if seconds is not None:
                histogram.observe(seconds)

    # ---- called by the servers ---------------------------------------------------

    def count_error(self, api: str, code: str) -> None:
        self._errors.labels(**self._model, api=api, code=code).inc()
