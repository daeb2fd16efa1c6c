"""The TensorRT builder and engine loader: thin, import-guarded (STEP_GRAPH.md 4).

Every decision (profiles, flags, memory, shapes) comes from `profiles.py` and
`memory_plan.py`, which are tested without TensorRT. This module only turns
those decisions into TensorRT 10.x / 11.x API calls; it cannot run on the
project's machines (no TensorRT there) and says so plainly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from clover_export.artifact.manifest import Profile
from clover_export.core.atomic import atomic_write
from clover_export.core.errors import CloverError
from clover_export.engines.profiles import BuildSettings

INSTALL_NOTE = "install the tensorrt wheel matching your CUDA (pip install tensorrt) on a machine with an NVIDIA GPU"
BROKEN_NOTE = ("the tensorrt package is there but its import failed: check that the TensorRT and CUDA libraries "
               "(libnvinfer) it names are installed and on the library path (LD_LIBRARY_PATH), matching the wheel")

log = logging.getLogger(__name__)


def probe_tensorrt() -> tuple[str | None, str | None]:
    """(version, None) when `import tensorrt` works; (None, None) when it is not installed; (None, why) when an
    installed TensorRT cannot be imported (a missing libnvinfer, a mismatched CUDA, ...)."""
    try:
        import tensorrt as trt
    except ModuleNotFoundError as e:
        if e.name == "tensorrt":
            return None, None
        return None, f"{type(e).__name__}: {e}"
    except Exception as e:  # ImportError / OSError from a broken install: report it, never "not installed"
        return None, f"{type(e).__name__}: {e}"
    return str(getattr(trt, "__version__", "unknown")), None


def import_tensorrt(component: str = "tensorrt", note: str = INSTALL_NOTE):
    """The one TensorRT import guard (builder, loader, runtime backend): >= the floor of `trt_versions`, or a
    plain error saying what failed (not installed, installed but broken, too old and why)."""
    from clover_export.plugins.trt.versions import require_tensorrt

    version, broken = probe_tensorrt()
    if broken:
        raise CloverError(component, f"TensorRT is installed but cannot be imported ({broken})", BROKEN_NOTE)
    if version is None:
        raise CloverError(component, "TensorRT is not installed on this machine", note)
    require_tensorrt(version, component)
    import tensorrt as trt

    return trt


def tensorrt_version() -> str | None:
    return probe_tensorrt()[0]


class _SafeMonitor:
    """Progress bars for TensorRT's build phases that never raise into TensorRT (an exception thrown from a
    monitor callback aborts the build): a failing bar is dropped, the build goes on."""

    def __init__(self):
        self.bars = {}

    def phase_start(self, phase_name, parent_phase, num_steps):
        try:
            from tqdm import tqdm

            self.bars[phase_name] = tqdm(total=num_steps, desc=phase_name, leave=parent_phase is None)
        except Exception:  # a progress bar is never worth a failed build
            self.bars.pop(phase_name, None)

    def step_complete(self, phase_name, step):
        try:
            bar = self.bars.get(phase_name)
            if bar is not None:
                bar.update(1)
        except Exception:  # see the class docstring
            self.bars.pop(phase_name, None)
        return True  # keep building

    def phase_finish(self, phase_name):
        try:
            bar = self.bars.pop(phase_name, None)
            if bar is not None:
                bar.close()
        except Exception:  # see the class docstring
            pass


def _progress_monitor(trt):
    class TqdmMonitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.safe = _SafeMonitor()

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.safe.phase_start(phase_name, parent_phase, num_steps)

        def step_complete(self, phase_name, step):
            return self.safe.step_complete(phase_name, step)

        def phase_finish(self, phase_name):
            self.safe.phase_finish(phase_name)

    return TqdmMonitor()


def plugin_layer_problems(found: dict[str, int], expected: dict[str, int]) -> list[str]:
    """Compare the parsed network's clover plugin layers (op -> count) with the ONNX graph's clover nodes."""
    problems = []
    for op in sorted(set(found) | set(expected)):
        if found.get(op, 0) != expected.get(op, 0):
            problems.append(f"clover::{op}: {found.get(op, 0)} plugin layer(s) after parsing, "
                            f"{expected.get(op, 0)} node(s) in the graph")
    return problems


def _clover_plugin_layers(trt, network) -> dict[str, int]:
    """op -> number of IPluginV3 layers in namespace clover (TensorRT 10.x/11.x Python API: ILayer.type,
    IPluginV3Layer.plugin, IPluginV3.get_capability_interface(CORE).plugin_namespace / plugin_name)."""
    from clover_export.plugins.contracts import NAMESPACE

    found: dict[str, int] = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type != trt.LayerType.PLUGIN_V3:
            continue
        layer.__class__ = trt.IPluginV3Layer  # get_layer returns the base class
        core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
        if core.plugin_namespace == NAMESPACE:
            found[core.plugin_name] = found.get(core.plugin_name, 0) + 1
    return found


def registration_problems(needed: set[str], available: bool, registered: tuple[str, ...], why: str = "") -> list[str]:
    """Every clover op of the graph must have a registered plugin before parsing (else a hard error)."""
    from clover_export.plugins.contracts import NAMESPACE

    if not available:
        because = f": {why}" if why else ""
        return [f"the clover plugins are not registered: tensorrt.plugin could not be imported{because}"]
    return [f"no plugin registered for {NAMESPACE}::{op}" for op in sorted(needed)
            if f"{NAMESPACE}::{op}" not in registered]


FP8_FLAG_ENV = "CLOVER_TRT_FP8_FLAG"


def fp8_builder_flag(trt_version: str, fp8_plugins: bool, strongly_typed: bool, environ=None) -> tuple[bool, str]:
    """(set BuilderFlag.FP8?, one line saying why) for a graph with or without FP8 plugins (MoEGateUpFP8 /
    MoEDownFP8 take e4m3 initialisers). docs/tensorrt.md, "BuilderFlag.FP8"."""
    from clover_export.plugins.trt.plan import env_flag
    from clover_export.plugins.trt.versions import parse_version

    forced = env_flag(FP8_FLAG_ENV, environ)
    if parse_version(trt_version)[0] >= 11:
        return False, "BuilderFlag.FP8: none in TensorRT 11 (strongly typed only: the graph's types decide)"
    if not fp8_plugins:
        return False, "BuilderFlag.FP8 not set: no FP8 plugin in the graph"
    if forced:
        return True, f"BuilderFlag.FP8 set ({FP8_FLAG_ENV}=1)"
    if not strongly_typed:  # weak typing: TensorRT offers plugins FP8 formats only with the flag (NvInfer.h 10.9)
        return True, "BuilderFlag.FP8 set: weakly typed network with FP8 plugins"
    return False, ("BuilderFlag.FP8 not set: the network is STRONGLY_TYPED, so the graph types the FP8 plugins' e4m3 "
                   "inputs (the flag is weak typing: trtexec 10.9-10.16 drops kFP8 under --stronglyTyped, 10.12 "
                   f"deprecates it as superseded by strong typing); {FP8_FLAG_ENV}=1 sets it")


def build_notes(trt_version: str | None, arch: int | None, environ=None) -> list[str]:
    """What the engine build decides for FP8 plugins and the AOT kernels' shared memory, one line each
    (`doctor`; the build logs the same lines for its own graph). Without TensorRT: what 10.x would get."""
    from clover_export.engines.profiles import BuildSettings
    from clover_export.plugins.trt.plan import shared_memory_note
    from clover_export.plugins.trt.versions import parse_version

    lines = []
    version = trt_version or "10.9"
    try:
        strong = "STRONGLY_TYPED" in BuildSettings.network_flags(parse_version(version)[0])
        why = fp8_builder_flag(version, True, strong, environ)[1]
        lines.append(f"fp8 engines{'' if trt_version else ' (TensorRT 10.x)'}: {why}")
    except ValueError as e:
        lines.append(f"fp8 engines: {e}")
    try:
        lines.append(shared_memory_note(arch, environ))
    except ValueError as e:
        lines.append(f"AOT plugin kernels: {e}")
    return lines


def _build_arch() -> int | None:
    try:
        import torch

        major, minor = torch.cuda.get_device_capability()
    except Exception:  # no usable CUDA here: the notes then name no architecture
        return None
    return major * 10 + minor


def build_engine(trt_onnx_path: Path, plan_path: Path, profiles: Sequence[Profile], settings: BuildSettings) -> dict:
    """Parse `model.trt.onnx` (plugins registered and checked), build one strongly typed engine, write the plan
    atomically. Every plugin is AOT: the plan runs without Python. Logs the FP8-flag and shared-memory choices."""
    import onnx

    from clover_export.exporter.trt_graph import plugin_nodes
    from clover_export.plugins.trt.plan import aot_shared_budget, shared_memory_note

    trt = import_tensorrt()
    from clover_export.plugins import trt as clover_trt_plugins  # registers clover:: plugins

    if not Path(trt_onnx_path).exists():
        raise CloverError("tensorrt", f"{trt_onnx_path}: missing",
                          "export the folder again (bf16, --weights link/copy)")
    expected = dict(plugin_nodes(onnx.load(str(trt_onnx_path), load_external_data=False)))
    problems = registration_problems(set(expected), clover_trt_plugins.AVAILABLE, clover_trt_plugins.REGISTERED,
                                     clover_trt_plugins.IMPORT_ERROR)
    if problems:
        raise CloverError("tensorrt", "; ".join(problems), "nothing was built")
    major = int(trt.__version__.split(".")[0])
    arch = _build_arch()
    try:
        set_fp8, fp8_why = fp8_builder_flag(trt.__version__, any(op.endswith("FP8") for op in expected),
                                            "STRONGLY_TYPED" in settings.network_flags(major))
        budget = aot_shared_budget(arch or 0)
        notes = [fp8_why, shared_memory_note(arch)]
    except ValueError as e:
        raise CloverError("tensorrt", str(e), "nothing was built") from None
    for line in notes:
        log.info(f"[engine] {line}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    for name in settings.network_flags(major) + ["PREFER_AOT_PYTHON_PLUGINS"]:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(trt_onnx_path)):
        errors = "\n  ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise CloverError("tensorrt", f"{trt_onnx_path}: the ONNX parser failed:\n  {errors}")
    problems = plugin_layer_problems(_clover_plugin_layers(trt, network), expected)
    if problems:
        raise CloverError("tensorrt", f"{trt_onnx_path}: the parsed network does not have one plugin layer per clover "
                          "node:\n  " + "\n  ".join(problems), "nothing was built")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_bytes)
    config.builder_optimization_level = settings.builder_optimization_level
    for name in settings.flags(major) + ["FP8"] * set_fp8:
        config.set_flag(getattr(trt.BuilderFlag, name))
    for name in settings.preview_features():  # required: the cache-pool outputs alias their inputs
        feature = getattr(trt.PreviewFeature, name, None)
        if feature is None:
            raise CloverError("tensorrt", f"TensorRT {trt.__version__} has no PreviewFeature.{name}",
                              "the cache-pool plugins need it; use a TensorRT that has it")
        config.set_preview_feature(feature, True)
    for p in profiles:  # the manifest's profiles (`artifact.manifest.Profile`): input -> {"min", "opt", "max"}
        prof = builder.create_optimization_profile()
        for name, s in p.shapes.items():
            prof.set_shape(name, s["min"], s["opt"], s["max"])
        config.add_optimization_profile(prof)
    cache = None
    if settings.timing_cache:
        blob = Path(settings.timing_cache).read_bytes() if Path(settings.timing_cache).exists() else b""
        cache = config.create_timing_cache(blob)
        if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
            raise CloverError("tensorrt", f"{settings.timing_cache}: TensorRT refused the timing cache (made by "
                              "another TensorRT version or GPU?)", "delete the file to start a fresh cache")
    config.progress_monitor = _progress_monitor(trt)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise CloverError("tensorrt", "the engine build failed (see TensorRT's messages above)")
    atomic_write(plan_path, memoryview(plan))
    if cache is not None:
        atomic_write(Path(settings.timing_cache), memoryview(cache.serialize()))
    return {"tensorrt": trt.__version__, "plan": plan_path.name, "bytes": plan_path.stat().st_size,
            "graph": Path(trt_onnx_path).name, "plugin_layers": sum(expected.values()),
            "profiles": [p.name for p in profiles], "stripped": settings.strip_weights,
            "fp8_builder_flag": set_fp8, "aot_shared_memory_bytes": budget}


def load_engine(plan_path: Path, onnx_path: Path | None = None, stripped: bool = False):
    """Deserialize a plan; refit a weight-stripped plan from the ONNX graph's external data."""
    trt = import_tensorrt()
    from clover_export.plugins import trt as clover_trt_plugins  # noqa: F401  (plugins must be registered)

    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
    if engine is None:
        raise CloverError("tensorrt", f"{plan_path}: cannot deserialize the engine",
                          "it was built by another TensorRT version or for another GPU; rebuild it")
    if stripped:
        if onnx_path is None:
            raise CloverError("tensorrt", f"{plan_path}: weight-stripped plan needs the ONNX graph to refit from")
        refitter = trt.Refitter(engine, logger)
        parser_refitter = trt.OnnxParserRefitter(refitter, logger)
        if not parser_refitter.refit_from_file(str(onnx_path)) or not refitter.refit_cuda_engine():
            raise CloverError("tensorrt", f"{plan_path}: refit from {onnx_path} failed")
    return engine
