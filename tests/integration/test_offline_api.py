"""The offline Python API (LLM, LLMEngine) and the examples that use it."""
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve import LLM, FinishReason, LLMEngine, SamplingParams
from tests.conftest import PROMPTS, hf_generate_greedy

EXAMPLES = Path(__file__).parents[2] / "examples"
SMALL = dict(dtype="float32", max_model_len=1024, kv_cache_gib=0.05)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **SMALL)


def test_generate_returns_request_outputs_in_order(llm, tokenizer, hf_model):
    outputs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=12, temperature=0,
                                                        logprobs=1))
    assert [o.prompt for o in outputs] == PROMPTS[:4]
    for output in outputs:
        ids = tokenizer(output.prompt)["input_ids"]
        assert output.prompt_token_ids == ids and output.finished
        choice = output.outputs[0]
        assert choice.token_ids == hf_generate_greedy(hf_model, ids, 12)
        assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert choice.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert len(choice.logprobs) == len(choice.token_ids)
        assert choice.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in choice.logprobs))


def test_generate_n_chat_and_stop_strings(llm):
    [output] = llm.generate([[{"role": "user", "content": "Tell me a story."}]],
                            SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3))
    assert len(output.outputs) == 2 and output.outputs[0].token_ids != output.outputs[1].token_ids
    [stopped] = llm.generate("The capital of France is", SamplingParams(
        max_tokens=20, temperature=0, stop=["."]), use_tqdm=False)
    assert stopped.outputs[0].text == " Paris" and stopped.outputs[0].stop_reason == "."
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.stats().num_used_kv_blocks == 0


def test_engine_step_abort_and_priority(model_dir):
    engine = LLMEngine.create(model=model_dir, scheduling_policy="priority", max_num_seqs=1,
                              **SMALL)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("late-but-urgent-arrives-second", "b", params, priority=-5)
    engine.add_request("low", "a", params, priority=5)
    engine.add_request("aborted", "c", params, priority=0)
    engine.abort_request("aborted")
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == ["late-but-urgent-arrives-second", "low"]
    assert engine.core.stats().num_used_kv_blocks == 0


@pytest.mark.parametrize("example", ["offline_generate.py", "engine_step_loop.py"])
def test_offline_examples_run(example):
    out = subprocess.run([sys.executable, str(EXAMPLES / example), "0.1"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("\n") >= 4


def test_n_choices_share_the_prompt_through_the_prefix_cache(llm):
    before = llm.engine.core.stats().prefix_cache_hits
    prompt = list(range(1000, 1064))  # 64 tokens: 3 full blocks reusable, the last token not
    [output] = llm.generate([prompt], SamplingParams(n=3, max_tokens=4, temperature=0.7, seed=1),
                            use_tqdm=False)
    assert len(output.outputs) == 3
    assert llm.engine.core.stats().prefix_cache_hits - before == 2 * 48
