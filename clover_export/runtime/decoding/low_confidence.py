"""LowConfidence block diffusion (DECODING.md 1, 2): prompt chunks, then blocks of `block_size` masked positions
filled over denoise steps (the most confident first), each resolved block committed causally (folded into the
next block's first step unless `fold_commit` is off)."""

from __future__ import annotations

from collections import Counter

from clover_export.runtime.decoding.base import DeviceWork, Phase, RowOutput, Rows, Strategy
from clover_export.runtime.decoding.logprobs import filled


class LowConfidence(Strategy):
    name = "low_confidence"
    grammar_mode = "self_spec"  # positions filled out of order: a left-to-right grammar masks self_spec's rows
    device_work = frozenset({DeviceWork.SELECT, DeviceWork.FILL})
    logprobs_source = "block"  # the block distribution at the step each token was committed

    def rows(self, req, chunk: list[int] | None, fold_commit: bool) -> Rows:
        if req.phase is Phase.PREFILL:
            last = req.prefill_pos + len(chunk) == len(req.prefill_ids)
            if not (last and fold_commit):
                return Rows(chunk)
            if not req.block:  # last prefill chunk folded into the first denoise step
                req.new_block()
            return Rows(chunk, req.block, response_base=self.response_base(req))
        if req.phase is Phase.COMMIT:
            return Rows(req.pending_commit)
        return Rows(req.pending_commit, req.block, response_base=self.response_base(req))  # DENOISE

    @staticmethod
    def response_base(req) -> int:
        """Response index n of block position 0 (negative while the prompt tail fills the block's start)."""
        return len(req.response) - req.tail

    def seen_counts(self, req) -> Counter:
        """The response so far plus the active block's filled response positions."""
        c = req.counts.copy()
        c.update(t for t in req.block[req.tail:] if t != req.mask_id)
        return c

    def advance(self, req, row: Rows, out: RowOutput, books) -> bool:
        was = req.phase
        books.commit_rows(req, len(row.causal))
        if was is Phase.PREFILL:
            if req.prefill_pos < len(req.prefill_ids):
                return False
            if row.block is None:  # prefill done without folding: the block starts next step
                req.new_block()
                req.phase = Phase.DENOISE
                return False
            req.phase = Phase.DENOISE
        elif was is Phase.COMMIT:
            req.unfolded_commits += 1
            req.pending_commit = []
            req.new_block()
            req.phase = Phase.DENOISE
            return False
        return self._denoised(req, out, books)

    @staticmethod
    def _denoised(req, out: RowOutput, books) -> bool:
        """The block after a denoise step; when resolved its tokens join the response (True)."""
        req.pending_commit = []
        if req.wants_logprobs:
            req.block_logprobs.update(filled(out, req.params.logprobs, req.block, req.mask_id))
        req.block = out.block
        req.denoise_steps += 1
        req.block_steps += 1
        req.coreset_sum += out.coreset
        if not req.block_resolved(books.early_stop):
            return False
        if req.take_block():
            books.finish(req)
        elif books.fold_commit:
            req.pending_commit = req.block
            req.new_block()
        else:
            req.pending_commit = req.block
            req.block = []
            req.phase = Phase.COMMIT
        return True

    def forwards(self, req) -> int:
        return req.denoise_steps  # one per denoise step (DECODING.md 4)
