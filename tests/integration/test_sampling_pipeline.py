"""Sampling parameters through the engine core with the real model."""
import math

import torch

from services.common.request_types import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.frontend.processor import bad_words_token_ids
from tests.conftest import PROMPTS, make_engine_core


def run(core, requests):
    for r in requests:
        core.add_request(r)
    outputs = {}
    while core.has_work():
        for o in core.step():
            outputs.setdefault(o.request_id, []).append(o)
    return outputs


def tokens_of(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def test_seeded_request_is_reproducible_in_any_batch(model_dir, tokenizer):
    core = make_engine_core(model_dir)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    prompt = tokenizer(PROMPTS[2])["input_ids"]
    alone = tokens_of(run(core, [EngineCoreRequest("alone", prompt, params)])["alone"])
    noise = [EngineCoreRequest(f"n{i}", tokenizer(p)["input_ids"], SamplingParams(
        max_tokens=8 + i, temperature=0.8, ignore_eos=True)) for i, p in enumerate(PROMPTS[:5])]
    crowded = run(core, noise[:2] + [EngineCoreRequest("crowded", prompt, params)] + noise[2:])
    assert tokens_of(crowded["crowded"]) == alone
    other_seed = SamplingParams(**{**vars(params), "seed": 8})
    assert tokens_of(run(core, [EngineCoreRequest("other", prompt, other_seed)])["other"]) != alone


def test_logprobs_and_prompt_logprobs_equal_log_softmax_of_reference_logits(
        model_dir, tokenizer, hf_model):
    core = make_engine_core(model_dir, max_num_batched_tokens=8)  # prompt in chunks
    prompt = tokenizer(PROMPTS[5])["input_ids"]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    outputs = run(core, [EngineCoreRequest("lp", prompt, params)])["lp"]
    generated = tokens_of(outputs)
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt + generated])).logits[0], -1)
    prompt_lps = [lp for o in outputs for lp in o.prompt_logprobs]
    assert [lp.token_id for lp in prompt_lps] == prompt[1:]
    for position, lp in enumerate(prompt_lps):
        row = reference[position]
        assert math.isclose(lp.logprob, row[lp.token_id], abs_tol=1e-3)
        assert lp.rank == int((row > row[lp.token_id]).sum()) + 1 or abs(
            row.sort(descending=True).values[lp.rank - 1] - row[lp.token_id]) < 1e-3
        assert lp.top_token_ids == row.topk(2).indices.tolist()
    new_lps = [lp for o in outputs for lp in o.new_logprobs]
    assert [lp.token_id for lp in new_lps] == generated
    for i, lp in enumerate(new_lps):
        row = reference[len(prompt) - 1 + i]
        assert lp.rank == 1 and math.isclose(lp.logprob, row.max(), abs_tol=1e-3)
        assert lp.top_token_ids == row.topk(3).indices.tolist()


def test_min_tokens_and_penalties_run_through_the_engine(model_dir, tokenizer):
    core = make_engine_core(model_dir)
    question = "What is 2+2? Answer with a number only."
    chat = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(chat, add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id]
    short = tokens_of(run(core, [EngineCoreRequest("short", prompt, SamplingParams(
        max_tokens=64, temperature=0), eos)])["short"])
    assert short[-1] == eos[0] and len(short) < 20  # "2 + 2 = 4<|im_end|>"
    long = tokens_of(run(core, [EngineCoreRequest("long", prompt, SamplingParams(
        max_tokens=64, temperature=0, min_tokens=len(short) + 5), eos)])["long"])
    assert len(long) >= len(short) + 5 and eos[0] not in long[:len(short) + 5]
    penalized = tokens_of(run(core, [EngineCoreRequest("pen", prompt, SamplingParams(
        max_tokens=len(short), temperature=0, repetition_penalty=1.5, frequency_penalty=1.0),
        eos)])["pen"])
    assert penalized != short


def test_bad_words_are_tokenized_as_vllm_does(tokenizer):
    # With and without a leading space; the spaced form only when its first
    # token differs and it has as many tokens.
    [plain, spaced] = bad_words_token_ids(tokenizer, ["Paris"])
    assert plain == tokenizer.encode("Paris", add_special_tokens=False)
    assert spaced == tokenizer.encode(" Paris", add_special_tokens=False)
    assert bad_words_token_ids(tokenizer, [" hello"])[0] == tokenizer.encode(
        "hello", add_special_tokens=False)
