"""The rejection sampler's output distribution equals the target's, whatever the
drafts: chi-square tests on a 6-token vocabulary over 20,000 draws, with fixed
seeds, for one-hot drafts (ngram, suffix) and for drafts drawn from a proposer's
own distribution. Planted bugs in the residual draw and the acceptance rule
make the same tests fail, so they can."""
from __future__ import annotations

import pytest
import torch

from services.worker.sampler import SamplingMetadata, process_logits, sampling_probs
from services.worker.spec_decode import rejection_sampler as rs
from services.worker.spec_decode.rejection_sampler import RejectionSampler

V = 6
N = 20_000
# The 0.999 quantile of chi-square with V - 1 = 5 degrees of freedom: a correct
# sampler fails one run in a thousand (the seeds are fixed, so never here).
CHI2_CRITICAL = 20.515
P0 = torch.tensor([1.2, 0.3, -0.4, 2.0, 0.0, -1.0])  # the target's logits, first position
P1 = torch.tensor([-0.5, 1.0, 0.7, -0.2, 0.4, 0.1])  # after the first draft


def meta(rows: int, temperature: float = 1.0, top_k: int = 0, seed_gens=None):
    return SamplingMetadata(temperature=torch.full((rows,), temperature),
                            top_k=torch.full((rows,), top_k, dtype=torch.int64),
                            top_p=torch.ones(rows), min_p=torch.zeros(rows),
                            generators=seed_gens or [None] * rows)


def target(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """The distribution the plain sampler draws from (every rule applied)."""
    processed, _ = process_logits(logits[None].clone(), m)
    return sampling_probs(processed, m)[0]


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    n = counts.sum()
    assert (counts[probs == 0] == 0).all(), "drew a token the target never gives"
    expected = probs.double() * n
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def verify(drafts: list[list[int]], draft_probs=None, temperature=1.0, top_k=0):
    """N requests with one draft each: their logits are P0, then P1."""
    torch.manual_seed(1234)
    logits = torch.stack([P0, P1] * len(drafts))
    m = meta(len(logits), temperature, top_k)
    return RejectionSampler()(logits, m, drafts, draft_probs), m


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_one_hot_drafts_leave_the_target_distribution_unchanged(temperature, top_k):
    draft = 0  # the target's second most likely token: rejected often, accepted often
    result, m = verify([[draft]] * N, temperature=temperature, top_k=top_k)
    first = torch.tensor([t[0] for t in result.token_ids])
    assert chi_square(first, target(P0, meta(1, temperature, top_k))) < CHI2_CRITICAL
    # After an accepted draft, the bonus token follows the second position's distribution.
    accepted = [t for t in result.token_ids if len(t) == 2]
    assert len(accepted) > N // 5
    second = torch.tensor([t[1] for t in accepted])
    assert chi_square(second, target(P1, meta(1, temperature, top_k))) < CHI2_CRITICAL


def test_drafts_from_a_proposer_distribution_leave_the_target_distribution_unchanged():
    q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.1, 0.1])  # far from the target's
    torch.manual_seed(99)
    drafts = torch.multinomial(q, N, replacement=True)
    result, _ = verify([[int(d)] for d in drafts], draft_probs=q.expand(N, V))
    first = torch.tensor([t[0] for t in result.token_ids])
    assert chi_square(first, target(P0, meta(1))) < CHI2_CRITICAL


def _draw_from_p_at_rejection(probs, final_pos, num_accepted, drafts, starts, draft_probs,
                              generators):
    """A planted bug: after a rejection, draw from p instead of the residual."""
    return rs.draw(probs[final_pos], [generators[p] for p in final_pos])


def _accept_by_p_alone(probs, draft_pos, draft_ids, draft_probs, generators):
    """A planted bug: accept with probability p(d), ignoring q."""
    return torch.rand(len(draft_ids)) < probs[draft_pos, draft_ids]


@pytest.mark.parametrize("bug", ["residual", "acceptance"])
def test_a_planted_bug_fails_the_same_checks(monkeypatch, bug):
    q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.1, 0.1])
    if bug == "residual":
        monkeypatch.setattr(RejectionSampler, "_draw_final", staticmethod(
            _draw_from_p_at_rejection))
        result, _ = verify([[0]] * N)
    else:
        monkeypatch.setattr(rs, "_accept_randomly", _accept_by_p_alone)
        torch.manual_seed(99)
        drafts = torch.multinomial(q, N, replacement=True)
        result, _ = verify([[int(d)] for d in drafts], draft_probs=q.expand(N, V))
    first = torch.tensor([t[0] for t in result.token_ids])
    assert chi_square(first, target(P0, meta(1))) > CHI2_CRITICAL


def test_greedy_accepts_drafts_while_they_are_the_argmax():
    logits = torch.stack([P0, P1, P0, P0, P1])  # request a: 2 drafts; request b: 1
    result = RejectionSampler()(logits, meta(5, temperature=0.0), [[3, 1], [3]])
    # a: 3 is P0's argmax (accepted), 1 is P1's argmax (accepted), bonus argmax of P0.
    # b: its one position is P0, whose argmax 3 is accepted; the bonus is P1's argmax.
    assert result.token_ids == [[3, 1, 3], [3, 1]]
    rejected = RejectionSampler()(torch.stack([P0, P1]), meta(2, temperature=0.0), [[0]])
    assert rejected.token_ids == [[3]]


def test_requests_without_drafts_sample_one_token_and_logprobs_follow_each_position():
    logits = torch.stack([P0, P0, P1])  # a: no drafts; b: one draft (3, accepted)
    m = meta(3, temperature=0.0)
    m.num_logprobs = [2, 0, 0]
    result = RejectionSampler()(logits, m, [[], [3]])
    assert result.token_ids == [[3], [3, 1]]
    a, b = result.logprobs
    assert a[0].top_token_ids == [3, 0] and len(b) == 2
    assert b[1].logprob == pytest.approx(float(P1.log_softmax(-1)[1]))


def test_a_seeded_request_gets_the_same_tokens_again():
    def run():
        generators = [torch.Generator().manual_seed(s) for s in (7, 8)]
        logits = torch.stack([P0, P1])
        return RejectionSampler()(logits, meta(2, seed_gens=generators), [[0]]).token_ids
    assert all(run() == run() for _ in range(5))
