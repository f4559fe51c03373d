"""RejectionSampler: verifies draft tokens against the target model, so that what
a request emits is distributed exactly as if the target had sampled every
token itself (Leviathan et al., 2023; Chen et al., 2023; vLLM's rule).

A request with n drafts has n + 1 positions in the step's logits: position j
holds the target's distribution for the token after the j-th draft (position 0:
after the request's last token). Draft j is accepted
- greedy: while the target's argmax at position j is that draft;
- random: with probability min(1, p_j(d) / q_j(d)), p being the target's
  distribution after every sampling rule and q the proposer's (one-hot for a
  deterministic proposer: ngram, suffix, a greedy draft model).
At the first rejection the request emits a token drawn from the residual
normalize(max(0, p_j - q_j)) instead (greedy: the argmax); when every draft is
accepted, one more from the last position's p (the bonus token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_layers import argmax_rows
from services.common.request_types import Logprobs
from services.worker.sampler import (SamplingMetadata, draw, gather_logprobs, process_logits,
                                     sampling_probs)


@dataclass
class Verification:
    """Per request, in the step's order: the tokens it emits (accepted drafts,
    then the target's own token) and their logprobs (None: not asked for)."""

    token_ids: list[list[int]]
    logprobs: list[list[Logprobs] | None]


class RejectionSampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 drafts: list[list[int]], draft_probs: torch.Tensor | None = None
                 ) -> Verification:
        """logits: [P, V], the positions of each request in turn (len(drafts[i]) + 1
        of them); meta: their sampling parameters, a row per position;
        draft_probs: [sum of len(drafts[i]), V], the proposer's distributions
        (None: one-hot at each draft)."""
        meta = meta.to(logits.device)
        logits, raw_logprobs = process_logits(logits, meta)
        starts = _starts(drafts)
        flat = [t for d in drafts for t in d]
        draft_pos = torch.tensor([s + j for s, d in zip(starts, drafts) for j in range(len(d))],
                                 dtype=torch.int64, device=logits.device)
        draft_ids = torch.tensor(flat, dtype=torch.int64, device=logits.device)
        argmax = argmax_rows(logits)
        accepted = argmax[draft_pos] == draft_ids
        probs = None
        if not meta.all_greedy:
            probs = sampling_probs(logits, meta)
            random = _accept_randomly(probs, draft_pos, draft_ids, draft_probs, meta.generators)
            accepted = torch.where(meta.temperature[draft_pos] == 0, accepted, random)
        num_accepted = _leading_true(accepted.tolist(), drafts)
        final_pos = [s + a for s, a in zip(starts, num_accepted)]
        final = argmax[final_pos]
        if probs is not None:
            drawn = self._draw_final(probs, final_pos, num_accepted, drafts, starts,
                                     draft_probs, meta.generators)
            final = torch.where(meta.temperature[final_pos] == 0, final, drawn)
        final = final.tolist()
        token_ids = [d[:a] + [t] for d, a, t in zip(drafts, num_accepted, final)]
        return Verification(token_ids, _logprobs(raw_logprobs, meta, starts, token_ids))

    @staticmethod
    def _draw_final(probs: torch.Tensor, final_pos: list[int], num_accepted: list[int],
                    drafts: list[list[int]], starts: list[int],
                    draft_probs: torch.Tensor | None,
                    generators: list[torch.Generator | None]) -> torch.Tensor:
        """Each request's token after its accepted drafts: from the residual at a
        rejection, from p itself after the last draft."""
        dist = probs[final_pos].clone()
        offset = 0
        for i, (a, d) in enumerate(zip(num_accepted, drafts)):
            if a < len(d):
                if draft_probs is None:
                    dist[i, d[a]] = 0.0
                else:
                    dist[i] = (dist[i] - draft_probs[offset + a]).clamp_(min=0.0)
                if float(dist[i].sum()) <= 0.0:  # p equal to q: nothing is left over
                    dist[i] = probs[final_pos[i]]
            offset += len(d)
        dist = dist / dist.sum(dim=-1, keepdim=True)
        return draw(dist, [generators[p] for p in final_pos])


def _starts(drafts: list[list[int]]) -> list[int]:
    starts, position = [], 0
    for d in drafts:
        starts.append(position)
        position += len(d) + 1
    return starts


def _accept_randomly(probs: torch.Tensor, draft_pos: torch.Tensor, draft_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None,
                     generators: list[torch.Generator | None]) -> torch.Tensor:
    """Accepts draft d at its position with probability min(1, p(d) / q(d)). A
    seeded request's uniforms come from its position's generator."""
    p = probs[draft_pos, draft_ids]
    q = torch.ones_like(p) if draft_probs is None else \
        draft_probs[torch.arange(len(draft_ids), device=p.device), draft_ids]
    uniform = torch.rand(len(draft_ids), device=p.device)
    for i, position in enumerate(draft_pos.tolist()):
        generator = generators[position]
        if generator is not None:
            uniform[i] = torch.rand(1, generator=generator, device=p.device)[0]
    return uniform * q < p


def _leading_true(accepted: list[bool], drafts: list[list[int]]) -> list[int]:
    """Per request, how many of its drafts were accepted before the first rejection."""
    counts, offset = [], 0
    for d in drafts:
        n = 0
        while n < len(d) and accepted[offset + n]:
            n += 1
        counts.append(n)
        offset += len(d)
    return counts


def _logprobs(raw_logprobs: torch.Tensor | None, meta: SamplingMetadata, starts: list[int],
              token_ids: list[list[int]]) -> list[list[Logprobs] | None]:
    """Each emitted token's logprobs at its position, for requests asking for them."""
    if raw_logprobs is None:
        return [None] * len(token_ids)
    positions = [s + j for s, tokens in zip(starts, token_ids) for j in range(len(tokens))]
    flat = torch.tensor([t for tokens in token_ids for t in tokens], dtype=torch.int64,
                        device=raw_logprobs.device)
    results = gather_logprobs(raw_logprobs[positions], flat,
                              [meta.num_logprobs[p] for p in positions])
    out, offset = [], 0
    for s, tokens in zip(starts, token_ids):
        chunk = results[offset:offset + len(tokens)]
        out.append(None if chunk[0] is None else chunk)
        offset += len(tokens)
    return out
