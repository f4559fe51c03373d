"""BeamGroup.select's rules on hand-made distributions: the rules shared with
transformers' beam search, and the two where llmserve and vLLM differ from it or
from each other (an EOS ranked below the width, and the length normalization)."""
from __future__ import annotations

import math

from services.common.beam_search import BeamSearch, beam_score
from services.common.request_types import FinishReason, Logprobs
from services.common.sampling_params import SamplingParams
from services.engine_core.beam_search import BeamGroup
from services.engine_core.request import Request

EOS = 2


def group(width: int, prompt_len: int = 5, detokenize=None, **params) -> BeamGroup:
    first = Request("g#0", list(range(10, 10 + prompt_len)),
                    SamplingParams(max_tokens=params.pop("max_tokens", 10), **params),
                    eos_token_ids=frozenset({EOS}))
    return BeamGroup("g", BeamSearch(width), first, None, detokenize)


def give(beam: Request, probs: dict[int, float], drawn: int | None = None) -> None:
    """The beam's step result: these tokens' logprobs, best first."""
    ranked = sorted(probs.items(), key=lambda kv: kv[1], reverse=True)
    ids, lps = [t for t, _ in ranked], [math.log(p) for _, p in ranked]
    token = ids[0] if drawn is None else drawn
    lp = lps[ids.index(token)] if token in ids else math.log(0.001)
    beam.beam.result = Logprobs(token, lp, ids.index(token) + 1 if token in ids else 99, ids, lps)


def step(g: BeamGroup, results: list[dict[int, float]]) -> None:
    for beam, probs in zip(g.beams, results):
        give(beam, probs)
    live = []
    for parent, children in g.select(max_model_len=100):
        for child in children:  # as the scheduler does, without KV: copy, then extend
            beam = Request(g.next_beam_id(), parent.prompt_token_ids, parent.sampling_params,
                           eos_token_ids=parent.eos_token_ids,
                           output_token_ids=list(parent.output_token_ids))
            beam.beam = type(parent.beam)(g, parent.beam.cum_logprob)
            live.append((beam, child))
    for beam, child in live:
        g.extend(beam, child)
    g.beams = [beam for beam, _ in live]


def test_the_best_continuations_of_all_beams_go_on():
    g = group(2)
    step(g, [{5: 0.5, 6: 0.3, 7: 0.2}])
    assert [b.output_token_ids for b in g.beams] == [[5], [6]]
    step(g, [{8: 0.4, 9: 0.35, 4: 0.25}, {8: 0.9, 9: 0.1}])
    # 6 then 8 (0.27) beats 5 then 9 (0.175): one beam splits, the other is pruned.
    assert [b.output_token_ids for b in g.beams] == [[5, 8], [6, 8]]


def test_an_eos_among_the_best_width_finishes_a_beam_and_the_rest_go_on():
    g = group(2)
    step(g, [{EOS: 0.5, 6: 0.3, 7: 0.2}])
    assert [b.token_ids for b in g.finished] == [[EOS]]
    assert g.finished[0].finish_reason is FinishReason.STOP and g.finished[0].stop_reason is None
    assert [b.output_token_ids for b in g.beams] == [[6], [7]]  # still two beams


def test_an_eos_ranked_below_the_width_is_dropped():
    """transformers' rule, which llmserve follows: of the 2k best continuations, an
    ending counts only among the first k. vLLM's LLM.beam_search keeps every EOS
    among each beam's 2k best as a finished sequence."""
    g = group(2)
    step(g, [{5: 0.5, 6: 0.3, EOS: 0.2}])
    assert g.finished == [] and [b.output_token_ids for b in g.beams] == [[5], [6]]


def test_the_group_ends_once_width_beams_have_finished():
    g = group(2)
    step(g, [{EOS: 0.6, 6: 0.4}])
    assert not g.is_done
    step(g, [{EOS: 0.7, 8: 0.3}])
    assert g.is_done and len(g.finished) == 2


def test_the_length_limit_finishes_the_best_width_continuations():
    g = group(2, max_tokens=2)
    step(g, [{5: 0.5, 6: 0.3, 7: 0.2}])
    step(g, [{8: 0.6, 9: 0.4}, {8: 0.9, 9: 0.1}])
    assert g.is_done
    assert {tuple(b.token_ids) for b in g.finished} == {(5, 8), (6, 8)}
    assert all(b.finish_reason is FinishReason.LENGTH for b in g.finished)


def test_finished_beams_are_ranked_by_vllms_length_penalized_score():
    """vLLM's score divides by the whole sequence's length, the prompt included and a
    final EOS excluded; transformers divides by the generated length, EOS included.
    Here the two rules keep different beams."""
    g = group(2, prompt_len=5, max_tokens=3)
    step(g, [{6: 1 - math.exp(-1.0), EOS: math.exp(-1.0)}])  # [EOS] finishes at -1.0
    step(g, [{7: 0.8, 8: 0.2}])
    step(g, [{9: math.exp(-2.0) / 0.8 / (1 - math.exp(-1.0)), 4: 0.1}, {9: 0.9}])
    assert g.is_done
    by_tokens = {tuple(b.token_ids): b for b in g.finished}
    assert math.isclose(by_tokens[(6, 7, 9)].cum_logprob, -2.0)

    def hf_score(b):
        return b.cum_logprob / len(b.token_ids)
    ours = [b.token_ids for b in g.best()]
    theirs = [b.token_ids for b in sorted(g.finished, key=hf_score, reverse=True)[:2]]
    assert ours == [[EOS], [6, 7, 9]]  # -1.0 / 5 beats -2.0 / 8
    assert theirs == [[6, 7, 9], [6, 8, 9]]  # -2.0 / 3 beats -1.0 / 1
    assert by_tokens[(EOS,)].score == beam_score(5, -1.0, 1.0)


def test_stop_tokens_and_stop_strings_end_a_beam_with_their_reason():
    text = {(7,): "a", (7, 9): "a STOP"}
    g = group(2, stop_token_ids=[8], stop=["STOP"],
              detokenize=lambda ids: text.get(tuple(ids), "x"))
    step(g, [{7: 0.9, 4: 0.1}])
    step(g, [{9: 0.6, 8: 0.4}, {5: 0.99}])
    reasons = {tuple(b.token_ids): b.stop_reason for b in g.finished}
    assert reasons == {(7, 9): "STOP", (7, 8): 8}


def test_at_temperature_the_drawn_token_competes_too():
    g = group(1, temperature=1.0)
    beam = g.beams[0]
    give(beam, {5: 0.6, 6: 0.4}, drawn=42)  # drawn outside the top 2 (logprob of 0.001)
    candidates = g._candidates(beam)
    assert {c.token_id for c in candidates} == {5, 6, 42}
