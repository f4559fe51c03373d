"""llmserve: what users import.

    from llmserve import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(max_tokens=16))
"""
from services.common.request_types import FinishReason, Logprobs
from services.common.sampling_params import OutputKind, SamplingParams
from services.frontend.output_processor import CompletionOutput, RequestOutput

__all__ = ["LLM", "LLMEngine", "SamplingParams", "OutputKind", "RequestOutput",
           "CompletionOutput", "FinishReason", "Logprobs"]


def __getattr__(name):
    # LLM and LLMEngine pull in torch and the model code: import them on first use
    # so that `llmserve.client` stays light.
    if name == "LLM":
        from llmserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from llmserve.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
