"""LoRA adapters through the real stack: one loaded at start (--lora-modules),
others loaded and unloaded at run time over gRPC and HTTP; requests naming
them (gRPC lora_name, HTTP model) equal transformers + peft, mixed with each
other and with the base model; every error is a clear status."""
import concurrent.futures

import grpc
import openai
import pytest
import requests

from llmserve.client import Client
from tests.e2e.conftest import address, wait_all_blocks_free
from tests.lora_adapters import peft_greedy

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(model_dir, tokenizer, lora_dirs) -> dict:
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return {name: peft_greedy(model_dir, path, prompts, MAX_TOKENS)
            for name, path in [(None, None), ("start-adapter", lora_dirs["start"]),
                               ("runtime-adapter", lora_dirs["runtime"])]}


@pytest.fixture
def client(stack):
    with Client(address(stack, "frontend")) as c:
        yield c


def _grpc_greedy(client: Client, prompt: str, lora_name: str | None) -> list[int]:
    return [t for r in client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       lora_name=lora_name) for t in r.token_ids]


def test_adapters_over_grpc_mixed_in_one_batch(stack, client, lora_dirs, references):
    assert list(client.model_info().lora_adapters) == ["start-adapter"]
    client.load_lora_adapter("runtime-adapter", lora_dirs["runtime"])
    try:
        cases = [(name, i) for name in (None, "start-adapter", "runtime-adapter")
                 for i in range(len(PROMPTS))]  # 6: within the stack's waiting limit (8)
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda c: _grpc_greedy(client, PROMPTS[c[1]], c[0]), cases))
        assert got == [references[name][i] for name, i in cases]
    finally:
        client.unload_lora_adapter("runtime-adapter")
    assert list(client.model_info().lora_adapters) == ["start-adapter"]
    wait_all_blocks_free(stack)


def test_generate_cli_names_an_adapter(stack, references):
    """`llmserve generate --lora-name`: the adapter's greedy tokens, printed with --json."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "--address",
                          address(stack, "frontend"), "--no-chat", "--json", "--lora-name",
                          "start-adapter", "--max-tokens", str(MAX_TOKENS), PROMPTS[0]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    tokens = [int(t) for line in out.stdout.splitlines()
              for t in json.loads(line).get("tokenIds", [])]
    assert tokens == references["start-adapter"][0]
    assert tokens != references[None][0]  # the adapter changes the answer


def test_grpc_errors(client, lora_dirs, tmp_path):
    cases = [(lambda: client.load_lora_adapter("start-adapter", lora_dirs["runtime"]),
              grpc.StatusCode.ALREADY_EXISTS, "loaded already"),
             (lambda: client.load_lora_adapter("nowhere", str(tmp_path)),
              grpc.StatusCode.INVALID_ARGUMENT, "not a PEFT adapter directory"),
             (lambda: client.unload_lora_adapter("never-loaded"),
              grpc.StatusCode.NOT_FOUND, "never-loaded"),
             (lambda: _grpc_greedy(client, "Hi", "never-loaded"),
              grpc.StatusCode.NOT_FOUND, "never-loaded")]
    for call, code, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code and message in err.value.details(), err.value.details()
    assert list(client.model_info().lora_adapters) == ["start-adapter"]


def test_adapters_over_http(stack, tokenizer, lora_dirs, references):
    base_url = f"http://{stack.http_address}"
    http = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    response = requests.post(f"{base_url}/v1/load_lora_adapter",
                             json={"lora_name": "http-adapter", "lora_path": lora_dirs["runtime"]})
    assert response.status_code == 200, response.text
    try:
        models = {m.id: m for m in http.models.list().data}
        assert set(models) == {MODEL, "start-adapter", "http-adapter"}
        assert models["http-adapter"].parent == MODEL
        for name, reference in (("http-adapter", "runtime-adapter"),
                                ("start-adapter", "start-adapter"), (MODEL, None)):
            completion = http.completions.create(model=name, prompt=PROMPTS[0],
                                                 max_tokens=MAX_TOKENS, temperature=0)
            assert completion.choices[0].text == tokenizer.decode(
                references[reference][0], skip_special_tokens=True), name
    finally:
        response = requests.post(f"{base_url}/v1/unload_lora_adapter",
                                 json={"lora_name": "http-adapter"})
        assert response.status_code == 200, response.text
    with pytest.raises(openai.NotFoundError):
        http.completions.create(model="http-adapter", prompt="Hi", max_tokens=2)
    bad = requests.post(f"{base_url}/v1/load_lora_adapter",
                        json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "PEFT" in bad.json()["error"]["message"]
    wait_all_blocks_free(stack)
