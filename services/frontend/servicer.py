"""InferenceServicer: the public llmserve.v1.Inference API over AsyncLLM
(convert the request, call the core, convert the outputs back)."""
from __future__ import annotations

import uuid

from services.common import convert, tracing
from services.common.pooling_params import PoolingParams
from services.common.pb import inference_pb2, inference_pb2_grpc
from services.frontend.async_llm import AsyncLLM, PromptInput, RequestOptions
from services.frontend.processor import ChatMessage
from services.frontend.responses import generate_responses


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    async def Generate(self, request, context):
        request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        params = convert.sampling_params_from_proto(request.sampling_params)
        options = RequestOptions(
            priority=request.priority,
            lora_name=request.lora_name if request.HasField("lora_name") else None,
            trace_context=tracing.context_from_metadata(context.invocation_metadata()),
            beam_search=convert.beam_search_from_proto(request))
        async for output in self.llm.generate(_input_of(request), params, request_id, options):
            for response in generate_responses(output):
                yield response

    async def Embed(self, request, context):
        request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        params = convert.pooling_params_from_proto(request, "pooling_params") or PoolingParams()
        options = RequestOptions(
            priority=request.priority,
            lora_name=request.lora_name if request.HasField("lora_name") else None,
            trace_context=tracing.context_from_metadata(context.invocation_metadata()))
        embeddings = await self.llm.embed([_input_of(i) for i in request.inputs], params,
                                          request_id, options)
        return inference_pb2.EmbedResponse(
            request_id=request_id, prompt_tokens=sum(e.num_prompt_tokens for e in embeddings),
            embeddings=[inference_pb2.Embedding(embedding=e.vector,
                                                prompt_tokens=e.num_prompt_tokens)
                        for e in embeddings])

    async def Tokenize(self, request, context):
        ids = await self.llm.tokenize(_input_of(request))
        return inference_pb2.TokenizeResponse(
            token_ids=ids, tokens=self.llm.tokenizer.batch_decode([[t] for t in ids]))

    async def Detokenize(self, request, context):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return inference_pb2.DetokenizeResponse(
            text=self.llm.processor.detokenize(list(request.token_ids), skip))

    async def GetModelInfo(self, request, context):
        info = await self.llm.engine.get_info()
        return inference_pb2.ModelInfo(
            model=self.llm.model_name, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, eos_token_ids=self.llm.processor.eos_token_ids,
            dtype=info.dtype, block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
            lora_adapters=self.llm.loras.names())

    async def LoadLoraAdapter(self, request, context):
        await self.llm.loras.load(request.lora_name, request.lora_path)
        return inference_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(self, request, context):
        await self.llm.loras.unload(request.lora_name)
        return inference_pb2.UnloadLoraAdapterResponse()


def _input_of(request) -> PromptInput:
    """The request's oneof `input`."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return PromptInput(prompt=request.prompt)
    if kind == "token_ids":
        return PromptInput(token_ids=list(request.token_ids.ids))
    if kind == "chat":
        chat = request.chat
        return PromptInput(
            chat=[ChatMessage(m.role, m.content) for m in chat.messages],
            add_generation_prompt=(chat.add_generation_prompt
                                   if chat.HasField("add_generation_prompt") else True))
    return PromptInput()
