"""POST /v1/chat/completions over AsyncLLM."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from services.frontend.async_llm import AsyncLLM, PromptInput, RequestOptions
from services.frontend.choice import ChoiceOutput
from services.frontend.openai_api import convert as C
from services.frontend.openai_api import protocol as P
from services.frontend.openai_api.serving import (run_prompts, server_sent_events, started,
                                                  unless_disconnected)
from services.frontend.output_processor import GenerationOutput


class ChatCompletions:
    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    async def create(self, body: P.ChatCompletionRequest, request: Request,
                     options: RequestOptions) -> P.ChatCompletionResponse | StreamingResponse:
        prompt = PromptInput(chat=C.chat_messages(body.messages),
                             add_generation_prompt=body.add_generation_prompt)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = C.sampling_params(body, body.max_completion_tokens or body.max_tokens, top)
        options = dataclasses.replace(options, beam_search=C.beam_search(body))
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        outputs = run_prompts(self.llm, [prompt], params, request_id, options)
        if not body.stream:
            return await unless_disconnected(request, self._response(outputs, request_id,
                                                                     created))
        chunks = self._chunks(body, await started(outputs), request_id, created)
        return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream")

    async def _response(self, outputs, request_id: str, created: int) -> P.ChatCompletionResponse:
        async for _, output in outputs:  # FINAL_ONLY: one output with every choice
            final = output
        return P.ChatCompletionResponse(
            id=request_id, created=created, model=self.llm.model_name,
            choices=[P.ChatChoice(
                index=c.index, message=P.AssistantMessage(content=c.text),
                logprobs=None if c.logprobs is None else C.chat_logprobs(c.logprobs),
                finish_reason=C.finish_reason(c), stop_reason=c.stop_reason)
                for c in final.outputs],
            usage=C.usage(len(final.prompt_token_ids), final.outputs, final.num_cached_tokens))

    async def _chunks(self, body: P.ChatCompletionRequest,
                      outputs: AsyncIterator[tuple[int, GenerationOutput]], request_id: str,
                      created: int) -> AsyncIterator[P.ChatCompletionChunk]:
        """Each choice's first chunk carries the assistant role (as OpenAI's do);
        with stream_options.include_usage a last chunk has the usage."""
        started_choices: set[int] = set()
        finals: dict[int, ChoiceOutput] = {}
        output = None
        async for _, output in outputs:
            for choice in output.outputs:
                role = None if choice.index in started_choices else "assistant"
                started_choices.add(choice.index)
                if choice.finished:
                    finals[choice.index] = choice
                yield self._chunk(request_id, created, choice, role)
        if output is not None and body.stream_options and body.stream_options.include_usage:
            yield P.ChatCompletionChunk(
                id=request_id, created=created, model=self.llm.model_name, choices=[],
                usage=C.usage(len(output.prompt_token_ids), list(finals.values()),
                              output.num_cached_tokens))

    def _chunk(self, request_id: str, created: int, choice: ChoiceOutput,
               role: str | None) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(
            id=request_id, created=created, model=self.llm.model_name,
            choices=[P.ChatChunkChoice(
                index=choice.index, delta=P.Delta(role=role, content=choice.text),
                logprobs=None if choice.logprobs is None else C.chat_logprobs(choice.logprobs),
                finish_reason=C.finish_reason(choice), stop_reason=choice.stop_reason)])
