"""Which request does what in the next step, and the step's row layout (STEP_GRAPH.md 1; DECODING.md 1, 4).

Plain Python (no torch, no numpy), like nano-vllm's scheduler: it hands out
cache slots, picks each active request's rows (a prefill chunk, the commit of
the previous block folded into the next block's first denoise step, or a
denoise block) and lays them out as flat int lists: per batch row, C causal
rows (the first `n_causal` valid, left-aligned, padded) then `block_size`
block rows, with C the most causal rows any row has this step. After the
runner has filled positions, `update` moves each request on. With a prefix
cache (runtime/prefix_cache.py) a new request may resume from another's
caches: it starts at `past_len` > 0 and its prefill chunks may end early at
`cuts` (points other requests resume from).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from clover_export.core.step_shape import PREFILL_CHUNK, StepShape
from clover_export.runtime.request import Phase, Request

if TYPE_CHECKING:
    from clover_export.runtime.prefix_cache import PrefixCache

PAD_ID = 0  # token id of padding causal rows (never read: n_causal excludes them)


@dataclass
class StepPlan:
    """One step's inputs as flat lists (row-major), plus the requests in row order."""

    requests: list[Request]
    causal_rows: int  # C
    block_size: int  # N
    input_ids: list[int]  # B * (C + N)
    n_causal: list[int]
    has_block: list[int]
    slot_ids: list[int]
    past_len: list[int]
    response_base: list[int]  # response index of block position 0, per row
    logit_rows: list[list[int]] | None = None  # per row, the causal rows whose next-token logits it needs

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def width(self) -> int:
        return self.causal_rows + self.block_size

    def logit_row_table(self) -> list[int]:
        """`logit_rows` as the graph takes it, [B, R] row-major: each row's list padded with 0 (computed, unread)."""
        lists = self.logit_rows or [[] for _ in self.requests]
        R = max(1, max(len(rows) for rows in lists))
        return [i for rows in lists for i in rows + [0] * (R - len(rows))]

    def subset(self, rows: list[int]) -> "StepPlan":
        """The same step for some batch rows only (same C)."""
        T = self.width
        return StepPlan([self.requests[r] for r in rows], self.causal_rows, self.block_size,
                        [t for r in rows for t in self.input_ids[r * T:(r + 1) * T]],
                        *([getattr(self, name)[r] for r in rows]
                          for name in ("n_causal", "has_block", "slot_ids", "past_len", "response_base")),
                        logit_rows=[self.logit_rows[r] for r in rows] if self.logit_rows else None)


