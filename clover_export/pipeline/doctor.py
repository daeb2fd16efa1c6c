"""What this machine has, and which commands, precisions and GPU architectures will work."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

# minimum compute capability (major, minor) per engine precision
PRECISION_MIN_SM = {"bf16": (8, 0), "fp8": (8, 9)}
# architectures the plugin kernels are compiled for (STEP_GRAPH.md 5)
KERNEL_ARCHS = (80, 89, 90, 100)


@dataclass
class Facts:
    torch: str | None = None
    cuda: str | None = None
    gpus: list[dict] = field(default_factory=list)  # name, sm (major, minor), memory bytes
    onnxruntime: str | None = None
    ort_providers: list[str] = field(default_factory=list)
    tensorrt: str | None = None
    tensorrt_error: str | None = None  # installed but `import tensorrt` failed: the reason
    triton: str | None = None
    polygraphy: str | None = None
    cupy: str | None = None


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # any import failure means "not usable here"
        return None


def collect() -> Facts:
    from clover_export.engines.builder import probe_tensorrt

    trt_version, trt_error = probe_tensorrt()
    f = Facts(torch=_version("torch"), onnxruntime=_version("onnxruntime"), tensorrt=trt_version,
              tensorrt_error=trt_error, triton=_version("triton"), polygraphy=_version("polygraphy"),
              cupy=_version("cupy"))
    if f.torch:
        import torch

        f.cuda = torch.version.cuda
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                f.gpus.append({"name": p.name, "sm": (p.major, p.minor), "memory": p.total_memory})
    if f.onnxruntime:
        import onnxruntime

        f.ort_providers = onnxruntime.get_available_providers()
    return f


def tensorrt_problem(f: Facts) -> str | None:
    """Why this machine's TensorRT cannot build clover engines (None: it can): absent, broken, or too old."""
    from clover_export.plugins.trt.versions import too_old_reason

    if f.tensorrt_error:
        return f"TensorRT is installed but cannot be imported: {f.tensorrt_error}"
    if not f.tensorrt:
        return "TensorRT is not installed on this machine"
    return too_old_reason(f.tensorrt)


def capabilities(f: Facts) -> list[tuple[str, bool, str]]:
    """(what, works, why) rows derived from the facts alone."""
    gpu = f.gpus[0] if f.gpus else None
    rows = [
        ("export / check (ONNX graphs)", True, "needs only torch + onnx"),
        ("generate --backend torch", bool(f.torch), "reference model" + (" on CUDA" if gpu else " on CPU")),
        ("validate / generate --backend ort", bool(f.onnxruntime),
         f"ONNX Runtime providers: {', '.join(f.ort_providers) or 'none'}" if f.onnxruntime
         else "onnxruntime not installed"),
    ]
    why = tensorrt_problem(f) or ("no CUDA GPU" if not gpu else f"TensorRT {f.tensorrt}")
    trt_ok = tensorrt_problem(f) is None and bool(gpu)
    rows.append(("build engines / generate --backend trt", trt_ok, why))
    for prec, sm in PRECISION_MIN_SM.items():
        if gpu:
            ok = tuple(gpu["sm"]) >= sm
            rows.append((f"{prec} engine on {gpu['name']}", ok and trt_ok,
                         f"sm_{gpu['sm'][0]}{gpu['sm'][1]} {'>=' if ok else '<'} sm_{sm[0]}{sm[1]}"))
        else:
            rows.append((f"{prec} engine", False, f"needs a GPU of sm_{sm[0]}{sm[1]} or newer"))
    rows.append(("Triton kernels on GPU", bool(f.triton and gpu), "triton " + (f.triton or "missing")))
    rows.append(("plugin PTX (AOT, no GPU needed)", bool(f.triton),
                 "targets " + ", ".join(f"sm_{a}" for a in KERNEL_ARCHS)))
    return rows


def report(f: Facts) -> list[str]:
    lines = ["machine:"]
    lines.append(f"  torch {f.torch or 'missing'}" + (f" (CUDA {f.cuda})" if f.cuda else " (CPU build)"))
    for g in f.gpus or [None]:
        lines.append("  GPU: none" if g is None else
                     f"  GPU: {g['name']}, sm_{g['sm'][0]}{g['sm'][1]}, {g['memory'] / 1024**3:.1f} GiB")
    for name in ("onnxruntime", "tensorrt", "triton", "polygraphy", "cupy"):
        if name == "tensorrt" and f.tensorrt_error:
            lines.append(f"  tensorrt: installed but broken ({f.tensorrt_error})")
            continue
        lines.append(f"  {name}: {getattr(f, name) or 'not installed'}")
    lines.append("works here:")
    for what, ok, why in capabilities(f):
        lines.append(f"  [{'yes' if ok else 'no '}] {what}: {why}")
    lines.append("TensorRT engine builds (docs/tensorrt.md):")
    lines += [f"  {line}" for line in engine_build_notes(f)]
    return lines


def engine_build_notes(f: Facts, environ=None) -> list[str]:
    """The FP8-flag and shared-memory choices a build would make with this machine's TensorRT and GPU."""
    from clover_export.engines.builder import build_notes

    gpu = f.gpus[0] if f.gpus else None
    usable = f.tensorrt if tensorrt_problem(f) is None else None
    return build_notes(usable, gpu["sm"][0] * 10 + gpu["sm"][1] if gpu else None, environ)


def engine_blocker(precision: str, facts=None) -> str | None:
    """Why no `precision` engine can be built on this machine, or None."""
    facts = collect() if facts is None else facts
    why = tensorrt_problem(facts)  # absent, broken (with the import error) or older than the floor (with the features)
    if why is None and not facts.gpus:
        why = "no CUDA GPU on this machine"
    elif why is None and tuple(facts.gpus[0]["sm"]) < PRECISION_MIN_SM[precision]:
        sm, need = facts.gpus[0]["sm"], "".join(map(str, PRECISION_MIN_SM[precision]))
        why = f"{precision} engines need sm_{need}+, this GPU is sm_{sm[0]}{sm[1]}"
    return why
