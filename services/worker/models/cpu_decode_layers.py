"""A decode step's trip through every layer of a Llama-family model in one call to
the C++ kernels (kernels/csrc/decode_layers.cpp), on the CPU.

At one stream a step is ~500 short kernel calls, and the Python and dispatch
around each (module calls, wrappers, views) cost more than the element-wise
kernels themselves (bench/NOTES.md). The C++ loop runs the same kernels in the
same order on the same tensors as LlamaDecoderLayer.forward, so its tokens are
the same. It takes decode steps of plain layers whose linears run our GEMV for
few rows and, above, our packed GEMM, MKL's or oneDNN's packed weights (the
fp32 and 16-bit paths) or our AMX kernel's (bf16 on AMX, up to its rows; steps of
more rows where another library serves them stay in Python); the Python layers
run everything else (prefills, mixed steps)."""
from __future__ import annotations

import torch

from kernels.cpu_build import cpu_ops_available
from kernels.paged_attention import KERNEL_BLOCK_SIZES, KERNEL_HEAD_DIMS
from services.worker.attention import AttentionMetadata, CpuPagedBackend
from services.worker.cpu_matmul.amx import AMX_MAX_ROWS, AMXWeights
from services.worker.cpu_matmul.gemv import GemvForFewRows
from services.worker.cpu_matmul.gemm import PackedGemmWeights
from services.worker.cpu_matmul.mkl import MKLPackedWeights
from services.worker.cpu_matmul.onednn import OneDNNWeights

# A step of any number of rows, where every linear has packed weights.
ANY_ROWS = 1 << 30
# The strategies whose packed weights the C++ loop multiplies by.
PACKED = (PackedGemmWeights, MKLPackedWeights, OneDNNWeights, AMXWeights)


def _plain_linears(layer) -> list | None:
    """The layer's four linears where each runs our GEMV on its own weight alone (no
    bias, no LoRA, one rank); else None."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    if all(lin.bias is None and lin.lora is None and lin.tp.size == 1
           and isinstance(getattr(lin, "cpu_weights", None), GemvForFewRows) for lin in linears):
        return linears
    return None


def _packed_rows(many) -> int:
    """The most rows C++ multiplies by `many`'s packed weights: our AMX kernel's up to
    AMX_MAX_ROWS (its strategy hands more to oneDNN, which C++ is not given); any
    for the rest."""
    return AMX_MAX_ROWS if isinstance(many, AMXWeights) else ANY_ROWS


class CpuDecodeLayers:
    """The weights of a model's layers listed once, in the C++ loop's order, and
    their KV caches as the model runner binds them."""

    def __init__(self, model, weights: list[torch.Tensor], packed: list[torch.Tensor],
                 gemv_rows: int, packed_rows: int = ANY_ROWS):
        self.layers = model.own_layers
        self.weights, self.packed = weights, packed
        self.gemv_rows = gemv_rows
        self.max_rows = packed_rows if packed else gemv_rows
        attn = self.layers[0].self_attn
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.scale = attn.scale
        self.eps = model.norm.eps
        self._bound = None  # the first layer's cache the list below was made from
        self._caches: list[torch.Tensor] = []

    @classmethod
    def of(cls, model) -> "CpuDecodeLayers | None":
        """For a LlamaModel whose linears are prepared and LoRA-free; None where any
        layer is not plain (biases, q/k norms, LoRA, parallel ranks or stages, a
        linear off our GEMV, another attention backend or head size)."""
        stage, layers = model.stage, model.own_layers
        if not (cpu_ops_available() and stage.is_first and stage.is_last and layers):
            return None
        weights, packed, strategies = [], [], []
        for layer in layers:
            attn, linears = layer.self_attn, _plain_linears(layer)
            if (linears is None or attn.q_norm is not None or attn.head_dim not in KERNEL_HEAD_DIMS
                    or not isinstance(attn.backend, CpuPagedBackend)):
                return None
            qkv, o, gate_up, down = (lin.cpu_weights for lin in linears)
            weights += [layer.input_layernorm.weight, qkv.gemv_weight, o.gemv_weight,
                        layer.post_attention_layernorm.weight, gate_up.gemv_weight,
                        down.gemv_weight]
            strategies += [qkv, o, gate_up, down]
        rows = {s.max_rows for s in strategies}
        # Above the GEMV's rows, packed weights (PACKED), where every linear has one
        # and switches at the same rows (C++ keeps one threshold); else the GEMV's
        # rows alone.
        if len(rows) == 1 and all(isinstance(s.many, PACKED) for s in strategies):
            packed = [s.many.packed for s in strategies]
        return cls(model, weights + [model.norm.weight], packed, min(rows),
                   min(_packed_rows(s.many) for s in strategies))

    @property
    def reach(self) -> str:
        """What the worker's load line says: up to how many rows steps take C++."""
        return "one C++ call" + ("" if self.max_rows >= ANY_ROWS
                                 else f" for <= {self.max_rows} rows, Python above")

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Decodes only, rows the linears take in C++, caches the kernels read."""
        return meta.decodes_only and x.shape[0] <= self.max_rows and bool(self.caches())

    def caches(self) -> list[torch.Tensor]:
        """Each layer's key and value caches; listed again when the runner binds new
        ones, empty where their block size is not one the kernels are built for."""
        first = self.layers[0].self_attn.kv_cache
        if first is not self._bound:
            self._bound = first
            ok = first is not None and first[0].shape[-1] in KERNEL_BLOCK_SIZES
            self._caches = ([c for layer in self.layers for c in layer.self_attn.kv_cache]
                            if ok else [])
        return self._caches

    def __call__(self, x: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        """The final norm of the last layer's output, from the step's embeddings x."""
        num_heads, num_kv_heads, head_dim = self.shape
        return torch.ops.llmserve.llama_decode_layers(
            x, self.weights, self.packed, self.caches(), rope.positions, rope.cos_sin,
            meta.slot_mapping, meta.decode_block_table, meta.decode_seq_lens, num_heads,
            num_kv_heads, head_dim, self.gemv_rows, self.eps, self.scale)
