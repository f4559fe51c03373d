"""vllm.sampling_params' names: `from llmserve.sampling_params import RequestOutputKind`."""
from services.common.beam_search import BeamSearchParams
from services.common.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["BeamSearchParams", "SamplingParams", "RequestOutputKind"]
