"""llmserve in this process: offline throughput through `LLM.generate`, and one
request stepped alone (single-stream decode)."""
from __future__ import annotations

import time

from bench.metrics import RequestTiming, single_stream_summary
from bench.prompts import greedy
from llmserve.llm import LLM


def load_llm(model_dir: str, dtype: str, kv_cache_gib: float, max_model_len: int,
             **mode_args) -> LLM:
    """Prefix caching off, as vLLM runs in the same bench (vllm_runner): the prompts
    are distinct, but a setting that differs could hide a cache hit."""
    return LLM(model_dir, dtype=dtype, kv_cache_gib=kv_cache_gib, max_model_len=max_model_len,
               enable_prefix_caching=False, **mode_args)


def warm_up(llm: LLM, prompts: list[list[int]]) -> None:
    """A short batched run, so one-time costs are not timed."""
    llm.generate(prompts, greedy(4), use_tqdm=False)


def run_offline(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts through one LLM.generate call."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(output_len), use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    output_tokens = len(prompts) * output_len
    prompt_tokens = sum(map(len, prompts))
    return {"requests": len(prompts), "seconds": seconds, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / seconds,
            "total_tok_s": (output_tokens + prompt_tokens) / seconds}


def run_single_stream(llm: LLM, prompt: list[int], output_len: int) -> dict:
    """One request alone, stepping the engine to time every token."""
    engine = llm.llm_engine
    timing = RequestTiming()
    engine.add_request("single-stream", {"prompt_token_ids": prompt}, greedy(output_len))
    seen = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "single-stream":
                num_tokens = len(output.outputs[0].token_ids)
                timing.add(num_tokens - seen)
                seen = num_tokens
    timing.finish()
    assert seen == output_len, seen
    return single_stream_summary(timing)
