"""LLM: offline batched generation in this process (vLLM's `LLM(model).generate`)."""
from __future__ import annotations

from tqdm import tqdm

from services.common.config import DEFAULT_MODEL
from services.common.sampling_params import SamplingParams
from services.frontend.output_processor import RequestOutput
from llmserve.llm_engine import LLMEngine, Prompt


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        """LLM(model, dtype=..., max_model_len=..., kv_cache_gib=..., ...): see
        llmserve.llm_engine.make_engine_config for every argument."""
        self.engine = LLMEngine.create(model=model, **kwargs)

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
