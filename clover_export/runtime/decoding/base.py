"""The interface of a decoding mode (docs/runtime.md "Decoding strategies"; DECODING.md 2, 5).

Plain Python, like the scheduler that calls it. A `Strategy` answers, for one request:
- which rows the next step needs (`rows`: causal rows, block rows, the causal rows whose logits it reads);
- what runs on the device with the step's outputs (`device_work`: a set of `DeviceWork` names, carried out
  batched over the step's rows by runtime/decoding/device.py);
- what the read-back means for it (`verdict`) and how the request advances (`advance`);
- its per-request state (`new_state`, kept on `Request.state`).
A new mode is one module with a `Strategy` subclass plus its line in `decoding/__init__.py`.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar


class Phase(enum.Enum):
    WAITING = "waiting"  # no slot yet
    PREFILL = "prefill"  # prompt chunks still to append to the caches
    COMMIT = "commit"  # a resolved block waits for its own causal step (commit not folded)
    DENOISE = "denoise"  # a block is being filled
    SPEC = "spec"  # ar / self_spec: each step verifies the draft and appends at least one token (DECODING.md 5)
    FINISHED = "finished"


class DeviceWork(str, enum.Enum):
    """What a row takes part in on the device after the forward (runtime/decoding/device.py), in this order."""

    VERIFY = "verify"  # the AR token of each logit row; speculative sampling of a sampled draft
    SELECT = "select"  # a sampling row's block choice drawn from its generator (every row gets the greedy one)
    DRAFT = "draft"  # the block's choice is the next draft (sampling rows draw it from q, kept for VERIFY)
    FILL = "fill"  # LowConfidence fill of the block's masked positions


@dataclass
class Rows:
    """One request's rows in the next step: causal tokens, block tokens (None: no block rows), the causal
    rows whose next-token logits it reads, the response index of block position 0, the tokens under
    verification (DECODING.md 5) and, for a prompt chunk scored for prompt logprobs (the scheduler sets
    it; no strategy reads those rows), the prompt token each logit row scores."""

    causal: list[int]
    block: list[int] | None = None
    logit_rows: list[int] = field(default_factory=list)
    response_base: int = 0
    draft: list[int] = field(default_factory=list)
    scored: list[int] = field(default_factory=list)  # prompt logprobs: the prompt token each logit row scores

    @property
    def verified_rows(self) -> list[int]:
        """The logit rows the strategy reads (verification): none in a scoring chunk, whose logit rows only
        score the prompt."""
        return [] if self.scored else self.logit_rows


@dataclass
class Verdict:
    """One verifying row's step: `accepted` leading draft tokens, then `bonus`; `draft` for the next step."""

    accepted: int
    bonus: int
    draft: list[int] = field(default_factory=list)


@dataclass
class RowOutput:
    """What one batch row's step read back (runtime/step_io.py `ReadBack`), typed.

    `block`: the block tokens after the step ([] without block rows); `coreset`: the mean kept-set size over
    layers; `tokens`: the block's chosen token per position; `lead`: its leading confident positions after
    position 0; `ar_tokens`: the AR token of each logit row; `sampled`: (accepted, bonus) of speculative
    sampling, (-1, -1) where not sampled; `verdict`: set by the strategy (`Strategy.verdict`).
    Room for later per-row outputs (logprobs, top-k, grammar state) is here, one named field each."""

    block: list[int] = field(default_factory=list)
    coreset: float = 0.0
    tokens: list[int] = field(default_factory=list)
    lead: int = 0
    ar_tokens: list[int] = field(default_factory=list)
    sampled: tuple[int, int] = (-1, -1)
    verdict: Verdict | None = None
    # logprobs (runtime/decoding/logprobs.py), for rows that asked: per logit row the AR token's and the draft
    # token's log-probability, a sampled bonus's, and the row's top k (ids, log-probabilities), flat [R * k]
    lp_ar: list[float] = field(default_factory=list)
    lp_draft: list[float] = field(default_factory=list)
    lp_bonus: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_lp: list[float] = field(default_factory=list)
    # low_confidence: per block position its token's log-probability in this step's block distribution, top k
    blk_lp: list[float] = field(default_factory=list)
    blk_top_ids: list[int] = field(default_factory=list)
    blk_top_lp: list[float] = field(default_factory=list)
    # prompt logprobs: per scoring logit row its next prompt token's log-probability, the row's top k
    prompt_lp: list[float] = field(default_factory=list)
    prompt_top_ids: list[int] = field(default_factory=list)
    prompt_top_lp: list[float] = field(default_factory=list)


class Strategy:
    """A decoding mode. Subclasses set `name`, `device_work` and write the host-side steps."""

    name: ClassVar[str]
    device_work: ClassVar[frozenset[DeviceWork]]
    block_alignment: ClassVar[bool] = True  # the model's block_alignment applies (False: blocks follow the prompt)
    drafts: ClassVar[bool] = False  # reports accepted draft tokens per verifying forward (serve/metrics.py)
    logprobs_source: ClassVar[str] = "causal"  # the distribution its logprobs come from (docs/serving.md, Logprobs)
    logit_hook: ClassVar[bool] = False  # True: `mask_logits` runs on the device for its rows every step
    grammar_mode: ClassVar[str] = ""  # the mode a request with a grammar runs in (runtime/decoding/grammar.py)

    def new_state(self) -> Any:
        """The per-request state this mode keeps (`Request.state`)."""
        return None

    def takes(self, work: DeviceWork) -> bool:
        return work in self.device_work

    def alignment(self, model_alignment: str) -> str:
        return model_alignment if self.block_alignment else "prompt_end"

    def rows(self, req, chunk: list[int] | None, fold_commit: bool) -> Rows:
        """The request's rows for the next step; `chunk`: its next prompt chunk while prefilling."""
        raise NotImplementedError

    def seen_counts(self, req) -> Counter:
        """count(token) of DECODING.md 3 for the request's block rows."""
        raise NotImplementedError

    def verdict(self, req, out: RowOutput, rows: Rows) -> Verdict | None:
        """The host-side reading of a verifying row's read-back (None: the row verifies nothing)."""
        return None

    def advance(self, req, out: RowOutput, n_causal: int, books) -> bool:
        """Move the request on after its step; True when its response grew. `books` is the Scheduler
        (`commit_rows`, `finish`, `early_stop`, `fold_commit`)."""
        raise NotImplementedError

    def mask_logits(self, req, block_logits, causal_logits) -> None:
        """The device-side hook (when `logit_hook`): change a row's logits in place before any control or
        choice, e.g. -inf outside a grammar's allowed tokens. block_logits [N, V], causal_logits [R, V]
        (its `logit_rows`' logits). Tensor methods only: this module imports no tensor library."""

    def prompt_cached(self, req) -> None:
        """The request's whole prompt was resumed from the prefix cache at admission: set up its first step."""
        req.phase = Phase.DENOISE

    def over_step_cap(self, req) -> bool:
        """True when the request has taken more steps than its mode allows without progress (a fault)."""
        return False

    def undoes(self, req, out: RowOutput) -> bool:
        """True when the step's changes to the slot's GDN states must be undone (`StateMover.undo_rows`)."""
        return False

    def resumable_prompt(self, req) -> list[int]:
        """The prompt tokens a request may resume from another's caches (runtime/prefix_cache.py)."""
        return req.prefill_ids

    def forwards(self, req) -> int:
        """Forwards the request took part in after its prompt (DECODING.md 4)."""
        return req.forwards
