"""Decode steps through every layer in one C++ call (services/worker/models/
cpu_decode_layers.py) against the Python layers: the same hidden states bit for bit,
on tiny random models, and the default model's greedy tokens against transformers
with the worker's own set-up."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from services.common.request_types import EngineCoreRequest, SamplingParams
from services.common.scheduler_output import (CachedRequestData, NewRequestData,
                                              SchedulerOutput)
from services.worker.cpu_matmul import prepare_cpu_linears
from services.worker.cpu_matmul.amx import (AMX_MAX_ROWS, GEMV_OVER_AMX_ROWS, AMXWeights,
                                            amx_available, fits_amx_blocks)
from services.worker.cpu_matmul.gemm import PackedGemmWeights
from services.worker.cpu_matmul.gemv import GemvForFewRows
from services.worker.cpu_matmul.mkl import MKLPackedWeights, mkl_packing_available
from services.worker.cpu_matmul.onednn import OneDNNWeights, onednn_native
from services.worker.cpu_matmul.strategy import FLinear
from services.worker.linear import linear_layers
from services.worker.model_loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.models.cpu_decode_layers import ANY_ROWS
from tests.conftest import PROMPTS, hf_generate_greedy, make_engine_core
from tests.integration.tiny_models import (BLOCK_SIZE, MAX_POSITIONS, TINY, VOCAB_SIZE,
                                           _append, step_logits, tiny_hf_model)

CPU = torch.device("cpu")
# TINY with heads of 32: a head size the attention kernels are built for.
SHAPE = {**TINY, "hidden_size": 128, "intermediate_size": 256}


def _tiny(config, tmp_path, dtype=torch.float32, many=None):
    """A tiny model whose linears all run our GEMV for up to two rows and packed
    weights above (oneDNN's unless `many` says otherwise, whatever this CPU's own
    choice would be), as the C++ loop takes them."""
    tiny_hf_model(config).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype, MAX_POSITIONS, CPU)
    # oneDNN in bf16 only where the CPU computes it (as choose.py rules).
    if many is None:
        many = OneDNNWeights if dtype == torch.float32 or onednn_native(dtype) else FLinear
    for i, layer in enumerate(linear_layers(model)):
        kind = many(i) if many is MIXED else many
        layer.cpu_weights = GemvForFewRows(layer.weight, 2, kind(layer.weight))
    return model


def MIXED(i: int):
    """Our packed GEMM, MKL's and oneDNN's packed weights, linear by linear."""
    return (PackedGemmWeights, MKLPackedWeights, OneDNNWeights)[i % 3]


def AMX(weight: torch.Tensor):
    """Our AMX kernel's tiles where the weight fills them; oneDNN's pack for the head,
    which does not (as choose.py rules)."""
    return AMXWeights(weight) if fits_amx_blocks(weight) else OneDNNWeights(weight)


def _both_ways(runner: ModelRunner, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's final hidden states through the C++ loop, then through the Python
    layers (which write the same K/V to the same slots again)."""
    runner.update_states(so)
    step = runner.input_batch.prepare(so)
    inner = runner.model.model
    fast = inner.cpu_decode
    assert fast.takes(step.input_ids, step.attn_metadata) == (
        bool(fast.packed) or len(step.input_ids) <= fast.gemv_rows)
    outs = []
    for path in (fast, None):
        inner.cpu_decode = path
        with torch.inference_mode():
            outs.append(runner.model(step.input_ids, step.positions, step.attn_metadata))
    inner.cpu_decode = fast
    return outs[0], outs[1]


