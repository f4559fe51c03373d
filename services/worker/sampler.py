"""Sampler: picks one token per request from its logits, vectorized over the batch."""
from __future__ import annotations

import torch

from services.common.request_types import SamplingParams


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits: [B, V] fp32 -> token ids [B]."""
        greedy = torch.tensor([p.greedy for p in params])
        argmax = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return argmax
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                   dtype=logits.dtype)
        logits = _apply_top_k_top_p(logits / temperature[:, None], params)
        probs = logits.softmax(dim=-1)
        sampled = _sample_exponential(probs, generators)
        return torch.where(greedy, argmax, sampled)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    if not bool((top_k > 0).any()) and not bool((top_p < 1.0).any()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    remove = ranks >= k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p.
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _sample_exponential(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) draws from p; seeded rows use their own generator,
    so a seed gives the same tokens whatever else is in the batch."""
    noise = torch.empty_like(probs).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
