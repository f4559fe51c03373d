"""vllm.sampling_params' names: `from llmserve.sampling_params import RequestOutputKind`."""
from services.common.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["SamplingParams", "RequestOutputKind"]
