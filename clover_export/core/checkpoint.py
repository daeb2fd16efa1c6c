"""Safetensors checkpoints: read (memory-mapped, checked), and write (shards + index, atomically).

MODEL.md 3. Headers are parsed here (8-byte length + JSON, a few lines) so that
a corrupt or truncated shard gives an error naming the file and tensor; the
data itself is memory-mapped through `safetensors.safe_open`.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_export.core import names
from clover_export.core.atomic import replace_dir
from clover_export.core.config import CloverConfig, read_json
from clover_export.core.errors import CloverError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
SAFETENSORS_DTYPE = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes are: file, absolute byte offset and length."""

    file: Path
    stored_name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, = 8 + header length + data offset
    length: int


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Parse and check one safetensors file's header; no tensor data is read."""

    def corrupt(why: str) -> CloverError:
        return CloverError("checkpoint", f"{path}: {why}", "the file is corrupt or truncated; download it again")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise corrupt("shorter than the 8-byte safetensors header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise corrupt(f"header length {n} exceeds the file size {size}")
            raw = f.read(n)
    except OSError as e:
        raise CloverError("checkpoint", f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise corrupt(f"safetensors header is not valid JSON ({e})") from None
    data_start, data_size = 8 + n, size - 8 - n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"header entry for tensor '{key}' is malformed") from None
        if dtype not in DTYPE_BYTES:
            raise corrupt(f"tensor '{key}' has unknown dtype {dtype!r}")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype] or begin < 0:
            raise corrupt(f"tensor '{key}' byte range {begin}..{end} does not match {dtype}{list(shape)}")
        if end > data_size:
            raise corrupt(f"tensor '{key}' ends at byte {end} but the data section has {data_size} bytes (truncated)")
        out[key] = TensorLocation(path, key, dtype, shape, data_start + begin, end - begin)
    return out


