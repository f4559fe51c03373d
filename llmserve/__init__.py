"""llmserve: what users import. The offline API has vLLM's names and types:

    from llmserve import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(max_tokens=16))
    print(outputs[0].outputs[0].text)
"""
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import OutputKind, RequestOutputKind, SamplingParams
from services.common.lora import LoRARequest
from services.common.structured_outputs import StructuredOutputsParams
from llmserve.engine_args import EngineArgs
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.pooling_outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                      PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams",
           "LoRARequest", "RequestOutputKind", "OutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "PoolingParams", "PoolingOutput",
           "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput"]


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
