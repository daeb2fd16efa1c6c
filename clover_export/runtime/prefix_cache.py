"""Prefix reuse across requests: which cached sequence a new request resumes from (docs/prefix_cache.md).

Plain Python (no torch), like the scheduler it serves. A slot's caches hold
the first `past_len` tokens of its sequence, `(prompt + response)[:past_len]`
(committed blocks only: DECODING.md 1), as attention K/V rows `[0, past_len)`
and the GDN conv + recurrent states after them (STEP_GRAPH.md 1). Rows below
`past_len` are never rewritten, and only causal rows write caches, so the
sequence can be resumed at a position p (K/V rows `[0, p)` plus the GDN states
after p tokens) only where a causal step ended: a prefill chunk end or a
committed block end. Those are the *points*:

- the slot's *live* end (its current `past_len`): the states in the slot;
- *snapshots*: GDN states (and, with `logits_shift`, the logits row that
  predicts the next position) copied out after a step at prefill chunk ends,
  the prompt end and cuts, kept a few per sequence under a byte budget.

A finished request's slot stays *parked* with its sequence; it is still a free
slot (`Scheduler.free_slots`), taken for a new request in LRU order, so parked
sequences never keep a request out. A new request resumes at the longest point
p within its common prefix with any slot (running or parked):

- it extends a parked sequence entirely: it *takes that slot over* (nothing copied);
- else it *forks*: a free slot (an empty one first, else the least recently
  used) gets K/V rows `[0, p)` copied from the source slot and the states at p
  (a snapshot, or the source's live states);
- the source is the only free slot: it is taken over *in place* at p (its
  snapshot at p restored, the rest of its sequence dropped).

Requests that arrive together and share a prefix that a running request is
still prefilling wait for it (*deferred*): that request's prefill is cut at
the shared length, so the point exists when they are placed (a shared system
prompt is computed once). A request that resumes short of its common prefix
with the source cuts its own prefill there, so the next one resumes exactly;
and a chat prompt's prefill is cut after its last end-of-turn token, where the
next turn's re-rendered conversation still agrees with it.
The cache keeps the books and orders the copies; the runner's `StateMover`
(runtime/state_mover.py) carries them out: `save` after a step (a snapshot's
`SavedState`), `fork` when `Runner.claim` places a request (the `Fork` order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from clover_export.runtime.request import Phase, Request

DEFAULT_BUDGET_GB = 4.0  # snapshot memory (Generator, serve); a full-size snapshot is ~61 MiB
HASH_RUN = 64  # tokens per hashed run of TokenRun
REUSABLE = ("stop", "length", "stop_string", "cancelled")  # finish reasons whose slot holds a valid sequence


class Device(Protocol):
    """What the cache asks of the runner's state mover (runtime/state_mover.py)."""

    def save(self, slot: int) -> tuple[Any, int]: ...  # (SavedState: copy of the slot's GDN states, its bytes)

    def sequence_bytes(self) -> tuple[int, int]: ...  # (bytes per cached token, fixed bytes) of a slot


