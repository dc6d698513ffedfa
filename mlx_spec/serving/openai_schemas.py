"""The request bodies of the OpenAI endpoints, and mlx-spec's `speculative` field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_NUM_DRAFT = 32
MAX_STOP = 4


class SpeculativeOptions(BaseModel):
    """The extra request field that controls speculation."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    drafter: str | None = None
    num_draft: int | str | None = None
    # A stream's chunks say how each token came (`trace.py`); alone, it leaves speculation
    # as the server's default.
    trace: bool = False

    @field_validator("num_draft")
    @classmethod
    def _num_draft(cls, value):
        if value is None or value == "auto":
            return value
        if isinstance(value, int) and 0 <= value <= MAX_NUM_DRAFT:
            return value
        raise ValueError(f"must be 'auto' or an integer in [0, {MAX_NUM_DRAFT}]")


class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestBase(BaseModel):
    """The fields both OpenAI endpoints take."""

    model_config = ConfigDict(extra="allow")  # other OpenAI fields are accepted and ignored
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # The common extensions (vLLM, llama.cpp's server): 0 turns either off.
    top_k: int = Field(default=0, ge=0, strict=True)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    speculative: SpeculativeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message, sent back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as chat templates read it."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatRequest(RequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None


class CompletionRequest(RequestBase):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
