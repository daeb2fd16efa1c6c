"""Disk plan of a build: bytes each stage will write vs free space on OUT's filesystem.

Checked with everything else `build` needs before anything is written
(`checks.check_inputs`): a plan that does not fit is one problem line.
Each stage says what it writes (`context.Stage.disk`, with the figures
below); stages already done with the same inputs (resume) write nothing.
The figures: graphs and manifests (`GRAPH_BYTES`, a generous bound: the 35B
graph proto is ~10 MB), shard copies under `--weights copy`, zero-filled
tensors of an opted-in Qwen checkpoint, the FP8 weights (once: both FP8
graphs link them), and the engine where TensorRT and a GPU will build one.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from clover_export.model.sizing import GiB

GRAPH_BYTES = 64 * 2**20  # one step graph + manifest + weight map (bound)
MARGIN = 1 * GiB  # left free for logs, timing cache and the filesystem itself


@dataclass
class DiskPlan:
    out: Path
    free: int
    stages: dict[str, int] = field(default_factory=dict)  # stage -> bytes it will write (0: reused / nothing)

    @property
    def total(self) -> int:
        return sum(self.stages.values())

    @property
    def fits(self) -> bool:
        return self.total + MARGIN <= self.free

    def lines(self) -> list[str]:
        def g(n):
            return f"{n / GiB:8.2f} GiB"

        out = [f"disk plan (writes into {self.out}):"]
        out += [f"  {name:24s}{g(n)}" for name, n in self.stages.items()]
        out.append(f"  {'total':24s}{g(self.total)}")
        out.append(f"  {'free':24s}{g(self.free)}  (+{MARGIN / GiB:.0f} GiB margin): "
                   f"{'fits' if self.fits else 'DOES NOT FIT'}")
        return out


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def fp8_weight_file_bytes(cfg) -> int:
    from clover_export.core import names
    from clover_export.model.sizing import fp8_weight_names
    from clover_export.quantize.weights import fp8_bytes

    shapes = names.expected_tensors(cfg, clover=cfg.is_clover)
    return fp8_bytes({n: shapes[n] for n in fp8_weight_names(cfg)})


def checkpoint_bytes(model_dir: Path) -> int:
    from clover_export.core.checkpoint import shard_files

    return sum(f.stat().st_size for f in shard_files(model_dir))


def zero_filled_bytes(cfg, dtype_bytes: int) -> int:
    """Clover tensors an opted-in plain Qwen checkpoint lacks: written zero-filled by each export."""
    from clover_export.core import names

    if cfg.is_clover:
        return 0
    shapes = names.expected_tensors(cfg)
    return sum(math.prod(shapes[n]) * dtype_bytes for n in names.clover_tensor_names(cfg))


def export_bytes(cfg, model_dir: Path, weights: str, dtype_bytes: int) -> int:
    """One exported graph: graph and manifest, the shards where they are copied, the zero-filled tensors."""
    from clover_export.artifact.manifest import COPY_BELOW

    ckpt = checkpoint_bytes(model_dir)
    # link mode copies a small checkpoint where the filesystem has no reflinks (exports.md): counted either way
    shards = ckpt if weights == "copy" or ckpt <= COPY_BELOW else 0
    return GRAPH_BYTES + shards + zero_filled_bytes(cfg, dtype_bytes)


def plan_disk(ctx, stages) -> DiskPlan:
    """What each of `stages` (`context.Stage`) will write into ctx.out: its `disk` figure, 0 when it will be
    reused (`BuildContext.done`); stages without a figure are left out."""
    plan = DiskPlan(Path(ctx.out), free_bytes(ctx.out))
    for stage in stages:
        n = stage.disk(ctx) if stage.disk is not None else None
        if n is not None:
            plan.stages[stage.name] = 0 if ctx.done(stage) else n
    return plan


def shortfall(plan: DiskPlan) -> str | None:
    """One line saying that and by how much the build does not fit on OUT's filesystem; None when it fits."""
    if plan.fits:
        return None
    writes = ", ".join(f"{name} {n / GiB:.2f} GiB" for name, n in plan.stages.items() if n)
    return (f"not enough free disk space for this build in {plan.out}: it writes {plan.total / GiB:.2f} GiB "
            f"({writes}), {plan.free / GiB:.2f} GiB free with {MARGIN / GiB:.0f} GiB kept free; "
            f"free {(plan.total + MARGIN - plan.free) / GiB:.1f} GiB there, or choose --out on a filesystem with "
            "more room")

