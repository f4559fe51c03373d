"""A small Python client for the public Inference API."""
from __future__ import annotations

from typing import Iterator

import grpc

from services.common.grpc_options import CHANNEL_OPTIONS
from services.common.pb import common_pb2, inference_pb2, inference_pb2_grpc


class Client:
    """Synchronous client; `generate` yields GenerateResponse messages as they stream."""

    def __init__(self, address: str = "127.0.0.1:50051"):
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def generate(self, prompt: str | None = None, *, chat: list[dict] | None = None,
                 token_ids: list[int] | None = None, timeout: float | None = None,
                 request_id: str | None = None,
                 **sampling) -> Iterator[inference_pb2.GenerateResponse]:
        request = inference_pb2.GenerateRequest(
            sampling_params=common_pb2.SamplingParams(**sampling), request_id=request_id)
        if prompt is not None:
            request.prompt = prompt
        if chat is not None:
            request.chat.messages.extend(inference_pb2.ChatMessage(**m) for m in chat)
        if token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        return self.stub.Generate(request, timeout=timeout)

    def model_info(self) -> inference_pb2.ModelInfo:
        return self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
