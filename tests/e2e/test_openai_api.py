"""The OpenAI-compatible HTTP API with the official openai client against the
real three-process stack: chat and completions, streaming, usage, n, stop,
logprobs, every error status, and client disconnects freeing their KV blocks."""
import json
import signal

import requests
import openai
import pytest

from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from tests.e2e.conftest import (MAX_NUM_SEQS, MAX_WAITING, address, engine_stats,
                               wait_all_blocks_free, wait_for_engine_stat)
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name the three primary colors."}]


@pytest.fixture(scope="module")
def base_url(stack):
    return f"http://{stack.http_address}"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_completion_and_chat(client, base_url):
    completion = client.completions.create(model=MODEL, prompt="The capital of France is",
                                           max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    [choice] = completion.choices
    assert choice.text and choice.finish_reason == "length"
    prompt_ids = requests.post(f"{base_url}/tokenize", json={"prompt": "The capital of France is"}
                            ).json()["tokens"]
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == 8 and completion.usage.total_tokens == \
        len(prompt_ids) + 8
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=40,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 40
    # The shared stack serves one LoRA adapter from its start (conftest.py).
    assert [m.id for m in client.models.list().data] == [MODEL, "start-adapter"]


def test_streamed_text_equals_non_streamed(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=30,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    text = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_n_choices_and_a_batch_of_prompts(client):
    result = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"],
                                       n=2, max_tokens=6, temperature=1.0, seed=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.choices[0].text != result.choices[1].text
    assert result.usage.completion_tokens == 4 * 6


def test_stop_sequences(client):
    free = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=12, temperature=0).choices[0].text
    word = free.split()[1]
    stopped = client.completions.create(model=MODEL, prompt="The capital of France is",
                                        max_tokens=12, temperature=0, stop=[word]).choices[0]
    assert stopped.text == free[:free.index(word)] and stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == word


def test_logprobs(client):
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5,
                                           temperature=0, logprobs=2).choices[0]
    lp = completion.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == completion.text and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-6
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
               for t in content)


@pytest.mark.parametrize("body, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 50}, "logprobs"),
    ({"unknown_field": 1}, "unknown_field"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": [10**7]}, "token_ids"), ({"prompt": "word " * 3000}, "max_model_len"),
    ({"prompt": ["text", [1, 2]]}, "prompt"), ({"stop": 5}, "stop"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
])
def test_bad_fields_are_400_naming_them(base_url, body, field):
    response = requests.post(f"{base_url}/v1/completions",
                          json={"model": MODEL, "prompt": "Hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert "gpt-4" in err.value.body["message"] and MODEL in err.value.body["message"]


def test_full_queue_is_429_and_harms_nobody(stack, client):
    with Client(address(stack, "frontend")) as grpc_client:
        def start(n, offset):
            return [grpc_client.generate(f"{offset + i} Tell a story.", max_tokens=2000,
                                         ignore_eos=True) for i in range(n)]
        streams = start(MAX_NUM_SEQS, 0)
        wait_for_engine_stat(stack, "num_running", MAX_NUM_SEQS)
        streams += start(MAX_WAITING, MAX_NUM_SEQS)
        wait_for_engine_stat(stack, "num_waiting", MAX_WAITING)
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert "waiting" in err.value.body["message"]
        for s in streams:
            s.cancel()
    wait_all_blocks_free(stack)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage \
        .completion_tokens == 2


def test_disconnect_mid_stream_frees_every_block(stack, base_url):
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True,
                       timeout=60) as response:
        events = []
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
        assert engine_stats(stack).num_running == 1
    # The connection is closed: the engine request is aborted within a step.
    wait_all_blocks_free(stack)
    with pytest.raises(requests.ReadTimeout):  # a non-streamed request whose client gives up
        requests.post(f"{base_url}/v1/completions", timeout=1.0,
                   json={**body, "stream": False})
    wait_all_blocks_free(stack)


def test_tokenize_detokenize_and_health(base_url):
    tokens = requests.post(f"{base_url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    text = requests.post(f"{base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = requests.post(f"{base_url}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tokens["count"]
    assert requests.get(f"{base_url}/health").status_code == 200
    assert requests.post(f"{base_url}/detokenize", json={"tokens": [10**7]}).status_code == 400


def test_no_engine_core_is_503(tmp_path, model_dir):
    """With its only engine core dead, the frontend answers 503 (and /health too)."""
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32", max_model_len=512),
                          cache=CacheConfig(kv_cache_bytes=32 << 20))
    with LocalStack(config, port=0, log_dir=str(tmp_path), http_port=0) as small:
        small.start(timeout_s=240)
        url = f"http://{small.http_address}"
        assert requests.get(f"{url}/health").status_code == 200
        engine = next(s for s in small.services if s.name == "engine-core")
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait()
        # The router notices at its next load poll.
        wait_until(lambda: requests.get(f"{url}/health").status_code == 503, "/health 503")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert err.value.status_code == 503 and "engine core" in err.value.body["message"]
