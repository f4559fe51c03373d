"""InputBatch: the worker's persistent batch, one row of arrays per live request.

The engine core sends only a diff per step; rows are filled once and updated in
place, and every per-step input (token ids, positions, slot mapping, block
table, query start locations, sequence lengths) is gathered from the arrays
with vectorized numpy, never a per-token Python loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.pooling_params import PoolingParams
from services.common.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.worker.attention import AttentionMetadata
from services.worker.sampler import SamplingMetadata


@dataclass
class RequestState:
    """What the arrays do not hold about a request."""

    request_id: str
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    generator: torch.Generator | None
    span: object = field(default=None, repr=False)  # the request's span in this worker
    lora_id: int = 0  # its LoRA adapter; 0: none
    # A pooling request's params, and its pooler's state across prefill chunks
    # (MEAN: the sum so far; CLS: the first position's hidden state).
    pooling_params: PoolingParams | None = None
    pooled: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    request_ids: list[str]  # scheduled requests, in batch order
    rows: np.ndarray  # their rows in the InputBatch
    query_start_loc: np.ndarray  # [B + 1]
    starts: np.ndarray  # num_computed_tokens of each before this step
    # Requests whose prompt is done after this step sample from their last position
    # (pooling requests pool instead: see pooling and prompt_done).
    sampling: np.ndarray  # [B] bool
    pooling: np.ndarray  # [B] bool: pooling requests
    prompt_done: np.ndarray  # [B] bool: every prompt token computed after this step

    @property
    def logits_indices(self) -> torch.Tensor:
        return torch.from_numpy(self.query_start_loc[1:][self.sampling] - 1)


class InputBatch:
    def __init__(self, max_model_len: int, block_size: int, device: torch.device,
                 capacity: int = 64):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((capacity, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(capacity, dtype=np.int64)  # prompt + sampled so far
        self.num_prompt_tokens = np.zeros(capacity, dtype=np.int64)
        self.num_computed_tokens = np.zeros(capacity, dtype=np.int64)
        self.block_table = np.zeros((capacity, self.max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self.is_pooling = np.zeros(capacity, dtype=bool)  # pooling requests' rows
        self.states: list[RequestState | None] = [None] * capacity
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(capacity - 1, -1, -1))
        # The last step's sampling metadata and its rows (as bytes), while no row
        # joins or leaves and none has metadata that changes by step.
        self.sampling_metadata_kept: tuple[bytes, SamplingMetadata] | None = None

    def __len__(self) -> int:
        return len(self.row_of)

    # ---- applying the step diff -------------------------------------------------

    def add(self, new: NewRequestData, state: RequestState) -> None:
        """Fills a row (replacing the request's old row after a preemption)."""
        self.remove(new.request_id)
        self.sampling_metadata_kept = None
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.row_of[new.request_id] = row
        self.states[row] = state
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.is_pooling[row] = new.pooling_params is not None
        self.append_blocks(new.request_id, new.block_ids)

    def state_of(self, request_id: str) -> RequestState | None:
        row = self.row_of.get(request_id)
        return None if row is None else self.states[row]

    def remove(self, request_id: str) -> RequestState | None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return None
        self.sampling_metadata_kept = None
        state, self.states[row] = self.states[row], None
        self._free_rows.append(row)
        return state

    def append_blocks(self, request_id: str, block_ids: list[int]) -> None:
        row = self.row_of[request_id]
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def set_num_computed(self, request_id: str, num_computed_tokens: int) -> None:
        self.num_computed_tokens[self.row_of[request_id]] = num_computed_tokens

    def set_output_tokens(self, request_id: str, num_computed_tokens: int,
                          token_ids: list[int]) -> None:
        """The request's output tokens from position max(num_computed_tokens, its
        prompt length) on, as the scheduler sends them (pipeline parallelism, where a
        stage never sees the tokens the last one samples)."""
        row = self.row_of[request_id]
        start = max(num_computed_tokens, int(self.num_prompt_tokens[row]))
        self.token_ids[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def append_token_lists(self, rows: np.ndarray, token_lists: list[list[int]]) -> None:
        """Speculative decoding: each row's accepted drafts and its sampled token."""
        for row, tokens in zip(rows.tolist(), token_lists):
            start = self.num_tokens[row]
            self.token_ids[row, start:start + len(tokens)] = tokens
            self.num_tokens[row] = start + len(tokens)

    def set_drafts(self, request_id: str, drafts: list[int]) -> None:
        """Places the drafts a step verifies after the request's tokens, where the
        step's inputs are gathered from; the tokens it emits overwrite them."""
        row = self.row_of[request_id]
        start = self.num_tokens[row]
        self.token_ids[row, start:start + len(drafts)] = drafts

    def trim_blocks(self, rows: np.ndarray) -> None:
        """Speculative decoding, after a step: the rows' blocks past their computed
        tokens (which held rejected drafts, or a draft model's lookahead) are no
        longer theirs; the scheduler frees them by the same rule (free_tail)."""
        needed = -(-self.num_computed_tokens[rows] // self.block_size)
        self.num_blocks[rows] = np.minimum(self.num_blocks[rows], needed)

    def token_history(self, row: int, start: int = 0) -> np.ndarray:
        """The row's tokens from `start` on (a view)."""
        return self.token_ids[row, start:self.num_tokens[row]]

    def _grow(self) -> None:
        old = len(self.states)
        for name in ("token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens",
                     "block_table", "num_blocks", "is_pooling"):
            array = getattr(self, name)
            grown = np.zeros((2 * old,) + array.shape[1:], dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self.states += [None] * old
        self._free_rows = list(range(2 * old - 1, old - 1, -1))

    # ---- the step's inputs ----------------------------------------------------------

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """Gathers the step's model inputs and advances num_computed_tokens."""
        request_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((self.row_of[r] for r in request_ids), dtype=np.int64,
                           count=len(request_ids))
        num_new = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64,
                              count=len(request_ids))
        step = self.gather(request_ids, rows, self.num_computed_tokens[rows], num_new)
        self.num_computed_tokens[rows] = step.starts + num_new
        return step

    def gather(self, request_ids: list[str], rows: np.ndarray, starts: np.ndarray,
               num_new: np.ndarray) -> StepInputs:
        """The model inputs of num_new tokens of each row from position starts on
        (a draft model's steps gather their own, from its own progress)."""
        bs = self.block_size
        seq_lens = starts + num_new
        max_query_len = int(num_new.max())
        query_start_loc, positions, token_rows = _token_layout(rows, starts, num_new,
                                                               max_query_len)
        input_ids = self.token_ids[token_rows, positions]
        slots = self.block_table[token_rows, positions // bs] * bs + positions % bs
        block_table = self._tensor(self.block_table[rows, :_blocks_for(seq_lens, bs)])
        meta = AttentionMetadata(
            query_start_loc=query_start_loc.tolist(), seq_lens=seq_lens.tolist(),
            query_start_loc_tensor=self._tensor(query_start_loc, np.int32),
            seq_lens_tensor=self._tensor(seq_lens, np.int32),
            max_query_len=max_query_len, max_seq_len=int(seq_lens.max()),
            block_table=block_table, slot_mapping=self._tensor(slots), block_size=bs,
            **self._decode_parts(rows, seq_lens, num_new, query_start_loc, block_table,
                                 decodes_only=max_query_len == 1))
        prompt_done = seq_lens >= self.num_tokens[rows]
        pooling = self.is_pooling[rows]
        return StepInputs(input_ids=self._tensor(input_ids), positions=self._tensor(positions),
                          attn_metadata=meta, request_ids=request_ids, rows=rows,
                          query_start_loc=query_start_loc, starts=starts,
                          sampling=prompt_done & ~pooling, pooling=pooling,
                          prompt_done=prompt_done)

    def _decode_parts(self, rows: np.ndarray, seq_lens: np.ndarray, num_new: np.ndarray,
                      query_start_loc: np.ndarray, block_table: torch.Tensor,
                      decodes_only: bool) -> dict:
        """AttentionMetadata's fields for the CPU backend's split into decodes and
        prefills; a step of decodes only is its own decode part."""
        if decodes_only:
            return dict(decode_token_indices=self._tensor(query_start_loc[:-1]),
                        decode_seq_lens=self._tensor(seq_lens), decode_block_table=block_table,
                        prefill_request_indices=[])
        decode_idx = np.flatnonzero(num_new == 1)
        lens = seq_lens[decode_idx]
        return dict(decode_token_indices=self._tensor(query_start_loc[decode_idx]),
                    decode_seq_lens=self._tensor(lens),
                    decode_block_table=self._tensor(
                        self.block_table[rows[decode_idx], :_blocks_for(lens, self.block_size)]),
                    prefill_request_indices=np.flatnonzero(num_new > 1).tolist())

    def _tensor(self, array: np.ndarray, dtype=np.int64) -> torch.Tensor:
        """A step input on the device. On the CPU, numpy's own memory: no torch op
        (each cost tens of microseconds with caches cold after a forward)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
        return tensor if self.device.type == "cpu" else tensor.to(self.device)


def _token_layout(rows: np.ndarray, starts: np.ndarray, num_new: np.ndarray,
                  max_query_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Query start locations [B + 1], and each token's position and row."""
    if max_query_len == 1:  # decodes only: a token a request, at the row's end
        # The arrays themselves, not copies: nothing writes a step's inputs.
        return np.arange(len(rows) + 1), starts, rows
    query_start_loc = np.concatenate(([0], np.cumsum(num_new)))
    # Per token: its request's index in the batch, then its position.
    token_req = np.repeat(np.arange(len(rows)), num_new)
    positions = starts[token_req] + np.arange(query_start_loc[-1]) - query_start_loc[token_req]
    return query_start_loc, positions, rows[token_req]


def _blocks_for(seq_lens: np.ndarray, block_size: int) -> int:
    """Blocks the longest of these sequences spans (0 for none)."""
    return int(-(-seq_lens.max() // block_size)) if len(seq_lens) else 0


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                            num_tokens: np.ndarray | None = None) -> SamplingMetadata:
    """The sampler's per-row tensors for the given rows. A row may come more than
    once (speculative decoding: one per position verified), each with the tokens
    before its position: num_tokens (default: all the row's, and the metadata is
    kept for the next step of the same rows where no row's changes by step, as
    vLLM's InputBatch keeps it: building it took ~0.2 ms of a one-stream step)."""
    if num_tokens is not None:
        return _sampling_metadata(batch, rows, vocab_size, num_tokens)
    key, kept = rows.tobytes(), batch.sampling_metadata_kept
    if kept is not None and kept[0] == key:
        return kept[1]
    meta = _sampling_metadata(batch, rows, vocab_size, batch.num_tokens[rows])
    steady = all(_same_every_step(batch.states[r].sampling_params) for r in rows)
    batch.sampling_metadata_kept = (key, meta) if steady else None
    return meta


def _same_every_step(params: SamplingParams) -> bool:
    """Whether a row's sampling metadata stays the same from step to step: not
    seeded (a generator per draw), no tokens banned by what came before (min_tokens,
    bad words), no penalties (over the tokens so far)."""
    return (params.seed is None and not params.min_tokens and not params.bad_words_token_ids
            and not params.uses_penalties)


def _sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                       num_tokens: np.ndarray) -> SamplingMetadata:
    states = [batch.states[r] for r in rows]
    params = [s.sampling_params for s in states]
    meta = SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        generators=_generators_for_this_draw(batch, rows, states, num_tokens),
        banned_token_ids=_banned_token_ids(batch, rows, states, num_tokens),
        disallowed_mask=_disallowed_mask(params, vocab_size),
        logit_bias=_logit_bias(params),
        num_logprobs=([-1 if p.logprobs is None else p.logprobs for p in params]
                      if any(p.logprobs is not None for p in params) else None),
        all_greedy=all(p.temperature == 0 for p in params))
    if any(p.uses_penalties for p in params):
        meta.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
        meta.presence_penalty = torch.tensor([p.presence_penalty for p in params])
        meta.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
        meta.prompt_token_mask, meta.output_token_counts = _token_histories(
            batch, rows, vocab_size, num_tokens)
    return meta


def _generators_for_this_draw(batch: InputBatch, rows: np.ndarray, states: list[RequestState],
                              num_tokens: np.ndarray) -> list[torch.Generator | None]:
    """Seeded rows draw output token i from a generator seeded with (seed, i), so
    a seed gives the same tokens whatever came before: other requests in the
    batch, a preemption and its recomputation, or a restarted worker. A row that
    comes again (another position) gets a generator of its own."""
    generators = []
    seen = set()
    for row, state, n in zip(rows, states, num_tokens):
        generator = state.generator
        if generator is not None:
            if row in seen:
                generator = torch.Generator(device=generator.device)
            seen.add(row)
            index = int(n - batch.num_prompt_tokens[row])
            generator.manual_seed(_draw_seed(state.sampling_params.seed, index))
        generators.append(generator)
    return generators


def _draw_seed(seed: int, output_index: int) -> int:
    # A 64-bit mix (splitmix64's constants): nearby (seed, index) pairs get
    # unrelated streams.
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _banned_token_ids(batch: InputBatch, rows: np.ndarray, states: list[RequestState],
                      row_num_tokens: np.ndarray) -> list[tuple[int, list[int]]]:
    """Per row, what it must not produce now: EOS and stop ids under min_tokens,
    and the last token of each bad word whose prefix ends the output (vLLM's rule)."""
    banned = []
    for i, (row, state, num_tokens) in enumerate(zip(rows, states, row_num_tokens)):
        params = state.sampling_params
        num_prompt = batch.num_prompt_tokens[row]
        ids = []
        if num_tokens - num_prompt < params.min_tokens:
            ids += state.eos_token_ids + params.stop_token_ids
        for seq in params.bad_words_token_ids:
            prefix = len(seq) - 1
            if prefix <= num_tokens - num_prompt and \
                    batch.token_ids[row, num_tokens - prefix:num_tokens].tolist() == seq[:-1]:
                ids.append(seq[-1])
        if ids:
            banned.append((i, ids))
    return banned


def _disallowed_mask(params: list[SamplingParams], vocab_size: int) -> torch.Tensor | None:
    if not any(p.allowed_token_ids for p in params):
        return None
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            mask[i] = True
            mask[i, p.allowed_token_ids] = False
    return mask


def _logit_bias(params: list[SamplingParams]):
    entries = [(i, token, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, bias)))
               for i, p in enumerate(params) for token, bias in p.logit_bias.items()]
    if not entries:
        return None
    rows, token_ids, biases = zip(*entries)
    return (torch.tensor(rows, dtype=torch.int64), torch.tensor(token_ids, dtype=torch.int64),
            torch.tensor(biases, dtype=torch.float32))


def _token_histories(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                     row_num_tokens: np.ndarray):
    """[B, V] 'in the prompt' mask and generated-token counts, by scatter."""
    width = int(row_num_tokens.max())
    tokens = torch.from_numpy(batch.token_ids[rows, :width])
    positions = torch.arange(width)[None, :]
    num_prompt = torch.from_numpy(batch.num_prompt_tokens[rows])[:, None]
    num_tokens = torch.from_numpy(np.ascontiguousarray(row_num_tokens))[:, None]
    # Positions outside each part scatter into a spare column, dropped after.
    spare = torch.full_like(tokens, vocab_size)
    prompt_ids = torch.where(positions < num_prompt, tokens, spare)
    output_ids = torch.where((positions >= num_prompt) & (positions < num_tokens), tokens, spare)
    b = len(rows)
    prompt_mask = torch.zeros(b, vocab_size + 1, dtype=torch.bool).scatter_(1, prompt_ids, True)
    counts = torch.zeros(b, vocab_size + 1).scatter_add_(1, output_ids, torch.ones(b, width))
    return prompt_mask[:, :vocab_size], counts[:, :vocab_size]
