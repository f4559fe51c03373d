"""LLM.beam_search against transformers' generate(num_beams=k, early_stopping=True),
fp32, on the default model, a tiny random Llama, and the default model with a
LoRA adapter (transformers + peft).

The searches share their rules (services/engine_core/beam_search.py) but one:
finished beams are ranked by vLLM's score, which divides by the whole length
(prompt included, EOS excluded), where transformers divides by the generated
length. So the beams are compared whole where lengths do not matter: with
length_penalty=1.0 when every beam runs to max_tokens, and with length_penalty=0
when beams end at EOS. With EOS and length_penalty=1.0, beams that both found are
ordered by each library's own rule (and the unit tests show the rule on its own)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.sampling_params import BeamSearchParams
from services.common.beam_search import beam_score
from tests.conftest import PROMPTS
from tests.integration.tiny_models import write_tiny_llama
from tests.lora_adapters import ALL_PROJECTIONS, build_adapter

SMALL = dict(dtype="float32", max_model_len=512, kv_cache_gib=0.25)
# Short answers: beams end at EOS well within EOS_TOKENS.
QUESTIONS = ["What is 2+2?", "Name a color.", "What is the capital of France?",
             "Reply with one word: yes or no."]
EOS_TOKENS = 32


def hf_beams(model, prompt_ids: list[int], width: int, max_tokens: int,
             length_penalty: float = 1.0) -> list[list[int]]:
    """transformers' beams, best first: output tokens, cut after the first EOS."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                             num_return_sequences=width, early_stopping=True, do_sample=False,
                             max_new_tokens=max_tokens, length_penalty=length_penalty,
                             pad_token_id=model.generation_config.eos_token_id)
    eos = model.generation_config.eos_token_id
    beams = [seq[len(prompt_ids):].tolist() for seq in out]
    return [b[:b.index(eos) + 1] if eos in b else b for b in beams]


def our_beams(llm: LLM, prompts: list[list[int]], width: int, max_tokens: int,
              length_penalty: float = 1.0, lora: LoRARequest | None = None):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty, include_stop_str_in_output=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params,
                              lora_request=lora)
    return [[s.tokens[len(p):] for s in o.sequences] for p, o in zip(prompts, outputs)], outputs


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, enable_lora=True, max_lora_rank=8, **SMALL)


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_beams_equal_transformers_when_every_beam_runs_to_max_tokens(llm, hf_model, tokenizer,
                                                                    width):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours, outputs = our_beams(llm, prompts, width, max_tokens=10)
    compared = 0
    for prompt, beams, output in zip(prompts, ours, outputs):
        if all(s.finish_reason == "length" for s in output.sequences):  # the rules agree
            assert beams == hf_beams(hf_model, prompt, width, 10)
            compared += 1
    assert compared >= 4


@pytest.mark.parametrize("width", [2, 3, 4])
def test_beams_equal_transformers_with_eos_when_length_does_not_count(llm, hf_model,
                                                                     chat_prompts, width):
    ours, outputs = our_beams(llm, chat_prompts, width, EOS_TOKENS, length_penalty=0.0)
    assert any(s.finish_reason == "stop" for o in outputs for s in o.sequences)
    for prompt, beams in zip(chat_prompts, ours):
        assert beams == hf_beams(hf_model, prompt, width, EOS_TOKENS, length_penalty=0.0)


def test_with_eos_each_library_orders_the_beams_by_its_own_length_rule(llm, hf_model,
                                                                       chat_prompts):
    """The rule where the searches differ: vLLM's (and our) length normalization."""
    width, differing = 2, 0
    ours, outputs = our_beams(llm, chat_prompts, width, EOS_TOKENS)
    for prompt, beams, output in zip(chat_prompts, ours, outputs):
        theirs = hf_beams(hf_model, prompt, width, EOS_TOKENS)
        scores = [beam_score(len(s.tokens), s.cum_logprob, 1.0) for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        if sorted(beams) != sorted(theirs):
            continue  # finished sets kept under different rules; the unit tests cover it
        hf_order = sorted(zip(beams, output.sequences), reverse=True,
                          key=lambda bs: bs[1].cum_logprob / len(bs[0]))
        assert [b for b, _ in hf_order] == theirs
        differing += beams != theirs
    assert differing, "no prompt showed the two length rules apart"


@pytest.mark.parametrize("width", [2, 3, 4])
def test_the_best_beam_scores_at_least_the_greedy_sequence(llm, tokenizer, width):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=10, logprobs=0),
                          use_tqdm=False)
    _, outputs = our_beams(llm, prompts, width, max_tokens=10)
    for g, o in zip(greedy, outputs):
        assert o.sequences[0].cum_logprob >= g.outputs[0].cumulative_logprob - 1e-4


def test_one_beam_is_greedy(llm, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    ours, _ = our_beams(llm, prompts, 1, max_tokens=12)
    assert [b[0] for b in ours] == [g.outputs[0].token_ids for g in greedy]


def test_beams_with_a_lora_adapter_equal_transformers_and_peft(llm, model_dir, tokenizer,
                                                               tmp_path):
    from peft import PeftModel
    build_adapter(model_dir, tmp_path / "a", 7, r=8, lora_alpha=16,
                  target_modules=ALL_PROJECTIONS)
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        str(tmp_path / "a")).eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    ours, _ = our_beams(llm, prompts, 3, max_tokens=8, lora=lora)
    for prompt, beams in zip(prompts, ours):
        assert beams == hf_beams(reference, prompt, 3, 8)


@pytest.fixture(scope="module")
def tiny_llama(model_dir, tmp_path_factory) -> str:
    """A tiny random Llama whose EOS logit is scaled up, so that beams end at EOS."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny-beams"), model_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[model.config.eos_token_id] *= 4.0
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_beams_of_a_tiny_random_llama_equal_transformers(tiny_llama, width):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = [[1, 400 + 37 * i, 900 + 11 * i, 5000 + i] for i in range(6)]
    llm = _tiny_llm(tiny_llama)
    ours, outputs = our_beams(llm, prompts, width, max_tokens=16, length_penalty=0.0)
    for prompt, beams in zip(prompts, ours):
        assert beams == hf_beams(hf, prompt, width, 16, length_penalty=0.0)
    if width > 1:
        assert any(s.finish_reason == "stop" for o in outputs for s in o.sequences)
        assert any(s.finish_reason == "length" for o in outputs for s in o.sequences)


_TINY_LLMS: dict[str, LLM] = {}


def _tiny_llm(path: str) -> LLM:
    if path not in _TINY_LLMS:
        _TINY_LLMS[path] = LLM(path, **SMALL)
    return _TINY_LLMS[path]


def test_beam_search_params_are_checked(llm):
    with pytest.raises(Exception, match="beam_width"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=4))
    assert math.isfinite(llm.beam_search(["hi"], BeamSearchParams(
        beam_width=2, max_tokens=2))[0].sequences[0].cum_logprob)
