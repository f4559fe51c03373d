"""The LoRA deltas of one linear layer, for up to max_loras adapters in one batch.

Punica's batched form on plain torch: every slot's A (for every projection a
packed layer holds) is stacked into one matrix, every slot's B into another, so
a step costs two GEMMs whatever the mix of adapters: x @ A_all^T gives each
token its product with every slot's A, a mask keeps only its own slot's
columns (no column for a token without an adapter), and @ B_all^T turns them
into the delta. The waste is max_loras * rank columns, small next to the layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.parallel import TensorParallel


@dataclass
class TokenSlots:
    """Per step, shared by every LoRA layer of a model: each token's slot (-1: none)."""

    slots: torch.Tensor | None = None  # int64 [T]; None when no token has an adapter


class LoRALayer:
    def __init__(self, shards: dict[str, tuple[int, int]], in_features: int, row_parallel: bool,
                 max_loras: int, max_rank: int, tp: TensorParallel, tokens: TokenSlots,
                 dtype: torch.dtype, device: torch.device):
        """shards: projection name -> (offset, size) of its local output features."""
        self.shards = shards
        self.row_parallel = row_parallel
        self.max_loras, self.max_rank, self.tp, self.tokens = max_loras, max_rank, tp, tokens
        out_features = sum(size for _, size in shards.values())
        columns = len(shards) * max_loras * max_rank
        self.a = torch.zeros(columns, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, columns, dtype=dtype, device=device)
        # The slot each column belongs to: column = (shard * max_loras + slot) * max_rank + j.
        self.column_slot = (torch.arange(columns, device=device) // max_rank) % max_loras

    def _columns(self, shard_index: int, slot: int, rank: int) -> slice:
        start = (shard_index * self.max_loras + slot) * self.max_rank
        return slice(start, start + rank)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """weights: projection -> (A [r, in], B [out, r] scaled), whole (not sharded);
        projections the adapter leaves alone get zeros."""
        self.clear_slot(slot)
        for index, (name, (offset, size)) in enumerate(self.shards.items()):
            if name not in weights:
                continue
            a, b = weights[name]
            # Column-parallel: B's rows are split like the layer's outputs; row-
            # parallel: A's columns like its inputs (the deltas are summed with
            # the layer's output across ranks).
            a, b = (self.tp.shard(a, 1), b) if self.row_parallel else (a, self.tp.shard(b, 0))
            columns = self._columns(index, slot, a.shape[0])
            self.a[columns] = a.to(self.a.dtype)
            self.b[offset:offset + size, columns] = b.to(self.b.dtype)

    def clear_slot(self, slot: int) -> None:
        for index in range(len(self.shards)):
            columns = self._columns(index, slot, self.max_rank)
            self.a[columns] = 0
            self.b[:, columns] = 0

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y + this step's LoRA deltas of x (y untouched when no token has an adapter)."""
        slots = self.tokens.slots
        if slots is None:
            return y
        xa = x @ self.a.t()
        xa = xa * (self.column_slot[None, :] == slots[:, None]).to(xa.dtype)
        return y + xa @ self.b.t()
