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
from clover_export.runtime.controls import COLUMNS, RowParams, apply_controls_, param_row, thinking_open
from clover_export.runtime.request import Request
from clover_export.runtime.scheduler import StepPlan
from clover_export.runtime.selector import Controls, choose, draw, fill, sampling_probs
from clover_export.runtime.speculative import Verdict, accept_greedy, accept_sampled, ar_distribution

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
        self.draft_q: dict[int, torch.Tensor] = {}  # self_spec sampling: per slot, q of its draft's positions

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
        self.draft_q.pop(s, None)
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
        if idx is not None and self.last_row is not None:
            states[LAST_ROW] = self.last_row.index_select(0, idx)
        gens = {s: g.get_state() for s in plan.slot_ids if (g := self.generators[s]) is not None}
        return Snapshot(idx, states, gens)

    @torch.inference_mode()
    def restore(self, snap: Snapshot) -> None:
        for name, saved in snap.states.items():
            (self.last_row if name == LAST_ROW else self.pools[name]).index_copy_(0, snap.slots, saved)
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

    def _causal_seen(self, plan: StepPlan, R: int) -> tuple[int, list[int], list[int], list[int], list[int]]:
        """What the controls of lossless rows' logit rows start from (runtime/speculative.py): (K, ids [B, K]
        (the response's and the draft's tokens), the response's counts [B, K], [B, R - 1] the draft
        (padding: -1), [B, 2] (response length, thinking open)). `_causal_controls` adds the draft's first
        i tokens on the device for logit row i. Other rows get nothing counted."""
        keys, base, drafts, state = [], [], [], []
        for r, req in enumerate(plan.requests):
            if not plan.logit_rows or not plan.logit_rows[r]:
                keys.append([])
                base.append([])
                drafts += [-1] * (R - 1)
                state += [0, 0]
                continue
            k = sorted(set(req.counts) | set(req.draft))
            keys.append(k)
            base.append([req.counts.get(t, 0) for t in k])
            drafts += req.draft + [-1] * (R - 1 - len(req.draft))
            state += [len(req.response),
                      int(thinking_open(req.params.enable_thinking, self.think_end_id, req.counts))]
        K = max(len(k) for k in keys)
        ids = [t for k in keys for t in k + [self.mask_id] * (K - len(k))]
        counts = [c for b in base for c in b + [0] * (K - len(b))]
        return K, ids, counts, drafts, state

    def _causal_controls(self, ids, counts, drafts, state, end_ids) -> Controls:
        """Controls of logit row i: counts of the response plus the draft's first i tokens, n = response
        length + i, thinking open until a `</think>` among those draft tokens (DECODING.md 3, 5)."""
        B, K = ids.shape
        R = drafts.shape[1] + 1
        hits = (drafts[:, :, None] == ids[:, None, :]).float()  # [B, R - 1, K]
        before = torch.cat([torch.zeros(B, 1, K, device=ids.device), hits.cumsum(1)], 1)  # draft[:i] counts
        n = state[:, :1].float() + torch.arange(R, device=ids.device).float()
        think = state[:, 1:] != 0
        if self.think_end_id is not None:
            ended = (drafts == self.think_end_id).int().cumsum(1) > 0
            think = think & ~torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=ids.device), ended], 1)
        return Controls(ids, counts.float()[:, None, :] + before, n, end_ids, self.think_end_id,
                        think.expand(B, R))

    @torch.inference_mode()
    def rollback(self, snap: Snapshot, slots: list[int]) -> None:
        """Put back the GDN states (and logits_shift row) of `slots` as `snap` holds them: a rejected draft's
        rows changed them (DECODING.md 5; K/V past the accepted length are never read)."""
        if not slots:
            return
        held = snap.slots.tolist()
        pos = torch.tensor([held.index(s) for s in slots], dtype=torch.long, device=self.device)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for name, saved in snap.states.items():
            target = self.last_row if name == LAST_ROW else self.pools[name]
            target.index_copy_(0, idx, saved.index_select(0, pos))

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[list[int]], list[float], list[Verdict | None]]:
        """One step: each row's block tokens after it, its mean coreset size over layers, and for lossless
        rows (ar, self_spec) its Verdict (None for the others)."""
        B, T, N = plan.batch, plan.width, plan.block_size
        K, seen_ids, seen_counts, think = self._seen(plan)
        logit_rows = plan.logit_row_table()
        R = len(logit_rows) // B
        Kc, c_ids, c_counts, drafts, c_state = self._causal_seen(plan, R)
        flat = torch.tensor(plan.input_ids + plan.n_causal + plan.has_block + plan.slot_ids + plan.past_len
                            + plan.response_base + think + seen_ids + seen_counts + logit_rows
                            + c_ids + c_counts + drafts + c_state, dtype=torch.int32)
        flat = flat.to(self.device, non_blocking=True)
        (ids, n_causal, has_block, slot_ids, past_len, base, think_open, seen_ids, seen_counts, rows,
         c_ids, c_counts, drafts, c_state) = flat.split([B * T, B, B, B, B, B, B, B * K, B * K, B * R, B * Kc,
                                                        B * Kc, B * (R - 1), B * 2])
        inputs = {names.INPUT_IDS: ids.view(B, T), names.N_CAUSAL: n_causal, names.HAS_BLOCK: has_block,
                  names.SLOT_IDS: slot_ids, names.PAST_LEN: past_len, names.LOGIT_ROWS: rows.view(B, R)}
        result = self.backend.step(inputs, self.pools)
        logits, coreset, self.pools = result
        if self.last_row is not None:
            self._first_from_last_row(logits, n_causal, slot_ids)
        if self.observer is not None:
            self.observer(plan, logits.clone())
        lossless = [r for r in range(B) if plan.logit_rows and plan.logit_rows[r]]
        if not any(plan.has_block) and not lossless:  # prefill or commit rows only: nothing to select or read
            return [[] for _ in range(B)], [0.0] * B, [None] * B

        slots = slot_ids.long()
        n = (base[:, None] + torch.arange(N, device=self.device)).float()
        params = RowParams(self.params.index_select(0, slots))
        end_ids = self.end_ids.index_select(0, slots)
        # first verify the draft of the last step (with the q it was drawn from), then draft the next one
        causal = self._causal_controls(c_ids.long().view(B, Kc), c_counts.view(B, Kc), drafts.long().view(B, R - 1),
                                       c_state.view(B, 2), end_ids)
        ar_tok, sampled = self._verify(plan, lossless, result.causal_logits, causal, params)
        spec_rows = [r for r in range(B) if plan.requests[r].decoding == "self_spec" and plan.has_block[r]]
        # only low_confidence rows with a block draw here: a row's generator is consumed by its own steps alone,
        # so a seeded request gives the same tokens whatever else shares the step (DECODING.md 4)
        rows_s = [r for r, req in enumerate(plan.requests)
                  if req.params.do_sample and plan.has_block[r] and not req.lossless]
        gens = [self.generators[plan.requests[r].slot] for r in rows_s]
        controls = Controls(seen_ids.long().view(B, K), seen_counts.float().view(B, K), n, end_ids,
                            self.think_end_id, think_open != 0)
        tok, conf = choose(logits, controls, params, self.mask_id, rows_s, gens,
                           in_place=True)  # the logits are ours until the next step; now controlled
        spec = self._self_spec_drafts(plan, spec_rows, logits, params, tok, conf)
        block = ids.view(B, T)[:, T - N:]
        active = (has_block != 0) & torch.tensor([not req.lossless for req in plan.requests], device=self.device)
        new_block, _ = fill(block, tok, conf, params.threshold, self.mask_id, active)
        # the leading confident block positions after position 0: self_spec's next draft (DECODING.md 5)
        lead = (conf[:, 1:] > params.draft_threshold[:, None]).int().cumprod(1).sum(1, keepdim=True)
        out = torch.cat([new_block, coreset.to(torch.int32).sum(1, keepdim=True), tok.to(torch.int32),
                         lead.to(torch.int32), ar_tok.to(torch.int32), sampled], 1).tolist()  # the one read
        verdicts: list[Verdict | None] = [None] * B
        for r in lossless:
            row = out[r]
            ar, (m, bonus) = row[2 * N + 2:2 * N + 2 + R], row[2 * N + 2 + R:]
            req = plan.requests[r]
            if m < 0:
                m, bonus = accept_greedy(req.draft, ar)
            draft = []
            if r in spec and m == len(req.draft) and row[N + 1] == bonus:
                draft = row[N + 2:2 * N + 1][:row[2 * N + 1]]
            verdicts[r] = Verdict(m, bonus, draft)
        return [row[:N] for row in out], [row[N] / self.num_layers for row in out], verdicts

    def _self_spec_drafts(self, plan: StepPlan, rows: list[int], logits, params: RowParams, tok, conf) -> set[int]:
        """self_spec rows' block fill: greedy rows keep `choose`'s tokens; sampling rows draw from q, the
        block distribution after the controls and sampling transforms, keep q for the next step's
        verification, and report max q as the confidence (so the draft's length does not depend on what
        was drawn). Returns the rows."""
        for r in rows:
            req = plan.requests[r]
            if not req.params.do_sample:
                continue
            q = sampling_probs(logits[r], params.temperature[r].expand(plan.block_size),
                               params.top_k[r].expand(plan.block_size), params.top_p[r].expand(plan.block_size))
            tok[r] = draw(q, self.generators[req.slot])
            conf[r] = q.max(-1).values
            self.draft_q[req.slot] = q[1:]
        return set(rows)

    def _verify(self, plan: StepPlan, rows: list[int], causal_logits, controls: Controls, params: RowParams):
        """The AR token of every logit row [B, R] (greedy), and per row (accepted, bonus) drawn by speculative
        sampling for sampling rows, (-1, -1) for the others (their acceptance is `accept_greedy`'s)."""
        B = causal_logits.shape[0]
        sampled = torch.full((B, 2), -1, dtype=torch.int32, device=self.device)
        if not rows:
            return torch.zeros(B, causal_logits.shape[1], dtype=torch.int32, device=self.device), sampled
        l = causal_logits.float().clone()
        l[..., self.mask_id] = float("-inf")
        apply_controls_(l, controls.seen_ids, controls.seen_counts, controls.n, params, controls.end_ids,
                        controls.think_end_id, controls.thinking_open)
        ar_tok = l.max(-1).indices
        for r in rows:
            req = plan.requests[r]
            if not req.params.do_sample:
                continue
            D = len(req.draft)
            p = ar_distribution(l[r:r + 1, :D + 1], RowParams(params.table[r:r + 1]))[0]
            q = self.draft_q[req.slot][:D] if D else p[:0]
            draft = torch.tensor(req.draft, dtype=torch.long, device=self.device)
            m, bonus = accept_sampled(p, q, draft, self.generators[req.slot])
            sampled[r, 0], sampled[r, 1] = m, bonus
        return ar_tok, sampled
