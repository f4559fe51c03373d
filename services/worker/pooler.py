"""The pooler: a pooling request's last-layer hidden states (after the model's
final norm) become one vector here in the worker, so that a step's response
carries vectors, not per-token states. A chunked prefill spans steps: MEAN sums
every chunk's positions as they are computed, CLS keeps the first position's,
LAST takes the final chunk's last position."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from services.common.pooling_params import PoolingParams


def pool_step(batch, step, hidden: torch.Tensor) -> dict[str, list[float]]:
    """The vectors of the pooling requests whose prompt this step finished; the
    others' MEAN sums and CLS states are kept in their RequestState."""
    out = {}
    for i in np.flatnonzero(step.pooling):
        state = batch.states[step.rows[i]]
        params = state.pooling_params
        first, end = int(step.query_start_loc[i]), int(step.query_start_loc[i + 1])
        if params.pooling_type == "MEAN":
            chunk_sum = hidden[first:end].float().sum(0)
            state.pooled = chunk_sum if state.pooled is None else state.pooled + chunk_sum
        elif params.pooling_type == "CLS" and step.starts[i] == 0:
            state.pooled = hidden[first].float()
        if not step.prompt_done[i]:
            continue
        if params.pooling_type == "LAST":
            vector = hidden[end - 1].float()
        elif params.pooling_type == "MEAN":
            vector = state.pooled / float(batch.num_prompt_tokens[step.rows[i]])
        else:
            vector = state.pooled
        out[state.request_id] = finish_vector(vector, params)
    return out


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """Matryoshka truncation to `dimensions`, then normalization, as vLLM orders them."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, dim=0)
    return vector.cpu().tolist()
