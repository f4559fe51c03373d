"""logit_bias, allowed_token_ids and bad words against their definitions, through
the worker's persistent batch and the sampler (random logits, no model)."""
import numpy as np
import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData
from services.worker.input_batch import InputBatch, RequestState, build_sampling_metadata
from services.worker.sampler import Sampler

V = 16


def batch_of(*requests: tuple[SamplingParams, list[int], list[int]]) -> InputBatch:
    """A persistent batch holding (params, prompt, output so far) per row."""
    batch = InputBatch(max_model_len=64, block_size=16, device=torch.device("cpu"))
    for i, (params, prompt, output) in enumerate(requests):
        batch.add(NewRequestData(f"r{i}", prompt + output, params, [0], 0,
                                 num_prompt_tokens=len(prompt)),
                  RequestState(f"r{i}", params, eos_token_ids=[], generator=None))
    return batch


def sample(batch: InputBatch, logits: torch.Tensor, draws: int = 1) -> torch.Tensor:
    """[draws, rows] tokens; the same metadata and logits each draw."""
    meta = build_sampling_metadata(batch, np.arange(len(batch)), V)
    torch.manual_seed(0)
    return torch.stack([Sampler()(logits.clone(), meta)[0] for _ in range(draws)])


def test_logit_bias_shifts_the_distribution_by_its_values():
    logits = torch.randn(1, V)
    params = SamplingParams(temperature=1.0, logit_bias={3: 1.5, 7: -2.0})
    rows = 200
    tokens = sample(batch_of(*[(params, [1], [])] * rows), logits.expand(rows, -1),
                    draws=100).flatten()
    biased = logits.clone()
    biased[0, 3] += 1.5
    biased[0, 7] -= 2.0
    expected = biased.softmax(-1)[0].double() * len(tokens)
    counts = torch.bincount(tokens, minlength=V).double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7  # 15 degrees of freedom, p = 1e-3


def test_logit_bias_is_clamped_to_100():
    batch = batch_of((SamplingParams(logit_bias={9: 1e9, 2: -1e9, 4: 0.5}), [1], []))
    _, ids, values = build_sampling_metadata(batch, np.arange(1), V).logit_bias
    assert dict(zip(ids.tolist(), values.tolist())) == {9: 100.0, 2: -100.0, 4: 0.5}


def test_allowed_token_ids_are_the_only_ones_drawn():
    allowed = [2, 5, 11]
    batch = batch_of((SamplingParams(temperature=1.0, allowed_token_ids=allowed), [1], []),
                     (SamplingParams(temperature=1.0), [1], []))
    logits = torch.zeros(2, V)
    logits[:, 0] = 5.0  # a disallowed favourite
    tokens = sample(batch, logits, draws=400)
    assert set(tokens[:, 0].tolist()) == set(allowed)  # all of them, and only them
    assert 0 in tokens[:, 1].tolist()  # the other row is unaffected


@pytest.mark.parametrize("output, banned", [
    ([4, 5, 6], {7, 9}),   # ends with 5, 6 -> 7; one-token word 9 always
    ([5], {9}),            # 5 alone is not the prefix (5, 6)
    ([], {9}),             # prompt tokens never count, even when they end with 5, 6
    ([5, 6, 1], {9}),
])
def test_bad_words_ban_the_last_token_after_their_prefix(output, banned):
    words = [[5, 6, 7], [9], [1, 6, 8]]
    batch = batch_of((SamplingParams(temperature=0.0, bad_words_token_ids=words), [5, 6], output))
    meta = build_sampling_metadata(batch, np.arange(1), V)
    assert set(t for _, ids in meta.banned_token_ids for t in ids) == banned
    logits = torch.zeros(1, V)
    for token in banned:
        logits[0, token] = 10.0  # each banned token would otherwise win
    assert int(sample(batch, logits)[0, 0]) not in banned


def test_the_metadata_is_kept_while_the_rows_stay_and_rebuilt_when_one_joins_or_leaves():
    batch = batch_of((SamplingParams(temperature=0.0), [1], []))
    rows = np.arange(1)
    first = build_sampling_metadata(batch, rows, V)
    assert first.all_greedy and build_sampling_metadata(batch, rows, V) is first
    batch.append_tokens(rows, np.array([3]))  # a step's token: nothing in it changes
    assert build_sampling_metadata(batch, rows, V) is first
    params = SamplingParams(temperature=0.8, top_k=4)
    batch.add(NewRequestData("r1", [2], params, [1], 0, num_prompt_tokens=1),
              RequestState("r1", params, eos_token_ids=[], generator=None))
    both = build_sampling_metadata(batch, np.arange(2), V)
    assert not both.all_greedy and both.top_k.tolist() == [0, 4]
    batch.remove("r1")
    alone = build_sampling_metadata(batch, rows, V)
    assert alone is not first and alone.all_greedy  # r1's row may come back as another


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, min_tokens=2),
    SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 6]]),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),
    SamplingParams(temperature=1.0, seed=7),
])
def test_metadata_that_follows_the_tokens_is_built_every_step(params):
    batch = batch_of((params, [5], []))
    rows = np.arange(1)
    first = build_sampling_metadata(batch, rows, V)
    assert build_sampling_metadata(batch, rows, V) is not first


def test_min_tokens_bans_eos_until_reached_and_then_no_longer():
    params = SamplingParams(temperature=0.0, min_tokens=1)
    batch = InputBatch(max_model_len=64, block_size=16, device=torch.device("cpu"))
    batch.add(NewRequestData("r0", [1], params, [0], 0, num_prompt_tokens=1),
              RequestState("r0", params, eos_token_ids=[2], generator=None))
    rows = np.arange(1)
    assert build_sampling_metadata(batch, rows, V).banned_token_ids == [(0, [2])]
    batch.append_tokens(rows, np.array([3]))
    assert build_sampling_metadata(batch, rows, V).banned_token_ids == []
