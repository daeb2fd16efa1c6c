"""What the build's stages share: the options, build.json's record, one context, and `run(stage)`.

A stage (`Stage`) describes itself: its name, what it makes, how an earlier
run of it is taken back, its folder, what its key is made from, the bytes it
writes and the problems it can find before any stage runs. `BuildContext.run`
is the one place that decides between making and reusing: a stage whose key
matches the one recorded in build.json, and whose folder is still there, is
reused; any other is made, recorded (build.json is rewritten atomically after
every stage) and counted. A stage without `reuse` is a check: it runs every
time and records nothing. The stages and their order: `stages.stage_list`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clover_export.artifact.manifest import BUILD_FILE
from clover_export.core.atomic import atomic_write
from clover_export.core.step_shape import MAX_BATCH, PREFILL_CHUNK

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    """`clover-export build`'s options; the command's defaults are these (cli/build.py reads them)."""

    precision: str = "fp8"  # the engine's; fp8 calibrates, quantizes and checks agreement (bf16 needs none of it)
    max_batch: int = MAX_BATCH
    max_context: int | None = None  # default: the model's max_context
    chunk: int = PREFILL_CHUNK
    weights: str = "link"
    calib: str | None = None
    gpu_memory_gib: float | None = None
    strip_weights: bool = False
    require_engine: bool = False
    allow_qwen: bool = False
    force: bool = False  # redo every stage; OUT must still be a build folder (clover_export.artifact.outdir)
    validation: str = "auto"  # "whole" graph, a full-width "slice", or "auto": whole when it fits in memory


@dataclass
class BuildResult:
    out: Path
    stages: dict[str, dict] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # human-readable reasons
    engine: Path | None = None
    ran: list[str] = field(default_factory=list)  # stages run by this invocation
    reused: list[str] = field(default_factory=list)  # stages reused from an earlier one


def stage_key(*parts) -> str:
    """A stage's key: a short hash of what it is made from."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Stages:
    """build.json: stage name -> {"key", "result"}; written after every stage."""

    def __init__(self, out: Path):
        self.path = out / BUILD_FILE
        try:
            self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except json.JSONDecodeError:
            self.data = {}
        self.data.setdefault("stages", {})

    def done(self, name: str, key: str, folder: Path | None) -> bool:
        rec = self.data["stages"].get(name)
        return bool(rec and rec["key"] == key and (folder is None or folder.exists()))

    def record(self, name: str, key: str, result: dict) -> None:
        self.data["stages"][name] = {"key": key, "result": result}
        atomic_write(self.path, json.dumps(self.data, indent=2).encode())

    def result(self, name: str) -> dict:
        return self.data["stages"][name]["result"]


@dataclass(frozen=True)
class Stage:
    """One step of the build, describing itself.

    name: its entry in build.json and its line in the disk plan.
    make(ctx): does the work, logs its lines, returns what build.json records (None: nothing to record, the
      stage did not apply here).
    reuse(ctx, record): takes an earlier run back (what later stages need into ctx) and returns the line
      saying so; None makes the stage a check (run every time, nothing recorded).
    folder: under OUT, what it writes: it must still exist for a reuse.
    key(ctx): what its key is made from (hashed by `stage_key`; None: not recordable here).
    disk(ctx): the bytes it will write (`disk_plan`; None: none counted here).
    checks(ctx): the problems it can find before any stage runs (`checks.check_inputs`), as CloverErrors;
      what they read that the stage needs goes into ctx."""

    name: str
    make: Callable[[BuildContext], dict | None]
    reuse: Callable[[BuildContext, dict], str] | None = None
    folder: str | None = None
    key: Callable[[BuildContext], tuple | None] | None = None
    disk: Callable[[BuildContext], int | None] | None = None
    checks: Callable[[BuildContext], list] | None = None


@dataclass
class BuildContext:
    """Everything the stages share: what `check_inputs` found before any stage ran, and what the stages
    hand each other as they run (the calibration's ranges, the FP8 weights, the background work)."""

    opts: BuildOptions
    out: Path
    stages: Stages  # build.json
    model_dir: Path | None = None
    cfg: object = None  # CloverConfig
    max_context: int | None = None
    memory: object = None  # engines.memory_plan.MemoryPlan
    disk: object = None  # disk_plan.DiskPlan
    plan: tuple[Stage, ...] = ()  # the stages of this build, in order (`stages.stage_list`)
    base: tuple = ()  # what every stage key is made from
    validation: tuple[bool, str] = (True, "")  # (whole graphs?, why): `checks.validation_mode`
    calibration_prompts: list[str] = field(default_factory=list)  # fp8: the prompts' text (the calibration's key)
    prompts: object = None  # fp8: calibration.PromptBatch, the calibration prompts tokenised
    result: BuildResult | None = None
    writer: object = None  # background.BackgroundWeights: the FP8 weight file, written beside the stages
    bf16_job: object = None  # background.BackgroundExport: the bf16 export, at full size
    shared: dict | None = None  # fp8 slice validation: weights it read that the streamed calibration takes over
    amax: dict | None = None  # calibrate: activation ranges
    weights: object = None  # fp8-weights: quantize.weights.Fp8Weights
    agreement: dict | None = None  # validate-onnx-fp8: the FP8 graph's agreement with the fp32 one
    facts: object = None  # doctor.Facts, collected once for the engine stage
    _keys: dict[str, str | None] = field(default_factory=dict)  # stage name -> key, made once

    def __post_init__(self):
        if self.result is None:
            self.result = BuildResult(self.out)

    def key(self, stage: Stage) -> str | None:
        """The stage's key: a hash of what it is made from (None: a check, or not recordable here)."""
        if stage.name not in self._keys:
            parts = stage.key(self) if stage.key is not None and stage.reuse is not None else None
            self._keys[stage.name] = None if parts is None else stage_key(*parts)
        return self._keys[stage.name]

    def done(self, stage: Stage) -> bool:
        """Recorded in build.json under its key, its folder still there: reused by `run`."""
        key = self.key(stage)
        folder = self.out / stage.folder if stage.folder else None
        return key is not None and self.stages.done(stage.name, key, folder)

    @property
    def fp8(self) -> bool:
        return self.opts.precision == "fp8"

    @property
    def whole(self) -> bool:
        """Whole graphs validated in ONNX Runtime; else a slice at full width (`validation_mode`)."""
        return self.validation[0]

    def run(self, *stages: Stage) -> None:
        """Each stage in turn: reused when build.json holds it under the same key (and its folder is there),
        else made, recorded and counted as run."""
        for stage in stages:
            key = self.key(stage)
            if self.done(stage):
                log.info(stage.reuse(self, self.stages.result(stage.name)))
                self.result.reused.append(stage.name)
                continue
            record = stage.make(self)
            if key is not None and record is not None:
                self.stages.record(stage.name, key, record)
                self.result.ran.append(stage.name)
