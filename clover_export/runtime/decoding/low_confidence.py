"""LowConfidence block diffusion (DECODING.md 1, 2): prompt chunks, then blocks of `block_size` masked positions
filled over denoise steps (the most confident first), each resolved block committed causally (folded into the
next block's first step unless `fold_commit` is off). Its per-request state is `BlockState`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from clover_export.runtime.decoding.base import DeviceWork, Phase, RowOutput, Rows, Strategy
from clover_export.runtime.decoding.logprobs import filled


@dataclass
class BlockState:
    """The active block and what goes with it."""

    block: list[int] = field(default_factory=list)  # mask_id where still masked ([]: none yet, or committing)
    tail: int = 0  # prompt tokens pre-filled at the block's start (absolute alignment, first block only)
    steps: int = 0  # denoise steps of the active block (at most block_size, DECODING.md 2 step 6)
    pending_commit: list[int] = field(default_factory=list)  # the resolved block still to append causally
    logprobs: dict = field(default_factory=dict)  # the active block's TokenLogprobs by position (if asked)


def new_block(req) -> None:
    """Start the next block after the committed text (DECODING.md 1.4); the first holds the prompt's tail."""
    st = req.state
    tail = req.prompt_ids[len(req.prefill_ids):] if req.blocks == 0 else []
    st.tail, st.steps, st.logprobs = len(tail), 0, {}
    st.block = list(tail) + [req.mask_id] * (req.block_size - len(tail))


def block_resolved(req, early_stop: bool) -> bool:
    """Every position filled, or (early stop) an end token filled with every position before it filled."""
    st = req.state
    for tok in st.block[st.tail:]:
        if tok == req.mask_id:
            return False
        if early_stop and tok in req.end_ids:
            return True
    return True


def take_block(req) -> bool:
    """Append the resolved block's response tokens; True when the request is done (DECODING.md 1.5)."""
    st = req.state
    req.blocks += 1
    # early stop leaves positions after the end token masked, with no logprob: `append` stops before them
    lps = [st.logprobs.get(i) for i in range(st.tail, req.block_size)] if req.wants_logprobs else None
    return req.append(st.block[st.tail:], lps)


class LowConfidence(Strategy):
    name = "low_confidence"
    grammar_mode = "self_spec"  # positions filled out of order: a left-to-right grammar masks self_spec's rows
    device_work = frozenset({DeviceWork.SELECT, DeviceWork.FILL})
    logprobs_source = "block"  # the block distribution at the step each token was committed

    def new_state(self) -> BlockState:
        return BlockState()

    def rows(self, req, chunk: list[int] | None, fold_commit: bool) -> Rows:
        st = req.state
        if req.phase is Phase.PREFILL:
            last = req.prefill_pos + len(chunk) == len(req.prefill_ids)
            if not (last and fold_commit):
                return Rows(chunk)
            if not st.block:  # last prefill chunk folded into the first denoise step
                new_block(req)
            return Rows(chunk, st.block, response_base=self.response_base(req))
        if req.phase is Phase.COMMIT:
            return Rows(st.pending_commit)
        return Rows(st.pending_commit, st.block, response_base=self.response_base(req))  # DENOISE

    @staticmethod
    def response_base(req) -> int:
        """Response index n of block position 0 (negative while the prompt tail fills the block's start)."""
        return len(req.response) - req.state.tail

    def seen_counts(self, req) -> Counter:
        """The response so far plus the active block's filled response positions."""
        c = req.counts.copy()
        st = req.state
        c.update(t for t in st.block[st.tail:] if t != req.mask_id)
        return c

    def prompt_cached(self, req) -> None:
        new_block(req)
        req.phase = Phase.DENOISE

    def over_step_cap(self, req) -> bool:
        return req.phase is Phase.DENOISE and req.state.steps >= req.block_size

    def advance(self, req, row: Rows, out: RowOutput, books) -> bool:
        was = req.phase
        books.commit_rows(req, len(row.causal))
        if was is Phase.PREFILL:
            if req.prefill_pos < len(req.prefill_ids):
                return False
            req.phase = Phase.DENOISE
            if row.block is None:  # prefill done without folding: the block starts next step
                new_block(req)
                return False
        elif was is Phase.COMMIT:
            req.unfolded_commits += 1
            req.state.pending_commit = []
            new_block(req)
            req.phase = Phase.DENOISE
            return False
        return self._denoised(req, out, books)

    @staticmethod
    def _denoised(req, out: RowOutput, books) -> bool:
        """The block after a denoise step; when resolved its tokens join the response (True)."""
        st = req.state
        st.pending_commit = []
        if req.wants_logprobs:
            st.logprobs.update(filled(out, req.params.logprobs, st.block, req.mask_id))
        st.block = out.block
        req.denoise_steps += 1
        st.steps += 1
        req.coreset_sum += out.coreset
        if not block_resolved(req, books.early_stop):
            return False
        if take_block(req):
            books.finish(req)
        elif books.fold_commit:
            st.pending_commit = st.block
            new_block(req)
        else:
            st.pending_commit, st.block = st.block, []
            req.phase = Phase.COMMIT
        return True

    def forwards(self, req) -> int:
        return req.denoise_steps  # one per denoise step (DECODING.md 4)
