"""Speculative decoding with the real default model and a tiny random Llama:
greedy output with drafts is token-identical to greedy output without them,
batched, with chunked prefill, preemption and prefix caching; logprobs, stop
strings and seeded sampling go through; every KV block is free afterwards."""
from __future__ import annotations

import json

import pytest
import torch

from llmserve import LLM, SamplingParams
from services.common.config import SpeculativeConfig
from tests.conftest import PROMPTS, make_engine_core
from tests.integration import test_engine_core_features
from tests.integration.tiny_models import write_repetitive_tiny_llama

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. All that glitters is not gold.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees Celsius.",
]
# Copy-heavy chat prompts, where drafts land, next to prompts where they rarely do.
COPY_PROMPTS = [f"<|im_start|>user\nRepeat this text exactly:\n\n{p}<|im_end|>\n"
                f"<|im_start|>assistant\n" for p in PASSAGES]
METHODS = ["ngram", "suffix"]


def run(core, prompts: dict[str, list[int]], max_tokens: int):
    """Greedy outputs and cache hits (every block free at the end), checking after
    each step that the worker's block tables and computed tokens are the scheduler's:
    both trim a request's blocks after its drafts, by one rule each."""
    return test_engine_core_features.run(core, prompts, max_tokens,
                                         on_step=check_worker_agrees_with_scheduler)


def check_worker_agrees_with_scheduler(core) -> None:
    batch = core.executor.workers[0].model_runner.input_batch
    kv = core.scheduler.kv_cache_manager
    for request in core.scheduler.running:
        row = batch.row_of[request.request_id]
        assert batch.block_table[row, :batch.num_blocks[row]].tolist() == \
            kv.block_ids(request.request_id), request.request_id
        assert batch.num_computed_tokens[row] == request.num_computed_tokens, request.request_id


def spec(method: str, **kwargs) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=4,
                             disable_by_batch_size=0, **kwargs)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return {f"r{i}": tokenizer(p)["input_ids"] for i, p in enumerate(COPY_PROMPTS + PROMPTS[:5])}


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    return run(make_engine_core(model_dir), prompts, max_tokens=40)[0]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_drafts_equals_greedy_without(model_dir, prompts, reference, method):
    core = make_engine_core(model_dir, speculative=spec(method))
    tokens, _ = run(core, prompts, max_tokens=40)  # run() checks every block is free
    assert tokens == reference
    stats = core.scheduler.spec_decoding.stats
    assert stats.num_accepted_tokens > 40, stats  # the copy prompts' drafts landed
    assert core.num_steps < sum(map(len, tokens.values())) / 8 + 40 / 2
    # The same prompts again hit the prefix cache, blocks written with drafts and all.
    again, cached = run(core, {f"again-{k}": v for k, v in list(prompts.items())[:3]},
                        max_tokens=40)
    assert min(cached.values()) >= 16
    assert again == {f"again-{k}": v for k, v in list(reference.items())[:3]}


@pytest.mark.parametrize("method", METHODS)
def test_preemption_chunked_prefill_and_prefix_caching_keep_greedy_outputs(
        model_dir, prompts, reference, method):
    block_bytes = 2 * 16 * 3 * 64 * 30 * 4  # K and V, 16 tokens, 3 KV heads × 64, 30 layers
    core = make_engine_core(model_dir, kv_cache_bytes=20 * block_bytes, max_model_len=256,
                            speculative=spec(method), max_num_batched_tokens=48)
    tokens, _ = run(core, prompts, max_tokens=40)
    assert core.stats().num_preemptions_total > 0
    assert core.scheduler.spec_decoding.stats.num_accepted_tokens > 0
    assert tokens == reference


def test_suffix_decoding_drafts_from_earlier_outputs(model_dir, prompts):
    """A request that repeats an earlier one's output finds it in the cache."""
    core = make_engine_core(model_dir, speculative=spec("suffix"))
    first, _ = run(core, {"first": prompts["r3"]}, max_tokens=40)
    before = core.scheduler.spec_decoding.stats.num_accepted_tokens
    second, _ = run(core, {"second": prompts["r3"]}, max_tokens=40)
    assert second["second"] == first["first"]
    # Nearly every token of the repeat is an accepted draft.
    assert core.scheduler.spec_decoding.stats.num_accepted_tokens - before >= 30


def test_logprobs_stop_strings_and_seeds_through_the_offline_api(model_dir):
    plain = LLM(model_dir, dtype="float32", max_model_len=512, kv_cache_gib=0.05)
    drafted = LLM(model_dir, dtype="float32", max_model_len=512, kv_cache_gib=0.05,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                      "prompt_lookup_min": 2, "disable_by_batch_size": 0})
    greedy = SamplingParams(max_tokens=40, temperature=0, logprobs=2, stop=["gold"])
    want = plain.generate(COPY_PROMPTS, greedy, use_tqdm=False)
    got = drafted.generate(COPY_PROMPTS, greedy, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            for token in lw:
                assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-3)
    assert got[0].outputs[0].text.endswith("All that glitters is not ")
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, n=2)
    once = drafted.generate(COPY_PROMPTS[:1], seeded, use_tqdm=False)[0]
    twice = drafted.generate(COPY_PROMPTS[:1], seeded, use_tqdm=False)[0]
    assert [o.token_ids for o in once.outputs] == [o.token_ids for o in twice.outputs]
    core = drafted.llm_engine.engine_core
    assert core.stats().num_used_kv_blocks == 0


