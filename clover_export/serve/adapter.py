"""OpenAI schema <-> runtime: the server's only knowledge of generation (SERVING.md 1, 2).

`submission` turns a request into `Generator.submit` keyword arguments;
`api_error` turns the runtime's CloverError into an OpenAI error; the
response builders turn `StreamChunk`/`Result` into OpenAI bodies. Decoding
itself stays in the runtime.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from clover_export.errors import CloverError
from clover_export.serve.protocol import ApiError, ChatRequest, CommonParams, CompletionRequest

THINK_END = "</think>"
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort", "error": "error"}
# runtime parameter name -> the OpenAI name a client sent
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}
_CLOVER_KNOBS = ("threshold", "block_size", "dllm_length_penalty", "dllm_length_penalty_start",
                 "dllm_length_penalty_window", "dllm_think_end_bias", "dllm_think_end_start", "dllm_think_end_window")


@dataclass
class Submission:
    """What the engine submits, and how the answer is shaped."""

    kwargs: dict[str, Any]
    chat: bool
    thinking: bool  # split reasoning_content off (chat with thinking on)
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' {why}", param=param)


def _sampling(req: CommonParams) -> dict[str, Any]:
    if req.n != 1:
        raise _refuse("n", f"must be 1 (one choice per request), got {req.n}")
    if req.logprobs:
        raise _refuse("logprobs", "is not supported")
    kw: dict[str, Any] = {k: getattr(req, k) for k in
                          ("top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                           *_CLOVER_KNOBS)}
    if req.temperature is not None:  # OpenAI: 0 is greedy; any other value samples at that temperature
        if req.temperature < 0:
            raise _refuse("temperature", f"must be >= 0, got {req.temperature}")
        kw["do_sample"] = req.temperature > 0
        kw["temperature"] = req.temperature if req.temperature > 0 else None
    kw["max_new_tokens"] = req.max_tokens
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return kw


def chat_submission(req: ChatRequest, default_thinking: bool) -> Submission:
    if req.top_logprobs is not None:
        raise _refuse("top_logprobs", "is not supported")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise _refuse("response_format", "must be {\"type\": \"text\"}")
    if req.tools or req.tool_choice not in (None, "none") or req.parallel_tool_calls:
        param = "tools" if req.tools else "tool_choice" if req.tool_choice not in (None, "none") else "parallel_tool_calls"
        raise _refuse(param, "is not supported (no tool calling)")
    kw = _sampling(req)
    if req.max_completion_tokens is not None:
        kw["max_new_tokens"] = req.max_completion_tokens
    thinking = default_thinking
    if req.chat_template_kwargs and req.chat_template_kwargs.enable_thinking is not None:
        thinking = kw["enable_thinking"] = req.chat_template_kwargs.enable_thinking
    kw["messages"] = [_message(m.model_dump(exclude_none=True), i) for i, m in enumerate(req.messages)]
    return Submission(_drop_none(kw), chat=True, thinking=thinking, stream=req.stream,
                      include_usage=bool(req.stream_options and req.stream_options.include_usage))


def _message(m: dict[str, Any], i: int) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise _refuse(f"messages[{i}].content", "may only hold text parts")
        m["content"] = "".join(p["text"] for p in content)
    m.setdefault("content", "")
    return m


def completion_submission(req: CompletionRequest) -> Submission:
    if req.echo or req.suffix is not None or (req.best_of or 1) != 1:
        param = "echo" if req.echo else "suffix" if req.suffix is not None else "best_of"
        raise _refuse(param, "is not supported")
    kw = _sampling(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        kw["prompt_ids"] = prompt
    else:
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise _refuse("prompt", f"must be one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        kw["prompt"], kw["raw"] = prompt, True
    return Submission(_drop_none(kw), chat=False, thinking=False, stream=req.stream,
                      include_usage=bool(req.stream_options and req.stream_options.include_usage))


def _drop_none(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def api_error(e: CloverError, chat: bool = True) -> ApiError:
    """A request the runtime refused -> 400 (context_length_exceeded when it cannot fit)."""
    text = str(e).removeprefix("[generate] ")
    if "over the context limit" in text:
        return ApiError(400, text, param="messages" if chat else "prompt", code="context_length_exceeded")
    m = re.search(r"parameter(?:\(s\))? '?(\w+)", text)
    param = OPENAI_NAMES.get(m.group(1), m.group(1)) if m else None
    return ApiError(400, text, param=param)


# --- responses ------------------------------------------------------------------
class TextSplit:
    """Reasoning and content deltas of a growing response; their sums equal `final_parts` of the whole text.

    With thinking on, text before `</think>` is reasoning (all of it while no
    `</think>` came); each part is stripped, so leading whitespace is dropped
    and trailing whitespace held back until more text follows.
    """

    def __init__(self, thinking: bool, strip: bool = True):
        self.thinking, self.strip = thinking, strip
        self.text = ""
        self.sent = ["", ""]

    def push(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        target = self.parts(self.text, final)
        out = tuple(t[len(s):] for t, s in zip(target, self.sent))
        self.sent = list(target)
        return out

    def parts(self, text: str, final: bool = True) -> tuple[str, str]:
        if not self.strip:
            return "", text
        if not self.thinking:
            return "", _clip(text, final)
        head, sep, tail = text.partition(THINK_END)
        if sep:
            return head.strip(), _clip(tail, final)
        if not final:  # hold back what may be the start of `</think>`
            head = head[:len(head) - _partial_suffix(head, THINK_END)]
        return _clip(head, final), ""


def _clip(s: str, final: bool) -> str:
    return s.strip() if final else s.lstrip().rstrip()


def _partial_suffix(s: str, marker: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of marker."""
    for n in range(min(len(s), len(marker) - 1), 0, -1):
        if s.endswith(marker[:n]):
            return n
    return 0


def usage(res) -> dict[str, int]:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.response_tokens,
            "total_tokens": res.prompt_tokens + res.response_tokens}


def clover_stats(res) -> dict[str, float]:
    return {"denoise_steps": res.denoise_steps, "tokens_per_forward": res.tokens_per_forward,
            "distinct_experts_per_block": res.distinct_experts_per_block}


def response(sub: Submission, model: str, res) -> dict[str, Any]:
    """The non-streaming body of a finished request."""
    finish = FINISH_REASONS.get(res.finish_reason, res.finish_reason)
    reasoning, content = TextSplit(sub.thinking, strip=sub.chat).parts(res.text)
    if sub.chat:
        message = {"role": "assistant", "content": content}
        if sub.thinking:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
        kind, prefix = "text_completion", "cmpl-"
    return {"id": prefix + sub.id, "object": kind, "created": sub.created, "model": model, "choices": [choice],
            "usage": usage(res), "clover": clover_stats(res)}


def chunk(sub: Submission, model: str, reasoning: str = "", content: str = "", finish: str | None = None,
          first: bool = False, res=None) -> dict[str, Any]:
    """One streaming chunk: a block's deltas, the finishing chunk, or (res given) the usage chunk."""
    if sub.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if content or first:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        kind, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choices = [{"index": 0, "text": content, "finish_reason": finish, "logprobs": None}]
        kind, prefix = "text_completion", "cmpl-"
    body = {"id": prefix + sub.id, "object": kind, "created": sub.created, "model": model,
            "choices": [] if res is not None else choices}
    if res is not None:
        body["usage"], body["clover"] = usage(res), clover_stats(res)
    return body