def _decode_steps(model, kv_dtype: torch.dtype) -> None:
    """Prefills three requests (the Python layers), then decodes three together
    (oneDNN's rows, where the model has them), two (the GEMV's) and one, through both
    paths at each decode."""
    params = SamplingParams(temperature=0)
    runner = ModelRunner(model, BLOCK_SIZE, CPU, kv_dtype, MAX_POSITIONS)
    runner.init_kv_cache(16)
    prompts = {"a": list(range(3, 22)), "b": list(range(40, 70)), "c": list(range(90, 96))}
    blocks = {"a": [3, 7], "b": [10, 4], "c": [12]}
    step_logits(runner, SchedulerOutput(
        new_requests=[NewRequestData(r, p, params, blocks[r], 0) for r, p in prompts.items()],
        num_scheduled_tokens={r: len(p) for r, p in prompts.items()}))
    computed = {r: len(p) for r, p in prompts.items()}
    for decoding in ("abc", "ab", "a"):
        _append(runner, {r: VOCAB_SIZE - 1 - i for i, r in enumerate(decoding)})
        ours, python = _both_ways(runner, SchedulerOutput(
            cached_requests=[CachedRequestData(r, [], computed[r]) for r in decoding],
            num_scheduled_tokens={r: 1 for r in decoding}))
        assert torch.equal(ours, python), decoding
        for r in decoding:
            computed[r] += 1


PLAIN = {
    "llama-tied": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "llama-untied": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=False),
}


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32),
                                             (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("case", PLAIN)
def test_the_cpp_loop_equals_the_python_layers(case, dtype, kv_dtype, tmp_path):
    model = _tiny(PLAIN[case](), tmp_path, dtype)
    assert model.use_cpu_decode_layers()
    _decode_steps(model, kv_dtype)


# PLAIN, and gate and up of 192 features each: whole panels of our packed GEMM,
# which then computes the activation in the product's pass, in C++ and in Python alike.
PACKED_GEMM_CASES = {
    **PLAIN,
    "llama-halves-of-whole-panels": lambda: LlamaConfig(**{**SHAPE, "intermediate_size": 192}),
}


@pytest.mark.parametrize("many,dtype", [(PackedGemmWeights, torch.float32),
                                        (MKLPackedWeights, torch.float32),
                                        (MIXED, torch.float32),
                                        (PackedGemmWeights, torch.bfloat16),
                                        (PackedGemmWeights, torch.float16),
                                        (AMX, torch.bfloat16)],
                         ids=["packed-gemm", "mkl", "mixed", "packed-gemm-bf16",
                              "packed-gemm-fp16", "amx"])
@pytest.mark.parametrize("case", PACKED_GEMM_CASES)
def test_the_cpp_loop_multiplies_by_packed_weights_as_python_does(case, many, dtype, tmp_path):
    """fp32's packed paths: our GEMM with AVX-512, MKL's pack on Intel without it (MKL
    computes on any x86 CPU, so both run here); and our GEMM on a bf16 model's weights
    (in pairs of K where the kernels have AVX512-BF16, widened on Intel without it or
    AMX) and an fp16 one's (CPUs without native fp16); our AMX kernel on a bf16 model's
    tiles, up to its rows. C++ tells the four packed kinds apart."""
    if many in (MKLPackedWeights, MIXED) and not mkl_packing_available():
        pytest.skip("this torch has no MKL")
    if many is AMX and not amx_available():
        pytest.skip("this CPU (or the kernels' build) has no AMX-BF16")
    model = _tiny(PACKED_GEMM_CASES[case](), tmp_path, dtype, many=many)
    assert model.use_cpu_decode_layers()
    assert model.model.cpu_decode.max_rows == (AMX_MAX_ROWS if many is AMX else ANY_ROWS)
    _decode_steps(model, dtype)


@pytest.mark.parametrize("config", [
    lambda: LlamaConfig(**SHAPE, attention_bias=True),  # biases
    lambda: Qwen2Config(**SHAPE),  # q/k/v biases
    lambda: Qwen3Config(**SHAPE, head_dim=32),  # q/k norms
], ids=["llama-bias", "qwen2", "qwen3"])
def test_layers_that_are_not_plain_stay_in_python(config, tmp_path):
    model = _tiny(config(), tmp_path)
    assert not model.use_cpu_decode_layers()
    assert model.model.cpu_decode is None


def test_a_linear_off_our_gemv_or_with_lora_stays_in_python(tmp_path):
    model = _tiny(LlamaConfig(**SHAPE), tmp_path)
    down = model.model.layers[1].mlp.down_proj
    gemv = down.cpu_weights
    down.cpu_weights = FLinear(down.weight)
    assert not model.use_cpu_decode_layers()
    down.cpu_weights, down.lora = gemv, object()
    assert not model.use_cpu_decode_layers()
    del down.lora  # back to the class's None
    assert model.use_cpu_decode_layers()
    assert model.model.cpu_decode.max_rows == ANY_ROWS
    assert model.model.cpu_decode.reach == "one C++ call"  # the worker's load line


def test_a_bf16_model_on_amx_takes_the_cpp_loop_up_to_the_amx_kernels_rows(tmp_path):
    """On AMX a bf16 model's decode steps take the C++ loop: our GEMV for few rows, our
    AMX kernel up to its rows; more stay in Python, where oneDNN takes them."""
    if not amx_available():
        pytest.skip("this CPU (or the kernels' build) has no AMX-BF16")
    tiny_hf_model(LlamaConfig(**SHAPE)).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), torch.bfloat16, MAX_POSITIONS, CPU)
    assert "AMX" in prepare_cpu_linears(linear_layers(model), torch.bfloat16, None)
    assert model.use_cpu_decode_layers()
    fast = model.model.cpu_decode
    assert fast.gemv_rows == GEMV_OVER_AMX_ROWS and fast.max_rows == AMX_MAX_ROWS and fast.packed
    _decode_steps(model, torch.bfloat16)


