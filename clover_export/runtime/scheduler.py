"""Which request does what in the next step, and the step's row layout (STEP_GRAPH.md 1; DECODING.md 1, 4).

Plain Python (no torch, no numpy), like nano-vllm's scheduler: it hands out
cache slots, asks each active request's strategy (runtime/decoding/) for its
rows (`Rows`: causal rows, block rows, logit rows) and hands the runner a
`StepPlan`: per batch row, C causal rows (the first `n_causal` valid,
left-aligned, padded) then `block_size` block rows, with C the most causal rows
any row has this step. After the step, `update` hands each request's typed
`RowOutput` to its strategy, which moves it on. With a prefix
cache (runtime/prefix_cache.py) a new request may resume from another's
caches: it starts at `past_len` > 0 and its prefill chunks may end early at
`cuts` (points other requests resume from). A request asking for its prompt's logprobs prefills in
chunks of at most a block, every row a logit row scoring the next prompt token (`Rows.scored`), and its
last prompt row alone, as its strategy lays it out (docs/runtime.md, Prompt logprobs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from clover_export.core.step_shape import PREFILL_CHUNK, StepShape
from clover_export.runtime.decoding.base import Phase, RowOutput, Rows
from clover_export.runtime.decoding.logprobs import scored
from clover_export.runtime.request import Request

if TYPE_CHECKING:
    from clover_export.runtime.prefix_cache import PrefixCache

PAD_ID = 0  # token id of padding causal rows (never read: n_causal excludes them)


@dataclass
class StepPlan:
    """What the scheduler hands the runner for one step: the requests in batch-row order, each one's `Rows`
    (its strategy's answer) and where its caches stand; the graph's flat inputs (row-major) derive from
    them (runtime/step_io.py packs them into the one upload)."""

    requests: list[Request]
    causal_rows: int  # C: the most causal rows any row has this step (padded up to a step shape's)
    block_size: int  # N
    rows: list[Rows]
    slot_ids: list[int]
    past_len: list[int]

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def width(self) -> int:
        return self.causal_rows + self.block_size

    @property
    def input_ids(self) -> list[int]:
        """Per batch row: its causal tokens left-aligned and padded to C, then its block (masks without one)."""
        C, N = self.causal_rows, self.block_size
        return [t for req, row in zip(self.requests, self.rows)
                for t in row.causal + [PAD_ID] * (C - len(row.causal)) + (row.block or [req.mask_id] * N)]

    @property
    def n_causal(self) -> list[int]:
        return [len(row.causal) for row in self.rows]

    @property
    def has_block(self) -> list[int]:
        return [int(row.block is not None) for row in self.rows]

    @property
    def response_base(self) -> list[int]:
        return [row.response_base for row in self.rows]

    @property
    def logit_rows(self) -> list[list[int]]:
        return [row.logit_rows for row in self.rows]

    def logit_row_table(self) -> list[int]:
        """`logit_rows` as the graph takes it, [B, R] row-major: each row's list padded with 0 (computed, unread)."""
        R = max(1, max(len(row.logit_rows) for row in self.rows))
        return [i for row in self.rows for i in row.logit_rows + [0] * (R - len(row.logit_rows))]

    def subset(self, rows: list[int]) -> "StepPlan":
        """The same step for some batch rows only (same C)."""
        return StepPlan([self.requests[r] for r in rows], self.causal_rows, self.block_size,
                        [self.rows[r] for r in rows], [self.slot_ids[r] for r in rows],
                        [self.past_len[r] for r in rows])


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
                req.strategy.prompt_cached(req)
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
        C = max(len(row.causal) for row in rows)
        if self.shapes:
            C = min(max(s.min_causal, C) for s in usable if s.max_causal >= C)
        return StepPlan(list(reqs), C, N, rows, [req.slot for req in reqs], [req.past_len for req in reqs])

    def _rows(self, req: Request, chunk_len: int) -> Rows:
        if req.phase is not Phase.PREFILL:
            return req.strategy.rows(req, None, self.fold_commit)
        chunk = self._prefill_chunk(req, chunk_len)
        rows = req.strategy.rows(req, chunk, self.fold_commit)
        pos = req.prefill_pos
        if req.scores_prompt and pos + len(chunk) < len(req.prefill_ids):  # a scoring chunk (not the last row)
            rows.logit_rows = list(range(len(chunk)))
            rows.scored = req.prefill_ids[pos + 1: pos + 1 + len(chunk)]
        return rows

    def _prefill_chunk(self, req: Request, chunk_len: int) -> list[int]:
        """The request's next prompt chunk: at most chunk_len tokens, ending early at a cut (prefix_cache.py);
        scoring its prompt, at most a block (the graph's logit rows) and never the last prompt row with others."""
        pos = req.prefill_pos
        ends = [pos + chunk_len] + [c for c in req.cuts if c > pos]
        if req.scores_prompt:
            last = len(req.prefill_ids) - 1
            ends += [pos + self.block_size] + ([last] if pos < last else [])
        return req.prefill_ids[pos: min(ends)]

    def update(self, plan: StepPlan, outputs: list[RowOutput]) -> list[Request]:
        """Advance every request of the step by its strategy, given the step's typed outputs.

        Returns the requests whose response grew this step; finished ones have already left the batch.
        """
        resolved = []
        for req, row, out in zip(plan.requests, plan.rows, outputs):
            if req.finished:  # cancelled while the step ran: its states moved past its parked sequence
                if self.cache is not None and row.causal:
                    self.cache.invalidate(req.slot)
                continue
            if row.scored:
                req.prompt_logprobs += scored(out, req.params.prompt_logprobs, row.scored)
            if req.strategy.advance(req, row, out, self):
                resolved.append(req)
        return resolved

    def commit_rows(self, req: Request, n_causal: int) -> None:
        """The step's `n_causal` causal rows of the request are in its caches now (prompt ones advance the
        prefill); the prefix cache records them (runtime/prefix_cache.py)."""
        prefill = req.phase is Phase.PREFILL
        req.past_len += n_causal
        if prefill:
            req.prefill_pos += n_causal
        if self.cache is not None and n_causal:
            self.cache.advanced(req, n_causal, prefill=prefill)
