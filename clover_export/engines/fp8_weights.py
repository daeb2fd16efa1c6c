"""FP8 weights written once, streamed tensor by tensor (STEP_GRAPH.md 4; issue 11).

`quantize_weights` reads every FP8 GEMM weight of a checkpoint straight from
its memory-mapped shards -- one tensor at a time, one expert at a time for
the [E, out, in] expert tensors (fused or per-expert layout) -- and appends
the e4m3 bytes and fp32 per-output-channel scales to one file, `fp8.bin`,
with an index `fp8.json`. Both FP8 graphs of a build (fp32 and bf16
activations) link that one file: the FP8 weights are written once.
Memory stays bounded by one expert's (or one 2-D tensor's) fp32 copy.
All-zero data (a sparse test checkpoint) takes a fast path with the same
result as the general one: q = 0, scale 1 (`quantize.weight_scales`).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from clover_export.checkpoint import TensorLocation, TensorPlan
from clover_export.engines.quantize import FP8_DTYPE, quantize_weight

FP8_BIN = "fp8.bin"
FP8_INDEX = "fp8.json"
ALIGN = 4096


@dataclass
class Fp8Weights:
    dir: Path
    index: dict[str, dict]  # weight name -> {"shape", "fp8": [offset, length], "scale": [offset, length, shape]}
    bytes_written: int

    @property
    def bin(self) -> Path:
        return self.dir / FP8_BIN


def load_fp8_weights(folder: Path) -> Fp8Weights:
    index = json.loads((folder / FP8_INDEX).read_text())
    return Fp8Weights(folder, index["tensors"], index["bytes_written"])


def fp8_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """What `quantize_weights` writes for these tensors: e4m3 bytes + fp32 scales, page-aligned."""
    total = 0
    for s in shapes.values():
        for n in (math.prod(s), 4 * math.prod(s[:-1])):
            total += n + (-n) % ALIGN
    return total


def _read(loc: TensorLocation, rows: slice | None = None) -> torch.Tensor:
    """One tensor (or a leading-dim slice of it) from its shard, memory-mapped; float32 out."""
    from clover_export.exporter.weights import storage_dtype

    itemsize = np.dtype(storage_dtype(loc.dtype)).itemsize
    shape, offset = list(loc.shape), loc.offset
    if rows is not None:
        per = math.prod(shape[1:]) * itemsize
        offset += rows.start * per
        shape[0] = rows.stop - rows.start
    arr = np.memmap(loc.file, dtype=storage_dtype(loc.dtype), mode="r", offset=offset, shape=tuple(shape))
    if not arr.any():  # all-zero (sparse) data: no conversion needed
        return torch.zeros(shape)
    t = torch.from_numpy(np.array(arr))
    return t.view(torch.bfloat16).float() if loc.dtype == "BF16" else t.float()


def _pieces(plan: TensorPlan):
    """The tensor in bounded pieces along its leading dim: one expert at a time for [E, out, in]."""
    if not plan.fused:
        for grp in plan.parts:
            yield torch.cat([_read(loc) for loc in grp], dim=0)
        return
    loc = plan.parts[0][0]
    if len(plan.shape) == 3:
        for e in range(plan.shape[0]):
            yield _read(loc, slice(e, e + 1))[0]
    else:
        yield _read(loc)


def quantize_weights(plans: dict[str, TensorPlan], targets: list[str], out: Path,
                     progress: Callable | None = None) -> Fp8Weights:
    """Quantise `targets` (names of `plans`) into OUT/fp8.bin + fp8.json, atomically (module docstring)."""
    from clover_export.atomic import replace_dir

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    index: dict[str, dict] = {}
    try:
        with open(tmp / FP8_BIN, "wb") as f:
            def put(raw: bytes) -> int:
                f.write(b"\0" * ((-f.tell()) % ALIGN))
                at = f.tell()
                f.write(raw)
                return at

            it = progress(targets) if progress else targets
            for name in it:
                plan = plans[name]
                start, scales = None, []
                for piece in _pieces(plan):
                    if not piece.any():  # all zero: q = 0 and scale 1 (quantize.weight_scales)
                        q = torch.zeros(piece.shape, dtype=FP8_DTYPE)
                        s = torch.ones(piece.shape[:-1])
                    else:
                        q, s = quantize_weight(piece)
                    at = put(q.view(torch.uint8).numpy().tobytes()) if start is None else _append(f, q)
                    start = at if start is None else start
                    scales.append(s.float())
                scale = torch.stack(scales) if len(plan.shape) == 3 else scales[0]
                raw = scale.numpy().astype(np.float32).tobytes()
                index[name] = {"shape": list(plan.shape), "fp8": [start, math.prod(plan.shape)],
                               "scale": [put(raw), len(raw), list(scale.shape)]}
            written = f.tell()
        (tmp / FP8_INDEX).write_text(json.dumps({"tensors": index, "bytes_written": written}))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Fp8Weights(out, index, written)


def _append(f, q: torch.Tensor) -> int:
    """Next expert right after the previous one (one contiguous [E, out, in] tensor)."""
    at = f.tell()
    f.write(q.view(torch.uint8).numpy().tobytes())
    return at
