"""Embeddings from a stack served with --runner pooling (the default pooler, LAST
and normalized): OpenAI's /v1/embeddings with the official client, vLLM's
/v1/score and the gRPC Embed RPC, each against transformers' last hidden states
of the same tokens; errors; no KV block left. As in vLLM, that stack refuses to
generate and the shared (generating) stack refuses to embed."""
import grpc
import numpy as np
import openai
import pytest
import requests
import torch
import torch.nn.functional as F

from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from services.common.pooling_params import PoolingParams
from tests.e2e.conftest import address, wait_all_blocks_free
from tests.metrics_scrape import scrape, value

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def pooling_stack(tmp_path_factory, model_dir):
    """Its own stack: the shared one is served for generation."""
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32", max_model_len=512,
                                            runner="pooling"),
                          cache=CacheConfig(kv_cache_bytes=64 << 20))
    with LocalStack(config, port=0, http_port=0, metrics_port=0,
                    log_dir=str(tmp_path_factory.mktemp("pooling"))) as stack:
        stack.start(timeout_s=240)
        yield stack


@pytest.fixture(scope="module")
def client(pooling_stack):
    return openai.OpenAI(base_url=f"http://{pooling_stack.http_address}/v1", api_key="unused",
                         max_retries=0)


def expected(hf_model, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    with torch.no_grad():
        last = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return F.normalize(last[:dimensions], dim=0).numpy()


def assert_close(got, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, atol=2e-4, rtol=1e-3)


def test_openai_client_embeddings_match_transformers(client, tokenizer, hf_model,
                                                     pooling_stack):
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    # The official client asks for base64 and decodes it unless told "float".
    for encoding in (openai.NOT_GIVEN, "float"):
        response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in response.data] == [0, 1, 2]
        for data, prompt_ids in zip(response.data, ids):
            assert_close(data.embedding, expected(hf_model, prompt_ids))
        assert response.usage.prompt_tokens == sum(map(len, ids)) == response.usage.total_tokens
    by_ids = client.embeddings.create(model=MODEL, input=ids[0], dimensions=32,
                                      encoding_format="float")
    assert_close(by_ids.data[0].embedding, expected(hf_model, ids[0], 32))
    wait_all_blocks_free(pooling_stack)


def test_bad_embedding_requests_get_400_with_the_field(client, hf_model):
    hidden = hf_model.config.hidden_size
    with pytest.raises(openai.BadRequestError, match=f"dimensions.*{hidden} values"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=hidden + 1)
    with pytest.raises(openai.BadRequestError, match="input: is empty"):
        client.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")


def test_score_is_the_cosine_of_the_embeddings(client, pooling_stack):
    url = f"http://{pooling_stack.http_address}/v1/score"
    body = {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]}
    response = requests.post(url, json=body, timeout=60)
    assert response.status_code == 200, response.text
    scores = [d["score"] for d in response.json()["data"]]
    vectors = [np.asarray(d.embedding) for d in client.embeddings.create(
        model=MODEL, input=TEXTS, encoding_format="float").data]
    assert scores == pytest.approx([float(vectors[0] @ v) for v in vectors[1:]], abs=1e-4)
    bad = requests.post(url, timeout=60,
                        json={"model": MODEL, "text_1": TEXTS[:2], "text_2": TEXTS})
    assert bad.status_code == 400 and "text_2" in bad.json()["error"]["message"]


def test_grpc_embed(pooling_stack, tokenizer, hf_model):
    ids = tokenizer(TEXTS[2])["input_ids"]
    with Client(address(pooling_stack, "frontend")) as c:
        text_vector, ids_vector = c.embed([TEXTS[2], ids], PoolingParams(dimensions=64))
        assert_close(text_vector, expected(hf_model, ids, 64))
        assert_close(ids_vector, expected(hf_model, ids, 64))
        [unnormalized] = c.embed([ids], PoolingParams(normalize=False))
        assert np.linalg.norm(unnormalized) > 2  # the raw hidden state, not a unit vector
        with pytest.raises(grpc.RpcError) as err:
            c.embed([ids], PoolingParams(dimensions=hf_model.config.hidden_size + 1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dimensions" in err.value.details()
    wait_all_blocks_free(pooling_stack)


def test_each_runner_refuses_the_other_task(pooling_stack, stack):
    """FAILED_PRECONDITION over gRPC, 400 with OpenAI's error object over HTTP."""
    with Client(address(pooling_stack, "frontend")) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate("Hello", max_tokens=2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--runner pooling" in err.value.details()
    completion = requests.post(f"http://{pooling_stack.http_address}/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert completion.status_code == 400
    assert "embedding model" in completion.json()["error"]["message"]
    with Client(address(stack, "frontend")) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.embed(["Hello"])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    embedding = requests.post(f"http://{stack.http_address}/v1/embeddings", timeout=60,
                              json={"model": MODEL, "input": "Hello"})
    assert embedding.status_code == 400
    assert "--runner pooling" in embedding.json()["error"]["message"]


def test_metrics_count_embeddings_by_task(pooling_stack, tokenizer):
    metrics = pooling_stack.metrics_addresses["frontend"]
    before = scrape(metrics)
    with Client(address(pooling_stack, "frontend")) as c:
        c.embed(TEXTS)
    after = scrape(metrics)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("llmserve:request_success_by_task_total", task="embed") == len(TEXTS)
    assert delta("llmserve:request_success_by_task_total", task="generate") == 0
    assert delta("llmserve:prompt_tokens_total") == sum(len(tokenizer(t)["input_ids"])
                                                        for t in TEXTS)
    assert delta("llmserve:e2e_request_latency_seconds_count") == len(TEXTS)