class Scheduler:
    """Slots, admission, per-step layout and state transitions."""

    def __init__(self, num_slots: int, block_size: int, prefill_chunk: int = PREFILL_CHUNK,
                 fold_commit: bool = True, early_stop: bool = True, shapes: list[StepShape] | None = None,
                 cache: "PrefixCache | None" = None):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.fold_commit = fold_commit
        self.early_stop = early_stop
        self.shapes = list(shapes) if shapes else None  # None: any C and batch
        if self.shapes:
            top = max(s.max_batch for s in self.shapes)
            for b in range(1, top + 1):
                if max(s.max_causal for s in self.shapes if s.max_batch >= b) < block_size:
                    raise ValueError(f"no step shape takes {b} rows with a {block_size}-row commit")
        self.cache = cache
        self.free_slots = list(range(num_slots))[::-1]  # slots no running request holds (parked ones too)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._turn = 0  # rotation when an engine takes fewer rows than are running

    # --- life cycle -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str | None = None) -> None:
        """Leave the batch (done, stop string or cancelled); frees the slot at once."""
        if req.finished:
            return
        if reason is not None:
            req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            self.free_slots.append(req.slot)
        req.phase = Phase.FINISHED
        if self.cache is not None:
            self.cache.release(req)

    def admit(self) -> list[Request]:
        """Give free slots to waiting requests (FIFO); returns the newly admitted ones."""
        return list(self.admit_each())

    def admit_each(self) -> Iterator[Request]:
        """`admit`, one request at a time: the caller claims each before the next is placed, so a later
        one may resume from caches the claim filled. With a prefix cache, a request that waits for a
        running one's prefill (prefix_cache.PrefixCache.waits_for) stays queued and later ones go first."""
        for req in list(self.waiting):
            if not self.free_slots:
                return
            if self.cache is None:
                req.slot = self.free_slots.pop()
            elif not self.cache.place(req, self.free_slots, self.running):
                continue
            self.waiting.remove(req)
            if req.prefill_pos < len(req.prefill_ids):
                req.phase = Phase.PREFILL
            else:
                req.new_block()
                req.phase = Phase.DENOISE
            self.running.append(req)
            yield req

    # --- one step ------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Lay out every running request's rows for the next step (None when idle)."""
        if not self.running:
            return None
        N = self.block_size
        reqs, chunk = self.running, self.prefill_chunk
        if self.shapes:  # an engine with fixed profiles: fewer rows, smaller chunks, C padded up
            top = max(s.max_batch for s in self.shapes)
            if len(reqs) > top:
                k = self._turn % len(reqs)
                reqs = (reqs[k:] + reqs[:k])[:top]
                self._turn = k + top
            usable = [s for s in self.shapes if s.max_batch >= len(reqs)]
            chunk = min(chunk, max(s.max_causal for s in usable))
        rows = [self._rows(req, chunk) for req in reqs]
        C = max(len(c) for c, _ in rows)
        if self.shapes:
            C = min(max(s.min_causal, C) for s in usable if s.max_causal >= C)
        plan = StepPlan(list(reqs), C, N, [], [], [], [], [], [], logit_rows=[])
        for req, (causal, block) in zip(reqs, rows):
            plan.logit_rows.append(self._logit_rows(req, len(causal)))
            plan.input_ids += causal + [PAD_ID] * (C - len(causal))
            plan.input_ids += block if block is not None else [req.mask_id] * N
            plan.n_causal.append(len(causal))
            plan.has_block.append(int(block is not None))
            plan.slot_ids.append(req.slot)
            plan.past_len.append(req.past_len)
            plan.response_base.append(req.response_base if block is not None else 0)
        return plan

    def _rows(self, req: Request, chunk_len: int) -> tuple[list[int], list[int] | None]:
        """(causal tokens, block tokens or None) of one request for the next step."""
        if req.lossless:
            return self._lossless_rows(req, chunk_len)
        if req.phase is Phase.PREFILL:
            chunk = self._prefill_chunk(req, chunk_len)
            last = req.prefill_pos + len(chunk) == len(req.prefill_ids)
            if last and self.fold_commit:  # last prefill chunk folded into the first denoise step
                if not req.block:
                    req.new_block()
                return chunk, req.block
            return chunk, None
        if req.phase is Phase.COMMIT:
            return req.pending_commit, None
        return req.pending_commit, req.block  # DENOISE (pending_commit empty unless folded)

    @staticmethod
    def _prefill_chunk(req: Request, chunk_len: int) -> list[int]:
        """The request's next prompt chunk: at most chunk_len tokens, ending early at a cut (prefix_cache.py)."""
        pos = req.prefill_pos
        return req.prefill_ids[pos: min([pos + chunk_len] + [c for c in req.cuts if c > pos])]

    def _lossless_rows(self, req: Request, chunk_len: int) -> tuple[list[int], list[int] | None]:
        """ar / self_spec (DECODING.md 5): prompt chunks, then the tokens not yet cached followed by the draft;
        self_spec adds a block of masks after them (its one-step fill is the next draft)."""
        block = [req.mask_id] * self.block_size if req.decoding == "self_spec" else None
        if req.phase is Phase.PREFILL:
            chunk = self._prefill_chunk(req, chunk_len)
            return chunk, block if req.prefill_pos + len(chunk) == len(req.prefill_ids) else None
        return req.pending + req.draft, block

    @staticmethod
    def _logit_rows(req: Request, n_causal: int) -> list[int]:
        """The causal rows whose logits a lossless row reads: the last cached-to-be token's row (it predicts
        the first draft token, or the next token) and each draft row after it. None for other rows."""
        if not req.lossless or (req.phase is Phase.PREFILL and req.prefill_pos + n_causal < len(req.prefill_ids)):
            return []
        first = n_causal - len(req.draft) - 1
        return list(range(first, n_causal))

    def update(self, plan: StepPlan, blocks: list[list[int]], coreset: list[float],
               verdicts: list | None = None) -> list[Request]:
        """Advance every request of the step; `blocks` are the block tokens after the step.

        Returns the requests whose block resolved this step (their `response`
        grew); finished ones have already left the batch.
        """
        resolved = []
        for r, req in enumerate(plan.requests):
            n_causal = plan.n_causal[r]
            if req.finished:  # cancelled while the step ran: its states moved past its parked sequence
                if self.cache is not None and n_causal:
                    self.cache.invalidate(req.slot)
                continue
            if verdicts is not None and verdicts[r] is not None:
                if self._verified(req, n_causal, verdicts[r]):
                    resolved.append(req)
                continue
            req.past_len += n_causal
            if self.cache is not None and n_causal:
                self.cache.advanced(req, n_causal, prefill=req.phase is Phase.PREFILL)
            if req.phase is Phase.PREFILL:
                req.prefill_pos += n_causal
                if req.prefill_pos < len(req.prefill_ids):
                    continue
                if not plan.has_block[r]:  # prefill done without folding: the block starts next step
                    req.new_block()
                    req.phase = Phase.DENOISE
                    continue
                req.phase = Phase.DENOISE
            elif req.phase is Phase.COMMIT:
                req.unfolded_commits += 1
                req.pending_commit = []
                req.new_block()
                req.phase = Phase.DENOISE
                continue
            req.pending_commit = []
            req.block = blocks[r]
            req.denoise_steps += 1
            req.block_steps += 1
            req.coreset_sum += coreset[r]
            if not req.block_resolved(self.early_stop):
                continue
            resolved.append(req)
            if req.take_block():
                self.finish(req)
            elif self.fold_commit:
                req.pending_commit = req.block
                req.new_block()
            else:
                req.pending_commit = req.block
                req.block = []
                req.phase = Phase.COMMIT
        return resolved

    def _verified(self, req: Request, n_causal: int, v) -> bool:
        """Move a lossless row on by its step's verdict (runtime/speculative.Verdict); True when its response
        grew. A fully accepted draft commits every causal row; otherwise the runner has restored the slot's
        GDN states (Loop.step), nothing is committed and the accepted tokens stay pending (DECODING.md 5)."""
        full = v.accepted == len(req.draft)
        prefill = req.phase is Phase.PREFILL
        new = req.draft[:v.accepted] + [v.bonus]
        if full:
            req.past_len += n_causal
            if prefill:
                req.prefill_pos += n_causal
            if self.cache is not None and n_causal:
                self.cache.advanced(req, n_causal, prefill=prefill)
            req.pending = [v.bonus]
        else:
            req.pending = req.pending + new
        req.forwards += 1
        if req.draft:
            req.verifications += 1
            req.drafted_tokens += len(req.draft)
            req.accepted_tokens += v.accepted
        req.phase = Phase.SPEC
        if req.append(new):
            self.finish(req)
            return True
        req.draft = v.draft[:req.draft_room()] if full else []
        return True