def test_without_onednn_above_the_gemv_it_takes_the_gemvs_rows_only(tmp_path):
    model = _tiny(LlamaConfig(**SHAPE), tmp_path)
    down = model.model.layers[0].mlp.down_proj
    down.cpu_weights = GemvForFewRows(down.weight, 2, FLinear(down.weight))
    assert model.use_cpu_decode_layers()
    assert model.model.cpu_decode.max_rows == 2 and not model.model.cpu_decode.packed
    assert model.model.cpu_decode.reach == "one C++ call for <= 2 rows, Python above"
    # Linears that leave the GEMV at different rows: the fewest, GEMV only.
    down.cpu_weights = GemvForFewRows(down.weight, 1, OneDNNWeights(down.weight))
    assert model.use_cpu_decode_layers()
    assert model.model.cpu_decode.max_rows == 1 and not model.model.cpu_decode.packed


@pytest.mark.parametrize("block_size", [None, 64], ids=["default-blocks", "blocks-of-64"])
def test_one_stream_of_the_default_model_equals_transformers(model_dir, tokenizer, hf_model,
                                                             block_size):
    """The worker as it sets itself up on this CPU; where its linears run our GEMV, the
    C++ loop serves the single stream's decodes (counted). Blocks of 64 as well: the
    attention kernels and the loop take them too."""
    core = make_engine_core(model_dir, block_size=block_size)
    model = core.executor.workers[0].model_runner.model
    on_gemv = isinstance(model.model.layers[0].self_attn.qkv_proj.cpu_weights, GemvForFewRows)
    assert (model.model.cpu_decode is not None) == on_gemv
    calls = []
    if on_gemv:
        fast = model.model.cpu_decode
        model.model.cpu_decode = _Counting(fast, calls)
    eos = [hf_model.config.eos_token_id]
    for i, prompt in enumerate(PROMPTS[:2]):
        ids = tokenizer(prompt)["input_ids"]
        core.add_request(EngineCoreRequest(f"r{i}", ids, SamplingParams(max_tokens=24,
                                                                        temperature=0), eos))
        tokens = []
        while core.has_work():
            tokens += [t for out in core.step() for t in out.new_token_ids]
        assert tokens == hf_generate_greedy(hf_model, ids, 24)
    assert core.stats().num_used_kv_blocks == 0
    assert not on_gemv or len(calls) >= 2 * 20


class _Counting:
    def __init__(self, fast, calls: list):
        self.fast, self.calls = fast, calls

    def takes(self, x, meta) -> bool:
        return self.fast.takes(x, meta)

    def __call__(self, *args):
        self.calls.append(1)
        return self.fast(*args)
