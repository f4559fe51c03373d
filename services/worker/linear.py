"""Tensor-parallel linear layers and the vocab-parallel embedding and LM head.

Column-parallel layers split their output features across ranks, row-parallel
ones their input features (then sum across ranks), as in Megatron-LM and vLLM.
Each parameter's `weight_loader` takes the full checkpoint tensor and keeps this
rank's slice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_layers import silu_and_mul
from services.worker.cpu_matmul.gemm import fused_silu_and_mul
from services.worker.cpu_matmul.strategy import matmul
from services.worker.lora.layer import LoRALayer
from services.worker.parallel import SINGLE, TensorParallel


class _Linear(nn.Linear):
    """nn.Linear whose product goes through cpu_matmul's strategy for it (prepacked
    or 16-bit weights on the CPU, F.linear otherwise), plus the LoRA deltas of the
    step's adapters when LoRA is on."""

    lora: "LoRALayer | None" = None  # set by the worker's LoRAManager

    def reset_parameters(self) -> None:
        """Leaves the weights as allocated (torch.empty), as ParallelLMHead does: the
        checkpoint fills every one (load_weights refuses one it lacks), so
        nn.Linear's random init was a pass over every weight for nothing, at each
        load (bench/NOTES.md, start-up)."""

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(self, x)
        return y if self.lora is None else self.lora.add_delta(y, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(_Linear):
    """y = x W^T + b with W's rows (output features) split across ranks; the output
    stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel = SINGLE):
        super().__init__(in_features, tp.divide(out_features, "output features"), bias=bias)
        self.tp = tp
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(self.tp.shard(loaded, 0))


class PackedColumnParallelLinear(_Linear):
    """Several column-parallel projections (q/k/v, gate/up) in one matmul. Each rank
    holds its slice of every projection, side by side; checkpoints hold them apart."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool,
                 tp: TensorParallel = SINGLE):
        local = {name: tp.divide(size, f"{name} features") for name, size in shard_sizes.items()}
        super().__init__(in_features, sum(local.values()), bias=bias)
        self.tp = tp
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in local.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        param.data.narrow(0, offset, size).copy_(self.tp.shard(loaded, 0))

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.split([size for _, size in self.shard_offsets.values()], dim=-1))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate/up layer's output: inside the product's kernel
        where its strategy fuses them, else after it."""
        flat = x.reshape(-1, x.shape[-1])
        y = None
        if self.lora is None and self.bias is None:
            y = fused_silu_and_mul(getattr(self, "cpu_weights", None), flat)
        if y is None:
            y = silu_and_mul(self(flat))
        return y.view(*x.shape[:-1], y.shape[-1])


class RowParallelLinear(_Linear):
    """y = sum over ranks of x_r W_r^T, + b: takes a column-parallel layer's split
    output and returns the full result on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel = SINGLE):
        super().__init__(tp.divide(in_features, "input features"), out_features, bias=bias)
        self.tp = tp
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = lambda param, loaded: param.data.copy_(loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(self.tp.shard(loaded, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._product(x))
        # The bias is added once, after the sum.
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__(tp.divide(vocab_size, "vocab_size"), hidden_size)
        self.tp = tp
        self.start = tp.rank * self.num_embeddings
        self.weight.weight_loader = self.weight_loader

    def reset_parameters(self) -> None:
        """Left as allocated: the checkpoint fills it (see _Linear.reset_parameters)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(self.tp.shard(loaded, 0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(x * mine[:, None])


class ParallelLMHead(nn.Module):
    """Logits for each rank's vocabulary slice, gathered into full logits on every rank
    (every rank samples, so that each keeps its persistent batch)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.divide(vocab_size, "vocab_size"), hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(self.tp.shard(loaded, 0))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(matmul(self, hidden), dim=-1)


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The layers whose products cpu_matmul.prepare_cpu_linears may speed up."""
    return [m for m in model.modules() if isinstance(m, (nn.Linear, ParallelLMHead))]
