"""What both completion endpoints do around AsyncLLM: run a request's prompts,
stream server-sent events, and stop the work of a client that went away."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from services.common.errors import Cancelled, LLMServeError
from services.common.sampling_params import SamplingParams
from services.frontend.async_llm import AsyncLLM, PromptInput, RequestOptions
from services.frontend.async_merge import merge
from services.frontend.openai_api.errors import error_body
from services.frontend.output_processor import GenerationOutput

T = TypeVar("T")


def run_prompts(llm: AsyncLLM, prompts: list[PromptInput], params: SamplingParams,
                request_id: str, options: RequestOptions
                ) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """(prompt index, output) for all the request's prompts at once; closing the
    iterator aborts them all."""
    if len(prompts) == 1:
        return merge([llm.generate(prompts[0], params, request_id, options)])
    return merge([llm.generate(p, params, f"{request_id}-{i}", options)
                  for i, p in enumerate(prompts)])


async def started(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Waits for the stream's first item before returning, so that a request the
    engine refuses gets its error status instead of a 200 and a broken stream."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None

    async def replay() -> AsyncIterator[T]:
        try:
            if first is not None:
                yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    return replay()


async def server_sent_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """`data: <json>` events, then `data: [DONE]`. An error after the stream began
    is sent as an OpenAI error object: the status line is already out."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
    except LLMServeError as e:
        yield f"data: {error_body(e).model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs work (a non-streamed request) but cancels it, and so aborts its engine
    requests, as soon as the client disconnects (as gRPC cancellation does)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise Cancelled("the client disconnected; its request was aborted")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
