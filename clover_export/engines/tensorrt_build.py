"""The TensorRT builder and engine loader: thin, import-guarded (STEP_GRAPH.md 4).

Every decision (profiles, flags, memory, shapes) comes from `profiles.py` and
`memory_plan.py`, which are tested without TensorRT. This module only turns
those decisions into TensorRT 10.x / 11.x API calls; it cannot run on the
project's machines (no TensorRT there) and says so plainly.
"""

from __future__ import annotations

from pathlib import Path

from clover_export.atomic import atomic_write
from clover_export.engines.profiles import BuildSettings
from clover_export.errors import CloverError


INSTALL_NOTE = "install the tensorrt wheel matching your CUDA (pip install tensorrt) on a machine with an NVIDIA GPU"


def import_tensorrt(component: str = "tensorrt", note: str = INSTALL_NOTE):
    """The one TensorRT import guard (builder, loader, runtime backend): 10.x or 11.x, or a plain error."""
    try:
        import tensorrt as trt
    except ImportError:
        raise CloverError(component, "TensorRT is not installed on this machine", note) from None
    major = int(trt.__version__.split(".")[0])
    if major < 10:
        raise CloverError(component, f"TensorRT {trt.__version__} is too old", "TensorRT 10.x or 11.x is required")
    return trt


def tensorrt_version() -> str | None:
    try:
        import tensorrt as trt
    except ImportError:
        return None
    return trt.__version__


def _progress_monitor(trt):
    from tqdm import tqdm

    class TqdmMonitor(trt.IProgressMonitor):
        """Feeds TensorRT's build phases into progress bars (one per phase)."""

        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.bars = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.bars[phase_name] = tqdm(total=num_steps, desc=phase_name, leave=parent_phase is None)

        def step_complete(self, phase_name, step):
            self.bars[phase_name].update(1)
            return True  # keep building

        def phase_finish(self, phase_name):
            self.bars.pop(phase_name).close()

    return TqdmMonitor()


def build_engine(onnx_path: Path, plan_path: Path, profiles: list[dict], settings: BuildSettings) -> dict:
    """Parse (plugins registered), build one strongly typed engine, write the plan atomically."""
    trt = import_tensorrt()
    from clover_export.plugins import trt as clover_trt_plugins  # registers clover:: plugins

    major = int(trt.__version__.split(".")[0])
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    for name in settings.network_flags(major):
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    if hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n  ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise CloverError("tensorrt", f"{onnx_path}: the ONNX parser failed:\n  {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_bytes)
    config.builder_optimization_level = settings.builder_optimization_level
    for name in settings.flags(major):
        config.set_flag(getattr(trt.BuilderFlag, name))
    for name in settings.preview_features():  # plugin outputs aliased to the cache inputs
        if hasattr(trt.PreviewFeature, name):
            config.set_preview_feature(getattr(trt.PreviewFeature, name), True)
    for p in profiles:  # the manifest's profiles: input name -> {"min", "opt", "max"}
        prof = builder.create_optimization_profile()
        for name, s in p["shapes"].items():
            prof.set_shape(name, s["min"], s["opt"], s["max"])
        config.add_optimization_profile(prof)
    cache = None
    if settings.timing_cache:
        blob = Path(settings.timing_cache).read_bytes() if Path(settings.timing_cache).exists() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)
    config.progress_monitor = _progress_monitor(trt)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise CloverError("tensorrt", "the engine build failed (see TensorRT's messages above)")
    atomic_write(plan_path, memoryview(plan))
    if cache is not None:
        atomic_write(Path(settings.timing_cache), memoryview(cache.serialize()))
    del clover_trt_plugins
    return {"tensorrt": trt.__version__, "plan": plan_path.name, "bytes": plan_path.stat().st_size,
            "profiles": [p["name"] for p in profiles], "stripped": settings.strip_weights}


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