class TokenRun:
    """Tokens plus a chained hash of each whole run of HASH_RUN tokens: common prefix lengths in
    O(log n) hash comparisons (checked against the tokens, so a hash collision never counts)."""

    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self.hashes: list[int] = []  # hashes[k] covers tokens[:(k + 1) * HASH_RUN]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new) -> None:
        self.tokens.extend(new)
        while (len(self.hashes) + 1) * HASH_RUN <= len(self.tokens):
            k = len(self.hashes)
            prev = self.hashes[-1] if self.hashes else 0
            self.hashes.append(hash((prev, tuple(self.tokens[k * HASH_RUN:(k + 1) * HASH_RUN]))))

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        del self.hashes[n // HASH_RUN:]

    def common_prefix(self, other: "TokenRun") -> int:
        """Length of the longest common prefix of the two token lists."""
        a, b = self.tokens, other.tokens
        lo, hi = 0, min(len(self.hashes), len(other.hashes))
        while lo < hi:  # chained hashes: equal at k means (almost surely) equal before k
            mid = (lo + hi + 1) // 2
            if self.hashes[mid - 1] == other.hashes[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        n = lo * HASH_RUN
        if a[:n] != b[:n]:  # a hash collision: fall back to the tokens
            n = 0
        limit = min(len(a), len(b))
        while n < limit and a[n] == b[n]:
            n += 1
        return n


@dataclass(eq=False)
class Snap:
    """GDN states saved after `pos` tokens; valid for every slot whose first `pos` tokens are the same,
    so entries share it (`holders`)."""

    pos: int
    saved: Any  # the runner's copy
    nbytes: int
    kind: str  # "chunk" (prefill chunk end), "prompt" (prompt end), "cut", "resume"
    last_used: int
    holders: set[int] = field(default_factory=set)  # slots whose entries list it


@dataclass(eq=False)
class Entry:
    """The sequence a slot's caches hold: rows [0, len(seq)), the live states after them, saved points."""

    slot: int
    seq: TokenRun
    points: dict[int, Snap] = field(default_factory=dict)
    request: Request | None = None  # the running request; None when parked
    last_used: int = 0


@dataclass
class Fork:
    """The cache's copy order for a placed request (`StateMover.fork`, at `Runner.claim`): K/V rows
    [0, length) from slot `source` (nothing when it is the request's own slot) and the GDN states at
    `length` (`saved`, a `SavedState`, else the source's live ones)."""

    source: int
    length: int
    saved: Any = None


@dataclass
class Candidate:
    point: int = 0  # resume position
    common: int = 0  # common prefix with the source
    entry: Entry | None = None
    snap: Snap | None = None  # None: the source's live states (point == len(entry.seq))


class PrefixCache:
    """Per-slot sequences, their points, placement of new requests and the snapshot budget."""

    def __init__(self, device: Device, budget_bytes: int, block_size: int, points_per_sequence: int = 8,
                 turn_end_id: int | None = None):
        if budget_bytes < 0 or points_per_sequence < 1:
            raise ValueError("budget_bytes must be >= 0 and points_per_sequence >= 1")
        self.device = device
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.points_per_sequence = points_per_sequence  # prefill chunk-end snapshots kept per sequence
        self.turn_end_id = turn_end_id  # the chat template's end-of-turn token (<|im_end|>), if any
        self.entries: dict[int, Entry] = {}
        self.snaps: set[Snap] = set()
        self.snapshot_bytes = 0
        self.prompt_tokens = 0  # of placed requests
        self.reused_tokens = 0
        self._runs: dict[int, TokenRun] = {}  # request id -> its prefill tokens
        self._clock = 0

    # --- figures --------------------------------------------------------------------
    def parked(self) -> list[Entry]:
        return [e for e in list(self.entries.values()) if e.request is None]  # a copy: /metrics reads it live

    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def figures(self) -> dict[str, float]:
        """Hit rate (reused / prompt tokens of placed requests), snapshot bytes (memory beyond the pools) and
        the bytes of parked sequences (K/V rows and states in idle slots of the pools)."""
        per_token, fixed = self.device.sequence_bytes()
        parked = self.parked()
        return {"hit_rate": self.hit_rate(), "snapshot_bytes": self.snapshot_bytes,
                "parked_bytes": sum(len(e.seq) * per_token + fixed for e in parked), "budget_bytes": self.budget_bytes,
                "parked_sequences": len(parked), "snapshots": len(self.snaps)}

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _run(self, req: Request) -> TokenRun:
        run = self._runs.get(req.request_id)
        if run is None:
            run = self._runs[req.request_id] = TokenRun(req.strategy.resumable_prompt(req))
        return run

    # --- placement --------------------------------------------------------------------
    def best(self, req: Request) -> Candidate:
        """The longest point within the request's common prefix with any slot's sequence."""
        run, best = self._run(req), Candidate()
        limit = 0 if req.scores_prompt else len(run)  # prompt logprobs: every prompt row computed here
        for e in self.entries.values():
            common = min(run.common_prefix(e.seq), limit)
            if common < best.point or not common:
                continue
            cand = Candidate(len(e.seq), common, e) if len(e.seq) <= common else Candidate(0, common, e)
            snap = max((s for p, s in e.points.items() if p <= common), key=lambda s: s.pos, default=None)
            if snap is not None and snap.pos > cand.point:
                cand.point, cand.snap = snap.pos, snap
            better = cand.point > best.point or (
                cand.point == best.point and cand.point > 0 and self._rank(cand) > self._rank(best))
            if better:
                best = cand
        return best

    @staticmethod
    def _rank(c: Candidate) -> tuple:
        """Among equal points: a parked sequence to take over whole, then the most recently used."""
        whole = c.entry.request is None and c.snap is None
        return whole, c.entry.last_used

    def waits_for(self, req: Request, running: list[Request], point: int) -> Request | None:
        """A running request still prefilling a longer shared prefix (worth at least a block, the whole
        prompt, or already a cut of its prefill): `req` waits for it, and its prefill gets cut where the
        shared part ends."""
        if req.scores_prompt:  # it resumes from nothing (`best`)
            return None
        run = self._run(req)
        for other in running:
            if other.phase is not Phase.PREFILL:
                continue
            target = min(run.common_prefix(self._run(other)), len(run))
            if target > max(point, other.past_len) and (
                    target - point >= self.block_size or target == len(run) or target in other.cuts):
                other.cuts.add(target)
                return other
        return None

    def place(self, req: Request, free_slots: list[int], running: list[Request]) -> bool:
        """Give `req` a slot from `free_slots` and its resume point; False when it waits (deferred) or no
        slot is free. Sets slot, past_len, prefill_pos, cached_tokens and fork."""
        if not free_slots:
            return False
        best = self.best(req)
        if self.waits_for(req, running, best.point) is not None:
            return False
        now, src, p = self._tick(), best.entry, best.point
        if p and best.snap is None and src.request is None:
            slot = src.slot  # it extends a parked sequence whole: take the slot over, nothing to copy
        else:
            if p:
                src.last_used = now  # the source goes last
            slot = min(free_slots, key=self._age)
        free_slots.remove(slot)
        if p and slot == src.slot:  # taken over, whole or in place at a snapshot
            entry = src
            self._truncate(entry, p)
            req.fork = Fork(slot, p, best.snap.saved if best.snap is not None else None)
        else:  # a fresh sequence, or forked: rows [0, p) copied, the states from the snapshot or the source
            self._drop(slot)
            entry = self.entries[slot] = Entry(slot, TokenRun(src.seq.tokens[:p] if p else ()))
            req.fork = Fork(src.slot, p, best.snap.saved if best.snap is not None else None) if p else None
        if best.snap is not None:
            best.snap.last_used = now
            self._hold(entry, best.snap)
        entry.request, entry.last_used = req, now
        req.slot, req.past_len, req.prefill_pos, req.cached_tokens = slot, p, p, p
        if p and best.common - p >= self.block_size and best.common < len(req.prefill_ids):
            req.cuts.add(best.common)  # the next request sharing as much resumes exactly there
        turn_end = self._after_last_turn(req.prefill_ids, p)
        if turn_end is not None:
            req.cuts.add(turn_end)
        self.prompt_tokens += req.prompt_len
        self.reused_tokens += p
        return True

    def _after_last_turn(self, ids: list[int], start: int) -> int | None:
        """The position after the prompt's last end-of-turn token, when a prefill chunk can end there: a chat's
        next turn re-renders the conversation the same way up to it, but not the generation prompt after it
        (templates drop an empty or earlier think block), so the next turn resumes there."""
        if self.turn_end_id is None:
            return None
        for i in range(len(ids) - 1, start - 1, -1):
            if ids[i] == self.turn_end_id:
                return i + 1 if i + 1 < len(ids) else None
        return None

    def _age(self, slot: int) -> tuple[int, int]:
        """Eviction order of free slots: empty ones first, then least recently used."""
        e = self.entries.get(slot)
        return (0, 0) if e is None or not len(e.seq) else (1, e.last_used)

    # --- as requests run ----------------------------------------------------------------
    def advanced(self, req: Request, n_causal: int, prefill: bool) -> None:
        """The request's step appended its `n_causal` causal rows (now `req.past_len`): record the tokens,
        and save the states where a later request may resume (prefill chunk ends, the prompt end, cuts)."""
        entry = self.entries.get(req.slot)
        if entry is None or entry.request is not req:
            return
        start, end = len(entry.seq), req.past_len
        entry.seq.extend(sequence_tokens(req, start, end))
        kind = "cut" if end in req.cuts else "prompt" if prefill and end == len(req.prefill_ids) else \
            "chunk" if prefill else None
        req.cuts = {c for c in req.cuts if c > end}
        if kind is not None:
            self._save(entry, end, kind)

    def release(self, req: Request) -> None:
        """The request left its slot: park the sequence (a normal end or a cancel), else forget it."""
        self._runs.pop(req.request_id, None)
        entry = self.entries.get(req.slot) if req.slot is not None else None
        if entry is None or entry.request is not req:
            return
        if req.finish_reason in REUSABLE and req.error is None and len(entry.seq) == req.past_len:
            entry.request, entry.last_used = None, self._tick()
        else:
            self._drop(req.slot)

    def invalidate(self, slot: int) -> None:
        """The slot's states moved past its recorded sequence (a step of a request that had already left)."""
        e = self.entries.get(slot)
        if e is not None and e.request is None:
            self._drop(slot)

    # --- points and the budget ----------------------------------------------------------
    def _save(self, entry: Entry, pos: int, kind: str) -> None:
        if pos in entry.points:
            return
        saved, nbytes = self.device.save(entry.slot)
        if nbytes > self.budget_bytes:
            return
        snap = Snap(pos, saved, nbytes, kind, self._tick())
        self._hold(entry, snap)
        self.snaps.add(snap)
        self.snapshot_bytes += nbytes
        self._thin(entry)
        while self.snapshot_bytes > self.budget_bytes:
            self._forget(min(self.snaps, key=lambda s: s.last_used))

    def _hold(self, entry: Entry, snap: Snap) -> None:
        entry.points[snap.pos] = snap
        snap.holders.add(entry.slot)

    def _thin(self, entry: Entry) -> None:
        """At most points_per_sequence chunk-end snapshots a sequence: drop the one whose removal leaves
        the smallest gap (they stay spread over the sequence); prompt ends and cuts stay."""
        while True:
            chunks = sorted(p for p, s in entry.points.items() if s.kind == "chunk")
            if len(chunks) <= self.points_per_sequence:
                return
            ends = [0] + chunks  # the newest one stays (the next chunk end makes it an inner one)
            gap = min(range(1, len(chunks)), key=lambda i: ends[i + 1] - ends[i - 1])
            self._unhold(entry, chunks[gap - 1])

    def _unhold(self, entry: Entry, pos: int) -> None:
        snap = entry.points.pop(pos)
        snap.holders.discard(entry.slot)
        if not snap.holders and snap in self.snaps:
            self.snaps.discard(snap)
            self.snapshot_bytes -= snap.nbytes

    def _forget(self, snap: Snap) -> None:
        for slot in list(snap.holders):
            self._unhold(self.entries[slot], snap.pos)

    def _truncate(self, entry: Entry, n: int) -> None:
        entry.seq.truncate(n)
        for p in [p for p in entry.points if p > n]:
            self._unhold(entry, p)

    def _drop(self, slot: int) -> None:
        entry = self.entries.pop(slot, None)
        if entry is not None:
            for p in list(entry.points):
                self._unhold(entry, p)


def sequence_tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of the request's cached sequence, (prompt + response)[:past_len]: the prompt
    (its tail included, absolute alignment), then committed blocks (every token of one is in the response)."""
    P = req.prompt_len
    head = req.prompt_ids[start:min(end, P)] if start < P else []
    return head + req.response[max(start - P, 0):max(end - P, 0)]
