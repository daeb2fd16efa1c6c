"""Response text per request: detokenise committed blocks, cut at the end token and stop strings (DECODING.md 1.5, 4).

Streaming granularity is one block; the text delta of a block holds back what
could still turn out to start a stop string, or an incomplete UTF-8 sequence
(decoded as U+FFFD), until the next block or the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class StreamChunk:
    """One committed block of one request."""

    request_id: int
    text: str  # text delta (may be empty while held back)
    token_ids: list[int]  # the block's response token ids
    finished: bool = False
    result: "Result | None" = None  # set on the last chunk


@dataclass
class Result:
    """A finished request (DECODING.md 4 report)."""

    request_id: int
    token_ids: list[int]  # response ids: cut after the first end token (kept), at max_new_tokens, at a stop string
    text: str  # response text: without the end token, cut before the first stop string
    finish_reason: str  # "stop" (end token), "length", "stop_string", "cancelled", "error"
    prompt_tokens: int
    response_tokens: int
    denoise_steps: int
    blocks: int
    tokens_per_forward: float
    forwards_per_block: float
    distinct_experts_per_block: float
    wall_time_s: float
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def reasoning(self) -> str:
        """Text before `</think>` (empty when the response has none)."""
        head, sep, _ = self.text.partition("</think>")
        return head.strip() if sep else ""

    @property
    def content(self) -> str:
        """Text after `</think>` (all of it when the response has none)."""
        _, sep, tail = self.text.partition("</think>")
        return (tail if sep else self.text).strip()

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("prompt_ids")
        return d


class TextTracker:
    """Text of one response as blocks arrive; finds stop strings."""

    def __init__(self, decode: Callable[[list[int]], str], end_ids: frozenset[int], stop: tuple[str, ...]):
        self.decode = decode
        self.end_ids = end_ids
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False  # a stop string was found

    def push(self, new_ids: list[int], final: bool) -> tuple[str, list[int]]:
        """Add a block's response ids; returns (text delta, ids kept of this block)."""
        start = len(self.token_ids)
        self.token_ids += new_ids
        body = self.token_ids[:-1] if self.token_ids and self.token_ids[-1] in self.end_ids else self.token_ids
        text = self.decode(body)
        hit = self._find_stop(text, start)
        if hit is not None:
            cut_chars, keep_ids = hit
            text = text[:cut_chars]
            self.token_ids = self.token_ids[:keep_ids]
            self.stopped = final = True
        self.text = text
        safe = len(text) if final else max(self.emitted, len(text) - self.hold)
        while not final and safe > self.emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        delta = text[self.emitted:safe]
        self.emitted = safe
        return delta, self.token_ids[start:]

    def _find_stop(self, text: str, start: int) -> tuple[int, int] | None:
        """(chars to keep, ids to keep) for the earliest stop string, or None."""
        if not self.stop:
            return None
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if not found:
            return None
        at = min(found)
        first = min((s for s in self.stop if text.find(s) == at), key=len)
        # the ids up to the one whose text completes the stop string
        for m in range(start + 1, len(self.token_ids) + 1):
            if first in self.decode(self.token_ids[:m])[at:]:
                return at, m
        return at, len(self.token_ids)
