"""What the offline API's pooling calls return, with vLLM's classes, field names and
types (vllm.outputs PoolingRequestOutput, EmbeddingRequestOutput,
ScoringRequestOutput), so code written for vLLM reads them unchanged."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with LLM, not with `import llmserve` (see __init__.py)
    import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled vector (float32)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()),
                   output.prompt_token_ids, output.finished)


@dataclass
class ScoringOutput:
    score: float  # the cosine similarity of the two texts' embeddings


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the two prompts' ids, one after the other
    finished: bool


def cosine_score(request_id: str, first: PoolingRequestOutput,
                 second: PoolingRequestOutput) -> ScoringRequestOutput:
    import torch

    score = torch.nn.functional.cosine_similarity(first.outputs.data, second.outputs.data, dim=0)
    return ScoringRequestOutput(request_id, ScoringOutput(float(score)),
                                first.prompt_token_ids + second.prompt_token_ids, True)
