"""Structured outputs in the worker: the engine core's token bitmasks applied to
the logits of the rows they constrain, before anything else in sampling."""
from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmasks(logits: torch.Tensor, request_ids: list[str],
                           bitmasks: dict[str, np.ndarray]) -> None:
    """Sets to -inf, in place, the logits of tokens a row's grammar forbids.
    logits: [B, V], row i sampling for request_ids[i]; other rows are untouched."""
    rows = [i for i, request_id in enumerate(request_ids) if request_id in bitmasks]
    if not rows:
        return
    import xgrammar  # only when a request is constrained: the import takes a while

    # One [B, words] mask with xgrammar's row indices: its CPU kernel and its
    # CUDA/Triton ones take that form (all bits set = nothing masked).
    width = next(iter(bitmasks.values())).shape[0]
    bitmask = torch.full((len(request_ids), width), -1, dtype=torch.int32)
    for i in rows:
        bitmask[i] = torch.from_numpy(bitmasks[request_ids[i]])
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device),
                                         vocab_size=logits.shape[-1], indices=rows)
