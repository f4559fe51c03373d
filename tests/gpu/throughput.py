"""The GPU's throughput figure: 64 requests of 128 prompt + 128 output tokens, and one
stream's inter-token latency, offline, in bf16, beside the floor this GPU sets: its measured
memory bandwidth (every decode step reads the weights once) and bf16 matrix rate.

python -m tests.gpu.throughput [--record FILE]: prints the figures, and appends them to FILE
as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 64, 128, 128


def measured_bandwidth() -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), repeats=20)
    return 2 * src.numel() / seconds


def measured_bf16_flops() -> float:
    """FLOP/s of an 8192³ bf16 matrix product."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n ** 3 / _timed(lambda: a @ b, repeats=10)


def _timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def engine_figures() -> dict:
    from llmserve import LLM, SamplingParams
    llm = LLM(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0)
    prompts = [{"prompt_token_ids": [(1000 + 7 * i + j) % 40000 for j in range(PROMPT_LEN)]}
               for i in range(NUM_REQUESTS)]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up: kernels, graphs, allocator
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    start = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    first_token_s = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts[:1], params, use_tqdm=False)
    stream_s = time.perf_counter() - start
    worker = llm.llm_engine.engine_core.executor.workers[0]
    weight_bytes = sum(p.numel() * p.element_size()
                       for p in worker.model_runner.model.parameters())
    return {"output_tok_s": generated / batch_s,
            "one_stream_itl_ms": 1000 * (stream_s - first_token_s) / (OUTPUT_LEN - 1),
            "weight_bytes": weight_bytes,
            "backend": worker.description.attention_backend}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--record", help="append the figures to this file as a JSON line")
    args = parser.parse_args()
    figures = {"gpu": torch.cuda.get_device_name(), "bandwidth_gb_s": measured_bandwidth() / 1e9,
               "bf16_tflop_s": measured_bf16_flops() / 1e12, **engine_figures()}
    # One stream cannot decode faster than it reads every weight once a token; a step of
    # 64 decodes, not faster than that read or than its matrix work (2 FLOP a weight a token).
    read_s = figures["weight_bytes"] / (figures["bandwidth_gb_s"] * 1e9)
    compute_s = NUM_REQUESTS * figures["weight_bytes"] / (figures["bf16_tflop_s"] * 1e12)
    figures["itl_floor_ms"] = 1000 * read_s
    figures["batch_floor_tok_s"] = NUM_REQUESTS / max(read_s, compute_s)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    if args.record:
        with open(args.record, "a") as f:
            f.write(json.dumps({"check": "throughput", **figures}) + "\n")


if __name__ == "__main__":
    main()
