"""DecodeGraphs: CUDA graphs of the model's forward pass for decode-only batches.

A decode step is many small kernels; replaying a captured graph removes their
launch cost. Graphs are captured for a few batch sizes; a batch is padded up to
the next one. Padding tokens write their K/V nowhere (slot -1) and their outputs
are dropped. Inputs live in static buffers that every replay reads.

Captured only on CUDA with a graph-safe backend (flash_attn: tensors only, fixed
max_seqlen_k); with `capture=False` the same padded static-buffer path runs
eagerly, which is how it is tested on the CPU.
"""
from __future__ import annotations

import torch

from services.worker.attention.metadata import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    return sizes + list(range(16, max_batch + 1, 16))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_model_len: int,
                 block_size: int, device: torch.device, capture: bool):
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.capture = capture
        n, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        as_long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **as_long)
        self.positions = torch.zeros(n, **as_long)
        self.slot_mapping = torch.full((n,), -1, **as_long)
        self.block_table = torch.zeros(n, max_blocks, **as_long)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def can_run(self, num_tokens: int, max_query_len: int) -> bool:
        return max_query_len == 1 and num_tokens <= self.sizes[-1]

    # As every forward pass here: no autograd (the layers write into views in place).
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures one graph per size, largest first so smaller ones reuse its pool."""
        pool = None
        for size in reversed(self.sizes):
            meta = self._metadata(size)
            self.model(self.input_ids[:size], self.positions[:size], meta)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size], meta)
            pool = graph.pool()
            self.graphs[size] = graph

    def release(self) -> None:
        """Drops the captured graphs and their outputs (their pool goes with them)."""
        self.graphs.clear()
        self.outputs.clear()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only batch, through the padded static buffers."""
        b = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens.fill_(1)
        self.seq_lens[:b].copy_(meta.seq_lens_tensor)
        self.block_table.zero_()
        self.block_table[:b, :meta.block_table.shape[1]].copy_(meta.block_table)
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:b]
        return self.model(self.input_ids[:size], self.positions[:size], self._metadata(size))[:b]

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the static buffers. The list fields serve only the CPU
        backend, which is never captured."""
        return AttentionMetadata(
            query_start_loc=list(range(size + 1)), seq_lens=[1] * size,
            query_start_loc_tensor=self.query_start_loc[:size + 1],
            seq_lens_tensor=self.seq_lens[:size], max_query_len=1,
            max_seq_len=self.max_model_len, block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size], block_size=self.block_size,
            decode_token_indices=torch.arange(size, device=self.device),
            decode_seq_lens=self.seq_lens[:size].long(),
            decode_block_table=self.block_table[:size], prefill_request_indices=[])
