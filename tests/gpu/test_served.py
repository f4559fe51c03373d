"""The served stack on the GPU: worker, engine core and frontend as three processes talking
gRPC, the worker on CUDA; streaming, structured outputs (xgrammar's bitmask applied to CUDA
logits) and LoRA adapters, each against its reference."""
import json

import pytest

from llmserve import StructuredOutputsParams
from llmserve.client import Client
from llmserve.launcher import LocalStack
from tests.e2e.conftest import address, wait_all_blocks_free
from tests.gpu.conftest import gpu_config
from tests.lora_adapters import ALL_PROJECTIONS, build_adapter, peft_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 24
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer", "minimum": 0}}}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, model_dir) -> str:
    path = str(tmp_path_factory.mktemp("lora") / "adapter")
    build_adapter(model_dir, path, 1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)
    return path


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory, model_dir, adapter):
    stack = LocalStack(gpu_config(model_dir, enable_lora=True, max_num_seqs=16), port=0,
                       log_dir=str(tmp_path_factory.mktemp("logs")),
                       lora_modules=[f"adapter={adapter}"])
    try:
        stack.start(timeout_s=300)
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{_log_tails(stack)}") from None
    yield stack
    stack.stop()


def _stream(client: Client, **kwargs) -> tuple[list[int], int]:
    """The tokens of one streamed choice, and how many messages carried them."""
    tokens, messages = [], 0
    for response in client.generate(**kwargs):
        tokens += response.token_ids
        messages += 1
    return tokens, messages


def test_streams_greedy_tokens_equal_to_transformers(gpu_stack, model_dir, tokenizer, adapter,
                                                     record):
    """fp32 on the GPU worker: the base model and the adapter, each against transformers
    (+ peft) on the CPU."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with Client(address(gpu_stack, "frontend")) as client:
        assert "cuda" in _worker_log(gpu_stack)
        for lora_name, path in ((None, None), ("adapter", adapter)):
            expected = peft_greedy(model_dir, path, prompts, MAX_TOKENS)
            for prompt, want in zip(PROMPTS, expected):
                tokens, messages = _stream(client, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, lora_name=lora_name)
                assert tokens == want, (lora_name, prompt)
                assert messages > 1  # streamed, not one final message
    wait_all_blocks_free(gpu_stack)
    record(prompts=len(PROMPTS), adapters=1)


def test_structured_outputs_on_gpu_logits(gpu_stack):
    with Client(address(gpu_stack, "frontend")) as client:
        texts: dict[int, str] = {}
        for response in client.generate(prompt="The largest city in Japan, as JSON:",
                                        max_tokens=80, temperature=0.9, seed=5, n=2,
                                        structured_outputs=StructuredOutputsParams(json=CITY)):
            texts[response.index] = texts.get(response.index, "") + response.text
    assert len(texts) == 2
    for text in texts.values():
        value = json.loads(text)
        assert set(value) == {"city", "population"} and isinstance(value["population"], int)
        assert len(value["city"]) <= 20 and value["population"] >= 0
    wait_all_blocks_free(gpu_stack)


def _worker_log(stack) -> str:
    """The worker's log, which names its device when the model is loaded."""
    worker = next(s for s in stack.services if s.name.startswith("worker"))
    with open(worker.log_path) as f:
        return f.read()


def _log_tails(stack) -> str:
    """The end of every service's log: what a failed start says."""
    tails = []
    for service in stack.services:
        if service.log_path and service.log_path.exists():
            tails.append(f"--- {service.name}\n{service.log_path.read_text()[-2500:]}")
    return "\n".join(tails)
