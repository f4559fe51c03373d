"""The OpenAI-compatible HTTP API: routes that convert, call AsyncLLM, and
convert back (FastAPI validates bodies and publishes /openapi.json)."""
from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request

from services.common import tracing
from services.common.auth import authorized
from services.common.errors import LLMServeError, NotFound, Unauthenticated, Unavailable
from services.frontend.async_llm import AsyncLLM, PromptInput, RequestOptions
from services.frontend.openai_api import convert as C
from services.frontend.openai_api import embeddings as E
from services.frontend.openai_api import protocol as P
from services.frontend.openai_api.chat import ChatCompletions
from services.frontend.openai_api.completions import Completions
from services.frontend.openai_api.errors import error_body, install_error_handlers

# What needs no API key: probes and scrapers.
_OPEN_PATHS = frozenset({"/health", "/metrics"})
# /health fails when no engine core answers within this long.
HEALTH_TIMEOUT_S = 5.0
_ERRORS = {400: {"model": P.ErrorResponse}, 404: {"model": P.ErrorResponse},
           429: {"model": P.ErrorResponse}, 503: {"model": P.ErrorResponse}}


def build_app(llm: AsyncLLM, api_key: str = "") -> FastAPI:
    """The routes over `llm`; with api_key, every route but /health and /metrics
    requires `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="llmserve", summary="OpenAI-compatible API of an llmserve frontend",
                  version="1")
    metrics = llm.metrics
    if api_key:
        _require_api_key(app, api_key)
    install_error_handlers(app, metrics and (lambda status: metrics.count_error("http", str(status))))
    completions, chat = Completions(llm), ChatCompletions(llm)
    created = int(time.time())

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=_ERRORS)
    async def create_completion(body: P.CompletionRequest, request: Request):
        lora_name = _check_model(llm, body.model)
        return await completions.create(body, request, _options(request, body.user, lora_name))

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse,
              responses=_ERRORS)
    async def create_chat_completion(body: P.ChatCompletionRequest, request: Request):
        lora_name = _check_model(llm, body.model)
        return await chat.create(body, request, _options(request, body.user, lora_name))

    @app.get("/v1/models", response_model=P.ModelList)
    async def models() -> P.ModelList:
        """The served model, then each loaded LoRA adapter."""
        max_len = llm.processor.engine_info.max_model_len
        return P.ModelList(data=[P.ModelCard(id=llm.model_name, created=created,
                                             max_model_len=max_len)] + [
            P.ModelCard(id=lora.lora_name, created=created, max_model_len=max_len,
                        root=lora.lora_path, parent=llm.model_name)
            for lora in llm.loras.by_name.values()])

    @app.get("/health", responses={503: {"model": P.ErrorResponse}})
    async def health():
        """200 only when an engine core answers and the server is not shutting down."""
        try:
            if llm.draining:
                raise Unavailable("this server is shutting down")
            await asyncio.wait_for(llm.engine.get_stats(), HEALTH_TIMEOUT_S)
        except (LLMServeError, asyncio.TimeoutError) as e:
            error = e if isinstance(e, LLMServeError) else Unavailable("no engine core answered")
            return JSONResponse(error_body(error).model_dump(), status_code=503)
        return {}

    if metrics is not None:
        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics() -> Response:
            """The frontend's Prometheus metrics (as on its --metrics-port)."""
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _add_tokenizer_routes(app, llm)
    _add_pooling_routes(app, llm)
    _add_lora_routes(app, llm)
    _publish_served_model(app, llm.model_name)
    return app


def _require_api_key(app: FastAPI, api_key: str) -> None:
    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.url.path in _OPEN_PATHS or authorized(
                api_key, request.headers.get("authorization")):
            return await call_next(request)
        error = Unauthenticated("a valid API key is required: send the header "
                                "`Authorization: Bearer <key>`")
        return JSONResponse(error_body(error).model_dump(), status_code=401)


def _publish_served_model(app: FastAPI, model_name: str) -> None:
    """The OpenAPI document names the one model served here as `model`'s only
    value, so clients (and fuzzers) see what the server accepts."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = build()
            for schema in document.get("components", {}).get("schemas", {}).values():
                model = schema.get("properties", {}).get("model")
                if model is not None:
                    model["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


def _add_tokenizer_routes(app: FastAPI, llm: AsyncLLM) -> None:
    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: P.TokenizeRequest) -> P.TokenizeResponse:
        """A prompt, or chat messages rendered with the chat template."""
        _check_model(llm, body.model)
        prompt = (PromptInput(prompt=body.prompt, add_special_tokens=body.add_special_tokens)
                  if isinstance(body, P.TokenizeCompletionRequest) else
                  PromptInput(chat=C.chat_messages(body.messages),
                              add_generation_prompt=body.add_generation_prompt))
        ids = await llm.tokenize(prompt)
        return P.TokenizeResponse(count=len(ids), tokens=ids,
                                  max_model_len=llm.processor.engine_info.max_model_len)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        _check_model(llm, body.model)
        return P.DetokenizeResponse(prompt=llm.processor.detokenize(body.tokens))


def _add_pooling_routes(app: FastAPI, llm: AsyncLLM) -> None:
    """Embeddings (OpenAI's route) and scores (vLLM's), beside generation on one server."""
    @app.post("/v1/embeddings", response_model=E.EmbeddingResponse, responses=_ERRORS)
    async def create_embeddings(body: E.EmbeddingRequest, request: Request):
        lora_name = _check_model(llm, body.model)
        return await E.create_embeddings(llm, body, _options(request, body.user, lora_name))

    @app.post("/v1/score", response_model=E.ScoreResponse, responses=_ERRORS)
    async def create_scores(body: E.ScoreRequest, request: Request):
        lora_name = _check_model(llm, body.model)
        return await E.create_scores(llm, body, _options(request, body.user, lora_name))


def _add_lora_routes(app: FastAPI, llm: AsyncLLM) -> None:
    """vLLM's routes for adapters at run time (the server needs --enable-lora)."""
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(body: P.LoadLoraAdapterRequest) -> str:
        await llm.loras.load(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(body: P.UnloadLoraAdapterRequest) -> str:
        await llm.loras.unload(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def _check_model(llm: AsyncLLM, model: str | None) -> str | None:
    """The LoRA adapter `model` names, if it names one; None for the served model."""
    if model is None or model == llm.model_name:
        return None
    if model in llm.loras.by_name:
        return model
    raise NotFound(f"model {model!r} does not exist; this server serves "
                   f"{', '.join(map(repr, [llm.model_name, *llm.loras.names()]))} "
                   "(GET /v1/models)")


def _options(request: Request, user: str | None, lora_name: str | None = None) -> RequestOptions:
    """The caller's trace context (W3C headers), who it is, for the span, and the
    adapter its `model` names."""
    return RequestOptions(
        trace_context=tracing.context_from_headers(dict(request.headers)), lora_name=lora_name,
        attributes={"llmserve.request.user": user} if user else {})