@pytest.fixture(scope="module")
def tiny_llama(model_dir, tmp_path_factory) -> str:
    return write_repetitive_tiny_llama(tmp_path_factory.mktemp("tiny-spec"), model_dir)


@pytest.mark.parametrize("method", METHODS)
def test_a_tiny_random_llama_decodes_the_same_with_drafts(tiny_llama, method):
    torch.manual_seed(0)
    prompts = {f"t{i}": torch.randint(3, 49152, (5 + 3 * i,)).tolist() for i in range(6)}
    want, _ = run(make_engine_core(tiny_llama), prompts, max_tokens=48)
    core = make_engine_core(tiny_llama, speculative=spec(method, prompt_lookup_min=1,
                                                         prompt_lookup_max=3))
    got, _ = run(core, prompts, max_tokens=48)
    assert got == want
    assert core.scheduler.spec_decoding.stats.num_accepted_tokens > 0


# ---- draft_model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def layer_draft(model_dir, tmp_path_factory) -> str:
    """The default model's first 2 layers: a draft that is cheap, and often wrong."""
    from bench.draft_model import write_layer_draft
    return write_layer_draft(model_dir, tmp_path_factory.mktemp("draft"), 2)


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(model_dir, prompts,
                                                                    reference):
    core = make_engine_core(model_dir, kv_cache_bytes=128 << 20,
                            speculative=spec("draft_model", model=model_dir))
    tokens, _ = run(core, prompts, max_tokens=40)
    assert tokens == reference
    stats = core.scheduler.spec_decoding.stats
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_small_draft_model_keeps_greedy_outputs_through_preemption_and_chunks(
        model_dir, prompts, reference, layer_draft):
    block_bytes = 2 * 16 * 3 * 64 * (30 + 2) * 4  # the draft's 2 layers share each block
    core = make_engine_core(model_dir, kv_cache_bytes=20 * block_bytes, max_model_len=256,
                            speculative=spec("draft_model", model=layer_draft),
                            max_num_batched_tokens=48)
    rows = {0: [], 1: []}  # rows into the draft's first and last MLP, forward by forward
    draft = core.executor.workers[0].model_runner.spec_decoder.proposer.model
    for i in rows:
        draft.model.layers[i].mlp.register_forward_pre_hook(
            lambda module, args, i=i: rows[i].append(args[0].shape[0]))
    tokens, _ = run(core, prompts, max_tokens=40)
    assert core.stats().num_preemptions_total > 0
    assert core.scheduler.spec_decoding.stats.num_draft_tokens > 0
    assert tokens == reference
    # Catching up on a prompt, the draft carries only each row's last token past
    # its last attention.
    assert any(last < first for first, last in zip(rows[0], rows[1]))


def test_a_draft_model_with_another_tokenizer_is_refused_at_start(model_dir, tmp_path):
    import json
    import shutil
    draft = tmp_path / "other-tokenizer"
    shutil.copytree(model_dir, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="has another tokenizer than"):
        LLM(model_dir, dtype="float32", speculative_config={"method": "draft_model",
                                                            "model": str(draft)})


def test_structured_outputs_verify_drafts_position_by_position(model_dir, tokenizer):
    """Drafts the grammar forbids are cut before verification; each position is
    masked by the grammar after the drafts before it. Greedy JSON with drafts equals
    greedy JSON without, and the copied JSON's drafts land."""
    from services.common.request_types import EngineCoreRequest, SamplingParams
    from services.common.sampling_params import StructuredOutputsParams

    record = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}'
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this JSON exactly:\n{record}"}],
        add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "born": {"type": "integer"},
        "fields": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "born", "fields"]}

    def generate(core):
        params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=(
            StructuredOutputsParams(json=json.dumps(schema))))
        core.add_request(EngineCoreRequest("json", ids, params, [2]))
        tokens = []
        while core.has_work():
            for output in core.step():
                tokens += output.new_token_ids
        assert core.stats().num_used_kv_blocks == 0
        return tokens

    want = generate(make_engine_core(model_dir))
    core = make_engine_core(model_dir, speculative=spec("ngram", prompt_lookup_min=2))
    assert generate(core) == want
    assert json.loads(tokenizer.decode(want, skip_special_tokens=True))["born"] == 1815
    assert core.scheduler.spec_decoding.stats.num_accepted_tokens > 10


def test_a_lora_adapter_decodes_the_same_with_drafts(model_dir, tmp_path):
    from llmserve import LoRARequest
    from tests.lora_adapters import ALL_PROJECTIONS, build_adapter

    build_adapter(model_dir, tmp_path / "a", 5, r=8, lora_alpha=16,
                  target_modules=ALL_PROJECTIONS)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = []
    for extra in ({}, {"speculative_config": {"method": "ngram", "prompt_lookup_min": 2,
                                              "disable_by_batch_size": 0}}):
        llm = LLM(model_dir, dtype="float32", max_model_len=512, kv_cache_gib=0.05,
                  enable_lora=True, **extra)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(
            COPY_PROMPTS, params, use_tqdm=False, lora_request=lora)])
    assert outputs[1] == outputs[0]
    assert llm.llm_engine.engine_core.stats().spec_decode_num_accepted_tokens > 0
