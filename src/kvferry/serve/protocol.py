"""OpenAI API request and response models (pydantic).

Faithful enough that the official ``openai`` client works unchanged. Unknown
request fields are ignored, as OpenAI and vLLM do, so newer clients keep
working. Known fields are strict, as OpenAI's are: an int is not a bool, a
string is not a number (``max_tokens: "10"`` is a 400), an int is a float. Extensions follow vLLM's names (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ...) and are passed by clients via
``extra_body``.

Bounds that protect the server (n, seed range) live here; bounds that are
about decoding (temperature >= 0, top_p in (0, 1], ...) live in
``SamplingParams`` so they are stated once.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator,
)

# n fans out into n engine sequences; a bound keeps one request from
# flooding the scheduler.
MAX_N = 128
MAX_KV_RETENTION_S = 86400.0  # one day (as SamplingParams)
# Seeds feed torch.Generator.manual_seed, which takes a 64-bit integer.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class _Request(BaseModel):
    # Strict: bodies are validated from JSON (model_validate_json), where
    # strict mode still accepts objects for nested models.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    # {"name": ..., "schema": {...}, "strict": true}; required for json_schema.
    json_schema: dict | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` extension: exactly one of these."""

    json_: Annotated[str | dict | None, Field(alias="json")] = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(_Request):
    """Fields the two generation endpoints share."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    min_p: float | None = None  # extension
    seed: Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = 0  # extension
    skip_special_tokens: bool = True  # extension
    include_stop_str_in_output: bool = False  # extension
    logit_bias: dict[str, float] | None = None  # accepted only when empty
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Narrows the caller's prefix-cache namespace (never widens it past the tenant).
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Keep the conversation's KV in the node's KV store this long after the
    # request ends (a paused conversation); extension.
    kv_retention_s: Annotated[float, Field(ge=0.0, le=MAX_KV_RETENTION_S, allow_inf_nan=False)] = 0.0
    response_format: ResponseFormat | None = None
    # Structured outputs, vLLM's extensions (at most one way per request).
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    # A string, a list of one string, token ids, or a list of one token-id list.
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for completions is 16; None here lets a server
    # default (--max-tokens-default) apply first.
    max_tokens: int | None = None
    logprobs: int | None = None
    # vLLM's extension: the prompt tokens' logprobs (and the top-n at each),
    # per choice; checked in serve/completions.py (a 400 naming it).
    prompt_logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # developer is OpenAI's newer name for system.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or content parts (only text parts are supported).
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        # Only an assistant turn that carries tool calls may omit content.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        return self


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[ToolDefinition], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # extension


# ---- responses ---------------------------------------------------------------

class _Response(BaseModel):
    pass


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One token's entry in vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string / token
    # vLLM extension, with the request's prompt_logprobs: one entry per prompt
    # token, the first null (nothing precedes it), each other one the prompt
    # token's and the top-n tokens' {logprob, rank, decoded_token} by token id.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(_Response):
    """A streamed tool call: the first delta of a call carries index, id,
    type and name; later ones only index and an arguments fragment."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict:
        # OpenAI omits absent delta fields (the final chunk's delta is {}).
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvferry"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- tokenize / detokenize (vLLM's extension endpoints) ---------------------

class TokenizeRequest(_Request):
    """Either ``prompt`` (plain text) or ``messages`` (rendered through the
    chat template), as vLLM's POST /tokenize takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: Annotated[list[ToolDefinition], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


# ---- embeddings ----------------------------------------------------------------

# OpenAI's limit on inputs per embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Request):
    model: str | None = None
    # A string, strings, token ids, or lists of token ids: one vector each.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # accepted only when absent (no truncation)
    user: str | None = None


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    # floats, or base64 of their little-endian float32 bytes
    embedding: list[float] | str


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# ---- /v1/responses (the subset vLLM serves) ----------------------------------

class ResponsesFunctionTool(_Request):
    """The Responses API's flat function tool (no nested "function")."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> ToolDefinition:
        return ToolDefinition(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict))


class ResponsesNamedToolChoice(_Request):
    type: Literal["function"]
    name: str


class InputMessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict]  # parts: input_text / output_text / text


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Annotated[InputMessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class ResponsesTextFormat(_Request):
    """``text.format``: chat's ``response_format`` kinds, with the json_schema
    fields (name, schema, strict, description) flattened into the format."""

    type: Literal["text", "json_object", "json_schema"]
    # name and schema are required for json_schema (as OpenAI's): see
    # missing_field(). Not required here because a validator's error would
    # name the Python field (schema_), not the wire one.
    name: Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")] | None = None
    # "schema" would shadow BaseModel.schema(): the alias is the wire name.
    schema_: Annotated[dict | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None  # the grammar is always enforced, strict or not (as vLLM)

    def missing_field(self) -> str | None:
        """The wire name of a field this format's type requires but lacks."""
        if self.type == "json_schema":
            return "name" if self.name is None else "schema" if self.schema_ is None else None
        return None

    def constraint(self) -> tuple[str, dict] | None:
        """(the field a bad constraint's 400 names, StructuredOutputsParams
        arguments); None for plain text. For a format without a missing_field()."""
        if self.type == "json_object":
            return "text.format", {"json_object": True}
        if self.type == "json_schema":
            return "text.format.schema", {"json": self.schema_}
        return None

    def echo(self) -> dict:
        """As the response object's ``text.format`` repeats it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponsesText(_Request):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    text: ResponsesText | None = None  # text.format: the output's format, as chat's response_format

    @model_validator(mode="before")
    @classmethod
    def _default_item_type(cls, data: object) -> object:
        # Items without "type" are messages ({"role": ..., "content": ...}).
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                                      else item for item in data["input"]]}
        return data


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = Field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(_Response):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
