"""`self_spec`: `ar`'s output, several tokens per forward (DECODING.md 5). Each step also runs a block of
masks after the causal rows; its one-step LowConfidence choice is the next draft (`DeviceWork.DRAFT`: the
leading block positions after position 0 more confident than `draft_threshold`, kept when the step's bonus
token equals the block's position 0). A draft stops at its first end token, and a step whose draft ends the
request when accepted runs without a block (`ar.draft_finishes`)."""

from __future__ import annotations

from clover_export.runtime.decoding.ar import Ar, draft_finishes
from clover_export.runtime.decoding.base import DeviceWork, RowOutput, Rows
from clover_export.runtime.decoding.grammar import mask_block


class SelfSpec(Ar):
    name = "self_spec"
    device_work = frozenset({DeviceWork.VERIFY, DeviceWork.DRAFT})
    drafts = True
    grammar_mode = "self_spec"

    def block_rows(self, req) -> list[int] | None:
        # a draft that ends the request when accepted leaves its block nothing to draft: a causal-only step
        return None if draft_finishes(req) else [req.mask_id] * req.block_size

    def mask_logits(self, req, block_logits, causal_logits) -> None:
        """The logit rows as `ar`'s; the block (the next draft) walked position by position under the grammar."""
        super().mask_logits(req, block_logits, causal_logits)
        if req.grammar is not None and not draft_finishes(req):  # a row without a block: nothing to walk
            mask_block(req.grammar, req.state.draft, block_logits)

    def next_draft(self, out: RowOutput, rows: Rows, accepted: int, bonus: int) -> list[int]:
        if rows.block is None or accepted != len(rows.draft) or out.tokens[0] != bonus:
            return []
        return out.tokens[1:1 + out.lead]
