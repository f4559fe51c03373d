"""The strategy interface: x W^T for one layer's weight, set up once."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class MatmulStrategy(Protocol):
    """x [rows, in] -> x W^T [rows, out], for the weight it was built from."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class FLinear:
    """torch's F.linear on the weight as loaded: what the others must beat."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def matmul(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x W^T for one of our linear layers (no bias), by the strategy
    prepare_cpu_linears gave it (`cpu_weights`), else F.linear."""
    weights = getattr(layer, "cpu_weights", None)
    if weights is None:
        return F.linear(x, layer.weight)
    y = weights(x.reshape(-1, x.shape[-1]))
    return y.view(*x.shape[:-1], y.shape[-1])
