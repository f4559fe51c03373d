"""Prefix caching, preemption and chunked prefill with the real default model:
each must change how the work is done, never the greedy tokens."""
import pytest

from services.common.request_types import EngineCoreRequest, SamplingParams
from tests.conftest import PROMPTS, make_engine_core

SYSTEM = ("You are a careful assistant. Answer briefly, cite no sources, and say so when "
          "you do not know. Keep every answer under fifty words and avoid lists. Prefer "
          "plain words to jargon, give numbers with their units, and when a question is "
          "ambiguous, answer the most likely reading and say which one you chose. ")


def run(core, prompts: dict[str, list[int]], max_tokens: int = 24, on_step=None, **sampling):
    """Outputs per request id (greedy unless `sampling` says otherwise), and each
    request's num_cached_tokens; on_step(core) runs after every step."""
    sampling = {"temperature": 0, **sampling}
    for request_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(request_id, ids, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, **sampling)))
    tokens, cached = {}, {}
    while core.has_work():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            cached[output.request_id] = output.num_cached_tokens
        if on_step is not None:
            on_step(core)
    assert core.stats().num_used_kv_blocks == 0
    return tokens, cached


def test_shared_prefix_is_computed_once(model_dir, tokenizer):
    first = tokenizer(SYSTEM + "What is the boiling point of water?")["input_ids"]
    second = tokenizer(SYSTEM + "Name a planet with rings.")["input_ids"]
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert shared >= 3 * 16

    core = make_engine_core(model_dir)
    run(core, {"first": first})
    tokens, cached = run(core, {"second": second})
    stats = core.stats()
    assert cached["second"] == shared // 16 * 16 >= 48
    assert stats.prefix_cache_hits == cached["second"]
    assert stats.prefix_cache_queries == len(first) + len(second)

    uncached, _ = run(make_engine_core(model_dir, enable_prefix_caching=False), {"second": second})
    assert tokens == uncached


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_preemption_keeps_the_outputs(model_dir, tokenizer, sampling):
    """Recomputed after a preemption, a request goes on as if undisturbed; a seeded
    one too (its draws depend on the seed and the token's index only)."""
    prompts = {f"r{i}": tokenizer(p)["input_ids"] for i, p in enumerate(PROMPTS)}
    roomy, _ = run(make_engine_core(model_dir), prompts, max_tokens=40, **sampling)
    block_bytes = 2 * 16 * 3 * 64 * 30 * 4  # K and V, 16 tokens, 3 KV heads × 64, 30 layers, fp32
    tight_core = make_engine_core(model_dir, kv_cache_bytes=16 * block_bytes, max_model_len=256)
    assert tight_core.info.num_kv_blocks == 16  # 8 requests need ~32 blocks at the end
    tight, _ = run(tight_core, prompts, max_tokens=40, **sampling)
    assert tight_core.stats().num_preemptions_total > 0
    assert tight == roomy


def test_chunked_prefill_matches_one_prefill(model_dir, tokenizer):
    prompt = tokenizer(SYSTEM * 2 + "Summarize the instructions above.")["input_ids"]
    assert len(prompt) > 4 * 16
    whole, _ = run(make_engine_core(model_dir), {"p": prompt})
    chunked_core = make_engine_core(model_dir, max_num_batched_tokens=16)
    chunked, _ = run(chunked_core, {"p": prompt})
    assert chunked_core.num_steps >= len(prompt) // 16 + 24
    assert chunked == whole
