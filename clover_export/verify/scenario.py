"""What validation plays: the steps, their inputs, the cache pools, and playing them (STEP_GRAPH.md 2).

Polygraphy's data loader and `Comparator.run` in one: a scenario is a list of
step feeds plus the pools a runtime would hand over; `play` runs them through
one runner with its own pools carried from step to step.

The steps, at the shapes the graph runs with: as many batch rows as the
profiles allow (slots in descending order, one slot owned by no row), a full
prefill chunk (the manifest's `chunk` causal rows; odd rows fold a shorter
last chunk with a block), a prefill chunk + block next to a block-only row,
commits folded with the next block, a step with no causal rows at all
(T = block_size), and rows in different phases. Every step asks for the
next-token logits of a few rows (`logit_rows`, `logit_rows_for`): each
row's last valid causal row and others before it, block rows, and one past
the step's rows (clamped by the graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from clover_export.artifact.manifest import Artifact
from clover_export.core import names
from clover_export.verify.runners import to_numpy

NUM_SLOTS = 3  # pool slots of the default 2-row scenario (rows in slots 2 and 0; slot 1 must stay untouched)


def slots_for(batch: int) -> list[int]:
    """Slot of each batch row in a pool of batch + 1 slots: descending, slot 1 left out (a graph that
    writes a slot no row owns, or reads slots in row order, shows up). 2 rows: slots 2 and 0."""
    return [s for s in range(batch, -1, -1) if s != 1]


@dataclass
class StepPlan:
    name: str
    causal_rows: int  # C of this step
    rows: list[tuple[int, int]]  # per batch row: (n_causal, has_block)


def scenario(block_size: int, chunk: int, batch: int = 2) -> list[StepPlan]:
    """The steps validate plays, at the shapes the graph runs with (STEP_GRAPH.md 2: a full prefill chunk of
    `chunk` causal rows, and `batch` rows, the profiles' largest). Per-row patterns repeat over the rows."""
    N, c = block_size, chunk
    steps = [
        ("full prefill chunk; odd rows fold a shorter last chunk with a block", c, [(c, 0), (max(c - 5, 0), 1)]),
        ("prefill + block | block only", N, [(N - 3, 1), (0, 1)]),
        ("commit folded with the next block (all rows)", N, [(N, 1), (N, 1)]),
        ("block only, no causal rows (T = block_size)", 0, [(0, 1), (0, 1)]),
        ("block only | commit + block", N, [(0, 1), (N, 1)]),
    ]
    return [StepPlan(name, C, [rows[i % 2] for i in range(batch)]) for name, C, rows in steps]


def profile_batch(art: Artifact) -> int:
    """The largest batch any optimisation profile of the manifest allows (export.profiles)."""
    return art.manifest.max_batch


LOGIT_ROWS = 4  # R of the scenario's steps


def logit_rows_for(n_causal: list[int], causal_rows: int, block_size: int, rng) -> np.ndarray:
    """[B, LOGIT_ROWS] int32 naming rows the step computes (valid causal rows, else block rows; padding causal
    rows are no backend's contract): per batch row its last valid causal row, a random earlier one, row 0,
    and one past the step's rows (the graph clamps it to the last block row) or a random block row. A row
    without valid causal rows names block rows instead."""
    C, N = causal_rows, block_size
    out = np.zeros((len(n_causal), LOGIT_ROWS), np.int32)
    for b, n in enumerate(n_causal):
        some = int(rng.integers(0, n)) if n else C + int(rng.integers(0, N))
        extra = C + N + 3 if b % 2 == 0 else C + int(rng.integers(0, N))
        out[b] = [n - 1 if n else C, some, 0 if n else C, extra]
    return out


def make_feeds(plans: list[StepPlan], cfg, block_size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Step inputs (int32) for the plans; past_len follows each row's committed rows."""
    rng = np.random.default_rng(seed)
    past = [0] * len(plans[0].rows)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else 0
    feeds = []
    for p in plans:
        B = len(p.rows)
        ids = rng.integers(0, cfg.vocab_size, size=(B, p.causal_rows + block_size), dtype=np.int64)
        ids[:, p.causal_rows:][rng.random((B, block_size)) < 0.5] = mask  # partly masked blocks
        feeds.append({
            names.INPUT_IDS: ids.astype(np.int32),
            names.N_CAUSAL: np.array([r[0] for r in p.rows], np.int32),
            names.HAS_BLOCK: np.array([r[1] for r in p.rows], np.int32),
            names.SLOT_IDS: np.array(slots_for(B), np.int32),
            names.PAST_LEN: np.array(past, np.int32),
            names.LOGIT_ROWS: logit_rows_for([r[0] for r in p.rows], p.causal_rows, block_size, rng),
        })
        past = [a + r[0] for a, r in zip(past, p.rows)]
    return feeds


def pool_len(plans: list[StepPlan], block_size: int) -> int:
    """Cache positions the plans need: every step's causal rows, then one block."""
    return sum(p.causal_rows for p in plans) + block_size


def initial_pools(art: Artifact, num_slots: int, length: int, seed: int = 1) -> dict[str, np.ndarray]:
    """Pools as a runtime would hand them over: allocated once; filled with noise, so a graph that reads
    beyond past_len or writes outside its rows shows up."""
    from clover_export.model.model import pool_dtype, pool_shape

    rng = np.random.default_rng(seed)
    dtype = torch.bfloat16 if art.dtype == "bf16" else torch.float32
    out = {}
    for name in names.pool_names(art.config):
        t = torch.from_numpy(rng.standard_normal(pool_shape(art.config, name, num_slots, length), np.float32) * 0.5)
        out[name] = to_numpy(t.to(pool_dtype(name, dtype)))
    return out


def small_step(art: Artifact, seed: int = 5):
    """One step of 1 row (slot 1 of 2): 3 causal rows + a block, inputs from `seed`, pools from `seed + 1`."""
    plans = [StepPlan("small", 3, [(3, 1)])]
    feeds = make_feeds(plans, art.config, art.block_size, seed=seed)
    feeds[0][names.SLOT_IDS] = np.array([1], np.int32)
    return feeds, initial_pools(art, 2, 3 + art.block_size, seed=seed + 1)


def play(runner, feeds: list[dict], pools: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """All steps with the runner's own pools carried from step to step; returns each step's outputs."""
    pools = dict(pools)
    results = []
    for f in feeds:
        out = runner.run({**f, **pools})
        pools = {p: out[names.present_name(p)] for p in pools}
        results.append(out)
    return results
