"""The device side of the loop: per-slot decoding state and one step (nano-vllm's ModelRunner).

The runner owns the `StateMover` (the cache pools, allocated once for `num_slots x max_context`, and every
copy of them) and, per slot, the end-token ids, the parameter row and the seeded generator.
`run(plan)` reads as the step does: `prepare` (the plan's inputs in one upload, runtime/step_io.py),
`forward` (the backend's step), the strategies' device work (runtime/decoding/device.py) and one read-back,
typed per row (`RowOutput`, runtime/decoding/base.py).
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable

import torch

from clover_export.backends.base import Backend
from clover_export.core import names
from clover_export.core.errors import CloverError
from clover_export.runtime import step_io
from clover_export.runtime.controls import COLUMNS, RowParams, param_row, thinking_open
from clover_export.runtime.decoding import device, logprobs
from clover_export.runtime.decoding.base import RowOutput
from clover_export.runtime.request import Request
from clover_export.runtime.scheduler import StepPlan
from clover_export.runtime.state_mover import StateMover, StepUndo

# observer(plan, logits [B, N, V]) sees a copy of the raw block logits of every step (tests, debugging)
Observer = Callable[[StepPlan, torch.Tensor], None]


class Runner:
    def __init__(self, backend: Backend, num_slots: int, max_context: int, mask_id: int,
                 think_end_id: int | None = None):
        self.backend = backend
        self.device = backend.device
        self.mask_id = mask_id
        self.think_end_id = think_end_id
        self.num_layers = backend.cfg.num_hidden_layers
        with torch.inference_mode():
            pools = backend.allocate_pools(num_slots, max_context)
            self.end_ids = torch.full((num_slots, 4), -1, dtype=torch.long, device=self.device)
            self.params = torch.zeros(num_slots, len(COLUMNS), dtype=torch.float32, device=self.device)
        self.generators: list[torch.Generator | None] = [None] * num_slots
        # logits_shift: per slot, the logits of its last prefix row (they predict block position 0)
        last_row = (torch.zeros(num_slots, backend.cfg.vocab_size, dtype=torch.float32, device=self.device)
                    if backend.cfg.logits_shift else None)
        self.states = StateMover(pools, last_row, self.generators)
        self.observer: Observer | None = None
        self.draft_q: dict[int, torch.Tensor] = {}  # per slot, q of its sampled draft (decoding/device.py)

    @property
    def pools(self) -> dict[str, torch.Tensor]:
        return self.states.pools

    # --- a request's slot -------------------------------------------------------------
    @torch.inference_mode()
    def claim(self, req: Request) -> None:
        """Per-slot state for a newly admitted request: its caches as the prefix cache's `Fork` order says
        (`req.fork`, runtime/prefix_cache.py), else fresh; its end ids, parameters and generator."""
        self.check(req)
        if req.fork is not None:
            self.states.fork(req.slot, req.fork)
            req.fork = None  # the saved states it held are the cache's to keep or drop
        else:
            self.states.fresh(req.slot)
        self.draft_q.pop(req.slot, None)
        self.set_end_ids(req.slot, sorted(req.end_ids))
        settings = req.params
        self.params[req.slot] = torch.tensor(param_row(settings), device=self.device)
        self.generators[req.slot] = None
        if settings.do_sample:
            seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**63)
            self.generators[req.slot] = torch.Generator(device=self.device).manual_seed(seed)

    def check(self, req: Request) -> None:
        """Host-side checks of a request that may have bypassed Generator.submit (an id outside the
        vocabulary would fail the whole step, on CUDA with a device-side assert)."""
        vocab = self.backend.cfg.vocab_size
        req.params.validate(vocab)
        for what, ids in (("end token", req.end_ids), ("prompt token", req.prompt_ids + req.prefill_ids)):
            if any(not 0 <= t < vocab for t in ids):
                raise CloverError("runtime", f"{what} ids are not all in the vocabulary (size {vocab})")

    def set_end_ids(self, slot: int, ends: list[int]) -> None:
        if len(ends) > self.end_ids.shape[1]:  # more end tokens than ever before: widen the table
            wider = torch.full((self.end_ids.shape[0], len(ends)), -1, dtype=torch.long, device=self.device)
            wider[:, :self.end_ids.shape[1]] = self.end_ids
            self.end_ids = wider
        self.end_ids[slot] = torch.tensor(ends + [-1] * (self.end_ids.shape[1] - len(ends)), device=self.device)

    def hold(self, plan: StepPlan) -> StepUndo:
        """What `run(plan)` may change, copied (`StateMover.hold`), so that the step can be undone."""
        causal = [s for s, n in zip(plan.slot_ids, plan.n_causal) if n > 0]
        return self.states.hold(causal, plan.slot_ids)

    def thread_scope(self, plan: StepPlan):
        """The backend's CPU thread setting for this step (backends/threads.py), if it has one."""
        scope = getattr(self.backend, "thread_scope", None)
        return scope(plan.batch * plan.width) if scope is not None else contextlib.nullcontext()

    # --- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[RowOutput]:
        """One step: each batch row's typed output (`RowOutput`, its `verdict` set by its strategy)."""
        inputs = self.prepare(plan)
        logits, causal_logits, coreset = self.forward(plan, inputs)
        columns = device.run(self.device_step(plan, inputs, logits, causal_logits))
        if columns is None:  # prefill or commit rows only: nothing to select or read
            return [RowOutput() for _ in plan.requests]
        columns["coreset"] = coreset.to(torch.int32).sum(1, keepdim=True)
        return self.outputs(plan, step_io.read_back(columns))

    def prepare(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """The plan's inputs and what the controls count, as named device tensors (one upload)."""
        B, T, logit_rows = plan.batch, plan.width, plan.logit_row_table()
        R = len(logit_rows) // B
        fields: step_io.Fields = {
            "input_ids": (plan.input_ids, (B, T)), "n_causal": (plan.n_causal, (B,)),
            "has_block": (plan.has_block, (B,)), "slot_ids": (plan.slot_ids, (B,)),
            "past_len": (plan.past_len, (B,)), "logit_rows": (logit_rows, (B, R)),
            "response_base": (plan.response_base, (B,))}
        fields.update(self.block_counts(plan))
        fields.update(self.verify_counts(plan, R))
        if any(row.scored for row in plan.rows):  # prompt logprobs: the token each scoring logit row precedes
            fields["scored"] = ([t for row in plan.rows for t in row.scored + [0] * (R - len(row.scored))], (B, R))
        return step_io.upload(fields, self.device)

    def block_counts(self, plan: StepPlan) -> step_io.Fields:
        """What the block rows' controls count (DECODING.md 3): per row its strategy's seen tokens and
        counts, padded to K with (mask_id, 0), and whether thinking is open."""
        seen = [req.strategy.seen_counts(req) if row.block is not None else {}
                for req, row in zip(plan.requests, plan.rows)]
        B, K = plan.batch, max(len(c) for c in seen)
        ids = [t for c in seen for t in list(c.keys()) + [self.mask_id] * (K - len(c))]
        counts = [n for c in seen for n in list(c.values()) + [0] * (K - len(c))]
        think = [int(thinking_open(req.params.enable_thinking, self.think_end_id, c))
                 for req, c in zip(plan.requests, seen)]
        return {"seen_ids": (ids, (B, K)), "seen_counts": (counts, (B, K)), "thinking_open": (think, (B,))}

    def verify_counts(self, plan: StepPlan, R: int) -> step_io.Fields:
        """What the logit rows' controls start from (decoding/device.causal_controls): the response's and
        the draft's tokens [B, K] and the response's counts of them, the draft [B, R - 1] (padding -1) and
        (response length, thinking open) [B, 2]. Rows without logit rows count nothing."""
        keys, base, drafts, state = [], [], [], []
        for req, row in zip(plan.requests, plan.rows):
            k = sorted(set(req.counts) | set(row.draft)) if row.logit_rows else []
            keys.append(k)
            base.append([req.counts.get(t, 0) for t in k])
            drafts += row.draft + [-1] * (R - 1 - len(row.draft))
            state += [len(req.response), int(thinking_open(req.params.enable_thinking, self.think_end_id,
                                                           req.counts))] if row.logit_rows else [0, 0]
        B, K = plan.batch, max(len(k) for k in keys)
        return {"verify_ids": ([t for k in keys for t in k + [self.mask_id] * (K - len(k))], (B, K)),
                "verify_counts": ([c for b in base for c in b + [0] * (K - len(b))], (B, K)),
                "drafts": (drafts, (B, R - 1)), "verify_state": (state, (B, 2))}

    def forward(self, plan: StepPlan, inputs: dict[str, torch.Tensor]):
        """The backend's step: (block logits [B, N, V], causal logits [B, R, V], coreset sizes [B, layers])."""
        graph_inputs = {names.INPUT_IDS: inputs["input_ids"], names.N_CAUSAL: inputs["n_causal"],
                        names.HAS_BLOCK: inputs["has_block"], names.SLOT_IDS: inputs["slot_ids"],
                        names.PAST_LEN: inputs["past_len"], names.LOGIT_ROWS: inputs["logit_rows"]}
        result = self.backend.step(graph_inputs, self.states.pools)
        logits, coreset, self.states.pools = result
        if self.states.last_row is not None:
            self._first_from_last_row(logits, inputs["n_causal"], inputs["slot_ids"])
        if self.observer is not None:
            self.observer(plan, logits.clone())
        return logits, result.causal_logits, coreset

    def _first_from_last_row(self, logits: torch.Tensor, n_causal: torch.Tensor, slot_ids: torch.Tensor) -> None:
        """logits_shift (MODEL.md 5.1): block position 0 is predicted by the slot's last prefix row. A step
        with causal rows computed it (the graph's logits row 0, `CloverModel.predicting_rows`): keep it;
        a step without them gets the kept row."""
        slots, last_row = slot_ids.long(), self.states.last_row
        row = torch.where((n_causal != 0).unsqueeze(1), logits[:, 0], last_row.index_select(0, slots))
        last_row.index_copy_(0, slots, row)
        logits[:, 0] = row

    def device_step(self, plan: StepPlan, inputs: dict[str, torch.Tensor], logits, causal_logits
                    ) -> device.DeviceStep:
        slots = inputs["slot_ids"].long()
        return device.DeviceStep(plan, inputs, logits, causal_logits, RowParams(self.params.index_select(0, slots)),
                                 self.end_ids.index_select(0, slots), self.mask_id, self.think_end_id,
                                 self.generators, self.draft_q)

    def outputs(self, plan: StepPlan, rows: list[dict[str, list[int]]]) -> list[RowOutput]:
        """The read-back rows, typed; each row's strategy reads its verdict from it."""
        outs = []
        for req, row, got in zip(plan.requests, plan.rows, rows):
            out = RowOutput(coreset=got["coreset"][0] / self.num_layers, **logprob_fields(got))
            if "block" in got:  # a step of prompt rows only reads back their scores (prompt logprobs)
                out.block, out.tokens, out.lead = got["block"], got["tokens"], got["lead"][0]
                out.ar_tokens, out.sampled = got["ar_tokens"], tuple(got["sampled"])
            out.verdict = req.strategy.verdict(req, out, row)
            outs.append(out)
        return outs


def logprob_fields(got: dict[str, list[int]]) -> dict[str, list]:
    """The logprob columns of a read-back row (runtime/decoding/logprobs.py): floats from their bits."""
    out = {name: logprobs.floats(got[name]) for name in ("lp_ar", "lp_draft", "lp_bonus", "top_lp", "blk_lp",
                                                         "blk_top_lp", "prompt_lp", "prompt_top_lp") if name in got}
    out.update({name: got[name] for name in ("top_ids", "blk_top_ids", "prompt_top_ids") if name in got})
    return out
