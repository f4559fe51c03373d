"""The offline API used as vLLM's documentation uses it (only the import line
differs), asserting on vLLM's field types; and the examples that use it."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmserve import (LLM, CompletionOutput, EngineArgs, LLMEngine, Logprob, RequestOutput,
                      SamplingParams)
from llmserve.sampling_params import RequestOutputKind
from services.common.errors import InvalidArgument, ResourceExhausted
from tests.conftest import PROMPTS, hf_generate_greedy

EXAMPLES = Path(__file__).parents[2] / "examples"
SMALL = dict(dtype="float32", max_model_len=1024, kv_cache_gib=0.05)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **SMALL)


def assert_vllm_types(output):
    assert isinstance(output, RequestOutput) and isinstance(output.request_id, str)
    assert isinstance(output.finished, bool) and output.finished
    assert isinstance(output.num_cached_tokens, int)
    for completion in output.outputs:
        assert isinstance(completion, CompletionOutput) and completion.finished()
        assert isinstance(completion.text, str) and isinstance(completion.finish_reason, str)
        assert completion.finish_reason in ("stop", "length")
        assert all(isinstance(t, int) for t in completion.token_ids)


def test_generate_takes_every_prompt_form(llm, tokenizer, hf_model):
    ids = tokenizer(PROMPTS[1])["input_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    [single] = llm.generate(PROMPTS[0], greedy, use_tqdm=False)
    mixed = llm.generate([PROMPTS[0], {"prompt": PROMPTS[1]}, {"prompt_token_ids": ids}],
                         [greedy, greedy, SamplingParams(temperature=0, max_tokens=4)])
    for output in [single, *mixed]:
        assert_vllm_types(output)
    assert [o.prompt for o in mixed] == [PROMPTS[0], PROMPTS[1], None]
    assert mixed[0].outputs[0].token_ids == single.outputs[0].token_ids
    assert mixed[1].prompt_token_ids == mixed[2].prompt_token_ids == ids
    assert mixed[1].outputs[0].token_ids == hf_generate_greedy(hf_model, ids, 8)
    assert mixed[2].outputs[0].token_ids == mixed[1].outputs[0].token_ids[:4]
    assert mixed[2].outputs[0].finish_reason == "length"
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        llm.generate({"text": "wrong key"}, use_tqdm=False)
    with pytest.raises(InvalidArgument, match="'x' is not a token id"):
        llm.generate({"prompt_token_ids": [1, "x"]}, use_tqdm=False)


def test_chat_takes_one_or_many_conversations(llm, tokenizer, hf_model):
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer
    conversation = [{"role": "user", "content": "Say hi."}]
    params = SamplingParams(temperature=0, max_tokens=24)
    [one] = llm.chat(conversation, params, use_tqdm=False)
    many = llm.chat([conversation, [{"role": "user", "content": "Name a color."}]], params)
    assert_vllm_types(one)
    assert len(many) == 2 and many[0].outputs[0].text == one.outputs[0].text
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert one.prompt_token_ids == ids
    expected = hf_generate_greedy(hf_model, ids, 24)
    assert one.outputs[0].token_ids == expected and expected[-1] == tokenizer.eos_token_id
    # EOS: "stop" with no stop_reason; the text leaves the special token out.
    assert one.outputs[0].finish_reason == "stop" and one.outputs[0].stop_reason is None
    assert one.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_logprob_dicts_are_vllms(llm, tokenizer, hf_model):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    [output] = llm.generate(PROMPTS[5], params, use_tqdm=False)
    completion = output.outputs[0]
    prompt, generated = output.prompt_token_ids, completion.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt + generated])).logits[0], -1)
    assert len(completion.logprobs) == len(generated)
    for i, (token, position) in enumerate(zip(generated, completion.logprobs)):
        assert isinstance(position, dict) and list(position)[0] == token
        assert all(isinstance(v, Logprob) for v in position.values())
        assert set(position) == set(reference[len(prompt) - 1 + i].topk(2).indices.tolist())
        assert position[token].rank == 1
        assert position[token].decoded_token == tokenizer.decode([token])
        assert math.isclose(position[token].logprob, reference[len(prompt) - 1 + i, token],
                            abs_tol=1e-3)
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(generated, completion.logprobs)))
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position, (token, entry) in enumerate(zip(prompt[1:], output.prompt_logprobs[1:])):
        assert token in entry and len(entry) in (1, 2)
        assert math.isclose(entry[token].logprob, reference[position, token], abs_tol=1e-3)


def test_stop_reasons(llm, tokenizer):
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    [free] = llm.generate(PROMPTS[0], SamplingParams(**greedy), use_tqdm=False)
    assert free.outputs[0].finish_reason == "length" and free.outputs[0].stop_reason is None
    tokens = free.outputs[0].token_ids
    end = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    [by_token] = llm.generate(PROMPTS[0], SamplingParams(**greedy, stop_token_ids=[tokens[end]]),
                              use_tqdm=False)
    assert by_token.outputs[0].token_ids == tokens[:end + 1]
    assert (by_token.outputs[0].finish_reason, by_token.outputs[0].stop_reason) == \
        ("stop", tokens[end])
    word = free.outputs[0].text.split()[1]
    [by_string] = llm.generate(PROMPTS[0], SamplingParams(**greedy, stop=word), use_tqdm=False)
    assert (by_string.outputs[0].finish_reason, by_string.outputs[0].stop_reason) == ("stop", word)
    assert by_string.outputs[0].text == free.outputs[0].text[:free.outputs[0].text.index(word)]


def test_n_with_a_seed_is_reproducible(llm):
    # ignore_eos: a raw prompt often samples EOS first, and two choices that both
    # stop at once would look alike for a reason that has nothing to do with seeds.
    params = SamplingParams(n=3, temperature=1.0, top_k=-1, seed=5, max_tokens=10,
                            ignore_eos=True)
    [first] = llm.generate("Tell me a story.", params, use_tqdm=False)
    [again] = llm.generate("Tell me a story.", params, use_tqdm=False)
    assert_vllm_types(first)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert llm.llm_engine.engine_core.stats().num_used_kv_blocks == 0


def test_logit_bias_allowed_token_ids_and_bad_words(llm, tokenizer):
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    [biased] = llm.generate(PROMPTS[0], SamplingParams(**greedy, logit_bias={1234: 100}),
                            use_tqdm=False)
    assert biased.outputs[0].token_ids == [1234] * 6
    allowed = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" a", " b", " c")]
    [only] = llm.generate(PROMPTS[2], SamplingParams(temperature=1.0, seed=0, max_tokens=20,
                                                     allowed_token_ids=allowed), use_tqdm=False)
    assert set(only.outputs[0].token_ids) <= set(allowed)
    [free] = llm.generate(PROMPTS[0], SamplingParams(**greedy), use_tqdm=False)
    word = free.outputs[0].text.split()[0]  # " Paris"
    [banned] = llm.generate(PROMPTS[0], SamplingParams(**greedy, bad_words=[word]),
                            use_tqdm=False)
    tokens = banned.outputs[0].token_ids
    for bad in (tokenizer.encode(word, add_special_tokens=False),
                tokenizer.encode(" " + word, add_special_tokens=False)):
        assert not any(tokens[i:i + len(bad)] == bad for i in range(len(tokens)))
    assert tokens != free.outputs[0].token_ids


def test_engine_step_loop_with_an_abort(model_dir, tokenizer):
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **SMALL))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("0", "A robot may not injure a human being", params)
    engine.add_request("1", {"prompt": "To be or not to be,"}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    engine.add_request("2", {"prompt_token_ids": [1000, 1001, 1002]}, params)
    assert engine.get_num_unfinished_requests() == 3
    finished, deltas, step = {}, [], 0
    while engine.has_unfinished_requests():
        for request_output in engine.step():
            if request_output.request_id == "1":
                deltas.append(request_output.outputs[0].text)
            if request_output.finished:
                finished[request_output.request_id] = request_output
        step += 1
        if step == 2:
            engine.abort_request(["2"])
    assert sorted(finished) == ["0", "1"]
    engine.add_request("1-again", "To be or not to be,", params)
    while engine.has_unfinished_requests():
        for request_output in engine.step():
            if request_output.finished:
                assert "".join(deltas) == request_output.outputs[0].text
    assert engine.engine_core.stats().num_used_kv_blocks == 0


def test_add_request_with_n_is_all_or_nothing(model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, max_waiting_requests=2,
                                                   **SMALL))
    with pytest.raises(ResourceExhausted):
        engine.add_request("three", "Hello", SamplingParams(n=3, max_tokens=4))
    assert not engine.has_unfinished_requests()
    assert not engine.engine_core.has_unfinished_requests()
    engine.add_request("two", "Hello", SamplingParams(n=2, max_tokens=4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {c.index for o in outputs for c in o.outputs} == {0, 1} and outputs[-1].finished
    assert engine.engine_core.stats().num_used_kv_blocks == 0


def test_engine_step_abort_and_priority(model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, scheduling_policy="priority",
                                                   max_num_seqs=1, **SMALL))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("late-but-urgent-arrives-second", "b", params, priority=-5)
    engine.add_request("low", "a", params, priority=5)
    engine.add_request("aborted", "c", params, priority=0)
    engine.abort_request("aborted")
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == ["late-but-urgent-arrives-second", "low"]
    assert engine.engine_core.stats().num_used_kv_blocks == 0


@pytest.mark.parametrize("example", ["offline_generate.py", "engine_step_loop.py"])
def test_offline_examples_run(example):
    out = subprocess.run([sys.executable, str(EXAMPLES / example), "0.1"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("\n") >= 4


def test_n_choices_share_the_prompt_through_the_prefix_cache(llm):
    before = llm.llm_engine.engine_core.stats().prefix_cache_hits
    prompt = {"prompt_token_ids": list(range(1000, 1064))}  # 3 full blocks reusable
    [output] = llm.generate(prompt, SamplingParams(n=3, max_tokens=4, temperature=0.7, seed=1),
                            use_tqdm=False)
    assert len(output.outputs) == 3
    assert llm.llm_engine.engine_core.stats().prefix_cache_hits - before == 2 * 48
