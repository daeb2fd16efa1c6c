"""The device side of the loop: cache pools, per-slot decoding state, one step (nano-vllm's ModelRunner).

The runner owns the pools (allocated once for `num_slots x max_context`)
and, per slot, the end-token ids, the parameter row and the seeded
generator. `run(plan)` uploads the step's inputs in one int tensor (the
step-graph inputs, plus each row's counted tokens, which the host knows),
calls the backend, runs controls and selection where the logits are, and
reads back one small int tensor (block tokens and coreset sizes).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Callable

import torch

from clover_export.backends.base import Backend
from clover_export.core import names
from clover_export.core.errors import CloverError
from clover_export.runtime.controls import COLUMNS, RowParams, param_row, thinking_open
from clover_export.runtime.request import Request
from clover_export.runtime.scheduler import StepPlan
from clover_export.runtime.selector import Controls, choose, fill

# observer(plan, logits [B, N, V]) sees a copy of the raw block logits of every step (tests, debugging)
Observer = Callable[[StepPlan, torch.Tensor], None]
STATE_POOLS = (".conv_state", ".recurrent_state")  # the pools a step overwrites below past_len (GDN states)
KV_POOLS = (".key", ".value")  # attention K/V [S, Hkv, L, hd]: rows below past_len are never rewritten
LAST_ROW = "last_row"  # key of the logits_shift row in a saved state


@dataclass
class Snapshot:
    """What a step may change that the next try of it reads: the GDN states of its causal rows' slots
    (block rows never write a cache; K/V are written past past_len only, which no later step reads
    before rewriting it: STEP_GRAPH.md 1) and the generator state of its sampling rows."""

    slots: torch.Tensor | None
    states: dict[str, torch.Tensor]
    generators: dict[int, torch.Tensor]


class Runner:
    def __init__(self, backend: Backend, num_slots: int, max_context: int, mask_id: int,
                 think_end_id: int | None = None):
        self.backend = backend
        self.device = backend.device
        self.mask_id = mask_id
        self.think_end_id = think_end_id
        self.num_layers = backend.cfg.num_hidden_layers
        with torch.inference_mode():
            self.pools = backend.allocate_pools(num_slots, max_context)
            self.end_ids = torch.full((num_slots, 4), -1, dtype=torch.long, device=self.device)
            self.params = torch.zeros(num_slots, len(COLUMNS), dtype=torch.float32, device=self.device)
        self.generators: list[torch.Generator | None] = [None] * num_slots
        # logits_shift: per slot, the logits of its last prefix row (they predict block position 0)
        self.last_row = (torch.zeros(num_slots, backend.cfg.vocab_size, dtype=torch.float32, device=self.device)
                         if backend.cfg.logits_shift else None)
        self.observer: Observer | None = None

    @torch.inference_mode()
    def claim(self, req: Request) -> None:
        """Fresh per-slot state for a newly admitted request (recurrent states zeroed; K/V past
        past_len are never read), or the caches it resumes from (`req.resume`, runtime/prefix_cache.py)."""
        s, settings = req.slot, req.params
        ends = sorted(req.end_ids)
        # host-side checks of a request that may have bypassed Generator.submit (an id outside the
        # vocabulary would fail the whole step, on CUDA with a device-side assert)
        vocab = self.backend.cfg.vocab_size
        settings.validate(vocab)
        for what, ids in (("end token", ends), ("prompt token", req.prompt_ids + req.prefill_ids)):
            if any(not 0 <= t < vocab for t in ids):
                raise CloverError("runtime", f"{what} ids are not all in the vocabulary (size {vocab})")
        if req.resume is not None:
            self.resume(s, req.resume)
            req.resume = None  # the saved states it held are the cache's to keep or drop
        else:
            for name, pool in self.pools.items():
                if not name.endswith(KV_POOLS):
                    pool[s].zero_()
            if self.last_row is not None:
                self.last_row[s].zero_()
        if len(ends) > self.end_ids.shape[1]:  # more end tokens than ever before: widen the table
            wider = torch.full((self.end_ids.shape[0], len(ends)), -1, dtype=torch.long, device=self.device)
            wider[:, :self.end_ids.shape[1]] = self.end_ids
            self.end_ids = wider
        self.end_ids[s] = torch.tensor(ends + [-1] * (self.end_ids.shape[1] - len(ends)), device=self.device)
        self.params[s] = torch.tensor(param_row(settings), device=self.device)
        if settings.do_sample:
            seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**63)
            self.generators[s] = torch.Generator(device=self.device).manual_seed(seed)
        else:
            self.generators[s] = None

    # --- prefix reuse (runtime/prefix_cache.py) --------------------------------------------
    def sequence_bytes(self) -> tuple[int, int]:
        """(bytes per cached token, fixed bytes) of one slot's caches: K/V rows; GDN states (+ logits_shift row)."""
        per_token = fixed = 0
        for name, pool in self.pools.items():
            if name.endswith(KV_POOLS):
                per_token += pool[0, :, 0].numel() * pool.element_size()
            else:
                fixed += pool[0].numel() * pool.element_size()
        if self.last_row is not None:
            fixed += self.last_row[0].numel() * self.last_row.element_size()
        return per_token, fixed

    @torch.inference_mode()
    def save_state(self, slot: int) -> tuple[dict[str, torch.Tensor], int]:
        """A copy of the slot's GDN states (and logits_shift row): what resuming after its `past_len`
        tokens needs besides the K/V rows; with its size in bytes."""
        saved = {name: pool[slot].clone() for name, pool in self.pools.items() if name.endswith(STATE_POOLS)}
        if self.last_row is not None:
            saved[LAST_ROW] = self.last_row[slot].clone()
        return saved, sum(t.numel() * t.element_size() for t in saved.values())

    @torch.inference_mode()
    def resume(self, slot: int, r) -> None:
        """Slot `slot` takes K/V rows [0, r.length) from slot `r.source` (unless it is the same slot) and
        the GDN states at r.length: `r.saved`, else the source's live ones (`prefix_cache.Resume`)."""
        for name, pool in self.pools.items():
            if r.source != slot and name.endswith(KV_POOLS):
                pool[slot, :, :r.length].copy_(pool[r.source, :, :r.length])
        if r.saved is not None:
            for name, t in r.saved.items():
                (self.last_row if name == LAST_ROW else self.pools[name])[slot].copy_(t)
        elif r.source != slot:
            for name, pool in self.pools.items():
                if name.endswith(STATE_POOLS):
                    pool[slot].copy_(pool[r.source])
            if self.last_row is not None:
                self.last_row[slot].copy_(self.last_row[r.source])

    @torch.inference_mode()
    def snapshot(self, plan: StepPlan) -> Snapshot:
        """Copy what `run(plan)` may change (see Snapshot), so that a failed step can be undone."""
        causal = [plan.slot_ids[r] for r in range(plan.batch) if plan.n_causal[r] > 0]
        idx = torch.tensor(causal, dtype=torch.long, device=self.device) if causal else None
        states = {name: pool.index_select(0, idx) for name, pool in self.pools.items()
                  if idx is not None and name.endswith(STATE_POOLS)}
        gens = {s: g.get_state() for s in plan.slot_ids if (g := self.generators[s]) is not None}
        return Snapshot(idx, states, gens)

    @torch.inference_mode()
    def restore(self, snap: Snapshot) -> None:
        for name, saved in snap.states.items():
            self.pools[name].index_copy_(0, snap.slots, saved)
        for s, state in snap.generators.items():
            self.generators[s].set_state(state)

    def _seen(self, plan: StepPlan) -> tuple[int, list[int], list[int], list[int]]:
        """(K, ids, counts, thinking_open) of the rows' counted tokens, padded to K with (mask_id, 0)."""
        seen = [req.seen_counts() if plan.has_block[r] else {} for r, req in enumerate(plan.requests)]
        K = max(len(c) for c in seen)
        ids, counts = [], []
        for c in seen:
            pad = K - len(c)
            ids += list(c.keys()) + [self.mask_id] * pad
            counts += list(c.values()) + [0] * pad
        think = [int(thinking_open(req.params.enable_thinking, self.think_end_id, c))
                 for req, c in zip(plan.requests, seen)]
        return K, ids, counts, think

    def thread_scope(self, plan: StepPlan):
        """The backend's CPU thread setting for this step (backends/threads.py), if it has one."""
        scope = getattr(self.backend, "thread_scope", None)
        return scope(plan.batch * plan.width) if scope is not None else contextlib.nullcontext()

    def _first_from_last_row(self, logits: torch.Tensor, n_causal: torch.Tensor, slot_ids: torch.Tensor) -> None:
        """logits_shift (MODEL.md 5.1): block position 0 is predicted by the slot's last prefix row. A step
        with causal rows computed it (the graph's logits row 0, `CloverModel.predicting_rows`): keep it;
        a step without them gets the kept row."""
        slots = slot_ids.long()
        row = torch.where((n_causal != 0).unsqueeze(1), logits[:, 0], self.last_row.index_select(0, slots))
        self.last_row.index_copy_(0, slots, row)
        logits[:, 0] = row

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[list[int]], list[float]]:
        """One step: returns each row's block tokens after it and its mean coreset size over layers."""
        B, T, N = plan.batch, plan.width, plan.block_size
        K, seen_ids, seen_counts, think = self._seen(plan)
        flat = torch.tensor(plan.input_ids + plan.n_causal + plan.has_block + plan.slot_ids + plan.past_len
                            + plan.response_base + think + seen_ids + seen_counts, dtype=torch.int32)
        flat = flat.to(self.device, non_blocking=True)
        ids, n_causal, has_block, slot_ids, past_len, base, think_open, seen_ids, seen_counts = flat.split(
            [B * T, B, B, B, B, B, B, B * K, B * K])
        inputs = {names.INPUT_IDS: ids.view(B, T), names.N_CAUSAL: n_causal, names.HAS_BLOCK: has_block,
                  names.SLOT_IDS: slot_ids, names.PAST_LEN: past_len}
        logits, coreset, self.pools = self.backend.step(inputs, self.pools)
        if self.last_row is not None:
            self._first_from_last_row(logits, n_causal, slot_ids)
        if self.observer is not None:
            self.observer(plan, logits.clone())
        if not any(plan.has_block):  # prefill or commit rows only: nothing to select, nothing to read
            return [[] for _ in range(B)], [0.0] * B

        slots = slot_ids.long()
        n = (base[:, None] + torch.arange(N, device=self.device)).float()
        params = RowParams(self.params.index_select(0, slots))
        # only rows with a block draw: a row's generator is consumed by its own denoise steps alone, so a
        # seeded request gives the same tokens whatever else shares the step (DECODING.md 4)
        rows = [r for r, req in enumerate(plan.requests) if req.params.do_sample and plan.has_block[r]]
        gens = [self.generators[plan.requests[r].slot] for r in rows]
        controls = Controls(seen_ids.long().view(B, K), seen_counts.float().view(B, K), n,
                            self.end_ids.index_select(0, slots), self.think_end_id, think_open != 0)
        tok, conf = choose(logits, controls, params, self.mask_id, rows, gens,
                           in_place=True)  # the logits are ours until the next step
        block = ids.view(B, T)[:, T - N:]
        new_block, _ = fill(block, tok, conf, params.threshold, self.mask_id, has_block != 0)
        out = torch.cat([new_block, coreset.to(torch.int32).sum(1, keepdim=True)], 1).tolist()  # the one read
        return [row[:N] for row in out], [row[N] / self.num_layers for row in out]
