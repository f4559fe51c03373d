"""Greedy generation through the in-process pipeline vs transformers' generate."""
import asyncio

from services.common.request_types import EngineCoreRequest, FinishReason, SamplingParams
from services.engine_core.engine_loop import EngineLoop
from services.frontend.engine_client import InprocEngineClient
from services.worker.host_memory import huge_pages_available
from tests.conftest import PROMPTS, hf_generate_greedy, make_engine_core
from tests.unit.test_host_memory import mapping_of

MAX_TOKENS = 32


async def _generate_all(client, requests):
    async def one(request):
        tokens, reasons = [], []
        async for output in client.generate(request):
            tokens += output.new_token_ids
            reasons.append(output.finish_reason)
        return tokens, reasons
    return await asyncio.gather(*(one(r) for r in requests))


def test_batched_greedy_is_token_identical_to_transformers(model_dir, tokenizer, hf_model):
    core = make_engine_core(model_dir)
    client = InprocEngineClient(EngineLoop(core))
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    eos = [hf_model.config.eos_token_id]
    requests = [EngineCoreRequest(f"r{i}", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                                  eos) for i, ids in enumerate(prompt_ids)]
    try:
        results = asyncio.run(_generate_all(client, requests))
        # All 8 ran together (one after another would take ~8x the steps). + 1: the step
        # that tells workers they finished (sent as the last outputs go out, and
        # waited for when asyncio.run ends); + 1: the engine can step on the first
        # request before the other seven are in its inbox (seen on a loaded 2-core
        # machine), so theirs finish a step later.
        assert core.num_steps <= MAX_TOKENS + 2
        stopped_by = set()
        for ids, (tokens, reasons) in zip(prompt_ids, results):
            assert tokens == hf_generate_greedy(hf_model, ids, MAX_TOKENS)
            expected = FinishReason.STOP if tokens[-1] in eos else FinishReason.LENGTH
            assert reasons == [None] * (len(tokens) - 1) + [expected]
            stopped_by.add(expected)
        assert stopped_by == {FinishReason.STOP, FinishReason.LENGTH}  # both paths covered
        assert core.stats().num_used_kv_blocks == 0
        runner = core.executor.workers[0].model_runner
        assert len(runner.input_batch) == 0
        if huge_pages_available():  # the weights and KV cache these tokens came from
            assert {"hg" in mapping_of(t.data_ptr())[1]
                    for t in [*runner.model.parameters(), *runner.kv_caches]} == {True}
    finally:
        asyncio.run(client.close())


def test_eos_stops_and_frees_blocks(model_dir, tokenizer):
    core = make_engine_core(model_dir)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    core.add_request(EngineCoreRequest("chat", ids, SamplingParams(max_tokens=200, temperature=0),
                                       [tokenizer.eos_token_id]))
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].new_token_ids == [tokenizer.eos_token_id]
    assert len(outputs) < 200
    assert core.stats().num_used_kv_blocks == 0
