"""POST /v1/embeddings (OpenAI's) and POST /v1/score (vLLM's, for embedding
models: the cosine similarity of two texts' embeddings) over AsyncLLM.embed."""
from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from services.common.errors import InvalidArgument
from services.common.pooling_params import PoolingParams, pair_for_scoring
from services.frontend.async_llm import AsyncLLM, PromptInput, RequestOptions
from services.frontend.openai_api.protocol import Request, TokenId


class EmbeddingRequest(Request):
    # A text, a list of texts, token ids, or a list of token-id lists.
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = Field(None, description="the served model (default: it)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, description="keep the first n values "
                                   "(Matryoshka), before normalizing")
    user: str | None = Field(None, max_length=256)
    # vLLM's extra fields.
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    normalize: bool | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ScoreRequest(Request):
    """One text against one or many (text_2), or two lists pairwise."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = Field(None, max_length=256)


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


def embedding_inputs(value: str | list) -> list[PromptInput]:
    if isinstance(value, str):
        return [PromptInput(prompt=value)]
    if value and all(isinstance(x, int) for x in value):
        return [PromptInput(token_ids=list(value))]
    return [PromptInput(prompt=x) if isinstance(x, str) else PromptInput(token_ids=list(x))
            for x in value]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def create_embeddings(llm: AsyncLLM, body: EmbeddingRequest,
                            options: RequestOptions) -> EmbeddingResponse:
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                           truncate_prompt_tokens=body.truncate_prompt_tokens)
    embeddings = await llm.embed(embedding_inputs(body.input), params,
                                 f"embd-{uuid.uuid4().hex}", options)
    num_prompt = sum(e.num_prompt_tokens for e in embeddings)
    return EmbeddingResponse(
        model=body.model or llm.model_name, usage=EmbeddingUsage(
            prompt_tokens=num_prompt, total_tokens=num_prompt),
        data=[EmbeddingData(index=i, embedding=_encode(e.vector, body.encoding_format))
              for i, e in enumerate(embeddings)])


async def create_scores(llm: AsyncLLM, body: ScoreRequest,
                        options: RequestOptions) -> ScoreResponse:
    second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not second:
        raise InvalidArgument("text_2", "is empty: give at least one text to score")
    try:
        first = pair_for_scoring(
            [body.text_1] if isinstance(body.text_1, str) else list(body.text_1), second)
    except ValueError as e:
        raise InvalidArgument("text_2", f"text_1 has {e}") from None
    request_id = f"score-{uuid.uuid4().hex}"
    params = PoolingParams(normalize=True, truncate_prompt_tokens=body.truncate_prompt_tokens)
    embeddings = await llm.embed([PromptInput(prompt=t) for t in first + second], params,
                                 request_id, options)
    vectors = np.asarray([e.vector for e in embeddings], dtype=np.float32)
    scores = (vectors[:len(first)] * vectors[len(first):]).sum(axis=1)  # unit vectors
    num_prompt = sum(e.num_prompt_tokens for e in embeddings)
    return ScoreResponse(id=request_id, created=int(time.time()),
                         model=body.model or llm.model_name,
                         data=[ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)],
                         usage=EmbeddingUsage(prompt_tokens=num_prompt, total_tokens=num_prompt))
