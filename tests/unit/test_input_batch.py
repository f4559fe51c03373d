"""The persistent batch's step inputs against their definitions: a decode step's
(one token a request, gathered without the per-token layout) and a mixed step's."""
import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData
from services.worker.input_batch import InputBatch, RequestState

BLOCK = 4


def batch_of(prompts: list[list[int]], blocks: list[list[int]]) -> InputBatch:
    batch = InputBatch(max_model_len=32, block_size=BLOCK, device=torch.device("cpu"))
    for i, (prompt, block_ids) in enumerate(zip(prompts, blocks)):
        params = SamplingParams(temperature=0.0)
        batch.add(NewRequestData(f"r{i}", prompt, params, block_ids, 0),
                  RequestState(f"r{i}", params, eos_token_ids=[], generator=None))
    return batch


def expected(batch: InputBatch, rows, starts, num_new):
    """Token ids, positions and slots, token by token from the definitions."""
    ids, positions, slots = [], [], []
    for row, start, n in zip(rows, starts, num_new):
        for p in range(start, start + n):
            ids.append(batch.token_ids[row, p])
            positions.append(p)
            slots.append(batch.block_table[row, p // BLOCK] * BLOCK + p % BLOCK)
    return ids, positions, slots


def check(batch: InputBatch, starts: list[int], num_new: list[int]):
    rows = np.arange(len(starts))
    step = batch.gather([f"r{i}" for i in rows], rows, np.array(starts), np.array(num_new))
    ids, positions, slots = expected(batch, rows, starts, num_new)
    meta = step.attn_metadata
    assert step.input_ids.tolist() == ids and step.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc == [0, *np.cumsum(num_new).tolist()]
    assert meta.seq_lens == [s + n for s, n in zip(starts, num_new)]
    assert meta.query_start_loc_tensor.dtype == meta.seq_lens_tensor.dtype == torch.int32
    decodes = [i for i, n in enumerate(num_new) if n == 1]
    assert meta.prefill_request_indices == [i for i, n in enumerate(num_new) if n > 1]
    assert meta.decode_token_indices.tolist() == [meta.query_start_loc[i] for i in decodes]
    assert meta.decode_seq_lens.tolist() == [meta.seq_lens[i] for i in decodes]
    width = max((-(-meta.seq_lens[i] // BLOCK) for i in decodes), default=0)
    assert meta.decode_block_table.tolist() == batch.block_table[decodes, :width].tolist()
    return step


def test_a_decode_steps_inputs_are_each_requests_next_token():
    batch = batch_of([list(range(10, 17)), [20, 21, 22], list(range(30, 39))],
                     [[5, 2], [7], [1, 3, 8]])
    step = check(batch, starts=[6, 2, 8], num_new=[1, 1, 1])
    assert step.attn_metadata.decodes_only and step.attn_metadata.max_query_len == 1


def test_a_mixed_steps_inputs_lay_each_requests_tokens_end_to_end():
    batch = batch_of([list(range(10, 17)), [20, 21, 22], list(range(30, 39))],
                     [[5, 2], [7], [1, 3, 8]])
    step = check(batch, starts=[6, 0, 3], num_new=[1, 3, 5])
    assert not step.attn_metadata.decodes_only and step.attn_metadata.max_query_len == 5
