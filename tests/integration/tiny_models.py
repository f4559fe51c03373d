"""Tiny random transformers models and a mixed paged batch to compare ours against them."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedConfig

from services.common.request_types import SamplingParams
from services.common.scheduler_output import (CachedRequestData, NewRequestData,
                                              SchedulerOutput)
from services.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
MAX_POSITIONS = 128
VOCAB_SIZE = 300
# Small enough to run in well under a second, big enough for GQA, several
# KV blocks per sequence and several safetensors shards.
TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
            rms_norm_eps=1e-6)


def tiny_hf_model(config: PreTrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A random fp32 model whose every parameter (biases and norms too) matters."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Default init leaves biases at 0 and norms at 1: a wrong bias or a
            # skipped norm would go unnoticed.
            if "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.1)
    return model


def write_tiny_llama(path: Path, tokenizer_dir: str, **config) -> str:
    """A tiny random Llama (4 heads, 2 KV heads: splittable by tensor parallelism)
    with the default model's vocabulary and tokenizer files, so the served stack can
    run it on text; `config` overrides (num_hidden_layers, tie_word_embeddings)."""
    tiny_hf_model(LlamaConfig(**{
        "vocab_size": 49152, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        **config})).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tokenizer_dir) / name, path / name)
    return str(path)


def write_repetitive_tiny_llama(path: Path, tokenizer_dir: str, **config) -> str:
    """write_tiny_llama, with 32 tokens' head rows scaled up: its greedy output
    loops on short cycles, so speculative drafts land often, on logits unlike the
    default model's."""
    write_tiny_llama(path, tokenizer_dir, **config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[100:132] *= 3.0
    model.save_pretrained(path)
    return str(path)


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' own forward pass over one whole sequence: [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def step_logits(runner: ModelRunner, so: SchedulerOutput) -> dict[str, torch.Tensor]:
    """Logits of every scheduled token, per request."""
    runner.update_states(so)
    step = runner.input_batch.prepare(so)
    with torch.inference_mode():
        logits = runner.model.compute_logits(
            runner.model(step.input_ids, step.positions, step.attn_metadata)).float()
    qsl = step.attn_metadata.query_start_loc
    return {r: logits[qsl[i]:qsl[i + 1]] for i, r in enumerate(so.num_scheduled_tokens)}


def _append(runner: ModelRunner, tokens: dict[str, int]) -> None:
    batch = runner.input_batch
    rows = np.array([batch.row_of[r] for r in tokens])
    batch.append_tokens(rows, np.array(list(tokens.values())))


def run_mixed_batch(model: torch.nn.Module, seed: int = 1) -> tuple[dict[str, list[int]],
                                                                    dict[str, torch.Tensor]]:
    """Three steps through the paged KV cache; returns each request's full token
    sequence and our logits at every one of its positions.

    step 1: prefill A (from scratch) and the first chunk of B;
    step 2: decode A, prefill the rest of B over its cached chunk, prefill C from scratch;
    step 3: decode A, B and C together.
    """
    rng = np.random.default_rng(seed)
    a, b, c = (rng.integers(0, VOCAB_SIZE, n).tolist() for n in (19, 45, 30))
    chunk = 21  # B's first chunk ends inside its second KV block
    nxt = {r: rng.integers(0, VOCAB_SIZE, 2).tolist() for r in "abc"}  # compared, not chosen
    params = SamplingParams(temperature=0)
    runner = ModelRunner(model, BLOCK_SIZE, torch.device("cpu"), torch.float32, MAX_POSITIONS)
    runner.init_kv_cache(16)
    # Non-contiguous, interleaved block ids, so a wrong block table shows.
    blocks = {"a": [3, 7], "b": [10, 4, 9, 1], "c": [12, 2, 14]}

    got1 = step_logits(runner, SchedulerOutput(
        new_requests=[NewRequestData("a", a, params, blocks["a"], 0),
                      NewRequestData("b", b, params, blocks["b"], 0)],
        num_scheduled_tokens={"a": len(a), "b": chunk}))
    _append(runner, {"a": nxt["a"][0]})
    got2 = step_logits(runner, SchedulerOutput(
        new_requests=[NewRequestData("c", c, params, blocks["c"], 0)],
        cached_requests=[CachedRequestData("a", [], len(a)), CachedRequestData("b", [], chunk)],
        num_scheduled_tokens={"a": 1, "b": len(b) - chunk, "c": len(c)}))
    _append(runner, {"a": nxt["a"][1], "b": nxt["b"][0], "c": nxt["c"][0]})
    got3 = step_logits(runner, SchedulerOutput(
        cached_requests=[CachedRequestData("a", [], len(a) + 1),
                         CachedRequestData("b", [], len(b)), CachedRequestData("c", [], len(c))],
        num_scheduled_tokens={"a": 1, "b": 1, "c": 1}))

    seqs = {"a": a + nxt["a"], "b": b + nxt["b"][:1], "c": c + nxt["c"][:1]}
    ours = {r: torch.cat([step[r] for step in (got1, got2, got3) if r in step]) for r in seqs}
    return seqs, ours


def max_logits_diff(model: torch.nn.Module, hf_model: torch.nn.Module) -> float:
    """Max |ours - transformers| over the mixed batch; asserts identical argmax."""
    seqs, ours = run_mixed_batch(model)
    diff = 0.0
    for request_id, token_ids in seqs.items():
        ref = hf_logits(hf_model, token_ids)
        assert ours[request_id].shape == ref.shape, request_id
        diff = max(diff, (ours[request_id] - ref).abs().max().item())
        assert torch.equal(ours[request_id].argmax(-1), ref.argmax(-1)), request_id
    return diff
