"""Pooling (embedding) requests through the in-process engine, against the last
hidden states of transformers' LlamaModel (after its final norm) on the same
prompts: LAST, MEAN and CLS, normalize and dimensions, chunked prefill, prefix
caching, pooling and generation in the same steps, and the offline API's
embed / encode / score with vLLM's names and types."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config

from llmserve import (LLM, EmbeddingRequestOutput, LLMEngine, PoolingParams,
                      PoolingRequestOutput, SamplingParams, ScoringRequestOutput)
from llmserve.engine_args import EngineArgs
from services.common.errors import InvalidArgument
from tests.conftest import PROMPTS, hf_generate_greedy

SMALL = dict(dtype="float32", max_model_len=512, kv_cache_gib=0.05)


def hf_hidden(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), hidden] last hidden states of one unpadded prompt."""
    with torch.no_grad():
        return hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()


def reference(hf_model, ids: list[int], pooling_type: str) -> torch.Tensor:
    hidden = hf_hidden(hf_model, ids)
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]


def assert_close(vector, expected: torch.Tensor) -> None:
    got = torch.as_tensor(vector, dtype=torch.float32)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-4 * float(expected.abs().max()), rtol=1e-3)


def pooling_llm(model_dir, pooling_type: str, **kwargs) -> LLM:
    return LLM(model_dir, runner="pooling", **{**SMALL, **kwargs},
               pooler_config={"pooling_type": pooling_type, "normalize": False})


@pytest.fixture(scope="module")
def last_llm(model_dir):
    return pooling_llm(model_dir, "LAST")


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_match_transformers_chunked_or_not(model_dir, tokenizer, hf_model,
                                                        pooling_type):
    """A 16-token step budget splits every prompt into chunks: MEAN sums them all,
    CLS keeps the first chunk's first position."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    assert max(map(len, prompts)) > 16
    for llm in (pooling_llm(model_dir, pooling_type),
                pooling_llm(model_dir, pooling_type, max_num_batched_tokens=16)):
        outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
        for output, ids in zip(outputs, prompts):
            assert_close(output.outputs.embedding, reference(hf_model, ids, pooling_type))
        core = llm.llm_engine.engine_core
        assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_kv_blocks


def test_embed_takes_every_prompt_form_and_returns_vllms_types(last_llm, tokenizer, hf_model):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    outputs = last_llm.embed([PROMPTS[0], {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}, ids],
                             use_tqdm=False)
    expected = reference(hf_model, ids, "LAST")
    for output in outputs:
        assert isinstance(output, EmbeddingRequestOutput) and output.finished
        assert output.prompt_token_ids == ids
        embedding = output.outputs.embedding
        assert isinstance(embedding, list) and all(isinstance(x, float) for x in embedding)
        assert output.outputs.hidden_size == hf_model.config.hidden_size
        assert_close(embedding, expected)
    [single] = last_llm.encode(PROMPTS[0], use_tqdm=False)
    assert isinstance(single, PoolingRequestOutput) and isinstance(single.outputs.data, torch.Tensor)
    assert_close(single.outputs.data, expected)


def test_dimensions_truncate_then_normalize(last_llm, tokenizer, hf_model):
    ids = tokenizer(PROMPTS[1])["input_ids"]
    full = reference(hf_model, ids, "LAST")
    [out] = last_llm.embed(ids, PoolingParams(dimensions=64, normalize=True), use_tqdm=False)
    assert_close(out.outputs.embedding, F.normalize(full[:64], dim=0))
    assert abs(sum(x * x for x in out.outputs.embedding) - 1) < 1e-5
    hidden = hf_model.config.hidden_size
    with pytest.raises(InvalidArgument, match=f"dimensions: is {hidden + 1}.*{hidden} values"):
        last_llm.embed(ids, PoolingParams(dimensions=hidden + 1), use_tqdm=False)
    # The model's pooler normalizes by default (vLLM's pooler_config normalize=True).
    engine_args = EngineArgs(pooler_config={"pooling_type": "MEAN"})
    assert (engine_args.pooling_type, engine_args.pooling_normalize) == ("MEAN", True)
    with pytest.raises(ValueError, match="pooler_config: llmserve supports"):
        EngineArgs(pooler_config={"pooling_type": "LAST", "step_tag_id": 3})


def test_truncate_prompt_tokens_keeps_the_last_ones(last_llm, tokenizer, hf_model):
    ids = tokenizer(PROMPTS[2])["input_ids"]
    [out] = last_llm.encode(ids, PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    assert out.prompt_token_ids == ids[-5:]
    assert_close(out.outputs.data, reference(hf_model, ids[-5:], "LAST"))


def test_score_is_the_cosine_of_embeddings(last_llm):
    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock prices fell."]
    embeddings = [torch.tensor(o.outputs.embedding)
                  for o in last_llm.embed(texts, use_tqdm=False)]
    scores = last_llm.score(texts[0], texts[1:], use_tqdm=False)
    assert all(isinstance(s, ScoringRequestOutput) for s in scores)
    for score, other in zip(scores, embeddings[1:]):
        expected = F.cosine_similarity(embeddings[0], other, dim=0)
        assert score.outputs.score == pytest.approx(float(expected), abs=1e-5)
    pairwise = last_llm.score(texts[:2], texts[1:], use_tqdm=False)
    assert len(pairwise) == 2
    with pytest.raises(ValueError, match="2 texts against 3"):
        last_llm.score(texts[:2], texts, use_tqdm=False)


def test_runner_decides_what_the_offline_api_serves(last_llm, model_dir):
    with pytest.raises(ValueError, match="LLM.generate needs LLM\\(model, runner='generate'\\)"):
        last_llm.generate("Hello", use_tqdm=False)
    generator = LLM(model_dir, **SMALL)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generator.embed("Hello", use_tqdm=False)


def test_pooling_and_generation_share_steps_and_free_every_block(model_dir, tokenizer,
                                                                 hf_model):
    """One engine, one step holding a pooling prompt and a generation prompt; the
    pooling request finishes in that step with no token, the generation goes on
    token-identical to transformers; prefix caching serves a repeated LAST prompt
    and never a MEAN one."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **SMALL))
    core = engine.engine_core
    pool_ids, gen_ids = (tokenizer(p)["input_ids"] for p in PROMPTS[:2])
    engine.add_request("gen", {"prompt_token_ids": gen_ids},
                       SamplingParams(temperature=0, max_tokens=12))
    engine.add_request("pool", {"prompt_token_ids": pool_ids}, PoolingParams())
    first = engine.step()
    assert core.num_scheduled_tokens_last_step == len(pool_ids) + len(gen_ids)
    [pooled] = [o for o in first if o.request_id == "pool"]
    assert isinstance(pooled, PoolingRequestOutput) and pooled.finished
    # The engine's default pooler: LAST, normalized.
    assert_close(pooled.outputs.data, F.normalize(reference(hf_model, pool_ids, "LAST"), dim=0))
    generated = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated = output
    assert generated.outputs[0].token_ids == hf_generate_greedy(hf_model, gen_ids, 12)
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_kv_blocks
    # Not seen by this engine, and long enough for full blocks a repeat can hit.
    long_ids = tokenizer(PROMPTS[2])["input_ids"] * 3
    for pooling_type, hit in (("LAST", True), ("MEAN", False)):
        vectors = []
        for run in range(2):
            engine.add_request(f"{pooling_type}-{run}", {"prompt_token_ids": long_ids},
                               PoolingParams(pooling_type=pooling_type))
            [out] = engine.step()
            assert (out.num_cached_tokens > 0) == (hit and run == 1), (pooling_type, run)
            vectors.append(out.outputs.data)
        torch.testing.assert_close(vectors[0], vectors[1], atol=1e-5, rtol=1e-4)
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_kv_blocks


