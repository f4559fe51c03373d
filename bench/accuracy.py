"""Accuracy of a numeric mode against float32 on the benchmark's prompts: greedy
agreement through `LLM.generate`, and the largest logit difference from the model
run directly (teacher-forced over the same prompt tokens in both).

Both run with at most weight_dtype_max_rows() sequences at a time: `weight_dtype`
only acts on steps of that few rows, so a bigger batch would show it as exact."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.prompts import greedy
from llmserve.llm import LLM
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.worker.cpu_matmul import weight_dtype_max_rows
from services.worker.model_runner import ModelRunner

# Prompts whose logits are compared: a few suffice for a maximum, and 4 rows keep
# each decode step within weight_dtype_max_rows() where the CPU has AVX-512.
LOGIT_PROMPTS = 4


@dataclass
class Probe:
    """What one model produced: greedy outputs per prompt and teacher-forced logits."""
    outputs: list[list[int]]
    logits: torch.Tensor  # [LOGIT_PROMPTS, prompt_len, vocab], float32


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """Share of outputs token-identical to the reference, and the mean share of each
    output's tokens before its first divergence (1.0 when identical)."""
    assert len(reference) == len(outputs) and reference, (len(reference), len(outputs))
    prefixes = [common_prefix(r, o) / len(r) for r, o in zip(reference, outputs)]
    return {"prompts": len(reference), "output_len": len(reference[0]),
            "identical": sum(r == o for r, o in zip(reference, outputs)) / len(reference),
            "mean_prefix": sum(prefixes) / len(prefixes)}


def logit_diff(reference: torch.Tensor, got: torch.Tensor) -> dict:
    """max |got - reference| over every position and token; argmax flips, and at the
    flips the largest reference margin between its top token and got's (a flip
    between near-ties is rounding, a wide one a bug)."""
    reference, got = reference.float().flatten(0, -2), got.float().flatten(0, -2)
    ref_top, got_top = reference.argmax(-1), got.argmax(-1)
    flips = ref_top != got_top
    margins = (reference.max(-1).values - reference.gather(-1, got_top[:, None])[:, 0])[flips]
    return {"positions": reference.shape[0],
            "max_abs_diff": (got - reference).abs().max().item(),
            "mean_abs_diff": (got - reference).abs().mean().item(),
            "argmax_flips": int(flips.sum()),
            "max_flip_margin": margins.max().item() if len(margins) else 0.0}


def greedy_outputs(llm: LLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Greedy outputs, weight_dtype_max_rows() prompts per LLM.generate call."""
    outputs = []
    rows = weight_dtype_max_rows()
    for i in range(0, len(prompts), rows):
        done = llm.generate(prompts[i:i + rows], greedy(output_len), use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in done]
    return outputs


def _step(runner: ModelRunner, so: SchedulerOutput) -> torch.Tensor:
    """Logits of every scheduled token, in the step's order (the way
    tests/integration/tiny_models.py's step_logits runs the model)."""
    runner.update_states(so)
    step = runner.input_batch.prepare(so)
    return runner.model.compute_logits(
        runner.model(step.input_ids, step.positions, step.attn_metadata))


@torch.inference_mode()
def teacher_forced_logits(runner: ModelRunner, prompts: list[list[int]],
                          num_blocks: int) -> torch.Tensor:
    """Logits at every prompt position: the first half as one prefill, then one
    prompt token per decode step, so the decode path (16-bit weights, the KV cache
    read back) is measured too. Uses KV blocks from 0 up: the engine must be idle."""
    ids = [f"accuracy-probe-{i}" for i in range(len(prompts))]
    length, block_size = len(prompts[0]), runner.block_size
    per_request = -(-length // block_size)
    assert per_request * len(prompts) <= num_blocks, "KV cache too small for the probe"
    prefill = max(1, length // 2)
    new = [NewRequestData(r, p, greedy(1), list(range(i * per_request, (i + 1) * per_request)), 0)
           for i, (r, p) in enumerate(zip(ids, prompts))]
    chunks = [_step(runner, SchedulerOutput(new_requests=new,
                                            num_scheduled_tokens=dict.fromkeys(ids, prefill)))]
    chunks[0] = chunks[0].view(len(prompts), prefill, -1)
    for pos in range(prefill, length):
        cached = [CachedRequestData(r, [], pos) for r in ids]
        chunks.append(_step(runner, SchedulerOutput(
            cached_requests=cached, num_scheduled_tokens=dict.fromkeys(ids, 1)))[:, None])
    runner.update_states(SchedulerOutput(finished_request_ids=ids))
    return torch.cat(chunks, dim=1).float()


def probe(llm: LLM, prompts: list[list[int]], output_len: int) -> Probe:
    """Greedy outputs of every prompt and logits of the first LOGIT_PROMPTS."""
    core = llm.llm_engine.engine_core
    assert not core.has_unfinished_requests(), "the probe needs an idle engine"
    # The probe writes KV blocks behind the scheduler's back: no cached prefix may
    # point at them, before or after.
    assert core.reset_prefix_cache()
    runner = core.executor.workers[0].model_runner
    logits = teacher_forced_logits(runner, prompts[:LOGIT_PROMPTS], core.info.num_kv_blocks)
    outputs = greedy_outputs(llm, prompts, output_len)
    assert core.reset_prefix_cache()  # timed runs after this must not hit these prompts
    return Probe(outputs, logits)


def compare(reference: Probe, got: Probe) -> dict:
    """A mode's accuracy against the float32 probe."""
    return {"agreement": agreement(reference.outputs, got.outputs),
            "logits": logit_diff(reference.logits, got.logits)}
