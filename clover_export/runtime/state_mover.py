"""Every copy of a slot's caches, in one place (docs/runtime.md "State mover"; STEP_GRAPH.md 1).

A slot's caches are attention K/V rows `[0, past_len)` (never rewritten below `past_len`) and the GDN
conv + recurrent states after them (overwritten by every causal row), plus, with `logits_shift`, the logits
row that predicts the slot's next block position 0 (MODEL.md 5.1). The prefix cache decides what to keep and
where a request starts (runtime/prefix_cache.py); the loop decides when a step is undone (runtime/loop.py);
the `StateMover` carries out both. Its vocabulary:

- `save(slot)` -> `SavedState`: a copy of the slot's GDN states (and logits_shift row): what resuming after
  its `past_len` tokens needs besides the K/V rows (the prefix cache's snapshots hold one each);
- `fork(slot, order)`: a `Fork` order of the prefix cache (runtime/prefix_cache.py): K/V rows
  `[0, length)` from the source slot and the states at `length` (a `SavedState`, else the source's live ones);
- `fresh(slot)`: zero states for a request that starts from nothing;
- `hold(slots, generators)` -> `StepUndo`: before a step, a copy of what the step may change that the next
  try of it reads (the GDN states of its causal rows' slots, its sampling rows' generator states);
  `undo(held)` puts all of it back (a failed step), `undo_rows(held, slots)` the states of some slots (the
  rows of a rejected draft, DECODING.md 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clover_export.runtime.prefix_cache import Fork

STATE_POOLS = (".conv_state", ".recurrent_state")  # the pools a step overwrites below past_len (GDN states)
KV_POOLS = (".key", ".value")  # attention K/V [S, Hkv, L, hd]: rows below past_len are never rewritten
LAST_ROW = "last_row"  # key of the logits_shift row among saved states


@dataclass
class SavedState:
    """A copy of one slot's GDN states (and logits_shift row) after some position, by pool name."""

    tensors: dict[str, torch.Tensor]
    nbytes: int


@dataclass
class StepUndo:
    """What a step may change that the next try of it reads: the GDN states of its causal rows' slots
    (block rows never write a cache; K/V are written past past_len only, which no later step reads before
    rewriting it: STEP_GRAPH.md 1) and the generator states of its sampling rows."""

    slots: torch.Tensor | None
    states: dict[str, torch.Tensor]
    generators: dict[int, torch.Tensor]


class StateMover:
    """The slots' cache pools (allocated once) and the logits_shift rows, and every copy between them."""

    def __init__(self, pools: dict[str, torch.Tensor], last_row: torch.Tensor | None,
                 generators: list[torch.Generator | None]):
        self.pools = pools  # replaced by each step's returned pools (Runner.run)
        self.last_row = last_row
        self.generators = generators  # the runner's per-slot list (shared, not copied)
        self.device = last_row.device if last_row is not None else next(iter(pools.values())).device

    def _target(self, name: str) -> torch.Tensor:
        return self.last_row if name == LAST_ROW else self.pools[name]

    def _state_names(self) -> list[str]:
        names = [name for name in self.pools if name.endswith(STATE_POOLS)]
        return names + ([LAST_ROW] if self.last_row is not None else [])

    def sequence_bytes(self) -> tuple[int, int]:
        """(bytes per cached token, fixed bytes) of one slot's caches: K/V rows; GDN states (+ logits_shift row)."""
        per_token = fixed = 0
        for name, pool in self.pools.items():
            if name.endswith(KV_POOLS):
                per_token += pool[0, :, 0].numel() * pool.element_size()
        for name in self._state_names():
            t = self._target(name)
            fixed += t[0].numel() * t.element_size()
        return per_token, fixed

    @torch.inference_mode()
    def fresh(self, slot: int) -> None:
        """Zero the slot's states (K/V past past_len are never read)."""
        for name in self._state_names():
            self._target(name)[slot].zero_()

    @torch.inference_mode()
    def save(self, slot: int) -> tuple[SavedState, int]:
        """A copy of the slot's GDN states (and logits_shift row), with its size in bytes."""
        saved = {name: self._target(name)[slot].clone() for name in self._state_names()}
        nbytes = sum(t.numel() * t.element_size() for t in saved.values())
        return SavedState(saved, nbytes), nbytes

    @torch.inference_mode()
    def fork(self, slot: int, order: Fork) -> None:
        """Carry out a prefix cache `Fork` into `slot`."""
        if order.source != slot:
            for name, pool in self.pools.items():
                if name.endswith(KV_POOLS):
                    pool[slot, :, :order.length].copy_(pool[order.source, :, :order.length])
        if order.saved is not None:
            for name, t in order.saved.tensors.items():
                self._target(name)[slot].copy_(t)
        elif order.source != slot:
            for name in self._state_names():
                target = self._target(name)
                target[slot].copy_(target[order.source])

    @torch.inference_mode()
    def hold(self, slots: list[int], generator_slots: list[int]) -> StepUndo:
        """Copy the states of `slots` (a step's causal rows) and the generator states of `generator_slots`."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device) if slots else None
        states = {name: self._target(name).index_select(0, idx) for name in self._state_names()} if slots else {}
        gens = {s: g.get_state() for s in generator_slots if (g := self.generators[s]) is not None}
        return StepUndo(idx, states, gens)

    @torch.inference_mode()
    def undo(self, held: StepUndo) -> None:
        """Put back everything `held` holds (a failed step)."""
        for name, saved in held.states.items():
            self._target(name).index_copy_(0, held.slots, saved)
        for s, state in held.generators.items():
            self.generators[s].set_state(state)

    @torch.inference_mode()
    def undo_rows(self, held: StepUndo, slots: list[int]) -> None:
        """Put back the states of `slots` as `held` holds them (a rejected draft's rows changed them)."""
        if not slots:
            return
        kept = held.slots.tolist()
        pos = torch.tensor([kept.index(s) for s in slots], dtype=torch.long, device=self.device)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for name, saved in held.states.items():
            self._target(name).index_copy_(0, idx, saved.index_select(0, pos))
