"""Response text per request: detokenise committed blocks, cut at the end token and stop strings (DECODING.md 1.5, 4).

Streaming granularity is one block; the text delta of a block holds back what
could still turn out to start a stop string, or an incomplete UTF-8 sequence
(decoded as U+FFFD), until the next block or the end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class StreamChunk:
    """One committed block of one request."""

    request_id: int
    text: str  # text delta (may be empty while held back)
    token_ids: list[int]  # the block's response token ids (with stop strings: those whose text is in `text` so far)
    finished: bool = False
    result: "Result | None" = None  # set on the last chunk
    logprobs: list = field(default_factory=list)  # token_ids' `TokenLogprob`s when the request asked
    prompt_logprobs: list = field(default_factory=list)  # the first chunk: the prompt's (`prompt_logprobs`)


@dataclass
class Result:
    """A finished request (DECODING.md 4 report)."""

    request_id: int
    token_ids: list[int]  # response ids: cut after the first end token (kept), at max_new_tokens, and before
    #                       the first token reaching into a stop string (not returned; see TextTracker)
    text: str  # response text: without end tokens (ignore_eos: none of those it ran past), cut before a stop string
    finish_reason: str  # "stop" (end token), "length", "stop_string", "cancelled", "error"
    prompt_tokens: int
    response_tokens: int  # len(token_ids)
    denoise_steps: int
    blocks: int
    tokens_per_forward: float  # response_tokens (the kept ids) / forwards (low_confidence: / denoise_steps)
    forwards_per_block: float
    distinct_experts_per_block: float
    wall_time_s: float
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    error: str | None = None  # why the request failed (finish_reason "error")
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (not computed): docs/prefix_cache.md
    decoding: str = "low_confidence"  # the request's mode (DECODING.md 2, 5)
    forwards: int = 0  # forwards it took part in after its prompt (low_confidence: its denoise steps)
    accepted_per_forward: float = 0.0  # self_spec: mean draft tokens accepted per verifying forward
    logprobs: list = field(default_factory=list, repr=False)  # token_ids' `TokenLogprob`s when the request asked
    # prompt_ids' `TokenLogprob`s when the request asked (`prompt_logprobs`; the first None)
    prompt_logprobs: list = field(default_factory=list, repr=False)

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
        if self.logprobs:  # asked for: each TokenLogprob as {token, logprob, top}
            d["logprobs"] = [dataclasses.asdict(t) for t in self.logprobs]
        else:
            d.pop("logprobs")
        if self.prompt_logprobs:
            d["prompt_logprobs"] = [t and dataclasses.asdict(t) for t in self.prompt_logprobs]
        else:
            d.pop("prompt_logprobs")
        return d


class TextTracker:
    """Text and kept ids of one response as blocks arrive; finds stop strings (DECODING.md 1.5).

    A stop string is not returned: `text` ends right before it and `token_ids`
    before the first token whose text reaches into it. When the stop string
    starts inside a token, `text` keeps that token's leading characters and
    `token_ids` drops the token, so `decode(token_ids)` is a prefix of `text`.
    With stop strings, a chunk's ids are those whose text has been emitted
    (ids that could still be cut are held back like their text). Ids in
    `hidden` (the end tokens when `ignore_eos` generates past them) stay in
    `token_ids` and out of `text`.
    """

    def __init__(self, decode: Callable[[list[int]], str], end_ids: frozenset[int], stop: tuple[str, ...],
                 hidden: frozenset[int] = frozenset()):
        self._decode_all = decode
        self.hidden = hidden
        self.end_ids = end_ids
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of `text` streamed so far
        self.emitted_ids = 0  # ids streamed so far
        self.stopped = False  # a stop string was found

    def decode(self, ids: list[int]) -> str:
        return self._decode_all([i for i in ids if i not in self.hidden] if self.hidden else ids)

    def push(self, new_ids: list[int], final: bool) -> tuple[str, list[int]]:
        """Add a block's response ids; returns (text delta, ids delta)."""
        self.token_ids += new_ids
        body = self.token_ids[:-1] if self.token_ids and self.token_ids[-1] in self.end_ids else self.token_ids
        text = self.decode(body)
        at = self._find_stop(text)
        if at is not None:
            text = text[:at]
            self.token_ids = self.token_ids[:self._ids_within(text, len(body))]
            self.stopped = final = True
        self.text = text
        safe = len(text) if final else max(self.emitted, len(text) - self.hold)
        while not final and safe > self.emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        delta = text[self.emitted:safe]
        self.emitted = safe
        if final or not self.stop:
            n_ids = len(self.token_ids)
        else:
            n_ids = max(self.emitted_ids, self._ids_within(text[:safe], len(body)))
        ids, self.emitted_ids = self.token_ids[self.emitted_ids:n_ids], n_ids
        return delta, ids

    def _find_stop(self, text: str) -> int | None:
        """Character index of the earliest stop string in `text`, or None."""
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _ids_within(self, prefix: str, upto: int) -> int:
        """The most leading ids (at most `upto`) whose decoded text is a prefix of `prefix`."""
        for m in range(upto, self.emitted_ids, -1):
            head = self.decode(self.token_ids[:m])
            if len(head) <= len(prefix) and prefix.startswith(head):
                return m
        return self.emitted_ids
