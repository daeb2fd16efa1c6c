"""The per-request record the scheduler and the runner share (DECODING.md 1; nano-vllm's `Sequence`).

Plain Python, no tensor library: positions, tokens, phase and counters of one
request, its decoding `strategy` (runtime/decoding/) and that strategy's per-request `state`. The runner
keeps the request's device state (counts, generator, parameters) under its slot.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from clover_export.runtime import decoding
from clover_export.runtime.decoding.base import Phase, Strategy

_ids = itertools.count()


@dataclass
class Request:
    """One generation request: what to do (fields set at submit) and where it stands (state)."""

    prompt_ids: list[int]
    max_new_tokens: int
    end_ids: frozenset[int]
    block_size: int
    mask_id: int
    alignment: str = "prompt_end"  # MODEL.md 5.1 block_alignment
    params: Any = None  # the request's GenerationSettings, read by the runner only
    request_id: int = field(default_factory=lambda: next(_ids))

    # --- state -----------------------------------------------------------
    phase: Phase = Phase.WAITING
    slot: int | None = None
    past_len: int = 0  # tokens in the slot's caches
    prefill_ids: list[int] = field(default_factory=list)  # prompt tokens appended causally
    prefill_pos: int = 0  # how many of them are cached
    response: list[int] = field(default_factory=list)  # response tokens, cut at end token / max_new_tokens
    counts: Counter = field(default_factory=Counter)  # occurrences of each token in `response`
    logprobs: list = field(default_factory=list)  # per response token its `decoding.logprobs.TokenLogprob` (if asked)
    prompt_logprobs: list = field(default_factory=list)  # per prompt token its TokenLogprob (the first: None)
    finish_reason: str | None = None
    error: Exception | None = None  # why the request failed (finish_reason "error"); see loop.py
    # prefix reuse (runtime/prefix_cache.py)
    cached_tokens: int = 0  # prompt tokens resumed from another request's caches, not computed
    fork: Any = None  # prefix_cache.Fork for Runner.claim, set when the request is placed
    cuts: set[int] = field(default_factory=set)  # positions its prefill chunks end at (points for others)
    # the decoding mode (runtime/decoding/) and its per-request state (`Strategy.new_state`)
    strategy: Strategy = field(default_factory=lambda: decoding.strategy(decoding.DEFAULT))
    state: Any = None
    grammar: Any = None  # decoding/grammar.RequestGrammar of a constrained request (ar / self_spec)

    # --- counters (DECODING.md 4 report) ------------------------------------
    denoise_steps: int = 0
    unfolded_commits: int = 0
    blocks: int = 0
    coreset_sum: float = 0.0  # sum over denoise steps of the mean kept-set size over layers
    forwards: int = 0  # steps that produced or refined response tokens (prefill-only chunks excluded)
    verifications: int = 0  # steps that verified a non-empty draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def __post_init__(self):
        self.alignment = self.strategy.alignment(self.alignment)
        self.state = self.strategy.new_state()
        if self.alignment == "absolute":
            cut = len(self.prompt_ids) // self.block_size * self.block_size
        else:
            cut = len(self.prompt_ids)
        self.prefill_ids = list(self.prompt_ids[:cut])  # the rest (absolute alignment) starts the first block
        if self.scores_prompt:
            self.prompt_logprobs = [None]  # the first prompt token follows nothing

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def decoding(self) -> str:
        """The mode's name (runtime/decoding/)."""
        return self.strategy.name

    @property
    def scores_prompt(self) -> bool:
        """The request asked for its prompt tokens' logprobs (`prompt_logprobs`)."""
        return getattr(self.params, "prompt_logprobs", None) is not None

    @property
    def wants_logprobs(self) -> bool:
        return getattr(self.params, "logprobs", None) is not None

    def append(self, tokens: list[int], logprobs: list | None = None) -> bool:
        """Append response tokens up to the first end token or max_new_tokens; True when the request is done.
        `logprobs`: each token's `TokenLogprob` (kept alongside the response)."""
        for i, tok in enumerate(tokens):
            if len(self.response) >= self.max_new_tokens:
                self.finish_reason = "length"
                return True
            self.response.append(tok)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            self.counts[tok] += 1
            if tok in self.end_ids:
                self.finish_reason = "stop"
                return True
        if len(self.response) >= self.max_new_tokens:
            self.finish_reason = "length"
            return True
        return False

    # --- report (DECODING.md 4) -------------------------------------------------
    def stats(self) -> dict[str, float]:
        steps = self.denoise_steps
        forwards = self.strategy.forwards(self)
        return {
            "prompt_tokens": self.prompt_len,
            "cached_tokens": self.cached_tokens,
            "response_tokens": len(self.response),
            "denoise_steps": steps,
            "blocks": self.blocks,
            "tokens_per_forward": len(self.response) / forwards if forwards else 0.0,
            "forwards": forwards,
            "accepted_per_forward": self.accepted_tokens / self.verifications if self.verifications else 0.0,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forwards_per_block": (steps + self.unfolded_commits) / self.blocks if self.blocks else 0.0,
            "distinct_experts_per_block": self.coreset_sum / steps if steps else 0.0,
        }
