"""OpenAI schema <-> runtime: the server's only knowledge of generation (SERVING.md 1, 2, 5).

`chat_submission` / `completion_submission` turn a validated request into
runtime parameters and a prompt; `prepare` (run off the engine thread, before
the request is handed over) renders the chat template, checks the prompt's
size cheaply, tokenises and checks the context, so the engine receives token
ids that cannot fail to admit. `api_error` turns the runtime's CloverError
into an OpenAI error; the response builders turn `StreamChunk`/`Result`
into OpenAI bodies. Decoding itself stays in the runtime.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from clover_export.core.errors import CloverError
from clover_export.serve.protocol import (
    BODY_PARAMETERS,
    ApiError,
    ChatRequest,
    CommonParams,
    CompletionRequest,
    refuse,
    show,
)

THINK_END = "</think>"
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort", "error": "error"}
# runtime parameter name -> the OpenAI name a client sent (the table's, generation.PARAMETERS)
OPENAI_NAMES = {p.name: p.openai for p in BODY_PARAMETERS if p.openai != p.name}
# how many characters a tokenizer's normalizer may fold into one (NFC/NFKC compose up to 3 code points into
# one, NFKC maps one 4-byte letter to one ASCII letter): the cheap prompt bound divides by it when one is set
NORMALIZER_FOLD = 4


@dataclass
class Submission:
    """A request's runtime parameters and prompt (one of messages, text, ids), and how the answer is shaped."""

    params: dict[str, Any]  # Generator.submit keyword arguments other than the prompt
    chat: bool
    thinking: bool  # split reasoning_content off (chat with thinking on)
    messages: list[dict[str, Any]] | None = None
    text: str | None = None  # raw completion prompt
    ids: list[int] | None = None  # completion prompt as token ids
    stream: bool = False
    include_usage: bool = False
    logit_bias: dict[str, float] | None = None  # checked against the vocabulary by prepare
    decoding: str | None = None  # the decoding mode it runs with (the request's or the model's default), set by prepare
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"


def _sampling(req: CommonParams) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:  # OpenAI and vLLM refuse it too
        raise refuse("stream_options", "is only allowed when 'stream' is true")
    kw: dict[str, Any] = {p.name: getattr(req, p.openai) for p in BODY_PARAMETERS}
    kw["block_size"] = req.block_size
    if req.temperature is not None:  # OpenAI: 0 is greedy; any other value samples at that temperature
        kw["do_sample"] = req.temperature > 0
        kw["temperature"] = req.temperature if req.temperature > 0 else None
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return kw


def _include_usage(req: CommonParams) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def chat_submission(req: ChatRequest, default_thinking: bool) -> Submission:
    if req.logprobs:
        raise refuse("logprobs", "is not supported")
    if req.top_logprobs is not None:
        raise refuse("top_logprobs", "is not supported")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise refuse("response_format", "must be {\"type\": \"text\"}")
    if req.tools:
        raise refuse("tools", "is not supported (no tool calling)")
    if req.tool_choice not in (None, "none"):
        raise refuse("tool_choice", "is not supported (no tool calling)")
    kw = _sampling(req)
    if req.max_completion_tokens is not None:
        kw["max_new_tokens"] = req.max_completion_tokens
    thinking = default_thinking
    if req.chat_template_kwargs and req.chat_template_kwargs.enable_thinking is not None:
        thinking = kw["enable_thinking"] = req.chat_template_kwargs.enable_thinking
    messages = [_message(m.model_dump(exclude_none=True), i) for i, m in enumerate(req.messages)]
    return Submission(_drop_none(kw), chat=True, thinking=thinking, messages=messages, stream=bool(req.stream),
                      include_usage=_include_usage(req), logit_bias=req.logit_bias)


def _message(m: dict[str, Any], i: int) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise refuse(f"messages[{i}].content", "may only hold text parts ({\"type\": \"text\", \"text\": ...})")
        m["content"] = "".join(p["text"] for p in content)
    m.setdefault("content", "")
    return m


def completion_submission(req: CompletionRequest) -> Submission:
    if req.logprobs:
        raise refuse("logprobs", "is not supported")
    if req.echo or req.suffix is not None or req.best_of not in (None, 1):
        param = "echo" if req.echo else "suffix" if req.suffix is not None else "best_of"
        raise refuse(param, "is not supported")
    kw = _sampling(req)
    sub = Submission(_drop_none(kw), chat=False, thinking=False, stream=bool(req.stream),
                     include_usage=_include_usage(req), logit_bias=req.logit_bias)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        sub.text = prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        sub.ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise refuse("prompt", f"must be one prompt per request, got {len(prompt)}")
    else:
        raise refuse("prompt", f"must be a string, a list of one string, or a non-empty list of token ids, "
                               f"got {show(prompt)}")
    return sub


def _drop_none(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


# --- before the engine: the prompt as token ids ---------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level and
    metaspace entries spell at least one character a byte or character they cover), times the
    normalizer's fold. A prompt of C characters is at least C / this many tokens."""
    longest = max(map(len, tokenizer.tok.get_vocab(with_added_tokens=True)))
    return longest * (NORMALIZER_FOLD if tokenizer.tok.normalizer is not None else 1)


