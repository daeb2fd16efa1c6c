"""`self_spec`: `ar`'s output, several tokens per forward (DECODING.md 5). Each step also runs a block of
masks after the causal rows; its one-step LowConfidence choice is the next draft (`DeviceWork.DRAFT`: the
leading block positions after position 0 more confident than `draft_threshold`, kept when the step's bonus
token equals the block's position 0). A draft stops at its first end token, and a step whose draft ends the
request when accepted runs without a block (`ar.draft_finishes`). Drafts that keep adding nothing (weights whose
block does not predict the causal model's tokens) send the request into `ar` steps for a while (`SpecState`)."""

from __future__ import annotations

from dataclasses import dataclass

from clover_export.core.generation import DRAFT_BACKOFF, DRAFT_MISSES
from clover_export.runtime.decoding.ar import Ar, ArState, draft_finishes
from clover_export.runtime.decoding.base import DeviceWork, RowOutput, Rows
from clover_export.runtime.decoding.grammar import mask_block


@dataclass
class SpecState(ArState):
    """`ArState` plus the back-off (core/generation.py DRAFT_MISSES, DRAFT_BACKOFF): `misses`, block steps in
    a row that added no draft token; `rest`, steps left to run without a block; `backoff`, the next rest."""

    misses: int = 0
    rest: int = 0
    backoff: int = DRAFT_BACKOFF[0]


class SelfSpec(Ar):
    name = "self_spec"
    device_work = frozenset({DeviceWork.VERIFY, DeviceWork.DRAFT})
    drafts = True
    grammar_mode = "self_spec"

    def new_state(self) -> SpecState:
        return SpecState()

    def runs_block(self, req) -> bool:
        """Whether the request's next step runs a block: not while backing off, and not when its draft ends
        the request if accepted (then no block can become a next draft: a causal-only step)."""
        return req.state.rest == 0 and not draft_finishes(req)

    def block_rows(self, req) -> list[int] | None:
        return [req.mask_id] * req.block_size if self.runs_block(req) else None

    def mask_logits(self, req, block_logits, causal_logits) -> None:
        """The logit rows as `ar`'s; the block (the next draft) walked position by position under the grammar."""
        super().mask_logits(req, block_logits, causal_logits)
        if req.grammar is not None and self.runs_block(req):
            mask_block(req.grammar, req.state.draft, block_logits)

    def advance(self, req, row: Rows, out: RowOutput, books) -> bool:
        grew = super().advance(req, row, out, books)
        v, st = out.verdict, req.state
        if v is None:
            return grew
        if row.block is None:
            st.rest = max(0, st.rest - 1)
        elif v.accepted or st.draft:  # a draft token accepted, or a fresh draft to verify: drafting pays
            st.misses, st.backoff = 0, DRAFT_BACKOFF[0]
        else:
            st.misses += 1
            if st.misses >= DRAFT_MISSES:
                st.rest, st.backoff, st.misses = st.backoff, min(2 * st.backoff, DRAFT_BACKOFF[1]), 0
        return grew

    def next_draft(self, out: RowOutput, rows: Rows, accepted: int, bonus: int) -> list[int]:
        if rows.block is None or accepted != len(rows.draft) or out.tokens[0] != bonus:
            return []
        return out.tokens[1:1 + out.lead]
