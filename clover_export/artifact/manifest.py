"""An exported folder as every reader sees it: manifest -> `Artifact`, and the weight map.

Folder layout (written by `export.py`, STEP_GRAPH.md 1-3):
  model.onnx        the step graph (opset 20 / IR 9), initializers as external data
  model.trt.onnx    what TensorRT parses (bf16, link/copy weights): no functions, MoE as AOT sub-ops (trt_graph.py)
  manifest.json     everything below, plus config, profiles, op contracts, tool versions
  weights.json      the weight map: initializer name -> file, offset, length, dtype, shape
  weights/          the checkpoint's shards as reflinks, copies or hard links (`weights.py`; the manifest's
                    weights.placement says which, weights.shards per shard), and zero-filled tensors
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_export.core.config import CloverConfig, config_from_dict
from clover_export.core.errors import CloverError

MANIFEST = "manifest.json"
GRAPH = "model.onnx"
WEIGHT_MAP = "weights.json"
WEIGHTS_DIR = "weights"
FORMAT = "clover-export/step-graph"
FORMAT_VERSION = 2  # 2: the step graph has the logit_rows input and causal_logits output
BUILD_FILE = "build.json"  # a build folder's record of its stages (`pipeline/build.py`)
WEIGHT_MODES = ("link", "map", "copy")
# `--weights link` where no reflink can be made copies checkpoints up to this size instead of hard-linking
# them: a copy loads in every tool (onnx >= 1.21 refuses hard links) and costs well under a second; above
# it the zero-copy hard link wins and export says which tools refuse it (docs/exports.md)
COPY_BELOW = 256 * 2**20
# copied from the model folder into every export: tokenizer, chat template, generation defaults
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class IOSpec:
    name: str
    shape: tuple  # ints and dynamic-dimension names ("batch", "step_len", "logit_rows", "slots", "pool_len")
    dtype: str  # numpy spelling: "int32", "float32", "bfloat16"


@dataclass(frozen=True)
class Artifact:
    """The manifest of an exported step graph, as a dataclass (see `load_artifact`)."""

    dir: Path
    graph_path: Path
    config: CloverConfig
    block_size: int
    chunk: int
    dtype: str  # "bf16" | "fp32": the graph's model dtype (recurrent states are always float32)
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    weights_mode: str  # the mode used: "link" | "map" | "copy"
    manifest: dict[str, Any]

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.outputs]

    @property
    def pool_names(self) -> list[str]:
        """Cache-pool inputs in graph order (`past_key_values.*`); outputs are `present.*`."""
        return [s.name for s in self.inputs if s.name.startswith("past_key_values.")]

    @property
    def weight_map_path(self) -> Path:
        return self.dir / WEIGHT_MAP


def load_artifact(path: str | Path) -> Artifact:
    """Read `DIR/manifest.json` (written by `clover-export export`) into an `Artifact`.

    Raises CloverError naming the file and field when the folder is not a
    complete export or was written by an incompatible version.
    """
    d = Path(path)
    mpath = d / MANIFEST
    if not d.is_dir():
        raise CloverError("artifact", f"{d}: no such folder", "pass the folder written by `clover-export export`")
    if not mpath.exists():
        raise CloverError(
            "artifact", f"{d}: no {MANIFEST}", "not an export folder (or an interrupted one); export again"
        )
    try:
        m = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CloverError("artifact", f"{mpath}: not valid JSON ({e})") from None
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
        raise CloverError(
            "artifact", f"{mpath}: format {m.get('format')!r} v{m.get('format_version')!r}",
            f"expected {FORMAT!r} v{FORMAT_VERSION}; export again with this version",
        )
    try:
        cfg = config_from_dict(m["config"], source=str(mpath))
        art = Artifact(
            dir=d,
            graph_path=d / m["graph"],
            config=cfg,
            block_size=int(m["block_size"]),
            chunk=int(m["chunk"]),
            dtype=m["dtype"],
            inputs=tuple(IOSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in m["inputs"]),
            outputs=tuple(IOSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in m["outputs"]),
            weights_mode=m["weights"]["mode"],
            manifest=m,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CloverError("artifact", f"{mpath}: missing or malformed field ({e!r})", "export again") from None
    if not art.graph_path.exists():
        raise CloverError("artifact", f"{art.graph_path}: graph file missing")
    return art


def read_weight_map(art: Artifact) -> dict[str, dict]:
    """Initializer name -> {"file", "offset", "length", "dtype", "shape"}; "file" relative to the folder or absolute."""
    try:
        return json.loads(art.weight_map_path.read_text())["tensors"]
    except FileNotFoundError:
        raise CloverError("artifact", f"{art.weight_map_path}: weight map missing") from None


def pool_len(manifest: dict, default: int) -> int:
    """The most cached positions the export was made for (its profiles' pool_len), else `default`."""
    lens = [p["dims"]["pool_len"][-1] for p in manifest.get("profiles", []) if "pool_len" in p.get("dims", {})]
    return min(max(lens), default) if lens else default


def is_artifact(path: str | Path | None) -> bool:
    """An exported artifact folder is recognised by its manifest.json."""
    return path is not None and (Path(path) / MANIFEST).is_file()
