"""vllm.logprobs' names: `from llmserve.logprobs import Logprob`."""
from llmserve.outputs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
