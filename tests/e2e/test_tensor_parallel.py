"""Tensor parallelism through real processes: greedy output with TP=2 equals TP=1.

The default model's 9 attention heads cannot be split in two, so this uses a tiny
random Llama (4 heads, 2 KV heads) with the default model's tokenizer."""
import concurrent.futures
from pathlib import Path

import pytest

from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.beam_search import BeamSearch
from services.common.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                    ParallelConfig)
from tests.e2e.conftest import address, kill_a_worker_mid_stream, wait_all_blocks_free
from tests.integration.tiny_models import write_tiny_llama
from tests.lora_adapters import ALL_PROJECTIONS, build_adapter, peft_greedy

pytestmark = pytest.mark.e2e
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, model_dir):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), model_dir,
                            tie_word_embeddings=False)


def greedy_outputs(model: str, tp: int, log_dir: Path, lora_dir: str = "",
                   lora_name: str | None = None) -> list[list[int]]:
    config = EngineConfig(model=ModelConfig(model=model, dtype="float32", max_model_len=512),
                          cache=CacheConfig(kv_cache_bytes=16 << 20),
                          parallel=ParallelConfig(tensor_parallel_size=tp),
                          lora=LoRAConfig(enable_lora=bool(lora_dir)))
    with LocalStack(config, port=0, log_dir=str(log_dir),
                    lora_modules=[f"tiny-adapter={lora_dir}"] if lora_dir else []) as stack:
        stack.start(timeout_s=180)
        assert sum(s.name.startswith("worker") for s in stack.services) == tp
        with Client(address(stack, "frontend")) as client:
            def greedy(prompt, name=None):
                return [t for r in client.generate(prompt, max_tokens=16, temperature=0,
                                                   ignore_eos=True, lora_name=name)
                        for t in r.token_ids]
            outputs = [greedy(p, name)
                       for name in ([None, lora_name] if lora_name else [None]) for p in PROMPTS]
            # All at once too: steps of several requests, whose tokens every rank
            # must lay out in the same order.
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                assert list(pool.map(greedy, PROMPTS)) == outputs[:len(PROMPTS)]
            # Three beams: every rank copies the forks' shared blocks (its heads).
            outputs += [list(r.token_ids) for r in client.generate(
                PROMPTS[1], max_tokens=16, temperature=0, ignore_eos=True,
                beam_search=BeamSearch(3))]
        wait_all_blocks_free(stack)
    return outputs


def test_tp2_greedy_equals_tp1_with_and_without_a_lora_adapter(tiny_model_dir, tokenizer,
                                                               tmp_path):
    """A and B of the adapter are split like their layers (column-parallel B by
    rows, row-parallel A by columns); the outputs equal TP=1 and peft's."""
    lora_dir = str(tmp_path / "adapter")
    build_adapter(tiny_model_dir, lora_dir, 3, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)
    (tmp_path / "tp1").mkdir()
    (tmp_path / "tp2").mkdir()
    single = greedy_outputs(tiny_model_dir, 1, tmp_path / "tp1", lora_dir, "tiny-adapter")
    split = greedy_outputs(tiny_model_dir, 2, tmp_path / "tp2", lora_dir, "tiny-adapter")
    assert len(single) == 2 * len(PROMPTS) + 3 and all(len(o) == 16 for o in single)
    assert split == single
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with_adapter = single[len(PROMPTS):2 * len(PROMPTS)]
    assert with_adapter == peft_greedy(tiny_model_dir, lora_dir, prompts, 16)
    assert with_adapter != single[:len(PROMPTS)]


def test_one_rank_killed_resets_the_group_and_loses_nothing(tiny_model_dir, tmp_path):
    """SIGKILL of rank 1 mid-stream: the launcher restarts both ranks (a process
    group cannot take a new member), the engine core reloads them and recomputes
    the request, and the stream ends with the undisturbed run's tokens."""
    config = EngineConfig(model=ModelConfig(model=tiny_model_dir, dtype="float32",
                                            max_model_len=512),
                          cache=CacheConfig(kv_cache_bytes=16 << 20),
                          parallel=ParallelConfig(tensor_parallel_size=2))
    with LocalStack(config, port=0, log_dir=str(tmp_path), restart_dead=True) as stack:
        stack.start(timeout_s=180)
        kill_a_worker_mid_stream(stack, PROMPTS[0], 300)


def test_tp2_embeddings_equal_transformers(tiny_model_dir, tokenizer, tmp_path):
    """Pooling with the layers split across two ranks (MEAN, unnormalized: the raw
    hidden states), against transformers' hidden states of the same tiny model."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.pooling_params import PoolingParams

    config = EngineConfig(model=ModelConfig(model=tiny_model_dir, dtype="float32",
                                            max_model_len=512, runner="pooling",
                                            pooling_type="MEAN", pooling_normalize=False),
                          cache=CacheConfig(kv_cache_bytes=16 << 20),
                          parallel=ParallelConfig(tensor_parallel_size=2))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with LocalStack(config, port=0, log_dir=str(tmp_path)) as stack:
        stack.start(timeout_s=180)
        with Client(address(stack, "frontend")) as client:
            vectors = client.embed(prompts) + client.embed(prompts[:1], PoolingParams(
                pooling_type="LAST"))
        wait_all_blocks_free(stack)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [hf.model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]
    expected = [h.mean(0) for h in hidden] + [hidden[0][-1]]
    for got, want in zip(vectors, expected):
        np.testing.assert_allclose(got, want.numpy(), atol=2e-4 * float(want.abs().max()),
                                   rtol=1e-3)
