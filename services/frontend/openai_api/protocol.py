"""Request and response bodies of the OpenAI-compatible HTTP API, as pydantic
models: FastAPI validates requests against them and publishes them in the
OpenAPI document. Field names and defaults follow OpenAI's API; the fields
after `# vLLM's extra sampling parameters` are vLLM's extensions. A field that
is not declared here is refused (400, naming it) rather than silently ignored.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20
TokenId = Annotated[int, Field(ge=0)]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Request):
    # A last chunk with `usage` and no choices.
    include_usage: bool = False


class StructuredOutputs(Request):
    """vLLM's `structured_outputs`: exactly one constraint the output satisfies."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict | str | None = Field(None, alias="json",
                                           description="a JSON schema the output is valid in")
    regex: str | None = Field(None, description="a regular expression the output matches")
    choice: list[str] | None = Field(None, description="the output is one of these")
    grammar: str | None = Field(None, description="an EBNF grammar (root rule `root`)")
    json_object: bool = Field(False, description="the output is a JSON object")
    disable_any_whitespace: bool = False


class JsonSchemaFormat(Request):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema",
                                     description="absent: any JSON object")
    strict: bool | None = None


class ResponseFormat(Request):
    """OpenAI's: `text`, `json_object`, or `json_schema` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(Request):
    """The sampling fields completions and chat completions share."""

    model: str | None = Field(None, description="the served model (default: it)")
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, description="default 1; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, in [-100, 100]")
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Beam search, with n beams; not with stream (vLLM's extra fields).
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionRequest(SamplingFields):
    # A text, a list of texts, token ids, or a list of token-id lists.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, description="None: up to max_model_len")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="top logprobs per token (0: the chosen one's)")


class ContentPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Append the chat template's assistant header (vLLM's extra field).
    add_generation_prompt: bool = True


class TokenizeCompletionRequest(Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class LoadLoraAdapterRequest(Request):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, description="a PEFT adapter directory the "
                           "engine's workers can read")


class UnloadLoraAdapterRequest(Request):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = Field(None, description="accepted for vLLM's clients; unused")


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": ...}


class CompletionLogprobs(BaseModel):
    """The legacy completions format."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmserve"
    max_model_len: int
    # LoRA adapters: their directory, and the model they adapt (vLLM's fields).
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
