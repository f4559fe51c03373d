"""Pooling requests on the frontend's side: what an embedding call may hold, and
its requests run in the engine side by side, their vectors back in order."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from services.common.errors import InvalidArgument, Unavailable
from services.common.request_types import EngineCoreRequest

# Inputs of one embedding call (OpenAI's limit for /v1/embeddings).
MAX_EMBED_INPUTS = 2048


@dataclass
class Embedding:
    vector: list[float]
    num_prompt_tokens: int


def check_embed_inputs(inputs: list) -> None:
    if not inputs:
        raise InvalidArgument("input", "is empty: give at least one text or list of token ids")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise InvalidArgument("input", f"has {len(inputs)} items; one call embeds at most "
                                       f"{MAX_EMBED_INPUTS}")


async def pool_all(engine, requests: list[EngineCoreRequest]) -> list[Embedding]:
    """Every request's vector, in order; the first failure cancels the others (each
    aborted in the engine as its stream closes) and is raised."""
    tasks = [asyncio.ensure_future(_pool(engine, r)) for r in requests]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def _pool(engine, request: EngineCoreRequest) -> Embedding:
    async with contextlib.aclosing(engine.generate(request)) as outputs:
        async for output in outputs:
            if output.pooled is not None:
                return Embedding(output.pooled, len(request.prompt_token_ids))
    raise Unavailable(f"the engine ended pooling request {request.request_id} without its vector")
