"""Shared fixtures: the default model, its transformers reference, in-process engines."""
from __future__ import annotations

import dataclasses
import os

import torch

# Without CUDA, Triton kernels run in Triton's interpreter. It has to be on before anything
# imports triton (torch._dynamo does, by way of transformers and peft): triton's own
# standard library (tl.zeros, tl.max, ...) is compiled or interpreted as it is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.common.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig,
                                    SchedulerConfig, SpeculativeConfig, StructuredOutputsConfig)
from services.common.model_store import resolve_model
from llmserve.llm_engine import make_inproc_engine_core
from services.engine_core.engine_core import EngineCore

# Prompts of different kinds and lengths, used by several tests.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "Translate to French: The weather is nice today.",
    "1, 1, 2, 3, 5, 8,",
    "Q: Why is the sky blue?\nA:",
    "Les plus beaux endroits de Paris sont",
    "A haiku about autumn leaves:\n",
]


@pytest.fixture(scope="session")
def model_dir() -> str:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_engine_core(model_dir: str, kv_cache_bytes: int = 64 << 20, max_model_len: int = 1024,
                     enable_prefix_caching: bool = True, dtype: str = "float32",
                     compile_timeout_s: float = 10.0,
                     speculative: SpeculativeConfig | None = None, block_size: int | None = None,
                     **scheduler) -> EngineCore:
    """An engine core (fp32 unless told) with one in-process worker."""
    blocks = {} if block_size is None else {"block_size": block_size}
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype=dtype,
                                            max_model_len=max_model_len),
                          cache=CacheConfig(kv_cache_bytes=kv_cache_bytes,
                                            enable_prefix_caching=enable_prefix_caching, **blocks),
                          scheduler=dataclasses.replace(SchedulerConfig(), **scheduler),
                          structured_outputs=StructuredOutputsConfig(compile_timeout_s),
                          speculative=speculative or SpeculativeConfig())
    return make_inproc_engine_core(config)


def hf_generate_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(), greedy, on one unpadded prompt; stops at EOS like we do."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens,
                                pad_token_id=hf_model.config.eos_token_id)
    return out[0, ids.shape[1]:].tolist()
