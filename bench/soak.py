"""The soak (`python -m bench --soak MINUTES`, not a test): the served stack under
closed-loop load for a long time, with a share of the requests cancelled at
random points. It reports each process's resident memory at the start and the
end (it should stay flat), KV blocks still held once idle (zero) and failed
requests (zero)."""
from __future__ import annotations

import asyncio
import random
import time

import grpc

from bench import prompts as P
from bench.progress import Phases
from bench.report import table
from bench.settings import Settings
from llmserve.client import AsyncClient

CONCURRENCY = 64
CANCEL_SHARE = 0.3


def run_soak(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    from bench.stack import engine_stats, frontend_address, serving_stack

    prompts = P.make_prompts(256, s.prompt_len, P.vocab_size(model_dir), s.seed, P.SERVING + 200)
    # Prefix caching on: cached blocks are what a leak would hide among.
    with serving_stack(model_dir, s.dtype, s.kv_cache_gib, s.max_model_len,
                       prefix_caching=True) as stack:
        rss_start = _resident_mib(stack)
        with phases(f"soak: {s.soak_minutes:g} minutes at concurrency {CONCURRENCY}"):
            counts = asyncio.run(_load(frontend_address(stack), prompts, s.output_len,
                                       s.soak_minutes * 60, random.Random(s.seed)))
            phases.note = ", ".join(f"{k} {v}" for k, v in counts.items())
        stats = _idle_stats(lambda: engine_stats(stack))
        results["soak"] = {
            "minutes": s.soak_minutes, "concurrency": CONCURRENCY, **counts,
            "rss_start_mib": rss_start, "rss_end_mib": _resident_mib(stack),
            "kv_blocks_held_when_idle": stats.num_used_kv_blocks,
            "requests_left_when_idle": stats.num_running + stats.num_waiting}


async def _load(address: str, prompts: list[list[int]], output_len: int, seconds: float,
                rng: random.Random) -> dict[str, int]:
    counts = {"completed": 0, "cancelled": 0, "failed": 0}
    deadline = time.monotonic() + seconds
    next_report = time.monotonic() + 60

    async def client_loop(client: AsyncClient) -> None:
        nonlocal next_report
        while time.monotonic() < deadline:
            cut = rng.randrange(1, output_len) if rng.random() < CANCEL_SHARE else None
            counts[await _one(client, rng.choice(prompts), output_len, cut)] += 1
            if time.monotonic() > next_report:
                next_report += 60
                print(f"[soak] {', '.join(f'{k} {v}' for k, v in counts.items())}", flush=True)

    async with AsyncClient(address) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(CONCURRENCY)))
    return counts


async def _one(client: AsyncClient, prompt: list[int], output_len: int, cut: int | None) -> str:
    """One request: 'completed', 'cancelled' (left after `cut` tokens) or 'failed'."""
    received = 0
    try:
        async for response in client.generate(token_ids=prompt, max_tokens=output_len,
                                              ignore_eos=True, temperature=0):
            received += len(response.token_ids)
            if cut is not None and received >= cut:
                return "cancelled"  # leaving the loop cancels the call
    except grpc.RpcError:
        return "failed"
    return "completed" if received == output_len else "failed"


def _resident_mib(stack) -> dict[str, float]:
    """VmRSS of each service process, in MiB."""
    sizes = {}
    for service in stack.services:
        with open(f"/proc/{service.process.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        sizes[service.name] = round(kib / 1024, 1)
    return sizes


def _idle_stats(read, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read()
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def soak_section(results: dict) -> list[str]:
    row = results.get("soak")
    if not row:
        return []
    memory = [[name, f"{row['rss_start_mib'][name]:.0f}", f"{row['rss_end_mib'][name]:.0f}"]
              for name in row["rss_start_mib"]]
    return [f"## Soak: {row['minutes']:g} minutes at concurrency {row['concurrency']}, "
            f"{CANCEL_SHARE:.0%} of requests cancelled", "",
            f"Requests: {row['completed']} completed, {row['cancelled']} cancelled, "
            f"**{row['failed']} failed**. Once idle: **{row['kv_blocks_held_when_idle']} KV "
            f"blocks held**, {row['requests_left_when_idle']} requests left.", "",
            *table(["process", "RSS at start MiB", "RSS at end MiB"], memory), ""]
