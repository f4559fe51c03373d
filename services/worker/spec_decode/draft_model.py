"""DraftModelProposer: greedy drafts from a smaller model that shares the target's
tokenizer, run in this worker after each step.

Its paged KV cache has tensors of its own but the target's block ids: a request's
blocks hold both models' KV, so the scheduler's allocation (with its lookahead
slots for the drafts) and the prefix cache's bookkeeping cover both. Per request
it remembers how many positions it computed; only those before the target's
num_computed_tokens hold KV of the real tokens (a draft accepted is a real token,
one rejected is not), so it resumes from there, catching up on what the target
emitted in one chunk, then decodes its drafts one position at a time.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.cpu_layers import argmax_rows
from services.worker.input_batch import InputBatch


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, num_tokens: int, input_batch: InputBatch):
        self.model = model
        self.k = num_tokens
        self.input_batch = input_batch
        self.computed: dict[str, int] = {}  # by request: positions its KV is of real tokens

    def blocks_trimmed(self, request_ids: list[str], rows: np.ndarray) -> None:
        """The rows gave up the blocks past their computed tokens, and with them the
        lookahead KV written there: it is computed again next time."""
        capacity = (self.input_batch.num_blocks[rows] * self.input_batch.block_size).tolist()
        for request_id, limit in zip(request_ids, capacity):
            if request_id in self.computed:
                self.computed[request_id] = min(self.computed[request_id], limit)

    def forget(self, request_id: str) -> None:
        """The request is gone, or its row was filled again (after a preemption)."""
        self.computed.pop(request_id, None)

    @torch.inference_mode()
    def propose_batch(self, request_ids: list[str], rows: np.ndarray) -> dict[str, list[int]]:
        batch = self.input_batch
        num_tokens = batch.num_tokens[rows]
        # Its last draft needs no KV; the others need slots the request holds.
        room = batch.num_blocks[rows] * batch.block_size - num_tokens + 1
        k = np.minimum(np.minimum(room, batch.max_model_len - num_tokens), self.k)
        keep = k > 0
        request_ids = [r for r, kept in zip(request_ids, keep) if kept]
        rows, num_tokens, k = rows[keep], num_tokens[keep], k[keep]
        starts = np.array([min(self.computed.get(r, 0), int(batch.num_computed_tokens[row]))
                           for r, row in zip(request_ids, rows.tolist())], dtype=np.int64)
        num_new = num_tokens - starts
        drafts: list[list[int]] = [[] for _ in request_ids]
        for step in range(int(k.max()) if len(k) else 0):
            live = np.flatnonzero(k > step)
            tokens = self._next_tokens([request_ids[i] for i in live], rows[live], starts[live],
                                       num_new[live])
            batch.token_ids[rows[live], num_tokens[live] + step] = tokens
            for i, token in zip(live.tolist(), tokens.tolist()):
                drafts[i].append(token)
            starts[live] += num_new[live]
            num_new[live] = 1
        for request_id, start in zip(request_ids, starts.tolist()):
            self.computed[request_id] = start
        return {r: d for r, d in zip(request_ids, drafts)}

    def _next_tokens(self, request_ids: list[str], rows: np.ndarray, starts: np.ndarray,
                     num_new: np.ndarray) -> np.ndarray:
        """One draft forward: each row's tokens from `starts` on, then its argmax."""
        step = self.input_batch.gather(request_ids, rows, starts, num_new)
        last = step.query_start_loc[1:] - 1
        # Rows catching up on several tokens need only their last one's hidden state.
        output_rows = None if len(last) == len(step.input_ids) else torch.from_numpy(last)
        hidden = self.model(step.input_ids, step.positions, step.attn_metadata, None, output_rows)
        return argmax_rows(self.model.compute_logits(hidden)).cpu().numpy()
