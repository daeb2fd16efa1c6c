"""An exported folder as every reader sees it: `Manifest` (manifest.json), `Artifact`, and the weight map.

`Manifest` is the only way manifest.json is written (`write`, atomic) or read (`load`: the format version
checked, one line naming the file and both versions otherwise); export, the FP8 rewrite, the build's
engine stage and every backend go through it (docs/exports.md, "The manifest").

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
from dataclasses import dataclass, field, replace
from pathlib import Path

from clover_export.core.atomic import atomic_write
from clover_export.core.config import CloverConfig, config_from_dict
from clover_export.core.errors import CloverError

MANIFEST = "manifest.json"
GRAPH = "model.onnx"
WEIGHT_MAP = "weights.json"
WEIGHTS_DIR = "weights"
FORMAT = "clover-export/step-graph"
FORMAT_VERSION = 2  # 2: the step graph has the logit_rows input and causal_logits output
# dynamic dimensions of the step graph (STEP_GRAPH.md 1); T = C + block_size; R: the rows of `logit_rows`
BATCH, STEP_LEN, SLOTS, POOL_LEN = "batch", "step_len", "slots", "pool_len"
LOGIT_ROWS = "logit_rows"
BUILD_FILE = "build.json"  # a build folder's record of its stages (`pipeline/build.py`)
WEIGHT_MODES = ("link", "map", "copy")
# `--weights link` where no reflink can be made copies checkpoints up to this size instead of hard-linking
# them: a copy loads in every tool (onnx >= 1.21 refuses hard links) and costs well under a second; above
# it the zero-copy hard link wins and export says which tools refuse it (docs/exports.md)
COPY_BELOW = 256 * 2**20
# copied from the model folder into every export: tokenizer, chat template, generation defaults
TOKENIZER_FILE = "tokenizer.json"
COMPANION_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class IOSpec:
    name: str
    shape: tuple  # ints and dynamic-dimension names ("batch", "step_len", "logit_rows", "slots", "pool_len")
    dtype: str  # numpy spelling: "int32", "float32", "bfloat16"

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> IOSpec:
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class Profile:
    """One optimisation profile (`exporter.export.profiles`): each dynamic dimension's [min, opt, max], and
    the per-input {"min", "opt", "max"} shapes TensorRT takes (`engines.builder`)."""

    name: str  # "decode" | "prefill"
    causal_rows: int
    block_rows: int
    dims: dict  # dimension name -> [min, opt, max]
    shapes: dict  # input name -> {"min", "opt", "max"}: lists of ints

    def to_json(self) -> dict:
        return {"name": self.name, "causal_rows": self.causal_rows, "block_rows": self.block_rows,
                "dims": self.dims, "shapes": self.shapes}

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(d["name"], int(d["causal_rows"]), int(d["block_rows"]), d["dims"], d.get("shapes", {}))


@dataclass(frozen=True)
class Weights:
    """How the graph's weights are placed (`exporter.weights.WeightReport`); an FP8 graph adds its e4m3 file
    and the files it links from its source graph (`quantize.graph`)."""

    mode: str  # WEIGHT_MODES
    report: dict  # the rest of WeightReport.to_dict(): requested, placement, shards, messages, bytes, ...
    fp8_file: str | None = None  # FP8 graphs: weights/fp8.bin, relative to the folder
    source_files: dict | None = None  # FP8 graphs: file -> how it came from the source graph's folder

    @property
    def messages(self) -> list[str]:
        return list(self.report.get("messages", []))

    def to_json(self) -> dict:
        fp8 = {} if self.fp8_file is None else {"fp8_file": self.fp8_file, "source_files": self.source_files}
        return {"mode": self.mode, **self.report, **fp8}

    @classmethod
    def from_json(cls, d: dict) -> Weights:
        report = {k: v for k, v in d.items() if k not in ("mode", "fp8_file", "source_files")}
        return cls(d["mode"], report, d.get("fp8_file"), d.get("source_files"))


@dataclass(frozen=True)
class TrtGraph:
    """model.trt.onnx, what TensorRT parses (`exporter.trt_graph`): its file and clover plugin nodes by op."""

    graph: str
    plugin_nodes: dict  # op type -> count

    def to_json(self) -> dict:
        return {"graph": self.graph, "plugin_nodes": self.plugin_nodes}

    @classmethod
    def from_json(cls, d: dict) -> TrtGraph:
        return cls(d["graph"], dict(d["plugin_nodes"]))


@dataclass(frozen=True)
class Quantization:
    """An FP8 graph's record (`quantize.graph`): the exported folder it was quantized from, and what was done."""

    source: str  # absolute path of the source graph's folder
    report: dict  # quantize.graph.Fp8Report.to_dict()

    def to_json(self) -> dict:
        return {**self.report, "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> Quantization:
        return cls(d["source"], {k: v for k, v in d.items() if k != "source"})


@dataclass(frozen=True)
class Engine:
    """The TensorRT engine built from this graph, beside it (`pipeline.stages`, `engines.builder.build_engine`)."""

    file: str  # the plan, relative to the folder
    graph: str  # the ONNX file it was parsed from: a weight-stripped plan is refit from it
    stripped: bool  # weights stripped from the plan: refit at load
    tensorrt: str  # the version that built it
    info: dict  # the rest of the builder's record: bytes, profiles, plugin layers, flags

    def to_json(self) -> dict:
        return {**self.info, "graph": self.graph, "stripped": self.stripped, "tensorrt": self.tensorrt}

    @classmethod
    def from_json(cls, file: str, d: dict) -> Engine:
        info = {k: v for k, v in d.items() if k not in ("graph", "stripped", "tensorrt")}
        return cls(file, d["graph"], bool(d["stripped"]), str(d["tensorrt"]), info)


@dataclass(frozen=True)
class Manifest:
    """manifest.json of an exported step graph, every field its writers write and its readers read.

    Written by `exporter.export` (a new export), `quantize.graph` (an FP8 graph: `quantization` set, `ops`
    and `weights` replaced) and the build's engine stage (`engine` set); read through `load`/`load_artifact`.
    The JSON keys are the field names, but for `engine` (the file, with the builder's record beside it as
    "engine_info") and the derived `format`, `format_version` and `config_fingerprint`."""

    config: CloverConfig
    model_dir: str  # the model folder it was exported from (absolute): the reference, tokenizer, checkpoint
    dtype: str  # "bf16" | "fp32": the graph's model dtype (recurrent states are always float32)
    block_size: int
    chunk: int  # causal rows of the prefill profile
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    profiles: tuple[Profile, ...]
    weights: Weights
    opset: int
    ir_version: int
    ops: dict = field(default_factory=dict)  # op contracts (`plugins.contracts.manifest_entry`)
    dynamic_dims: dict = field(default_factory=dict)  # dimension name -> what it counts
    tools: dict = field(default_factory=dict)  # package -> version
    created: str = ""
    graph: str = GRAPH
    weight_map: str = WEIGHT_MAP
    tensorrt: TrtGraph | None = None  # set by `ArtifactWriter` where model.trt.onnx is written
    quantization: Quantization | None = None  # FP8 graphs
    engine: Engine | None = None  # a built engine beside the graph

    @property
    def max_context(self) -> int:
        """The most cached positions the graph was made for: its profiles' largest pool_len."""
        return max(int(p.dims[POOL_LEN][-1]) for p in self.profiles)

    @property
    def max_batch(self) -> int:
        """The largest batch any profile allows."""
        return max(int(p.dims[BATCH][2]) for p in self.profiles)

    def replace(self, **changes) -> Manifest:
        return replace(self, **changes)

    def to_json(self) -> dict:
        out = {"format": FORMAT, "format_version": FORMAT_VERSION, "graph": self.graph,
               "weight_map": self.weight_map, "model_dir": self.model_dir, "config": self.config.to_dict(),
               "config_fingerprint": self.config.fingerprint(), "dtype": self.dtype, "block_size": self.block_size,
               "chunk": self.chunk, "opset": self.opset, "ir_version": self.ir_version,
               "inputs": [s.to_json() for s in self.inputs], "outputs": [s.to_json() for s in self.outputs],
               "dynamic_dims": self.dynamic_dims, "profiles": [p.to_json() for p in self.profiles],
               "ops": self.ops, "weights": self.weights.to_json(), "tools": self.tools, "created": self.created}
        optional = {"tensorrt": self.tensorrt, "quantization": self.quantization}
        out |= {k: v.to_json() for k, v in optional.items() if v is not None}
        if self.engine is not None:
            out |= {"engine": self.engine.file, "engine_info": self.engine.to_json()}
        return out

    def write(self, folder: str | Path) -> Path:
        """FOLDER/manifest.json, written atomically (a reader never sees half a manifest)."""
        path = Path(folder) / MANIFEST
        atomic_write(path, json.dumps(self.to_json(), indent=2).encode())
        return path

    @classmethod
    def from_json(cls, m: dict, source: str = "<dict>") -> Manifest:
        """The manifest of the JSON object `m` (read from `source`); raises KeyError / TypeError / ValueError
        on a missing or malformed field (`load` says which file)."""
        engine = Engine.from_json(m["engine"], m["engine_info"]) if isinstance(m.get("engine"), str) else None
        return cls(
            config=config_from_dict(m["config"], source=source), model_dir=m["model_dir"], dtype=m["dtype"],
            block_size=int(m["block_size"]), chunk=int(m["chunk"]),
            inputs=tuple(map(IOSpec.from_json, m["inputs"])), outputs=tuple(map(IOSpec.from_json, m["outputs"])),
            profiles=tuple(map(Profile.from_json, m["profiles"])), weights=Weights.from_json(m["weights"]),
            opset=int(m["opset"]), ir_version=int(m["ir_version"]), ops=m.get("ops", {}),
            dynamic_dims=m.get("dynamic_dims", {}), tools=m.get("tools", {}), created=m.get("created", ""),
            graph=m.get("graph", GRAPH), weight_map=m.get("weight_map", WEIGHT_MAP),
            tensorrt=TrtGraph.from_json(m["tensorrt"]) if "tensorrt" in m else None,
            quantization=Quantization.from_json(m["quantization"]) if "quantization" in m else None,
            engine=engine,
        )

    @classmethod
    def load(cls, folder: str | Path, component: str = "artifact") -> Manifest:
        """FOLDER/manifest.json; CloverError (as `component`) naming the file, and the versions when the
        folder was written by a clover-export of another format version."""
        mpath = Path(folder) / MANIFEST
        if not mpath.is_file():
            raise CloverError(component, f"{Path(folder)}: no {MANIFEST}",
                              "not an export folder (or an interrupted one); export again")
        try:
            m = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CloverError(component, f"{mpath}: not valid JSON ({e})", "export the folder again") from None
        _check_version(m, mpath, component)
        try:
            return cls.from_json(m, source=str(mpath))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CloverError(component, f"{mpath}: missing or malformed field ({e!r})", "export again") from None


def _check_version(m, mpath: Path, component: str) -> None:
    """A manifest of this format and version; else one line naming the file and both versions."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        what = f"format {m.get('format')!r}" if isinstance(m, dict) else "not a JSON object"
        raise CloverError(component, f"{mpath}: not a clover-export step-graph manifest ({what})",
                          "pass a folder written by `clover-export export`")
    if m.get("format_version") != FORMAT_VERSION:
        raise CloverError(component, f"{mpath}: written as {FORMAT} version {m.get('format_version')!r}; this "
                          f"clover-export reads version {FORMAT_VERSION}", "export the model again with this version")


@dataclass(frozen=True)
class Artifact:
    """An exported folder and its manifest (see `load_artifact`)."""

    dir: Path
    manifest: Manifest

    @property
    def graph_path(self) -> Path:
        return self.dir / self.manifest.graph

    @property
    def config(self) -> CloverConfig:
        return self.manifest.config

    @property
    def block_size(self) -> int:
        return self.manifest.block_size

    @property
    def chunk(self) -> int:
        return self.manifest.chunk

    @property
    def dtype(self) -> str:
        return self.manifest.dtype

    @property
    def inputs(self) -> tuple[IOSpec, ...]:
        return self.manifest.inputs

    @property
    def outputs(self) -> tuple[IOSpec, ...]:
        return self.manifest.outputs

    @property
    def weights_mode(self) -> str:
        return self.manifest.weights.mode

    @property
    def model_dir(self) -> Path:
        return Path(self.manifest.model_dir)

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
        return self.dir / self.manifest.weight_map

    def source_dir(self) -> Path:
        """The folder holding the tokenizer and generation config: the artifact itself (export copies them
        there: COMPANION_FILES), else the model folder it was exported from."""
        for d in (self.dir, self.model_dir):
            if (d / TOKENIZER_FILE).is_file():
                return d
        raise CloverError("runtime", f"{self.dir}: no {TOKENIZER_FILE} in the artifact or the model folder it "
                          f"names ({self.model_dir})", "copy the model's tokenizer files into the artifact folder")


def load_artifact(path: str | Path) -> Artifact:
    """Read `DIR/manifest.json` (written by `clover-export export`) into an `Artifact`.

    Raises CloverError naming the file and field when the folder is not a
    complete export or was written by an incompatible version.
    """
    d = Path(path)
    if not d.is_dir():
        raise CloverError("artifact", f"{d}: no such folder", "pass the folder written by `clover-export export`")
    art = Artifact(d, Manifest.load(d))
    if not art.graph_path.exists():
        raise CloverError("artifact", f"{art.graph_path}: graph file missing")
    return art


def read_weight_map(art: Artifact) -> dict[str, dict]:
    """Initializer name -> {"file", "offset", "length", "dtype", "shape"}; "file" relative to the folder or absolute."""
    try:
        return json.loads(art.weight_map_path.read_text())["tensors"]
    except FileNotFoundError:
        raise CloverError("artifact", f"{art.weight_map_path}: weight map missing") from None


def is_artifact(path: str | Path | None) -> bool:
    """An exported artifact folder is recognised by its manifest.json."""
    return path is not None and (Path(path) / MANIFEST).is_file()
