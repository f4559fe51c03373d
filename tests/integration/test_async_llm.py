"""AsyncLLM, the frontend core every server adapts, with a scripted engine client:
tokenization off the event loop, n choices merged, a stop string aborting its
engine request, and one failing choice failing (and closing) the request."""
import asyncio
import threading

import pytest

from services.common.errors import ResourceExhausted
from services.common.metrics import ServiceMetrics
from services.common.request_events import RequestEvent, RequestEventKind
from services.common.request_types import EngineCoreOutput, EngineInfo, FinishReason
from services.common.sampling_params import OutputKind, SamplingParams
from services.frontend.async_llm import AsyncLLM, PromptInput
from services.frontend.engine_client import EngineClient
from services.frontend.metrics import FrontendMetrics
from services.frontend.processor import Processor
from services.common.tokenizer import load_tokenizer


class ScriptedEngine(EngineClient):
    """Streams each request the tokens `script` gives for its choice index."""

    def __init__(self, script):
        self.script, self.aborted, self.closed = script, [], []

    async def generate(self, request):
        tokens, fail = self.script(request.request_id)
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(0)
                if fail and i == 1:
                    raise ResourceExhausted("queue full")
                last = i == len(tokens) - 1
                yield EngineCoreOutput(request.request_id, [token],
                                       FinishReason.LENGTH if last else None)
        finally:
            self.closed.append(request.request_id)

    async def abort(self, request_ids):
        self.aborted += request_ids

    async def get_stats(self):
        raise NotImplementedError

    async def get_info(self):
        raise NotImplementedError


@pytest.fixture(scope="module")
def processor(model_dir):
    tokenizer, eos = load_tokenizer(model_dir)
    return Processor(tokenizer, EngineInfo(model_dir, 2048, 16, 100, "float32", 49152), eos)


def collect(llm, prompt, params, request_id="r"):
    async def run():
        return [o async for o in llm.generate(prompt, params, request_id)]
    return asyncio.run(run())


def test_tokenization_runs_off_the_event_loop(processor, monkeypatch):
    threads = []
    tokenize = processor.tokenize
    monkeypatch.setattr(processor, "tokenize",
                        lambda **kw: threads.append(threading.get_ident()) or tokenize(**kw))
    llm = AsyncLLM(ScriptedEngine(lambda rid: ([7], False)), processor, "m")
    collect(llm, PromptInput(prompt="Hello " * 500), SamplingParams(max_tokens=1))
    assert threads and threads[0] != threading.get_ident()  # asyncio.run's loop is this thread


def test_choices_merge_and_a_stop_string_aborts_its_engine_request(processor):
    tok = processor.tokenizer
    words = {0: tok.encode(" one two three", add_special_tokens=False),
             1: tok.encode(" red green blue", add_special_tokens=False)}
    engine = ScriptedEngine(lambda rid: (words[int(rid.rsplit("-", 1)[1])], False))
    llm = AsyncLLM(engine, processor, "m")
    outputs = collect(llm, PromptInput(prompt="x"), SamplingParams(
        n=2, max_tokens=10, stop=[" green"], output_kind=OutputKind.FINAL_ONLY))
    [final] = outputs
    assert [c.text for c in final.outputs] == [" one two three", " red"]
    assert final.outputs[1].stop_reason == " green" and final.finished
    [aborted] = engine.aborted
    assert aborted.startswith("r-") and aborted.endswith("-1")


def test_the_engine_knows_each_request_by_an_id_of_its_own(processor):
    """The caller's id, made unique: a caller may reuse it as soon as a request
    ends, before the engine core has heard of that end."""
    engine = ScriptedEngine(lambda rid: ([5, 6], False))
    llm = AsyncLLM(engine, processor, "m")
    for _ in range(2):
        collect(llm, PromptInput(prompt="x"), SamplingParams(max_tokens=2), "caller-id")
    first, second = engine.closed
    assert first != second and first.startswith("caller-id-") and second.startswith("caller-id-")


def test_a_failing_choice_fails_the_request_and_closes_the_others(processor):
    engine = ScriptedEngine(lambda rid: ([5, 6, 7, 8], rid.endswith("-1")))
    llm = AsyncLLM(engine, processor, "m")
    with pytest.raises(ResourceExhausted):
        collect(llm, PromptInput(prompt="x"), SamplingParams(n=3, max_tokens=4))
    assert sorted(c[-2:] for c in engine.closed) == ["-0", "-1", "-2"]
    assert not llm.output_processor.requests  # nothing left tracked


def test_metrics_count_tokens_latencies_and_outcomes(processor):
    """With n=2 and a stop string: each choice is a request; tokens that arrive after
    a stop string ended its choice are not counted; engine events give phases."""
    tok = processor.tokenizer
    words = {0: tok.encode(" one two three", add_special_tokens=False),
             1: tok.encode(" red green blue", add_special_tokens=False)}
    engine = ScriptedEngine(lambda rid: (words[int(rid.rsplit("-", 1)[1])], False))
    metrics = FrontendMetrics(ServiceMetrics("test"), "m", 2048)
    llm = AsyncLLM(engine, processor, "m", metrics)
    prompt_ids = processor.tokenize(prompt="x")
    collect(llm, PromptInput(prompt="x"), SamplingParams(n=2, max_tokens=10, stop=[" green"]))
    registry = metrics.registry

    def sample(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    delivered = len(words[0]) + words[1].index(tok.encode(" green", add_special_tokens=False)[0]) + 1
    assert sample("llmserve:generation_tokens_total") == delivered
    assert sample("llmserve:time_to_first_token_seconds_count") == 2
    assert sample("llmserve:inter_token_latency_seconds_count") == delivered - 2
    assert sample("llmserve:request_success_total", finished_reason="length") == 1
    assert sample("llmserve:request_success_total", finished_reason="stop") == 1
    assert sample("llmserve:prompt_tokens_total") == 2 * len(prompt_ids)
    assert sample("llmserve:e2e_request_latency_seconds_count") == 2
    assert sample("llmserve:request_queue_time_seconds_count") == 0  # the script sends no events
    metrics.on_engine_events([RequestEvent(RequestEventKind.QUEUED, 0),
                              RequestEvent(RequestEventKind.SCHEDULED, 2_000_000),
                              RequestEvent(RequestEventKind.FIRST_TOKEN, 5_000_000),
                              RequestEvent(RequestEventKind.FINISHED, 9_000_000)])
    assert sample("llmserve:request_queue_time_seconds_sum") == pytest.approx(0.002)
    assert sample("llmserve:request_prefill_time_seconds_sum") == pytest.approx(0.003)
    assert sample("llmserve:request_decode_time_seconds_sum") == pytest.approx(0.004)
