"""Python clients for the public Inference API: `Client` (sync) and `AsyncClient`.

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=32, temperature=0):
            print(chunk.text, end="")

Sampling parameters are SamplingParams fields, given as keyword arguments or as
`sampling=SamplingParams(...)`; without `sampling`, text streams as DELTA (the
gRPC API's default; SamplingParams' own default is vLLM's CUMULATIVE). Streams
are iterators of GenerateResponse; cancelling one (`.cancel()`, or leaving an
`async for`) aborts the request.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc

from services.common import convert
from services.common.beam_search import BeamSearch
from services.common.grpc_options import CHANNEL_OPTIONS
from services.common.pb import inference_pb2, inference_pb2_grpc
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import OutputKind, SamplingParams


def build_generate_request(prompt: str | None = None, *, chat: list[dict] | None = None,
                           token_ids: list[int] | None = None,
                           sampling: SamplingParams | None = None,
                           request_id: str | None = None, priority: int = 0,
                           add_generation_prompt: bool = True, lora_name: str | None = None,
                           beam_search: BeamSearch | None = None,
                           **sampling_kwargs) -> inference_pb2.GenerateRequest:
    params = dataclasses.replace(sampling or SamplingParams(output_kind=OutputKind.DELTA),
                                 **sampling_kwargs)
    request = inference_pb2.GenerateRequest(
        sampling_params=convert.sampling_params_to_proto(params), request_id=request_id,
        priority=priority, lora_name=lora_name,
        beam_search=convert.beam_search_to_proto(beam_search))
    if prompt is not None:
        request.prompt = prompt
    if chat is not None:
        request.chat.messages.extend(inference_pb2.ChatMessage(**m) for m in chat)
        request.chat.add_generation_prompt = add_generation_prompt
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


def build_embed_request(inputs: list[str | list[int]], pooling: PoolingParams | None = None,
                        request_id: str | None = None, priority: int = 0,
                        lora_name: str | None = None) -> inference_pb2.EmbedRequest:
    return inference_pb2.EmbedRequest(
        inputs=[inference_pb2.EmbedInput(prompt=x) if isinstance(x, str) else
                inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(ids=x))
                for x in inputs],
        pooling_params=convert.pooling_params_to_proto(pooling), request_id=request_id,
        priority=priority, lora_name=lora_name)


def _tokenize_request(prompt: str | None, chat: list[dict] | None) -> inference_pb2.TokenizeRequest:
    request = inference_pb2.TokenizeRequest()
    if prompt is not None:
        request.prompt = prompt
    if chat is not None:
        request.chat.messages.extend(inference_pb2.ChatMessage(**m) for m in chat)
    return request


def _credentials(tls_ca: str | None) -> grpc.ChannelCredentials | None:
    """TLS trusting the CA in the PEM file tls_ca ("" : the system's roots); None:
    plaintext."""
    if tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(Path(tls_ca).read_bytes() if tls_ca else None)


def _key_metadata(api_key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {api_key}")] if api_key else []


class Client:
    """The public API over gRPC. api_key: sent with every call (when the server
    has --api-key); tls_ca: speak TLS, trusting this CA file ("": system roots)."""

    def __init__(self, address: str = "127.0.0.1:50051", api_key: str | None = None,
                 tls_ca: str | None = None):
        credentials = _credentials(tls_ca)
        self.channel = (grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
                        if credentials else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.metadata = _key_metadata(api_key)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kwargs) -> Iterator[inference_pb2.GenerateResponse]:
        """A stream of responses (see build_generate_request for the arguments);
        `.cancel()` on it aborts the request."""
        return self.stub.Generate(build_generate_request(prompt, **kwargs), timeout=timeout,
                                  metadata=self.metadata)

    def embed(self, inputs: list[str | list[int]], pooling: PoolingParams | None = None,
              **kwargs) -> list[list[float]]:
        """One vector per input (a text or token ids), in order; kwargs: request_id,
        priority, lora_name."""
        response = self.stub.Embed(build_embed_request(inputs, pooling, **kwargs),
                                   metadata=self.metadata)
        return [list(e.embedding) for e in response.embeddings]

    def tokenize(self, prompt: str | None = None, *, chat: list[dict] | None = None) -> list[int]:
        return list(self.stub.Tokenize(_tokenize_request(prompt, chat),
                                       metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.stub.Detokenize(inference_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens),
            metadata=self.metadata).text

    def model_info(self) -> inference_pb2.ModelInfo:
        return self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), metadata=self.metadata)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        self.stub.LoadLoraAdapter(inference_pb2.LoadLoraAdapterRequest(
            lora_name=lora_name, lora_path=lora_path), metadata=self.metadata)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.stub.UnloadLoraAdapter(inference_pb2.UnloadLoraAdapterRequest(lora_name=lora_name),
                                    metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """Client's asyncio twin (the same arguments)."""

    def __init__(self, address: str = "127.0.0.1:50051", api_key: str | None = None,
                 tls_ca: str | None = None):
        credentials = _credentials(tls_ca)
        self.channel = (grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
                        if credentials else
                        grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.metadata = _key_metadata(api_key)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kwargs) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Yields responses as they stream; leaving the loop early aborts the request."""
        call = self.stub.Generate(build_generate_request(prompt, **kwargs), timeout=timeout,
                                  metadata=self.metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def embed(self, inputs: list[str | list[int]], pooling: PoolingParams | None = None,
                    **kwargs) -> list[list[float]]:
        response = await self.stub.Embed(build_embed_request(inputs, pooling, **kwargs),
                                         metadata=self.metadata)
        return [list(e.embedding) for e in response.embeddings]

    async def tokenize(self, prompt: str | None = None, *,
                       chat: list[dict] | None = None) -> list[int]:
        return list((await self.stub.Tokenize(_tokenize_request(prompt, chat),
                                              metadata=self.metadata)).token_ids)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return (await self.stub.Detokenize(inference_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens),
            metadata=self.metadata)).text

    async def model_info(self) -> inference_pb2.ModelInfo:
        return await self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(),
                                            metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
