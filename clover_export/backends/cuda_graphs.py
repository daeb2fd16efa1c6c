"""CUDA graphs of one step, one per step-shape bucket, captured at load and replayed (vLLM's / SGLang's
cudagraph runners).

A bucket is (batch rows, causal rows C); the block adds `block_size` rows.
A step of B <= batch rows and C <= causal rows runs in the smallest bucket
holding it: its inputs are copied into the bucket's static buffers, the
extra batch rows point at a scratch slot with no causal rows (they read and
write only that slot), the extra causal rows are padding (at or past
`n_causal`, never read; they select no expert), and the first B rows of the
static outputs are the step's. `logit_rows` is captured with block_size
columns (R = 1..block_size): the step's R columns, the rest 0, and the
first R rows of the static `causal_logits` are the step's; its indices are
clamped to the step's rows and its block rows moved to where the bucket
puts them, so a replay returns what the eager step does. Steps outside every
bucket (or R > block_size) are the caller's to run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from clover_export.core import names
from clover_export.core.errors import CloverError

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # captured up to the slot count (vLLM's sizes, in short)

# fn(inputs) -> (logits [B, N, V], coreset_size [B, layers], causal_logits [B, R, V]); the pools are bound inside fn
StepFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    causal: int  # C; the step has C + block_size rows per batch row

    def rows(self, block_size: int) -> int:
        return self.batch * (self.causal + block_size)


def default_buckets(max_batch: int, block_size: int, batch_sizes=None, causal_rows=None) -> list[Bucket]:
    """Batch sizes up to `max_batch` (by default 1, 2, 4, ... and max_batch itself; else the given ones that fit)
    x causal rows (by default 0 for denoise steps and block_size for commit + denoise steps and the
    self-speculative steps: their pending tokens plus draft are at most block_size rows, docs/decoding.md)."""
    given = list(batch_sizes or ())
    causal = sorted(set(causal_rows if causal_rows is not None else (0, block_size)))
    bad = [v for v in given if not isinstance(v, int) or v < 1] + [v for v in causal if not isinstance(v, int) or v < 0]
    if bad or not causal:
        raise CloverError("runtime", f"CUDA-graph buckets need batch sizes >= 1 and causal rows >= 0, got "
                          f"batch {given} causal {list(causal_rows or ())}")
    sizes = sorted({b for b in (given or BATCH_SIZES) if b <= max_batch} | (set() if given else {max_batch}))
    if not sizes:
        raise CloverError("runtime", f"no CUDA-graph batch size in {given} fits the {max_batch} slots",
                          "give graph_batch_sizes up to the slot count (max_slots)")
    return [Bucket(b, c) for b in sizes for c in causal]


def pick(buckets: list[Bucket], batch: int, causal: int, block_size: int) -> Bucket | None:
    """The bucket holding (batch, causal) with the fewest rows; None if none holds it."""
    fits = [b for b in buckets if b.batch >= batch and b.causal >= causal]
    return min(fits, key=lambda b: (b.rows(block_size), b)) if fits else None


class StepGraphs:
    """Static buffers and one captured graph per bucket, sharing one memory pool."""

    def __init__(self, fn: StepFn, buckets: list[Bucket], block_size: int, scratch_slot: int, device: torch.device):
        self.fn, self.block_size, self.scratch, self.device = fn, block_size, scratch_slot, device
        self.buckets = sorted(buckets, reverse=True)  # largest first: the smaller ones reuse its memory
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}

    def _static_inputs(self, b: Bucket) -> dict[str, torch.Tensor]:
        i32 = dict(dtype=torch.int32, device=self.device)
        return {
            names.INPUT_IDS: torch.zeros(b.batch, b.causal + self.block_size, **i32),
            names.N_CAUSAL: torch.zeros(b.batch, **i32),
            names.HAS_BLOCK: torch.zeros(b.batch, **i32),
            names.SLOT_IDS: torch.full((b.batch,), self.scratch, **i32),
            names.PAST_LEN: torch.zeros(b.batch, **i32),
            names.LOGIT_ROWS: torch.zeros(b.batch, self.block_size, **i32),
        }

    def capture(self, progress: bool = True, warmup: int = 2) -> None:
        """Warm up (compiles the kernels) and capture every bucket; only the scratch slot is touched."""
        from tqdm.auto import tqdm

        pool = torch.cuda.graph_pool_handle()
        for b in tqdm(self.buckets, desc="capturing CUDA graphs", unit="graph", disable=not progress):
            static = self._static_inputs(b)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.fn(static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.fn(static)
            self.graphs[b] = (graph, static, out)
        torch.cuda.synchronize(self.device)

    def bucket_for(self, batch: int, causal: int, logit_rows: int = 1) -> Bucket | None:
        """The bucket of a step of `batch` rows x `causal` causal rows asking for `logit_rows` rows' logits."""
        if logit_rows > self.block_size:
            return None
        return pick(list(self.graphs), batch, causal, self.block_size)

    def replay(self, b: Bucket, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy the step into bucket b's buffers, replay, return the first B rows of its outputs (views; of
        `causal_logits` the first R, R the step's `logit_rows` columns, 1 when it has none)."""
        graph, static, (logits, coreset, causal) = self.graphs[b]
        ids = inputs[names.INPUT_IDS]
        B, T = ids.shape
        C = T - self.block_size
        sids = static[names.INPUT_IDS]
        sids.zero_()
        sids[:B, :C].copy_(ids[:, :C])
        sids[:B, b.causal:].copy_(ids[:, C:])
        for name, fill in (
            (names.N_CAUSAL, 0),
            (names.HAS_BLOCK, 0),
            (names.SLOT_IDS, self.scratch),
            (names.PAST_LEN, 0),
        ):
            static[name][B:].fill_(fill)
            static[name][:B].copy_(inputs[name])
        R = self._logit_rows(static[names.LOGIT_ROWS], inputs.get(names.LOGIT_ROWS), B, C, b.causal)
        graph.replay()
        return logits[:B], coreset[:B], causal[:B, :R]

    def _logit_rows(self, dst: torch.Tensor, rows: torch.Tensor | None, B: int, C: int, bucket_c: int) -> int:
        """Fill the static `logit_rows` [batch, block_size] from the step's [B, R] (None: row 0); returns R.
        Indices are clamped to the step's C + block_size rows, as the eager step clamps them, and those
        naming block rows (>= C) moved to where the bucket's block starts (bucket_c)."""
        dst.zero_()
        if rows is None:
            return 1
        r = rows.to(torch.int32).clamp(0, C + self.block_size - 1)
        dst[:B, :r.shape[1]].copy_(torch.where(r >= C, r + (bucket_c - C), r))
        return r.shape[1]
