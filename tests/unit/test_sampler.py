"""The sampler against reference formulas (random logits, no model)."""
import math

import torch

from services.worker.sampler import Sampler, SamplingMetadata, apply_penalties

V = 12


def metadata(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None,
             num_logprobs=None, banned_token_ids=()):
    full = lambda v, dtype=torch.float32: torch.full((batch,), v, dtype=dtype)  # noqa: E731
    return SamplingMetadata(temperature=full(temperature), top_k=full(top_k, torch.int64),
                            top_p=full(top_p), min_p=full(min_p),
                            generators=generators or [None] * batch,
                            banned_token_ids=list(banned_token_ids), num_logprobs=num_logprobs)


def draws(logits_row, n, **kwargs):
    torch.manual_seed(0)
    tokens, _ = Sampler()(logits_row.expand(n, -1).clone(), metadata(n, **kwargs))
    return tokens


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.randn(5, V)
    tokens, logprobs = Sampler()(logits.clone(), metadata(5, temperature=0.0,
                                                          num_logprobs=[3, 0, -1, 5, 1]))
    assert torch.equal(tokens, logits.argmax(-1))
    reference = torch.log_softmax(logits.double(), -1)
    assert logprobs[2] is None
    for i, lp in enumerate(logprobs):
        if lp is None:
            continue
        assert lp.rank == 1 and math.isclose(lp.logprob, reference[i, tokens[i]], abs_tol=1e-5)
        top = reference[i].topk(len(lp.top_token_ids))
        assert lp.top_token_ids == top.indices.tolist()
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(lp.top_logprobs, top.values))


def test_bf16_logits_give_the_tokens_and_logprobs_of_their_fp32_widening():
    """A 16-bit model hands its logits over unconverted: greedy rows take the
    argmax directly, anything more runs on an fp32 copy."""
    logits = (torch.randn(64, 300) * 3).to(torch.bfloat16)
    widened = logits.float()
    greedy = metadata(64, temperature=0.0)
    assert greedy.argmax_only
    tokens, logprobs = Sampler()(logits.clone(), greedy)
    assert torch.equal(tokens, widened.argmax(-1)) and logprobs == [None] * 64
    with_logprobs = metadata(64, temperature=0.0, num_logprobs=[1] * 64)
    assert not with_logprobs.argmax_only
    tokens, logprobs = Sampler()(logits.clone(), with_logprobs)
    reference = torch.log_softmax(widened.double(), -1)
    assert torch.equal(tokens, widened.argmax(-1))
    assert all(math.isclose(lp.logprob, reference[i, tokens[i]], abs_tol=1e-5)
               for i, lp in enumerate(logprobs))


def test_rank_of_a_sampled_token():
    logits = torch.randn(1, V)
    _, [lp] = Sampler()(logits.clone(), metadata(1, temperature=5.0, num_logprobs=[2]))
    assert lp.rank == int((logits[0] > logits[0, lp.token_id]).sum()) + 1


def test_temperature_frequencies_match_softmax():
    logits = torch.randn(V)
    n, temperature = 40_000, 0.7
    counts = torch.bincount(draws(logits, n, temperature=temperature), minlength=V).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # df = 11: P(chi2 > 40) < 1e-4, so this fails by chance less than once in 10^4 runs.
    assert chi2 < 40, chi2


def test_top_k_top_p_min_p_stay_in_the_allowed_set():
    logits = torch.randn(V) * 2
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    top3 = set(order[:3].tolist())
    assert set(draws(logits, 4000, top_k=3).tolist()) <= top3
    cum = probs[order].cumsum(0)
    nucleus = set(order[:int((cum < 0.6).sum()) + 1].tolist())
    assert set(draws(logits, 4000, top_p=0.6).tolist()) <= nucleus
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(draws(logits, 4000, min_p=0.3).tolist()) <= allowed
    assert set(draws(logits, 4000, top_k=5, top_p=0.6).tolist()) <= nucleus & set(
        order[:5].tolist())


def test_penalties_match_the_formula():
    b = 3
    logits = torch.randn(b, V)
    prompt = torch.zeros(b, V, dtype=torch.bool)
    prompt[0, [1, 2]] = True
    prompt[2, 5] = True
    counts = torch.zeros(b, V)
    counts[0, 2] = 3
    counts[1, [4, 7]] = torch.tensor([1.0, 2.0])
    meta = metadata(b)
    meta.repetition_penalty = torch.tensor([1.3, 1.0, 0.8])
    meta.presence_penalty = torch.tensor([0.5, -0.2, 0.0])
    meta.frequency_penalty = torch.tensor([0.1, 0.3, 1.0])
    meta.prompt_token_mask, meta.output_token_counts = prompt, counts
    got = apply_penalties(logits.clone(), meta)
    for i in range(b):
        for t in range(V):
            x = logits[i, t].item()
            if prompt[i, t] or counts[i, t] > 0:
                r = meta.repetition_penalty[i].item()
                x = x / r if x > 0 else x * r
            x -= meta.frequency_penalty[i].item() * counts[i, t].item()
            x -= meta.presence_penalty[i].item() * (counts[i, t].item() > 0)
            assert math.isclose(got[i, t].item(), x, rel_tol=1e-5, abs_tol=1e-6)


def test_banned_token_ids_are_never_drawn():
    logits = torch.zeros(2, V)
    logits[:, 3] = 10.0  # the stop token would win by far
    tokens, _ = Sampler()(logits, metadata(2, temperature=0.0, banned_token_ids=[(0, [3])]))
    assert tokens[0] != 3 and tokens[1] == 3


def test_seed_gives_the_same_tokens_whatever_the_batch():
    logits = torch.randn(1, V)

    def run(batch_size, row):
        gen = torch.Generator().manual_seed(1234)
        generators = [None] * batch_size
        generators[row] = gen
        out = []
        for _ in range(20):
            batch = torch.randn(batch_size, V)
            batch[row] = logits[0]
            tokens, _ = Sampler()(batch, metadata(batch_size, temperature=1.0,
                                                  generators=generators))
            out.append(int(tokens[row]))
        return out

    alone = run(1, 0)
    assert run(6, 3) == alone and run(3, 2) == alone
    assert len(set(alone)) > 1  # really sampled
