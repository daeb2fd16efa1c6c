"""FP8 weights written once, streamed tensor by tensor (STEP_GRAPH.md 4).

`quantize_weights` reads every FP8 GEMM weight of a checkpoint straight from
its memory-mapped shards -- one tensor at a time, one expert at a time for
the [E, out, in] expert tensors (fused or per-expert layout) -- and appends
the e4m3 bytes and fp32 per-output-channel scales to one file, `fp8.bin`,
with an index `fp8.json`. Both FP8 graphs of a build (fp32 and bf16
activations) link that one file: the FP8 weights are written once. The file
is written past the page cache (`direct_io.DirectWriter`): `build` writes it
in a thread beside its CPU-bound stages (`background.py`).
Memory stays bounded by one expert's (or one 2-D tensor's) fp32 copy.
All-zero data takes a fast path with the same result as the general one:
q = 0, scale 1 (`quantize.weight_scales`); a hole of a sparse file (a test
checkpoint) is recognised with SEEK_DATA without reading it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from clover_export.core.checkpoint import TensorLocation, TensorPlan
from clover_export.core.direct_io import DirectWriter
from clover_export.quantize.scales import quantize_weight

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


def _is_hole(path: Path, offset: int, length: int) -> bool:
    """True when [offset, offset + length) of the file is a hole (reads as zeros, nothing stored)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + length
    except OSError as e:  # ENXIO: no data after offset; EINVAL etc.: no SEEK_DATA here
        return e.errno == errno.ENXIO
    finally:
        os.close(fd)


def _read(loc: TensorLocation, rows: slice | None = None) -> torch.Tensor | None:
    """One tensor (or a leading-dim slice of it) from its shard, memory-mapped; float32 out; None when
    the bytes are a hole of a sparse file (all zero)."""
    from clover_export.exporter.weights import storage_dtype

    itemsize = np.dtype(storage_dtype(loc.dtype)).itemsize
    shape, offset = list(loc.shape), loc.offset
    if rows is not None:
        per = math.prod(shape[1:]) * itemsize
        offset += rows.start * per
        shape[0] = rows.stop - rows.start
    if _is_hole(loc.file, offset, math.prod(shape) * itemsize):
        return None
    arr = np.memmap(loc.file, dtype=storage_dtype(loc.dtype), mode="r", offset=offset, shape=tuple(shape))
    t = torch.from_numpy(np.array(arr))
    return t.view(torch.bfloat16).float() if loc.dtype == "BF16" else t.float()


def _pieces(plan: TensorPlan):
    """(shape, tensor or None if all zero) in bounded pieces along the leading dim: one expert at a time."""
    piece_shape = tuple(plan.shape[1:]) if len(plan.shape) == 3 else tuple(plan.shape)
    if not plan.fused:
        for grp in plan.parts:
            parts = [_read(loc) for loc in grp]
            yield piece_shape, None if all(p is None for p in parts) else torch.cat(
                [torch.zeros(loc.shape) if p is None else p for p, loc in zip(parts, grp)], dim=0)
        return
    loc = plan.parts[0][0]
    if len(plan.shape) == 3:
        for e in range(plan.shape[0]):
            t = _read(loc, slice(e, e + 1))
            yield piece_shape, None if t is None else t[0]
    else:
        yield piece_shape, _read(loc)


class Cancelled(Exception):
    """`quantize_weights` stopped by its `cancel` event (the build it ran beside failed or was interrupted)."""


def quantize_weights(plans: dict[str, TensorPlan], targets: list[str], out: Path,
                     progress: Callable | None = None, cancel=None) -> Fp8Weights:
    """Quantize `targets` (names of `plans`) into OUT/fp8.bin + fp8.json, atomically (module docstring).
    `cancel`: a `threading.Event` checked before each piece (tensor or expert); when set, nothing is left written."""
    from clover_export.core.atomic import replace_dir

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    index: dict[str, dict] = {}
    f = None
    try:
        f = DirectWriter(tmp / FP8_BIN)  # past the page cache: it is written beside CPU-bound stages (direct_io)

        def put(raw) -> int:
            f.zeros(-f.tell() % ALIGN)
            at = f.tell()
            write(raw)
            return at

        def write(raw) -> None:
            if isinstance(raw, int):  # that many zero bytes
                f.zeros(raw)
            else:
                f.write(raw)

        it = progress(targets) if progress else targets
        for name in it:
            plan = plans[name]
            start, scales = None, []
            for shape, piece in _pieces(plan):
                if cancel is not None and cancel.is_set():  # per piece: a stop waits for one expert at most
                    raise Cancelled(name)
                if piece is None or not piece.any():  # all zero: q = 0 and scale 1 (quantize.weight_scales)
                    raw, s = math.prod(shape), torch.ones(shape[:-1])
                else:
                    q, s = quantize_weight(piece)
                    raw = q.view(torch.uint8).numpy()
                if start is None:
                    start = put(raw)
                else:  # the next expert right after the previous one (one contiguous [E, out, in] tensor)
                    write(raw)
                scales.append(s.float())
            scale = torch.stack(scales) if len(plan.shape) == 3 else scales[0]
            raw = scale.numpy().astype(np.float32)
            index[name] = {"shape": list(plan.shape), "fp8": [start, math.prod(plan.shape)],
                           "scale": [put(raw), raw.nbytes, list(scale.shape)]}
        written = f.close()
        (tmp / FP8_INDEX).write_text(json.dumps({"tensors": index, "bytes_written": written}))
        replace_dir(tmp, out)
    except BaseException:
        try:
            if f is not None:
                f.abort()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Fp8Weights(out, index, written)
