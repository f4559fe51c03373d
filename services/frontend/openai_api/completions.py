"""POST /v1/completions over AsyncLLM."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from services.frontend.async_llm import AsyncLLM, RequestOptions
from services.frontend.choice import ChoiceOutput
from services.frontend.openai_api import convert as C
from services.frontend.openai_api import protocol as P
from services.frontend.openai_api.serving import (run_prompts, server_sent_events, started,
                                                  unless_disconnected)
from services.frontend.output_processor import GenerationOutput


class Completions:
    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    async def create(self, body: P.CompletionRequest, request: Request,
                     options: RequestOptions) -> P.CompletionResponse | StreamingResponse:
        prompts = C.completion_prompts(body.prompt)
        params = C.sampling_params(body, body.max_tokens, body.logprobs)
        options = dataclasses.replace(options, beam_search=C.beam_search(body))
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        outputs = run_prompts(self.llm, prompts, params, request_id, options)
        if not body.stream:
            return await unless_disconnected(request, self._response(
                body, outputs, request_id, created))
        chunks = self._chunks(body, await started(outputs), request_id, created)
        return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream")

    async def _response(self, body: P.CompletionRequest, outputs, request_id: str,
                        created: int) -> P.CompletionResponse:
        choices, finals, num_prompt, num_cached = [], [], 0, 0
        async for prompt_index, output in outputs:
            num_prompt += len(output.prompt_token_ids)
            num_cached += output.num_cached_tokens
            for choice in output.outputs:
                finals.append(choice)
                choices.append(self._choice(body, prompt_index, choice, 0))
        return P.CompletionResponse(
            id=request_id, created=created, model=self.llm.model_name,
            choices=sorted(choices, key=lambda c: c.index),
            usage=C.usage(num_prompt, finals, num_cached))

    async def _chunks(self, body: P.CompletionRequest,
                      outputs: AsyncIterator[tuple[int, GenerationOutput]], request_id: str,
                      created: int) -> AsyncIterator[P.CompletionResponse]:
        """One chunk per choice update; with stream_options.include_usage a last
        chunk with the usage and no choices."""
        offsets: dict[int, int] = {}  # choice index -> characters sent so far
        prompts: dict[int, tuple[int, int]] = {}  # prompt index -> (tokens, cached)
        finals: dict[int, ChoiceOutput] = {}
        async for prompt_index, output in outputs:
            prompts[prompt_index] = (len(output.prompt_token_ids), output.num_cached_tokens)
            for choice in output.outputs:
                index = prompt_index * body.n + choice.index
                yield P.CompletionResponse(
                    id=request_id, created=created, model=self.llm.model_name,
                    choices=[self._choice(body, prompt_index, choice, offsets.get(index, 0))])
                offsets[index] = offsets.get(index, 0) + len(choice.text)
                if choice.finished:
                    finals[index] = choice
        if body.stream_options and body.stream_options.include_usage:
            yield P.CompletionResponse(
                id=request_id, created=created, model=self.llm.model_name, choices=[],
                usage=C.usage(sum(n for n, _ in prompts.values()), list(finals.values()),
                              sum(c for _, c in prompts.values())))

    @staticmethod
    def _choice(body: P.CompletionRequest, prompt_index: int, choice: ChoiceOutput,
                text_offset: int) -> P.CompletionChoice:
        return P.CompletionChoice(
            index=prompt_index * body.n + choice.index, text=choice.text,
            logprobs=None if choice.logprobs is None
            else C.completion_logprobs(choice.logprobs, text_offset),
            finish_reason=C.finish_reason(choice), stop_reason=choice.stop_reason)
