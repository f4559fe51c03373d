"""dtype selection: auto follows the CPU, --dtype overrides, the KV cache follows."""
import torch

from services.common.request_types import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.worker.model_loader import cpu_has_bf16, resolve_dtype
from tests.conftest import make_engine_core

CPU = torch.device("cpu")


def test_auto_follows_the_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    native_bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
    assert cpu_has_bf16() == native_bf16
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16


def test_bf16_override_runs_and_the_kv_cache_follows(model_dir, tokenizer):
    fp32 = make_engine_core(model_dir)
    core = make_engine_core(model_dir, dtype="bfloat16")
    runner = core.executor.workers[0].model_runner
    assert core.info.dtype == "bfloat16" and runner.kv_caches[0].dtype == torch.bfloat16
    assert runner.kv_block_bytes() * 2 == fp32.executor.workers[0].model_runner.kv_block_bytes()
    prompt = tokenizer("The capital of France is")["input_ids"]
    outputs = {}
    for name, engine in (("fp32", fp32), ("bf16", core)):
        engine.add_request(EngineCoreRequest(name, prompt, SamplingParams(max_tokens=3,
                                                                          temperature=0)))
        while engine.has_work():
            for o in engine.step():
                outputs.setdefault(name, []).extend(o.new_token_ids)
    assert outputs["bf16"][0] == outputs["fp32"][0]  # " Paris": a wide margin even in bf16