def test_lora_embeddings_equal_peft(model_dir, tokenizer, tmp_path):
    """A LoRA adapter's MEAN embedding against transformers + peft's hidden states
    with the same adapter; the base model's in the same batch stays the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmserve import LoRARequest
    from tests.lora_adapters import ALL_PROJECTIONS, build_adapter

    build_adapter(model_dir, tmp_path / "adapter", 5, r=8, lora_alpha=16,
                  target_modules=ALL_PROJECTIONS)
    llm = LLM(model_dir, runner="pooling", enable_lora=True, max_lora_rank=16, **SMALL,
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    ids = tokenizer(PROMPTS[0])["input_ids"]
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    adapted, base = llm.embed([ids, ids], use_tqdm=False, lora_request=[lora, None])
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        hidden = peft_model.get_base_model().model(torch.tensor([ids])).last_hidden_state[0]
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model(
            torch.tensor([ids])).last_hidden_state[0]
    assert_close(adapted.outputs.embedding, hidden.mean(0))
    assert_close(base.outputs.embedding, plain.mean(0))
    assert (hidden.mean(0) - plain.mean(0)).abs().max() > 0.05  # the adapter changes it


TINY_CONFIGS = {  # random weights, the default model's tokenizer (and vocabulary)
    "llama": lambda: LlamaConfig(**TINY_POOLING, tie_word_embeddings=False),
    # head_dim != hidden_size / num_heads, as in real Qwen3 models
    "qwen3": lambda: Qwen3Config(**TINY_POOLING, head_dim=32, tie_word_embeddings=True),
}
TINY_POOLING = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_tiny_random_models_match_transformers(arch, model_dir, tokenizer, tmp_path):
    """Every pooler, normalized or not, per request on one engine, against the
    model's transformers twin: cosine above 0.9999 and elementwise close."""
    import shutil
    from pathlib import Path

    from tests.integration.tiny_models import tiny_hf_model

    hf = tiny_hf_model(TINY_CONFIGS[arch]())
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, tmp_path / name)
    llm = LLM(str(tmp_path), runner="pooling", **SMALL)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    for pooling_type in ("LAST", "MEAN", "CLS"):
        for normalize in (False, True):
            params = PoolingParams(pooling_type=pooling_type, normalize=normalize)
            outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], params,
                                use_tqdm=False)
            for output, ids in zip(outputs, prompts):
                want = reference(hf, ids, pooling_type)
                want = F.normalize(want, dim=0) if normalize else want
                got = torch.tensor(output.outputs.embedding)
                assert float(F.cosine_similarity(got, want, dim=0)) > 0.9999
                assert_close(got, want)
