"""Our Llama implementation over the paged KV cache vs transformers, fp32."""
import numpy as np
import torch

from services.common.request_types import SamplingParams
from services.common.scheduler_output import (CachedRequestData, NewRequestData,
                                              SchedulerOutput)
from services.worker.model_loader import load_model
from services.worker.model_runner import ModelRunner
from tests.integration.tiny_models import step_logits

BLOCK_SIZE = 16


def test_logits_match_transformers_on_mixed_paged_batch(model_dir, tokenizer, hf_model):
    """Step 1 prefills prompt A and the first chunk of B; step 2 decodes A and
    prefills the rest of B against its cached first chunk. Every position's
    logits must equal transformers' full forward pass."""
    model = load_model(model_dir, torch.float32, 512, torch.device("cpu"))
    runner = ModelRunner(model, BLOCK_SIZE, torch.device("cpu"), torch.float32, 512)
    runner.init_kv_cache(32)
    a = tokenizer("The quick brown fox jumps over the lazy dog because")["input_ids"]
    b = tokenizer("In 1492, Columbus sailed the ocean blue. Many years later, "
                  "historians still debate what he actually found when he landed in")["input_ids"]
    a_next = 42  # any token: its logits are compared, not its choice
    chunk = 20
    params = SamplingParams(temperature=0)
    step1 = SchedulerOutput(
        new_requests=[NewRequestData("a", a, params, [3, 7], 0),
                      NewRequestData("b", b, params, [10, 4, 9], 0)],
        num_scheduled_tokens={"a": len(a), "b": chunk})
    got1 = step_logits(runner, step1)
    runner.input_batch.append_tokens(np.array([runner.input_batch.row_of["a"]]), np.array([a_next]))
    step2 = SchedulerOutput(
        cached_requests=[CachedRequestData("a", [], len(a)), CachedRequestData("b", [], chunk)],
        num_scheduled_tokens={"a": 1, "b": len(b) - chunk})
    got2 = step_logits(runner, step2)

    with torch.no_grad():
        ref_a = hf_model(torch.tensor([a + [a_next]])).logits[0]
        ref_b = hf_model(torch.tensor([b])).logits[0]
    ours_a = torch.cat([got1["a"], got2["a"]])
    ours_b = torch.cat([got1["b"], got2["b"]])
    diff = max((ours_a - ref_a).abs().max().item(), (ours_b - ref_b).abs().max().item())
    print(f"max |logits - transformers| = {diff:.3e}")
    assert diff < 1e-3, f"max abs logits difference {diff:.3e}"
    assert torch.equal(ours_a.argmax(-1), ref_a.argmax(-1))
    assert torch.equal(ours_b.argmax(-1), ref_b.argmax(-1))


def test_prefill_steps_carry_only_sampled_rows_past_the_last_attention(model_dir, tokenizer,
                                                                       hf_model):
    """The last layer's o_proj and MLP see only the rows a step samples from: a
    finished prompt's last, a decode's one, one row when only chunks ran; every
    row with prompt logprobs. The samples stay transformers' argmax, and every
    chunk's K/V still lands in the cache (B's continuation reads it)."""
    model = load_model(model_dir, torch.float32, 512, torch.device("cpu"))
    runner = ModelRunner(model, BLOCK_SIZE, torch.device("cpu"), torch.float32, 512)
    runner.init_kv_cache(32)
    rows_seen = []
    last_mlp = model.model.layers[-1].mlp
    last_mlp.register_forward_pre_hook(lambda module, args: rows_seen.append(args[0].shape[0]))
    a = tokenizer("The quick brown fox jumps over the lazy dog because")["input_ids"]
    b = tokenizer("In 1492, Columbus sailed the ocean blue. Many years later, "
                  "historians still debate what he actually found")["input_ids"]
    c = tokenizer("Water boils at")["input_ids"]
    greedy, chunk = SamplingParams(temperature=0), 12
    out1 = runner.execute_model(SchedulerOutput(
        new_requests=[NewRequestData("a", a, greedy, [3, 7], 0),
                      NewRequestData("b", b, greedy, [10, 4, 9], 0)],
        num_scheduled_tokens={"a": len(a), "b": chunk}))
    out2 = runner.execute_model(SchedulerOutput(
        cached_requests=[CachedRequestData("b", [], chunk)],
        num_scheduled_tokens={"b": 6}))  # a chunk alone: nothing sampled
    out3 = runner.execute_model(SchedulerOutput(
        cached_requests=[CachedRequestData("a", [], len(a)), CachedRequestData("b", [], chunk + 6)],
        num_scheduled_tokens={"a": 1, "b": len(b) - chunk - 6}))
    out4 = runner.execute_model(SchedulerOutput(
        new_requests=[NewRequestData("c", c, SamplingParams(temperature=0, prompt_logprobs=1),
                                     [12], 0)],
        num_scheduled_tokens={"c": len(c)}))
    assert rows_seen == [1, 1, 2, len(c)]
    assert out2.sampled_token_ids == {}
    with torch.no_grad():
        a_next = out1.sampled_token_ids["a"][0]
        ref_a = hf_model(torch.tensor([a + [a_next]])).logits[0]
        ref_b = hf_model(torch.tensor([b])).logits[0, -1]
        ref_c = hf_model(torch.tensor([c])).logits[0]
    assert a_next == ref_a[len(a) - 1].argmax().item()
    assert out3.sampled_token_ids == {"a": [ref_a[-1].argmax().item()],
                                      "b": [ref_b.argmax().item()]}
    assert out4.sampled_token_ids == {"c": [ref_c[-1].argmax().item()]}
    assert len(out4.prompt_logprobs["c"]) == len(c) - 1
