"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes (docs/serving.md, Tokenizer endpoints).

/tokenize takes a completion prompt (`prompt`, tokenised as /v1/completions does) or chat `messages` (rendered and
tokenised as /v1/chat/completions does: the same messages give the same ids) and answers
{count, max_model_len, tokens, token_strs}; /detokenize takes `tokens` and answers {prompt}.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from clover_export.core.errors import CloverError
from clover_export.serve.doors.common import chat_submission
from clover_export.serve.protocol import MAX_TOOLS, STRICT, ApiError, ChatTemplateKwargs, Message, Tool, refuse

PATHS = ("/tokenize", "/detokenize")


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # prompt: true by default (as /v1/completions); messages: not taken
    add_generation_prompt: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # OpenAI chat tools, as there
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def error_body(err: ApiError) -> dict[str, Any]:
    return err.body()  # OpenAI's error shape, as vLLM's


def tokenize(req: TokenizeRequest, gen) -> dict[str, Any]:
    """The request's token ids, as the completion or chat path would feed them to the model."""
    if (req.prompt is None) == (req.messages is None):
        raise refuse("prompt", "or 'messages' is required (exactly one of them)")
    if req.prompt is not None:
        ids = gen.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        ids = _chat_ids(req, gen)
    strs = [gen.tokenizer.tok.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": gen.max_context, "tokens": ids, "token_strs": strs}


def _chat_ids(req: TokenizeRequest, gen) -> list[int]:
    if req.add_special_tokens:
        raise refuse("add_special_tokens", "is not taken with 'messages' (the chat template writes the special tokens)")
    # the chat path's own checks and mapping (tools with tool_choice "none": shown to the template, no format
    # needed), so the same messages and tools give the ids /v1/chat/completions feeds the model
    chat = {"messages": [m.model_dump(exclude_none=True) for m in req.messages],
            "tools": [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            "tool_choice": "none" if req.tools else None,
            "chat_template_kwargs": req.chat_template_kwargs.model_dump() if req.chat_template_kwargs else None}
    sub = chat_submission(chat, gen.defaults.enable_thinking)
    tools = sub.tools.tools if sub.tools is not None else None
    try:
        return gen.tokenizer.apply_chat_template(sub.messages, enable_thinking=sub.thinking, tools=tools,
                                                 add_generation_prompt=req.add_generation_prompt)
    except CloverError as e:
        raise refuse("messages", f"cannot be rendered by the chat template: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - a template meeting values it did not expect (extra fields)
        raise refuse("messages", f"cannot be rendered by the chat template: {type(e).__name__}: {e}") from None


def detokenize(req: DetokenizeRequest, gen) -> dict[str, Any]:
    """The ids' text (special tokens written out), or a 400 naming an id outside the vocabulary."""
    size = gen.cfg.vocab_size
    if len(req.tokens) > gen.max_context:
        raise refuse("tokens", f"holds {len(req.tokens)} ids, more than the model's context of {gen.max_context}")
    bad = next((i for i in req.tokens if not 0 <= i < size), None)
    if bad is not None:
        raise refuse("tokens", f"holds the id {bad}, outside the vocabulary of {size} tokens (ids 0 to {size - 1})")
    return {"prompt": gen.tokenizer.decode(req.tokens)}


HANDLERS = {"/tokenize": (TokenizeRequest, tokenize), "/detokenize": (DetokenizeRequest, detokenize)}
