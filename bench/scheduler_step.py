"""Micro-benchmark: the engine core's own cost per step (schedule + update_from_output)
with N running decode requests, next to the cost of a real model step of the same
batch, so the scheduler's share of step time is known.

    .venv/bin/python -m bench.scheduler_step [--requests 256] [--steps 200] [--no-model]
"""
from __future__ import annotations

import argparse
import time

from services.common.config import CacheConfig, SchedulerConfig
from services.common.request_types import SamplingParams
from services.common.scheduler_output import ModelRunnerOutput
from services.engine_core.request import Request
from services.engine_core.scheduler import Scheduler

PROMPT_LEN = 128


def make_running_scheduler(num_requests: int, steps: int, policy: str,
                           prefix_caching: bool) -> Scheduler:
    """A scheduler whose requests have all finished prefill and are decoding."""
    max_model_len = PROMPT_LEN + steps + 16
    num_blocks = num_requests * (max_model_len // 16 + 1)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=num_requests * PROMPT_LEN,
                        policy=policy),
        CacheConfig(block_size=16, enable_prefix_caching=prefix_caching), max_model_len, num_blocks)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 49152 for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 10)))
    step(scheduler)  # the prefill step
    return scheduler


def step(scheduler: Scheduler):
    so = scheduler.schedule()
    sampled = {r: [42] for r in so.num_scheduled_tokens}
    scheduler.update_from_output(so, ModelRunnerOutput(sampled))
    return so


def time_scheduler(num_requests: int, steps: int, policy: str, prefix_caching: bool) -> float:
    scheduler = make_running_scheduler(num_requests, steps, policy, prefix_caching)
    start = time.perf_counter()
    for _ in range(steps):
        so = step(scheduler)
        assert len(so.num_scheduled_tokens) == num_requests
    return (time.perf_counter() - start) / steps


def time_model_step(num_requests: int, repeats: int = 3) -> float:
    """One decode step of the default model for the same batch, in process (fp32)."""
    from llmserve.llm_engine import make_inproc_engine_core
    from services.common.config import DEFAULT_MODEL, EngineConfig, ModelConfig
    from services.common.request_types import EngineCoreRequest

    config = EngineConfig(model=ModelConfig(model=DEFAULT_MODEL, max_model_len=1024),
                          cache=CacheConfig(kv_cache_bytes=2 << 30),
                          scheduler=SchedulerConfig(max_num_seqs=num_requests,
                                                    max_num_batched_tokens=8192))
    core = make_inproc_engine_core(config)
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 49152 for j in range(PROMPT_LEN)]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(
            max_tokens=repeats + 50, temperature=0, ignore_eos=True)))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                        for r in core.scheduler.running):
        core.step()  # prefills
    core.step()
    start = time.perf_counter()
    for _ in range(repeats):
        core.step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-model", action="store_true", help="skip the model step baseline")
    args = parser.parse_args()

    rows = []
    for policy in ("fcfs", "priority"):
        for caching in (True, False):
            seconds = time_scheduler(args.requests, args.steps, policy, caching)
            rows.append((f"{policy}, prefix caching {'on' if caching else 'off'}", seconds))
    model_s = None if args.no_model else time_model_step(args.requests)

    print(f"\nengine-core cost per step, {args.requests} running decode requests "
          f"({args.steps} steps)\n")
    print(f"| {'configuration':<32} | {'µs/step':>9} | {'µs/request':>10} | {'share of step':>13} |")
    print(f"|{'-' * 34}|{'-' * 11}|{'-' * 12}|{'-' * 15}|")
    for name, seconds in rows:
        share = f"{seconds / (seconds + model_s):.1%}" if model_s else "-"
        print(f"| {name:<32} | {seconds * 1e6:>9.0f} | {seconds * 1e6 / args.requests:>10.2f} "
              f"| {share:>13} |")
    if model_s:
        print(f"\nbaseline: one model decode step of the same batch (fp32, in process): "
              f"{model_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
