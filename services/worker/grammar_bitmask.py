"""Structured outputs in the worker: the engine core's token bitmasks applied to
the logits of the rows they constrain, before anything else in sampling."""
from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmasks(logits: torch.Tensor, request_ids: list[str],
                           bitmasks: dict[str, np.ndarray]) -> None:
    """Sets to -inf, in place, the logits of tokens a row's grammar forbids.
    logits: [B, V], row i sampling for request_ids[i]; other rows are untouched."""
    apply_row_bitmasks(logits, [bitmasks.get(r) for r in request_ids])


def apply_row_bitmasks(logits: torch.Tensor, masks: list[np.ndarray | None]) -> None:
    """The same, given each row's mask (None: unconstrained)."""
    rows = [i for i, mask in enumerate(masks) if mask is not None]
    if not rows:
        return
    import xgrammar  # only when a request is constrained: the import takes a while

    # One [B, words] mask with xgrammar's row indices: its CPU kernel and its
    # CUDA/Triton ones take that form (all bits set = nothing masked).
    width = masks[rows[0]].shape[-1]
    bitmask = torch.full((len(masks), width), -1, dtype=torch.int32)
    for i in rows:
        bitmask[i] = torch.from_numpy(masks[i])
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device),
                                         vocab_size=logits.shape[-1], indices=rows)
