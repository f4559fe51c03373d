"""Sampler: one token per request from its logits, vectorized over a batch whose
requests each have their own parameters.

Order (as in vLLM v1): logprobs of the raw logits; allowed_token_ids; banned
tokens (bad words, and EOS/stop ids under min_tokens); logit_bias;
repetition/presence/frequency penalties; then greedy argmax, or temperature,
min-p, top-k/top-p and a draw.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kernels.cpu_layers import argmax_rows
from services.common.request_types import Logprobs


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as tensors ([B] unless noted)."""

    temperature: torch.Tensor  # 0 for greedy rows
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]
    # Per row, token ids it must not produce this step: EOS and stop ids while
    # under min_tokens, and the last token of each bad word whose prefix the
    # output ends with.
    banned_token_ids: list[tuple[int, list[int]]] = field(default_factory=list)
    # [B, V] True where a row that lists allowed_token_ids does not allow a token.
    disallowed_mask: torch.Tensor | None = None
    # logit_bias as (rows, token ids, biases), each [N].
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Penalties (None when no row uses any).
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_token_mask: torch.Tensor | None = None  # [B, V] bool: token in the prompt
    output_token_counts: torch.Tensor | None = None  # [B, V]: times generated
    # How many top logprobs each row wants; -1 = none.
    num_logprobs: list[int] | None = None
    # Whether every row is greedy; None: from temperature, once. Asked twice a step:
    # a torch op there cost ~0.1 ms, its code cold after the forward's weights.
    all_greedy: bool | None = None

    def __post_init__(self):
        if self.all_greedy is None:
            self.all_greedy = bool((self.temperature == 0).all())

    def to(self, device: torch.device) -> "SamplingMetadata":
        """The same parameters with every tensor on `device` (the logits'): they
        are built on the CPU, from Python lists."""
        if device.type == "cpu":
            return self
        def move(value):
            if isinstance(value, torch.Tensor):
                return value.to(device, non_blocking=True)
            if isinstance(value, tuple):
                return tuple(move(v) for v in value)
            return value
        return dataclasses.replace(self, **{f.name: move(getattr(self, f.name))
                                            for f in dataclasses.fields(self)})

    @property
    def argmax_only(self) -> bool:
        """Whether every row takes its argmax with nothing else to compute: no
        logprobs, bias or penalties (masks only set -inf, exact in any dtype)."""
        return (self.all_greedy and not self.num_logprobs and self.logit_bias is None
                and self.repetition_penalty is None)


class Sampler:
    def __call__(self, logits: torch.Tensor,
                 meta: SamplingMetadata) -> tuple[torch.Tensor, list[Logprobs | None]]:
        """logits: [B, V] -> token ids [B] and, per row, its logprobs (or None)."""
        meta = meta.to(logits.device)
        logits, raw_logprobs = process_logits(logits, meta)
        tokens = argmax_rows(logits)
        if not meta.all_greedy:
            tokens = torch.where(meta.temperature == 0, tokens,
                                 draw(sampling_probs(logits, meta), meta.generators))
        if raw_logprobs is None:
            return tokens, [None] * len(tokens)
        return tokens, gather_logprobs(raw_logprobs, tokens, meta.num_logprobs)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every rule up to the choice of a token: the logits a greedy row takes the
    argmax of, and the raw logits' logprobs when a row asks for them."""
    if not meta.argmax_only:
        # Logprobs, bias, penalties and draws run in fp32 (as vLLM's do); an
        # argmax compares 16-bit logits exactly, without a copy of [B, V] fp32.
        logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if meta.num_logprobs else None
    if meta.disallowed_mask is not None:
        logits = logits.masked_fill(meta.disallowed_mask, float("-inf"))
    logits = apply_banned_tokens(logits, meta.banned_token_ids)
    if meta.logit_bias is not None:
        rows, token_ids, biases = meta.logit_bias
        logits = logits.index_put((rows, token_ids), biases, accumulate=True)
    if meta.repetition_penalty is not None:
        logits = apply_penalties(logits, meta)
    return logits, raw_logprobs


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from: processed logits under its
    temperature, min-p, top-k and top-p (greedy rows: at temperature 1)."""
    temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
    logits = logits / temperature[:, None]
    if bool((meta.min_p > 0).any()):
        logits = apply_min_p(logits, meta.min_p)
    if bool((meta.top_k > 0).any()) or bool((meta.top_p < 1).any()):
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(dim=-1)


def apply_banned_tokens(logits: torch.Tensor,
                        banned: list[tuple[int, list[int]]]) -> torch.Tensor:
    if not banned:
        return logits
    on = dict(dtype=torch.int64, device=logits.device)
    rows = torch.tensor([row for row, ids in banned for _ in ids], **on)
    cols = torch.tensor([t for _, ids in banned for t in ids], **on)
    return logits.index_put((rows, cols), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """HF/vLLM semantics: repetition over prompt and output tokens (divide positive
    logits, multiply negative ones); presence and frequency over output tokens."""
    counts = meta.output_token_counts
    generated = counts > 0
    seen = meta.prompt_token_mask | generated
    rep = meta.repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - meta.frequency_penalty[:, None] * counts
            - meta.presence_penalty[:, None] * generated)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    remove = torch.arange(vocab)[None, :] >= k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token once the more likely ones already reach top_p (the top one
    # always stays).
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(
        remove, float("-inf")))


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) is a draw from p. Seeded rows take their noise
    from their own generator, so a seed gives the same tokens whatever else is in
    the batch."""
    noise = torch.empty_like(probs).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: list[int]) -> list[Logprobs | None]:
    """Each row's chosen-token logprob and rank, and its num_top best (-1: none)."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = max(num_top)
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    out: list[Logprobs | None] = []
    for i, n in enumerate(num_top):
        if n < 0:
            out.append(None)
            continue
        out.append(Logprobs(
            token_id=int(token_ids[i]), logprob=float(chosen[i]), rank=int(ranks[i]),
            top_token_ids=top.indices[i, :n].tolist() if n else [],
            top_logprobs=top.values[i, :n].tolist() if n else []))
    return out
