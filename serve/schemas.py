"""The OpenAI request bodies flare accepts, validated before any request reaches the engine.

Fields the OpenAI API defines and flare does not implement (n > 1, best_of, tools) are
refused with a clear message rather than silently ignored; unknown extra fields are ignored,
as OpenAI clients send some (user, stream_options) that change nothing here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What every generation request may set; None means the package's default."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    """An extension (as in vLLM): generate max_tokens even past end-of-sequence, for loads."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)

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
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain content; a list of parts may hold text parts only."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)
