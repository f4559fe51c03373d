"""TensorParallel: this worker's rank in the tensor-parallel group, and its collectives.

With size 1 every collective is a no-op, so the same model code runs unsharded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def divide(self, n: int, what: str) -> int:
        """This rank's share of n things (heads, rows...), which must split evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size "
                             f"({self.size})")
        return n // self.size

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full (checkpoint) tensor along dim."""
        size = self.divide(tensor.shape[dim], f"dimension {dim} of a weight")
        return tensor.narrow(dim, self.rank * size, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()


def init_distributed(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Joins the process group of all ranks (blocks until every rank has joined)."""
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    return TensorParallel(rank, size)
