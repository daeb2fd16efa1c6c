"""The OpenAI request schema (SERVING.md 1) and its error bodies (SERVING.md 2).

Unknown fields are refused (extra="forbid"), so a misspelt parameter is a
400 naming it rather than a silent default. Fields the server accepts only
at their neutral value (`logprobs`, `tools`, ...) are declared so the error
says why they are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    """An HTTP error with an OpenAI error body {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
             503: "service_unavailable", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enable_thinking: bool | None = None


class CommonParams(BaseModel):
    """Parameters of both endpoints; None means the model's generation_config.json default."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored
    logprobs: Any = None  # refused unless null/false
    # Clover's own knobs (generation-config names, DECODING.md 3)
    threshold: float | None = None
    block_size: int | None = None
    dllm_length_penalty: float | None = None
    dllm_length_penalty_start: int | None = None
    dllm_length_penalty_window: int | None = None
    dllm_think_end_bias: float | None = None
    dllm_think_end_start: int | None = None
    dllm_think_end_window: int | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template as given
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(CommonParams):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


class CompletionRequest(CommonParams):
    prompt: str | list[str] | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
