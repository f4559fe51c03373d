"""Serving through the gRPC stack: streaming clients, closed loop at a fixed
concurrency or open loop with Poisson arrivals."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from bench.metrics import RequestTiming, summarize
from bench.prompts import greedy
from llmserve.client import AsyncClient
from services.common.sampling_params import OutputKind


async def _request(client: AsyncClient, prompt: list[int] | str,
                   output_len: int) -> RequestTiming:
    """One streamed request (token ids, or a text the frontend tokenizes), timing
    every message that carries tokens."""
    timing = RequestTiming()
    params = dataclasses.replace(greedy(output_len), output_kind=OutputKind.DELTA)
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    async for response in client.generate(text, token_ids=ids, sampling=params):
        timing.add(len(response.token_ids))
    timing.finish()
    assert timing.output_tokens == output_len, timing.output_tokens
    return timing


async def _closed_loop(address: str, prompts: list[list[int]] | list[str], output_len: int,
                       concurrency: int) -> tuple[list[RequestTiming], float]:
    """`concurrency` clients, each sending its next request when the last one ends."""
    queue = list(reversed(prompts))
    timings: list[RequestTiming] = []

    async def client_loop(client: AsyncClient) -> None:
        while queue:
            timings.append(await _request(client, queue.pop(), output_len))

    async with AsyncClient(address) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return timings, time.perf_counter() - start


async def _poisson(address: str, prompts: list[list[int]], output_len: int, rate: float,
                   seed: int) -> tuple[list[RequestTiming], float]:
    """Requests sent at Poisson arrival times of `rate` per second, whatever is running."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(prompts))
    async with AsyncClient(address) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_request(client, prompt, output_len)))
        timings = await asyncio.gather(*tasks)
        return list(timings), time.perf_counter() - start


def warm_up(address: str, prompts: list[list[int]]) -> None:
    """A few short concurrent requests, so one-time costs are not timed."""
    asyncio.run(_closed_loop(address, prompts, 4, concurrency=len(prompts)))


def run_closed_loop(address: str, prompts: list[list[int]] | list[str], output_len: int,
                    concurrency: int) -> dict:
    timings, wall = asyncio.run(_closed_loop(address, prompts, output_len, concurrency))
    return {"load": f"concurrency {concurrency}", "concurrency": concurrency,
            **summarize(timings, wall)}


def run_poisson(address: str, prompts: list[list[int]], output_len: int, rate: float,
                seed: int) -> dict:
    timings, wall = asyncio.run(_poisson(address, prompts, output_len, rate, seed))
    return {"load": f"Poisson {rate:g} req/s", "request_rate": rate, **summarize(timings, wall)}
