"""LLM: offline batched generation in this process (vLLM's `LLM(model).generate`)."""
from __future__ import annotations

from tqdm import tqdm

from services.common.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig,
                                    SchedulerConfig)
from services.common.sampling_params import SamplingParams
from services.frontend.output_processor import RequestOutput
from llmserve.llm_engine import LLMEngine, Prompt


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", max_model_len: int = 2048,
                 kv_cache_gib: float = 1.0, seed: int = 0, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                 scheduling_policy: str = "fcfs"):
        self.engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed),
            cache=CacheConfig(kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      policy=scheduling_policy)))

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(f"offline-{i}", p, sp)
               for i, (p, sp) in enumerate(zip(prompts, params))]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> RequestOutput:
        """One chat, rendered with the model's chat template."""
        return self.generate([messages], sampling_params, use_tqdm)[0]
