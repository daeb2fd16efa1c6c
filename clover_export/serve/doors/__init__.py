"""Front doors: request shapes other than OpenAI's Chat Completions, each mapped onto the chat path (docs/serving.md,
Other front doors).

A generation door is one module (`messages.py`: Anthropic Messages, `responses.py`: OpenAI Responses) with

- `PATH`, and `error_body(err)`: the door's error shape for an `ApiError`;
- `admit(data, default_thinking, tool_parser) -> Call`: the validated body as an OpenAI chat request
  (`common.flat_tools_submission`), so every door runs the chat path's checks, template, tool calls and engine
  request; what the door answers with rides on the Call;
- `Writer(call)`: its answer built from a sequence of `Piece`s (`start`, `feed`, `finish` return the stream's
  events; `body` is the non-streamed answer), so streamed and whole answers are one fold over the same pieces;
  `error(err)`: the events of a failure after the stream began.

`tokens.py` (/tokenize, /detokenize) and `messages.admit_count` (/v1/messages/count_tokens) answer from the
tokenizer alone. The HTTP loop that runs a door's Call through the engine is app.py's `_door`.
"""

from __future__ import annotations

from typing import Any

from clover_export.serve.doors import messages, responses, tokens
from clover_export.serve.protocol import ApiError

GENERATION = (messages, responses)  # doors run through the engine
TOKENS = tokens


def door_for(path: str):
    """The generation or token door module serving `path`, or None (OpenAI's own endpoints)."""
    return {messages.PATH: messages, messages.COUNT_PATH: messages, responses.PATH: responses,
            **{p: tokens for p in tokens.PATHS}}.get(path)


def error_body(path: str, err: ApiError) -> dict[str, Any]:
    """The error body of `err` in the shape of the door at `path` (OpenAI's elsewhere)."""
    door = door_for(path)
    return door.error_body(err) if door is not None else err.body()


def takes_x_api_key(path: str) -> bool:
    """The door at `path` takes its key as `x-api-key` (Anthropic's header) as well as `Authorization: Bearer`."""
    return getattr(door_for(path), "X_API_KEY", False)
