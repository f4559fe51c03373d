"""The decode-graph path's contract, on the CPU: padding a decode batch up to a
captured size through the static buffers gives the same hidden states as the
eager forward. (Capture and replay themselves need CUDA; see the README.)"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.common.scheduler_output import (CachedRequestData, NewRequestData,  # noqa: E402
                                              SchedulerOutput)
from services.worker.attention.flash_attn import FlashAttentionBackend  # noqa: E402
from tests.references.flash_attn import flash_attn_varlen_func_reference  # noqa: E402
from services.worker.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from services.worker.model_loader import build_model  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.worker import kv_blocks_for_memory  # noqa: E402

CPU = torch.device("cpu")


def test_capture_sizes():
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(3) == [1, 2]


def test_padded_static_buffers_match_the_eager_forward():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = build_model(config, torch.float32, 128, CPU,
                        backend=FlashAttentionBackend(flash_attn_varlen_func_reference))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    graphs = DecodeGraphs(model, max_batch=8, max_model_len=128, block_size=16, device=CPU,
                          capture=False)
    runner = ModelRunner(model, 16, CPU, torch.float32, 128, decode_graphs=graphs)
    runner.init_kv_cache(16)
    params = SamplingParams(temperature=0)
    prompts = {"a": list(range(5, 25)), "b": list(range(30, 33)), "c": list(range(40, 57))}
    runner.execute_model(SchedulerOutput(
        new_requests=[NewRequestData(r, ids, params, [3 * i, 3 * i + 1, 3 * i + 2], 0)
                      for i, (r, ids) in enumerate(prompts.items())],
        num_scheduled_tokens={r: len(ids) for r, ids in prompts.items()}))
    decode = SchedulerOutput(
        cached_requests=[CachedRequestData(r, [], len(ids)) for r, ids in prompts.items()],
        num_scheduled_tokens={r: 1 for r in prompts})
    runner.update_states(decode)
    step = runner.input_batch.prepare(decode)
    with torch.inference_mode():
        eager = model(step.input_ids, step.positions, step.attn_metadata)
        padded = graphs.run(step.input_ids, step.positions, step.attn_metadata)  # 3 -> 4 rows
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)


def test_kv_blocks_for_memory():
    gib = 1 << 30
    assert kv_blocks_for_memory(80 * gib, 0.9, 10 * gib, gib // 2) == 124
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        kv_blocks_for_memory(16 * gib, 0.5, 9 * gib, 1 << 20)
