"""FP8 routed experts for the `triton` backend (STEP_GRAPH.md 4): e4m3 weights + fp32 per-output-channel scales.

Two sources, the same bytes: quantized at load (`engines.quantize.quantize_weight`,
what `clover-export fp8` writes), or read from an FP8 artifact (its
`<name>.fp8` tensors in the weight map and the `<name>.scale` initializers of
its graph). The model's expert parameters are replaced by the e4m3 tensors
(half the bytes of bf16); `Fp8Experts.scales(gate_up, down)` gives the scales
the MoE core passes to `CoresetMoEFP8`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from clover_export.core.errors import CloverError
from clover_export.quantize.scales import FP8_DTYPE, quantize_weight

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def expert_names(model) -> list[str]:
    """Checkpoint names of the fused routed-expert tensors, layer by layer."""
    return [f"model.layers.{i}.mlp.experts.{t}" for i in range(len(model.model.layers)) for t in EXPERT_TENSORS]


class Fp8Experts:
    """Scales of the model's e4m3 expert tensors, looked up by the tensor the MoE core receives."""

    def __init__(self):
        self._scales: dict[int, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # the keys' tensors stay alive with the table

    def install(self, model, name: str, w8: torch.Tensor, scale: torch.Tensor) -> None:
        experts = model.get_submodule(name.rsplit(".", 1)[0])
        tensor = name.rsplit(".", 1)[1]
        old = getattr(experts, tensor)
        if tuple(w8.shape) != tuple(old.shape) or tuple(scale.shape) != tuple(old.shape[:-1]):
            raise CloverError("runtime", f"{name}: FP8 weight {tuple(w8.shape)} / scale {tuple(scale.shape)} do not "
                              f"match the model's {tuple(old.shape)}", "the artifact was exported from another model")
        param = nn.Parameter(w8.to(old.device), requires_grad=False)
        setattr(experts, tensor, param)
        self._scales[id(param)] = scale.to(old.device, torch.float32).contiguous()
        self._keep.append(param)

    def scales(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if gate_up.dtype != FP8_DTYPE:
            return None
        return self._scales[id(gate_up)], self._scales[id(down)]


@torch.no_grad()
def quantize_at_load(model) -> Fp8Experts:
    """Quantize every layer's experts in place, one tensor at a time (per-output-channel absmax scales)."""
    table = Fp8Experts()
    for name in expert_names(model):
        w8, scale = quantize_weight(model.get_parameter(name))
        table.install(model, name, w8, scale)
    return table


def from_artifact(model, art_dir: str | Path) -> Fp8Experts:
    """The e4m3 expert tensors and their scales of an FP8 artifact (written by `clover-export fp8`)."""
    import onnx
    from onnx import numpy_helper

    from clover_export.artifact.manifest import load_artifact, read_weight_map

    art = load_artifact(art_dir)
    if art.manifest.quantization is None:
        raise CloverError("runtime", f"{art.dir}: not an FP8 artifact (its manifest has no quantization entry)",
                          "pass the folder written by `clover-export fp8`, or fp8_experts=True to quantize at load")
    wmap = read_weight_map(art)
    graph = onnx.load(str(art.graph_path), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    table = Fp8Experts()
    for name in expert_names(model):
        entry, scale = wmap.get(f"{name}.fp8"), inits.get(f"{name}.scale")
        if entry is None or entry.get("dtype") != "F8_E4M3":
            raise CloverError("runtime", f"{art.dir}: no e4m3 tensor {name}.fp8 in its weight map",
                              "quantize the artifact's experts again with `clover-export fp8`")
        if scale is None:
            raise CloverError("runtime", f"{art.dir}: FP8 scales {name}.scale missing from the graph",
                              "the artifact is incomplete; quantize it again with `clover-export fp8`")
        w8 = torch.from_numpy(_read(art.dir, entry, np.uint8)).view(FP8_DTYPE)
        if scale.data_location == onnx.TensorProto.EXTERNAL:  # in the build's shared FP8 weight file
            s = _read(art.dir, wmap[f"{name}.scale"], np.float32)
        else:
            s = numpy_helper.to_array(scale).astype(np.float32)
        table.install(model, name, w8, torch.from_numpy(s))
    return table


def _read(folder: Path, entry: dict, dtype) -> np.ndarray:
    """One tensor of a weight map entry (file, offset, shape), memory-read from its file."""
    path = Path(entry["file"]) if Path(entry["file"]).is_absolute() else folder / entry["file"]
    raw = np.fromfile(path, dtype=dtype, count=int(np.prod(entry["shape"])), offset=int(entry["offset"]))
    return raw.reshape(entry["shape"])
