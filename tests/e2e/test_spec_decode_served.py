"""Speculative decoding through the served stack, with tensor parallelism: greedy
output over gRPC and the OpenAI HTTP API equals greedy output without drafts,
alone and batched; the engine core's spec_decode_* metrics count the drafts;
a worker killed mid-stream is recovered from and the stream loses nothing.

Its own stack: speculation is an engine setting (the shared stack runs without
it). A tiny random Llama that repeats itself (4 heads: splittable in two)."""
import concurrent.futures

import openai
import pytest

from llmserve import LLM, SamplingParams
from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                                    SpeculativeConfig)
from tests.e2e.conftest import address, kill_a_worker_mid_stream, wait_all_blocks_free
from tests.integration.tiny_models import write_repetitive_tiny_llama
from tests.metrics_scrape import scrape, value

pytestmark = pytest.mark.e2e
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "1, 2, 3, 1, 2, 3, 1, 2,"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, model_dir):
    return write_repetitive_tiny_llama(tmp_path_factory.mktemp("tiny-spec"), model_dir,
                                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy output without drafts, in this process."""
    llm = LLM(tiny_model_dir, dtype="float32", max_model_len=512, kv_cache_gib=0.02)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    return [o.outputs[0] for o in outputs]


@pytest.fixture(scope="module")
def spec_stack(tiny_model_dir, tmp_path_factory):
    config = EngineConfig(model=ModelConfig(model=tiny_model_dir, dtype="float32",
                                            max_model_len=512),
                          cache=CacheConfig(kv_cache_bytes=16 << 20),
                          parallel=ParallelConfig(tensor_parallel_size=2),
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                        prompt_lookup_min=1,
                                                        prompt_lookup_max=3))
    with LocalStack(config, port=0, log_dir=str(tmp_path_factory.mktemp("logs")), http_port=0,
                    metrics_port=0, restart_dead=True) as stack:
        stack.start(timeout_s=180)
        yield stack


def test_greedy_over_grpc_and_http_equals_greedy_without_drafts(spec_stack, reference):
    with Client(address(spec_stack, "frontend")) as client:
        def greedy(prompt):
            return [t for r in client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               ignore_eos=True) for t in r.token_ids]
        assert [greedy(p) for p in PROMPTS] == [list(o.token_ids) for o in reference]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(greedy, PROMPTS)) == [list(o.token_ids) for o in reference]
    http = openai.OpenAI(base_url=f"http://{spec_stack.http_address}/v1", api_key="unused",
                         max_retries=0)
    model = http.models.list().data[0].id
    for prompt, want in zip(PROMPTS, reference):
        got = http.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text
        streamed = "".join(c.choices[0].text for c in http.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert streamed == want.text
    wait_all_blocks_free(spec_stack)
    samples = scrape(spec_stack.metrics_addresses["engine-core"])
    drafts = value(samples, "llmserve:spec_decode_num_draft_tokens_total")
    accepted = value(samples, "llmserve:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafts
    assert accepted == value(samples, "llmserve:spec_decode_num_accepted_tokens_per_pos_total")
    assert value(samples, "llmserve:spec_decode_num_accepted_tokens_per_pos_total",
                 position=0) > 0


def test_a_worker_killed_mid_stream_loses_nothing(spec_stack):
    kill_a_worker_mid_stream(spec_stack, PROMPTS[3], max_tokens=200)
