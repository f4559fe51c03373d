"""TensorParallel: this worker's rank in its tensor-parallel group, and its collectives.

With size 1 every collective is a no-op, so the same model code runs unsharded.
With pipeline parallelism each stage is its own tensor-parallel group, a
subgroup of the world of all stages' ranks (services/worker/pipeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # The group's collectives run in; None: the default group (one stage).
    group: object = None

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
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()


def init_distributed(rank: int, tp_size: int, init_method: str, device: torch.device,
                     num_stages: int = 1) -> TensorParallel:
    """Joins the process group of all ranks, tp_size × num_stages of them (blocks until
    every rank has joined); returns this rank's place in its stage's TP group."""
    world = tp_size * num_stages
    if world == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    group = None
    if num_stages > 1 and tp_size > 1:
        # Every rank creates every stage's group, in the same order (torch's rule).
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
                  for s in range(num_stages)]
        group = groups[rank // tp_size]
    return TensorParallel(rank % tp_size, tp_size, group)
