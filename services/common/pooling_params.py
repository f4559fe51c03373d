"""PoolingParams: what a pooling (embedding) request asks for, with vLLM's names.

A pooling request is prefill only: the engine computes its prompt, the worker
pools the last layer's (normalized) hidden states into one vector, and the
request finishes with that vector and no token."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.common.errors import InvalidArgument

# LAST: the last prompt token's hidden state (decoder embedding models: Qwen3-
# Embedding, e5-mistral); MEAN: the mean over every prompt token (gte-Qwen2);
# CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolingParams:
    # Matryoshka embeddings: keep the first `dimensions` values (before normalizing).
    dimensions: int | None = None
    # Scale the vector to length 1 (None: the model's pooler config says).
    normalize: bool | None = None
    # Keep only the last k prompt tokens (-1: as many as max_model_len allows).
    truncate_prompt_tokens: int | None = None
    # LAST, MEAN or CLS for this request (not in vLLM's PoolingParams); None: the
    # model's pooler (pooler_config's pooling_type), which the engine fills in.
    pooling_type: str | None = None

    def validate(self, hidden_size: int) -> None:
        """InvalidArgument naming the field a person has to change."""
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise InvalidArgument("dimensions", f"is {self.dimensions}; this model's embeddings "
                                  f"have {hidden_size} values, so it must be in [1, "
                                  f"{hidden_size}]")
        t = self.truncate_prompt_tokens
        if t is not None and t != -1 and t < 1:
            raise InvalidArgument("truncate_prompt_tokens", f"is {t}; give a positive number "
                                  "of tokens, or -1 for as many as max_model_len allows")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidArgument("pooling_type", f"is {self.pooling_type!r}; choose one of "
                                  f"{', '.join(POOLING_TYPES)}")

    def resolved(self, pooling_type: str, normalize: bool) -> "PoolingParams":
        """The params with the model's pooler filling in what the caller left out."""
        return dataclasses.replace(
            self, pooling_type=self.pooling_type or pooling_type,
            normalize=normalize if self.normalize is None else self.normalize)


def truncate_prompt(prompt_ids: list[int], params: PoolingParams,
                    max_model_len: int) -> list[int]:
    """The prompt tokens a pooling request keeps: the last truncate_prompt_tokens
    (-1: as many as max_model_len allows), or all of them."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    keep = max_model_len if keep == -1 else keep
    return prompt_ids[-keep:]


def pair_for_scoring(first: list, second: list) -> list:
    """The texts `second` is scored against, one each: a single first text against
    every second one, or two lists pairwise (vLLM's score); ValueError otherwise."""
    if len(first) == 1:
        return first * len(second)
    if len(first) != len(second):
        raise ValueError(f"{len(first)} texts against {len(second)}: give one text against "
                         "many, or two lists of the same length")
    return first
