"""Weights as external data (STEP_GRAPH.md 3): link, map or copy the checkpoint, never load it.

Every canonical tensor the graph references becomes an initializer whose
external data is (location, offset, length) inside a safetensors shard:
- `link`: the shards are reflinked into `weights/` where the filesystem can
  (zero bytes copied); else copied when the checkpoint is small (`artifact.COPY_BELOW`),
  else hard-linked (zero bytes copied, but onnx >= 1.21 refuses hard links:
  `READERS`, docs/exports.md); a symlinked shard (Hugging Face cache) is
  resolved first.
- `map`: nothing is linked; `weights.json` names the shards in place and
  `exporter.session.ort_session` feeds their memory-mapped bytes to ONNX Runtime.
- `copy`: the shards are copied into `weights/` (a self-contained folder).
Tensors whose stored dtype differs from the graph's (fp32 graphs of a bf16
checkpoint, F32-stored norms in a bf16 graph) are referenced as stored and
cast inside the graph (`<name>__<stored dtype>` -> Cast -> `<name>`): no
weight is ever converted into a new file, so an fp32 graph of the 35B model
costs no disk. Per-expert checkpoints keep their per-expert
initializers; the fused tensor is a Concat + Reshape of them (then one Cast).
Only zero-filled tensors (plain Qwen checkpoints opted in) are written, into
`weights/converted.bin`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from clover_export.artifact import manifest as A
from clover_export.core import names
from clover_export.core.checkpoint import SAFETENSORS_DTYPE, TensorLocation, TensorPlan, TensorReader
from clover_export.core.errors import CloverError

WEIGHTS_DIR = "weights"
CONVERTED = "converted.bin"
ALIGN = 4096  # converted tensors start on page boundaries (memory-mappable)
FICLONE = 0x40049409  # linux/fs.h: reflink a whole file

_ONNX = {"BF16": TensorProto.BFLOAT16, "F16": TensorProto.FLOAT16, "F32": TensorProto.FLOAT}
_STORAGE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def onnx_elem_type(st_dtype: str) -> int:
    return _ONNX[st_dtype]


def stored_name(name: str, st_dtype: str) -> str:
    """The initializer holding a tensor in its stored dtype, cast in the graph to `name` (module docstring)."""
    return f"{name}__{st_dtype.lower()}"


def logical_name(name: str) -> str:
    """Inverse of `stored_name`: the tensor an initializer holds, whatever dtype it is stored in."""
    for st in _ONNX:
        suffix = f"__{st.lower()}"
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def storage_dtype(st_dtype: str):
    """numpy dtype with the stored item size (bf16 as uint16: numpy has no bfloat16)."""
    return _STORAGE[st_dtype]


# --- who reads an export's external data (docs/exports.md) ---------------------------------
# Placement of a shard: "reflink" | "copy" (a regular file with one link: every reader accepts it),
# "hardlink" (onnx >= 1.21 refuses any external-data file with more than one link, in onnx.load and in
# onnx.checker by path; ONNX Runtime >= 1.24 only checks that the file resolves inside the folder;
# TensorRT's parser opens it relative to the graph, refusing only '../'), "mapped" (`map` mode: the
# file is not in the folder, only `exporter.session.ort_session` supplies the bytes).
READERS = {  # key -> (short name, what the user runs)
    "onnx": ("onnx.load / onnx.checker", "onnx.load(path) and onnx.checker.check_model(path)"),
    "polygraphy-onnx": ("polygraphy inspect model", "polygraphy inspect model, and polygraphy run options that "
                        "load the model through onnx (--shape-inference, --onnx-outputs, --save-onnx)"),
    "onnxruntime": ("ONNX Runtime", "ONNX Runtime's InferenceSession(path) and polygraphy run --onnxrt"),
    "tensorrt": ("TensorRT", "TensorRT's ONNX parser from a file (trtexec --onnx, polygraphy run --trt)"),
}
REFUSED_BY = {
    "reflink": (), "copy": (),
    "hardlink": ("onnx", "polygraphy-onnx"),
    "mapped": tuple(READERS),
}
REMEDY = {
    "hardlink": "export with --weights copy for a folder every tool loads; for the graph alone use "
                "onnx.load(path, load_external_data=False) or polygraphy inspect model --ignore-external-data; "
                "`clover-export check DIR` runs onnx.checker (full check) on the graph",
    "mapped": "export with --weights link or copy; in Python, "
              "clover_export.exporter.session.ort_session(load_artifact(DIR)) feeds the mapped weights to ONNX Runtime",
}


def refused_by(placement: str, short: bool = False) -> list[str]:
    """What the user runs that refuses a folder whose shards are placed so (`READERS`)."""
    return [READERS[k][0 if short else 1] for k in REFUSED_BY[placement]]


def read_by(placement: str, short: bool = False) -> list[str]:
    return [v[0 if short else 1] for k, v in READERS.items() if k not in REFUSED_BY[placement]]


def hardlink_warning(shard_bytes: int) -> str:
    """The one line `export` prints when it hard-linked the checkpoint (docs/exports.md)."""
    return (f"weights/ holds hard links to the checkpoint (no reflinks on this filesystem; {_size(shard_bytes)} is "
            f"above the {_size(A.COPY_BELOW)} copied by default): {' and '.join(read_by('hardlink', short=True))} "
            f"read them, onnx >= 1.21 refuses them (\"potential hardlink attack\": "
            f"{', '.join(refused_by('hardlink', short=True))}). Use --weights copy for a folder every tool loads, or "
            f"onnx.load(path, load_external_data=False) for the graph alone; `clover-export check DIR` says more "
            f"(docs/exports.md)")


def _size(n: int) -> str:
    return f"{round(n / 2**30, 1):g} GiB" if n >= 2**30 else f"{round(n / 2**20, 1):g} MiB"


def shard_bytes(plans) -> int:
    """Size of the checkpoint files the tensor plans reference (what `link` would copy)."""
    files = {loc.file.resolve() for plan in plans for grp in plan.parts for loc in grp}
    return sum(f.stat().st_size for f in files)


@dataclass
class WeightReport:
    requested: str
    mode: str  # the mode used
    messages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the messages a user must not miss (also in `messages`)
    link_kind: dict[str, str] = field(default_factory=dict)  # shard -> "reflink" | "hardlink" | "copy" | "mapped"
    bytes_referenced: int = 0  # weight bytes the graph reads from the checkpoint (not written)
    bytes_copied: int = 0
    bytes_converted: int = 0
    converted: list[str] = field(default_factory=list)
    cast_in_graph: int = 0  # tensors referenced in their stored dtype and cast by a graph node

    @property
    def weight_bytes_written(self) -> int:
        return self.bytes_copied + self.bytes_converted

    @property
    def placement(self) -> str:
        """How the shards were placed: "reflink" | "copy" | "hardlink" | "mapped" (joined by "+" when mixed;
        "none" when every tensor was converted)."""
        return "+".join(sorted(set(self.link_kind.values()))) or "none"

    def warn(self, text: str) -> None:
        self.messages.append(text)
        self.warnings.append(text)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "requested": self.requested, "placement": self.placement,
            "messages": self.messages, "warnings": self.warnings,
            "shards": self.link_kind, "bytes_referenced": self.bytes_referenced,
            "bytes_copied": self.bytes_copied, "bytes_converted": self.bytes_converted,
            "weight_bytes_written": self.weight_bytes_written, "converted": self.converted,
            "cast_in_graph": self.cast_in_graph,
        }


# --- putting shard files into the output folder ------------------------------------
def reflink(src: Path, dst: Path) -> None:
    """Copy-on-write clone (btrfs, xfs, ...); raises OSError where unsupported."""
    with open(src, "rb") as s, open(dst, "wb") as d:
        try:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        except OSError:
            d.close()
            os.unlink(dst)
            raise


def hardlink(src: Path, dst: Path) -> None:
    os.link(src, dst)


def link_file(src: Path, dst: Path, copy: bool = False) -> str:
    """Reflink, else (with `copy`: the caller's files are small, `A.COPY_BELOW`) copy, else hard-link `src`
    (already resolved) to `dst`: "reflink" | "copy" | "hardlink"; OSError if none can be made."""
    try:
        reflink(src, dst)
        return "reflink"
    except OSError:
        pass
    if copy:
        copy_file(src, dst)
        return "copy"
    hardlink(src, dst)
    return "hardlink"


def copy_file(src: Path, dst: Path) -> int:
    shutil.copyfile(src, dst)
    return dst.stat().st_size


class WeightWriter:
    """Builds the initializers, Concat nodes and weight map for one export into `folder`.

    `checkpoint_bytes`: the size of the shards the export references (`shard_bytes`), which decides
    between a copy and a hard link in `link` mode where no reflink can be made."""

    def __init__(self, folder: Path, mode: str, graph_dtype: torch.dtype, checkpoint_bytes: int = 0):
        self.folder = folder
        self.checkpoint_bytes = checkpoint_bytes
        self.report = WeightReport(requested=mode, mode=mode)
        self.dtype = SAFETENSORS_DTYPE[graph_dtype]
        self.graph_dtype = graph_dtype
        self.files: dict[Path, str] = {}  # resolved shard -> location relative to the folder (or absolute, map)
        self.initializers: list[TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.weight_map: dict[str, dict] = {}
        self._reader = TensorReader()
        self._converted = None
        (folder / WEIGHTS_DIR).mkdir(parents=True, exist_ok=True)

    # --- files -------------------------------------------------------------------
    def _place(self, shard: Path) -> str:
        """Location of a shard for the graph (placing it per the mode on first use)."""
        real = shard.resolve()
        if real in self.files:
            return self.files[real]
        rel = f"{WEIGHTS_DIR}/{real.name}"
        if rel in self.files.values():
            raise CloverError("weights", f"two shards are both named {real.name}", "shard file names must be unique")
        if shard.is_symlink() and self.report.mode != "map":
            self.report.messages.append(
                f"{shard.name} is a symlink (Hugging Face cache layout) to {real}; onnx cannot reference symlinks, "
                f"so its target is placed in {WEIGHTS_DIR}/ instead"
            )
        if self.report.mode == "link":
            try:
                self.report.link_kind[real.name] = self._link(real, self.folder / rel)
            except OSError as e:
                self._fall_back_to_map(real, e)
        if self.report.mode == "copy":
            self.report.bytes_copied += copy_file(real, self.folder / rel)
            self.report.link_kind[real.name] = "copy"
        if self.report.mode == "map":
            self.report.link_kind[real.name] = "mapped"
            self.files[real] = str(real)
        else:
            self.files[real] = rel
        return self.files[real]

    def _link(self, real: Path, dst: Path) -> str:
        """`--weights link` for one shard: a reflink where the filesystem makes one (a plain file to every
        reader, zero bytes copied); else a copy when the checkpoint is small (`A.COPY_BELOW`: loads in every
        tool); else a hard link (zero copy, refused by onnx: `REFUSED_BY`). OSError when no hard link can be
        made (another filesystem): the caller falls back to `map`. A failing copy raises from here."""
        how = link_file(real, dst, copy=self.checkpoint_bytes <= A.COPY_BELOW)
        if how == "copy":
            self.report.bytes_copied += dst.stat().st_size
        return how

    def _fall_back_to_map(self, real: Path, e: OSError) -> None:
        why = "the output is on another filesystem" if e.errno == errno.EXDEV else (e.strerror or str(e))
        self.report.warn(
            f"cannot link {real} into {self.folder.name}/ ({why}); falling back to --weights map: the graph "
            f"reads the checkpoint in place through weights.json "
            f"(ONNX Runtime: clover_export.exporter.session.ort_session). "
            f"Use --weights copy for a self-contained folder, or export onto the checkpoint's filesystem"
        )
        rel_to_real = {rel: real for real, rel in self.files.items()}
        for rel, real in rel_to_real.items():  # shards linked before the failure go: one mode per export
            (self.folder / rel).unlink(missing_ok=True)
            self.files[real] = str(real)
        for entry in self.weight_map.values():
            if not entry["converted"]:
                entry["file"] = str(rel_to_real[entry["file"]])
        self.report.mode = "map"
        self.report.link_kind = {k: "mapped" for k in self.report.link_kind}

    # --- tensors -----------------------------------------------------------------
    def add(self, plan: TensorPlan) -> None:
        """Initializer(s) for one canonical tensor (plus Concat + Reshape for per-expert checkpoints)."""
        if plan.fused:
            self._initializer(plan.name, plan.parts[0][0])
            return
        stored = {loc.dtype for grp in plan.parts for loc in grp}
        st = stored.pop() if len(stored) == 1 else self.dtype
        pieces = []
        for grp in plan.parts:
            for loc in grp:
                name = names.canonical_name(loc.stored_name)
                self._initializer(name, loc, keep_dtype=st)
                pieces.append(name)
        cat = f"{plan.name}__concat"
        shape = f"{plan.name}__shape"
        fused = plan.name if st == self.dtype else stored_name(plan.name, st)
        self.initializers.append(helper.make_tensor(shape, TensorProto.INT64, [len(plan.shape)], list(plan.shape)))
        self.nodes.append(helper.make_node("Concat", pieces, [cat], axis=0, name=f"{plan.name}/fuse_experts"))
        self.nodes.append(helper.make_node("Reshape", [cat, shape], [fused], name=f"{plan.name}/fuse_experts_shape"))
        if fused != plan.name:
            self._cast(fused, plan.name)

    def add_zeros(self, name: str, shape: tuple[int, ...]) -> None:
        """A zero tensor (plain Qwen checkpoint opted in: the Clover block-mixer tensors)."""
        self._converted_entry(name, torch.zeros(shape, dtype=self.graph_dtype))

    def _initializer(self, name: str, loc: TensorLocation, keep_dtype: str | None = None) -> None:
        """An initializer referencing the stored bytes; cast in the graph where the stored dtype differs
        (unless `keep_dtype`: per-expert pieces are cast once, after their Concat)."""
        init = name
        if loc.dtype != self.dtype and keep_dtype != loc.dtype:
            init = stored_name(name, loc.dtype)
            self._cast(init, name)
        location = self._place(loc.file)
        self.report.bytes_referenced += loc.length
        self._external(init, loc.shape, location, loc.offset, loc.length, loc.dtype)
        self.weight_map[init] = {"file": location, "offset": loc.offset, "length": loc.length,
                                 "dtype": loc.dtype, "shape": list(loc.shape), "converted": False}

    def _cast(self, src: str, dst: str) -> None:
        self.report.cast_in_graph += 1
        self.nodes.append(helper.make_node("Cast", [src], [dst], to=_ONNX[self.dtype], name=f"{dst}/cast"))

    def _converted_entry(self, name: str, t: torch.Tensor) -> None:
        if self._converted is None:
            self._converted = open(self.folder / WEIGHTS_DIR / CONVERTED, "wb")
        f = self._converted
        f.write(b"\0" * ((-f.tell()) % ALIGN))
        offset = f.tell()
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        f.write(memoryview(data))
        self.report.bytes_converted += len(data)
        self.report.converted.append(name)
        location = f"{WEIGHTS_DIR}/{CONVERTED}"
        self._external(name, tuple(t.shape), location, offset, len(data))
        self.weight_map[name] = {"file": location, "offset": offset, "length": len(data),
                                 "dtype": self.dtype, "shape": list(t.shape), "converted": True}

    def _external(self, name, shape, location, offset, length, st_dtype: str | None = None) -> None:
        t = TensorProto(name=name, data_type=_ONNX[st_dtype or self.dtype], dims=list(shape),
                        data_location=TensorProto.EXTERNAL)
        # map mode: locations inside the folder that do not exist; ort_session supplies the bytes
        loc = location if not os.path.isabs(location) else f"{WEIGHTS_DIR}/{Path(location).name}"
        for k, v in (("location", loc), ("offset", str(offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.initializers.append(t)

    def _placement_notes(self) -> None:
        """One line on how `link` placed the shards where it could not reflink them (docs/exports.md)."""
        kinds = set(self.report.link_kind.values())
        if "hardlink" in kinds:
            self.report.warn(hardlink_warning(self.checkpoint_bytes))
        elif self.report.mode == "link" and "copy" in kinds:
            self.report.messages.append(
                f"no reflink could be made here: the checkpoint's shards ({_size(self.checkpoint_bytes)}; up to "
                f"{_size(A.COPY_BELOW)} is copied by default) were copied, not hard-linked (onnx >= 1.21 refuses "
                f"hard links), so the folder loads in every tool")

    def close(self) -> None:
        self._placement_notes()
        if self._converted is not None:
            self._converted.close()
            self._converted = None
            if not self.files:
                self.report.messages.append(
                    f"every tensor was converted to {self.dtype} ({WEIGHTS_DIR}/{CONVERTED}); no shard is referenced")
        if self.report.mode == "map" and not any((self.folder / WEIGHTS_DIR).iterdir()):
            (self.folder / WEIGHTS_DIR).rmdir()
