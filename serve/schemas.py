"""The OpenAI request bodies flare accepts, validated before any request reaches the engine,
and the bodies it answers with (for the OpenAPI document at /openapi.json).

Fields the OpenAI API defines and flare does not implement (n > 1, best_of, penalties,
logit_bias, suffix, tools and functions, a response format other than text) are refused with
a clear message unless they ask for nothing, rather than silently ignored (`refused_unless`);
unknown extra fields are ignored, as OpenAI clients send some (user, stream_options) that
change nothing here. Types are strict, as the OpenAPI document states them: `false` is not a
token id, nor `"5"` a max_tokens.

Every string a request carries must be valid Unicode: JSON can spell a lone surrogate
(`"\\ud800"`), which Python keeps in a str but no tokenizer (and no UTF-8 encoder) takes, so
it is refused here, with the field named, before it gets anywhere.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

MAX_TOP_LOGPROBS = 20
INT64 = 2**63
"""Seeds are 64-bit, as torch's generators take them."""


def _valid_unicode(value: Any) -> Any:
    """Refuse a lone surrogate in a string, or in a list's strings and text parts."""
    for text in _strings(value):
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"character {exc.start} is a lone surrogate ({text[exc.start]!r}), which is "
                "not Unicode text; send valid UTF-8"
            ) from None
    return value


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [
            v.text if isinstance(v, TextPart) else v for v in value if isinstance(v, str | TextPart)
        ]
    return []


Unicode = AfterValidator(_valid_unicode)


def refused_unless(*neutral: Any) -> AfterValidator:
    """For a field the OpenAI API defines and flare does not implement: its neutral values
    pass (what a client sends when it asks for nothing), any other is refused, naming them,
    rather than ignored (a `logit_bias` that bans a token, ignored, would answer with it)."""
    allowed = " or ".join(repr(v) for v in neutral)

    def check(value: Any) -> Any:
        if value is not None and value not in neutral:
            raise ValueError(f"not implemented by flare: send {allowed}, or leave it out")
        return value

    return AfterValidator(check)


REQUEST = ConfigDict(extra="ignore", strict=True)
"""How every request body (and each object in one) is read."""


class StreamOptions(BaseModel):
    model_config = REQUEST

    include_usage: bool = False


class Sampling(BaseModel):
    """What every generation request may set; None means the package's default."""

    model_config = REQUEST

    model: Annotated[str, Unicode]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: Annotated[str | list[str] | None, Unicode] = None
    ignore_eos: bool | None = False
    """An extension (as in vLLM): generate max_tokens even past end-of-sequence, for loads."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=1)
    frequency_penalty: Annotated[float | None, refused_unless(0)] = None
    presence_penalty: Annotated[float | None, refused_unless(0)] = None
    logit_bias: Annotated[dict[str, float] | None, refused_unless({})] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A field that may be left out may also be null, as OpenAI's clients send a field
        they leave unset (`"n": null`, `"stream": null`): its default, not a type error (the
        schema says `| None`; the value is never None)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or (key in fields and fields[key].is_required())
        }

    @model_validator(mode="after")
    def _stops(self) -> Sampling:
        stops = self.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(Sampling):
    prompt: Annotated[str | list[int] | list[str], Unicode]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] | None = False
    best_of: Annotated[int | None, refused_unless(1)] = None
    suffix: Annotated[str | None, refused_unless("")] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self._texts() and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (send several requests)")
        return self

    def _texts(self) -> bool:
        return (
            isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], str)
        )

    def prompt_value(self) -> str | list[int]:
        """The one prompt: text, or token ids."""
        return self.prompt[0] if self._texts() else self.prompt  # type: ignore[return-value,index]


class TextPart(BaseModel):
    """A part of a message's content; flare takes text parts only."""

    model_config = REQUEST

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = REQUEST

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[str | list[TextPart] | None, Unicode] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Say plainly that an image (or any other part) is not taken, before the union's
        per-branch errors would."""
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            raise ValueError("only text content parts are supported")
        return content

    def text(self) -> str:
        """Plain content: the string, or its text parts joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[dict[str, Any]] | None, refused_unless([])] = None
    tool_choice: Annotated[str | dict[str, Any] | None, refused_unless("none", "auto")] = None
    functions: Annotated[list[dict[str, Any]] | None, refused_unless([])] = None
    function_call: Annotated[str | dict[str, Any] | None, refused_unless("none", "auto")] = None
    response_format: Annotated[dict[str, Any] | None, refused_unless({"type": "text"})] = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs true")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(BaseModel):
    model_config = REQUEST

    model: Annotated[str, Unicode]
    input: Annotated[str | list[str], Unicode] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


# -- what the server answers (documentation: the routes build these bodies as dicts) ----------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx: the OpenAI error body."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; with `include_usage`, a last one with
    no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion: the first says the role; with
    `include_usage`, a last one with no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str
    """Floats, or base64 of little-endian float32 (encoding_format)."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class SamplingInfo(BaseModel):
    defaults: dict[str, float | int]
    ranges: dict[str, list[float | int | None]]


class ModelEntry(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    digest: str
    context_length: int
    sampling: SamplingInfo


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


class Health(BaseModel):
    status: Literal["ok", "starting", "draining", "stalled", "failed"]
    error: str | None = None
    """Why, when stalled (the engine makes no progress) or failed (it can serve no more)."""


class ServedPackageInfo(BaseModel):
    name: str
    digest: str


class VersionInfo(BaseModel):
    """GET /version: this flare, the package format and runtime ABI it serves, the package."""

    version: str
    package_format: int
    runtime_abi: int
    package: ServedPackageInfo