def shard_files(model_dir: Path) -> list[Path]:
    """The shard files of a checkpoint folder, from the index or the single file."""
    index = model_dir / INDEX_FILE
    if index.exists():
        data = read_json(index, "checkpoint")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CloverError("checkpoint", f"{index}: has no 'weight_map' object")
        files = []
        for fname in sorted(set(weight_map.values())):
            p = model_dir / fname
            # symlinks are fine for reading (HF cache layout); paths that leave the folder are not
            if not isinstance(fname, str) or Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise CloverError("checkpoint", f"{index}: shard path {fname!r} points outside {model_dir}")
            if not p.exists():
                raise CloverError("checkpoint", f"{index}: names shard {fname!r}, which does not exist in {model_dir}")
            files.append(p)
        return files
    single = model_dir / SINGLE_FILE
    if single.exists():
        return [single]
    if not model_dir.is_dir():
        raise CloverError("checkpoint", f"{model_dir}: no such model folder")
    raise CloverError("checkpoint", f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def locate_tensors(model_dir: str | Path) -> dict[str, TensorLocation]:
    """Canonical name -> location for every tensor of the checkpoint (ignored ones dropped)."""
    out: dict[str, TensorLocation] = {}
    for f in shard_files(Path(model_dir)):
        for stored, loc in read_header(f).items():
            name = names.canonical_name(stored)
            if name is not None:
                out[name] = loc
    return out


@dataclass(frozen=True)
class TensorPlan:
    """How to build one canonical tensor: from one location, or by stacking per-expert ones."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[tuple[TensorLocation, ...], ...]  # one tuple of locations per expert (fused: a single one)
    fused: bool


def plan_tensors(cfg: CloverConfig, locs: dict[str, TensorLocation], allow_qwen: bool = False) -> dict[str, TensorPlan]:
    """Check every tensor against the config; one error listing every problem (MODEL.md 3)."""
    has_clover = any(n in locs for n in names.clover_tensor_names(cfg))
    clover = cfg.is_clover or has_clover
    if not clover and not allow_qwen:
        raise CloverError(
            "checkpoint",
            f"{cfg.source}: a plain Qwen3.5-MoE checkpoint (no Clover block-mixer tensors)",
            "pass --allow-qwen (allow_qwen=True) to zero-fill them; "
            "diffusion decoding is then meaningless, causal mode stays exact",
        )
    expected = names.expected_tensors(cfg, clover=clover)
    missing, shapes, dtypes = [], [], []
    used: set[str] = set()
    plans: dict[str, TensorPlan] = {}
    for name, shape in expected.items():
        if name in locs:
            groups = ((locs[name],),)
            used.add(name)
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            per = names.per_expert_names(name, cfg.num_experts)
            absent = [n for grp in per for n in grp if n not in locs]
            if absent:
                missing.append(
                    name if len(absent) == sum(map(len, per)) else f"{absent[0]} (and {len(absent) - 1} more)"
                )
                continue
            groups = tuple(tuple(locs[n] for n in grp) for grp in per)
            used.update(n for grp in per for n in grp)
            part_rows = shape[1] // len(per[0])
            for grp in groups:
                for loc in grp:
                    if loc.shape != (part_rows, shape[2]):
                        shapes.append(f"{loc.stored_name}: {list(loc.shape)}, expected {[part_rows, shape[2]]}")
        else:
            missing.append(name)
            continue
        if len(groups) == 1 and groups[0][0].shape != shape:
            shapes.append(f"{groups[0][0].stored_name}: {list(groups[0][0].shape)}, expected {list(shape)}")
        for grp in groups:
            for loc in grp:
                if loc.dtype not in names.FLOAT_DTYPES:
                    dtypes.append(f"{loc.stored_name}: {loc.dtype}, expected one of {', '.join(names.FLOAT_DTYPES)}")
        plans[name] = TensorPlan(name, shape, groups, fused=len(groups) == 1)
    unexpected = sorted(set(locs) - used)
    problems = (
        [f"missing: {m}" for m in missing]
        + [f"wrong shape: {s}" for s in shapes]
        + [f"wrong dtype: {d}" for d in dtypes]
        + [f"unexpected: {u}" for u in unexpected]
    )
    if problems:
        shown = problems[:40] + ([f"... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise CloverError(
            "checkpoint",
            f"{len(problems)} problem(s) with the checkpoint for {cfg.source}:\n  - " + "\n  - ".join(shown),
        )
    if not clover:
        warnings.warn(
            "plain Qwen3.5-MoE checkpoint: Clover block-mixer tensors zero-filled; "
            "diffusion decoding is meaningless for this model (causal mode is exact)",
            stacklevel=2,
        )
    return plans


class TensorReader:
    """Memory-mapped access to planned tensors; files are opened once."""

    def __init__(self):
        from safetensors import safe_open

        self._open = safe_open
        self._handles: dict[Path, object] = {}

    def close(self) -> None:
        """Drop the open shards: their mapped pages stop counting in this process's RSS (a streamed pass over
        the 69 GB checkpoint otherwise ends with every page it touched mapped: 15 GiB RssFile seen)."""
        self._handles.clear()

    def _get(self, loc: TensorLocation) -> torch.Tensor:
        h = self._handles.get(loc.file)
        if h is None:
            h = self._handles[loc.file] = self._open(str(loc.file), framework="pt")
        try:
            return h.get_tensor(loc.stored_name)
        except Exception as e:  # safetensors raises its own error types
            raise CloverError("checkpoint", f"{loc.file}: cannot read tensor '{loc.stored_name}' ({e})") from None

    def read(self, plan: TensorPlan) -> torch.Tensor:
        if plan.fused:
            return self._get(plan.parts[0][0])
        out = None
        for e, grp in enumerate(plan.parts):  # per-expert pieces copied once into the fused tensor
            row = 0
            for loc in grp:
                t = self._get(loc)
                if out is None:
                    out = torch.empty(plan.shape, dtype=t.dtype)
                out[e, row:row + t.shape[0]].copy_(t)
                row += t.shape[0]
        return out


def load_state_dict(
    model_dir: str | Path, cfg: CloverConfig, dtype: torch.dtype | None = None, allow_qwen: bool = False
) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (memory-mapped where no conversion is needed)."""
    plans = plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=allow_qwen)
    reader = TensorReader()
    out = {}
    for name, plan in plans.items():
        t = reader.read(plan)
        out[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
    for name in names.clover_tensor_names(cfg):
        if name not in out:  # opted-in plain Qwen checkpoint: zero-fill
            shape = names.expected_tensors(cfg)[name]
            out[name] = torch.zeros(shape, dtype=dtype or torch.bfloat16)
    return out


def save_checkpoint(
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    max_shard_bytes: int = 2 * 1024**3,
    per_expert: bool = False,
    prefix: str = names.TEXT_PREFIX,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write tensors as safetensors shards + index, atomically (temp folder, then rename).

    `per_expert` splits fused expert tensors into the per-expert layout;
    `prefix` replaces the canonical `model.` (e.g. `model.language_model.`);
    `extra_files` maps file name -> text (config.json, ...).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if per_expert and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            for j, grp in enumerate(names.per_expert_names(name, t.shape[0])):
                for part, piece in zip(grp, t[j].chunk(len(grp), dim=0)):
                    tensors[part] = piece
        else:
            tensors[name] = t
    tensors = {(prefix + n[len(names.TEXT_PREFIX):] if n.startswith(names.TEXT_PREFIX) else n): t.contiguous()
               for n, t in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