def prepare(gen, sub: Submission) -> dict[str, Any]:
    """The engine's `Generator.submit` keyword arguments for `sub`: {"prompt_ids": [...], **parameters}.

    Runs off the engine thread (the tokenizer releases the GIL). Everything the
    request brings is checked here, so admitting it cannot fail: parameters
    against the model's defaults and the engine (block_size), the rendered
    prompt's length against the context before tokenising it, then the token
    count. A refusal is a 400 naming the field.
    """
    check_logit_bias(sub.logit_bias, gen.cfg.vocab_size)
    try:
        settings = gen.settings(**sub.params)
    except CloverError as e:
        raise api_error(e, sub.chat) from None
    sub.decoding = settings.decoding
    if sub.ids is None:
        text = sub.text if sub.text is not None else _render(gen, sub.messages, settings.enable_thinking)
        limit = gen.max_context * chars_per_token(gen.tokenizer)
        if len(text) > limit:
            raise ApiError(400, f"the prompt has {len(text)} characters, more than a context of {gen.max_context} "
                                f"tokens can hold (at most {limit} characters); shorten it",
                           param=sub.prompt_field, code="context_length_exceeded")
    try:  # the runtime's own tokenisation and checks (empty prompt, ids outside the vocabulary)
        ids = gen.prompt_ids(sub.text, sub.messages, sub.ids, raw=sub.text is not None,
                             enable_thinking=settings.enable_thinking)
    except CloverError as e:
        raise ApiError(400, f"{sub.prompt_field}: {e.message}", param=sub.prompt_field) from None
    from clover_export.runtime.generator import context_needed  # torch: imported once an engine exists

    need = context_needed(len(ids), settings.max_new_tokens, gen.block_size, gen.cfg.block_alignment)
    if need > gen.max_context:
        raise _too_long(gen, sub, len(ids), settings.max_new_tokens, need)
    return {"prompt_ids": ids, **sub.params}


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> None:
    """A 400 naming `logit_bias` unless empty: a key that is no token id of the model (its id and the
    vocabulary's size named), a bias outside OpenAI's [-100, 100], else that biases are not supported."""
    for key, value in (bias or {}).items():
        if not re.fullmatch(r"-?[0-9]{1,20}", key):
            raise refuse("logit_bias", f"has the key {show(key)}, which is not a token id (keys are token ids "
                                       f"written as strings, such as \"42\")")
        if not 0 <= int(key) < vocab_size:
            raise refuse("logit_bias", f"has the token id {key}, outside the vocabulary of {vocab_size} tokens "
                                       f"(ids 0 to {vocab_size - 1})")
        if not -100 <= value <= 100:
            raise refuse("logit_bias", f"gives token {key} the bias {show(value)}, outside [-100, 100]")
    if bias:
        raise refuse("logit_bias", "is not supported (only {} or null)")


def _render(gen, messages: list[dict[str, Any]], enable_thinking: bool) -> str:
    """The chat template on the client's messages; any failure is the messages' (400 naming them)."""
    try:
        return gen.tokenizer.render(messages, enable_thinking)
    except CloverError as e:
        raise refuse("messages", f"cannot be rendered by the chat template: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - a template meeting values it did not expect (extra fields)
        raise refuse("messages", f"cannot be rendered by the chat template: {type(e).__name__}: {e}") from None


def _too_long(gen, sub: Submission, prompt_tokens: int, max_tokens: int, need: int) -> ApiError:
    what = f"needs {need} positions (prompt {prompt_tokens} tokens + max_tokens {max_tokens} rounded up to blocks " \
           f"of {gen.block_size})"
    return ApiError(400, f"this request {what}, over the model's context of {gen.max_context}; shorten the "
                         f"{sub.prompt_field} or lower max_tokens", param=sub.prompt_field,
                    code="context_length_exceeded")


def api_error(e: CloverError, chat: bool = True) -> ApiError:
    """A request the runtime refused -> 400 naming the public parameter (context_length_exceeded when it cannot fit)."""
    text = e.message
    for inner, public in OPENAI_NAMES.items():
        text = text.replace(inner, public)
    if "over the context limit" in text:
        return ApiError(400, text, param="messages" if chat else "prompt", code="context_length_exceeded")
    m = re.search(r"parameter(?:\(s\))? '?(\w+)", text)
    return ApiError(400, text, param=m.group(1) if m else None)


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


def usage(res) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens`: prompt tokens resumed from the prefix cache."""
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.response_tokens,
            "total_tokens": res.prompt_tokens + res.response_tokens,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


def clover_stats(res, decoding: str | None = None) -> dict[str, Any]:
    """The `clover` object: the request's decoding mode and the runtime's figures (DECODING.md 4, 5)."""
    return {"decoding": getattr(res, "decoding", None) or decoding, "denoise_steps": res.denoise_steps,
            "forwards": forwards(res), "tokens_per_forward": res.tokens_per_forward,
            "accepted_per_forward": getattr(res, "accepted_per_forward", 0.0),
            "distinct_experts_per_block": res.distinct_experts_per_block}


def forwards(res) -> int:
    """Forwards the request took part in after its prompt (DECODING.md 5): the Result's, else (low_confidence)
    its denoise steps."""
    given = getattr(res, "forwards", None)
    return int(given) if given is not None else res.denoise_steps


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
            "usage": usage(res), "clover": clover_stats(res, sub.decoding)}


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
        body["usage"], body["clover"] = usage(res), clover_stats(res, sub.decoding)
    elif sub.include_usage:  # OpenAI: every chunk carries usage, null until the usage chunk
        body["usage"] = None
    return body
