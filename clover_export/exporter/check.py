"""`clover-export check`: is an exported folder ready for TensorRT? (STEP_GRAPH.md 1-4)

Static checks only; it reports, it does not guess:
- opset 20 / IR 9 as pinned, for the model and every function;
- every node's operator is in TensorRT's ONNX parser matrix
  (`trt_onnx_operators.csv`), its input type is among the listed types, and
  each listed restriction that can be checked statically is (the others are
  listed as "not checked"); nodes of the custom ops' function bodies are
  checked too, as warnings: TensorRT runs the plugin, not the body;
- custom nodes: a known `clover` op with its function attached, the plugin
  attributes, attribute types TensorRT plugins accept (ints in int32 range,
  floats, strings, 1-D arrays);
- external data: relative paths without `..`, no symlinks, inside the
  folder, within the file (map mode: inside the mapped shards instead);
  which standard tools will read the folder and which refuse it (hard links:
  onnx >= 1.21; map mode: all but clover's loader) and what to do
  (`weights.READERS`, docs/exports.md), always printed by the CLI;
- every dynamic dimension of the graph's inputs and outputs is set by every
  optimisation profile of the manifest;
- `onnx.checker` (full check) on the graph without its external data;
- TensorRT (`_check_tensorrt`): the graph it parses is `model.trt.onnx`
  (engine-bound bf16 folders): no functions left (a missing plugin would
  silently become the function body), only known plugin ops, each with
  plugin_namespace / plugin_version and aot=1, the same external data as
  `model.onnx`; map-mode weights cannot reach TensorRT. The report names the
  graph, the plugin nodes by op and the minimum TensorRT version.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import AttributeProto, TensorProto

from clover_export.artifact import manifest as A
from clover_export.core.errors import CloverError
from clover_export.exporter.trace import IR_VERSION, OPSET
from clover_export.plugins.contracts import CONTRACTS, NAMESPACE, PLUGIN_VERSION

TRT_TABLE = Path(__file__).with_name("trt_onnx_operators.csv")
INT32 = (-(2**31), 2**31 - 1)
_TYPE_NAMES = {
    "FP32": TensorProto.FLOAT, "FP16": TensorProto.FLOAT16, "BF16": TensorProto.BFLOAT16,
    "INT32": TensorProto.INT32, "INT64": TensorProto.INT64, "INF64": TensorProto.INT64,  # typo in the source table
    "UINT8": TensorProto.UINT8, "INT8": TensorProto.INT8, "BOOL": TensorProto.BOOL,
    "FP8": TensorProto.FLOAT8E4M3FN, "INT4": TensorProto.INT4,
}
# which input carries the type the table lists (default: input 0)
_TYPED_INPUT = {"Where": 1, "Constant": None, "ConstantOfShape": None, "Shape": None, "Size": None, "Range": 0}
# restrictions checkable from the graph alone: op -> (input index that must be a constant, what the table says)
_CONST_INPUT = {
    **{op: 1 for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                        "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare", "Squeeze", "Unsqueeze", "CumSum")},
    "Slice": 3, "Pad": 3,
}
TOPK_MAX = 3840


@dataclass
class Finding:
    level: str  # "fail" | "warn" | "info"
    where: str
    message: str

    def __str__(self):
        return f"{self.level.upper():4} {self.where}: {self.message}"


@dataclass
class CheckReport:
    folder: Path
    findings: list[Finding] = field(default_factory=list)
    nodes_checked: int = 0
    tensorrt: list[str] = field(default_factory=list)  # what TensorRT would get (always shown by the CLI)
    readers: list[str] = field(default_factory=list)  # which tools read / refuse the folder (always shown)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "fail"]

    def add(self, level, where, message):
        self.findings.append(Finding(level, where, message))

    def format(self, only_failures: bool = False) -> str:
        shown = self.failures if only_failures else self.findings
        return "\n".join(f"  {f}" for f in shown)


def trt_table() -> dict[str, dict]:
    with open(TRT_TABLE, newline="") as f:
        return {
            r["operator"]: {
                "supported": r["supported"] == "Y",
                "types": {_TYPE_NAMES[t.strip()] for t in r["types"].split(",") if t.strip() in _TYPE_NAMES},
                "restrictions": r["restrictions"].strip(),
            }
            for r in csv.DictReader(f)
        }


def check_folder(folder: str | Path, proto: onnx.ModelProto | None = None, tensorrt: bool = True) -> CheckReport:
    """Run every check on an export folder (the graph is read without its external data).

    tensorrt=False skips the TensorRT rules (the exporter's own check of a map-mode folder, which is meant
    for ONNX Runtime only)."""
    folder = Path(folder)
    manifest = A.Manifest.load(folder, component="check")
    if proto is None:
        gpath = folder / manifest.graph
        try:
            proto = onnx.load(str(gpath), load_external_data=False)
        except Exception as e:  # onnx raises DecodeError / OSError
            raise CloverError("check", f"{gpath}: cannot read the graph ({e})") from None
    rep = CheckReport(folder)
    _check_versions(proto, rep)
    _check_checker(proto, rep)
    table = trt_table()
    _check_nodes(proto, table, rep)
    _check_custom_nodes(proto, rep)
    _check_external_data(proto, folder, manifest, rep)
    _check_profiles(proto, manifest, rep)
    if tensorrt:
        _check_tensorrt(folder, manifest, proto, rep)
    return rep


# --- versions and onnx.checker --------------------------------------------------
def _check_versions(proto, rep):
    if proto.ir_version != IR_VERSION:
        rep.add("fail", "model", f"IR version {proto.ir_version}, pinned {IR_VERSION}")
    want = {"": OPSET, NAMESPACE: int(PLUGIN_VERSION)}
    for where, imports in [("model", proto.opset_import)] + [
        (f"function {f.domain}::{f.name}", f.opset_import) for f in proto.functions
    ]:
        got = {o.domain: o.version for o in imports}
        if got.get("", OPSET) != OPSET or "" not in got:
            rep.add("fail", where, f"default-domain opset {got.get('')}, pinned {OPSET}")
        for dom in got:
            if dom not in want:
                rep.add("fail", where, f"imports unknown domain {dom!r}")
            elif got[dom] != want[dom]:
                rep.add("fail", where, f"domain {dom!r} version {got[dom]}, pinned {want[dom]}")


def _check_checker(proto, rep):
    """onnx.checker on the graph with its external initializers turned into typed graph inputs: the checker
    would otherwise open the data files relative to the working directory (`_check_external_data` checks them)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    external = [t for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    keep = [t for t in m.graph.initializer if t.data_location != TensorProto.EXTERNAL]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    m.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    try:
        onnx.checker.check_model(m, full_check=True)
    except onnx.checker.ValidationError as e:
        rep.add("fail", "onnx.checker", str(e).splitlines()[0])
    except onnx.shape_inference.InferenceError as e:
        rep.add("fail", "onnx shape inference", str(e).splitlines()[0])


# --- operators, types, restrictions ------------------------------------------------
def _types(proto) -> dict[str, int]:
    """Value name -> element type, from shape inference over the graph with its functions inlined."""
    from onnx import inliner, shape_inference

    inlined = inliner.inline_local_functions(proto)
    inferred = shape_inference.infer_shapes(inlined)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output) + list(g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types, inlined


def _check_nodes(proto, table, rep):
    types, inlined = _types(proto)
    main_outputs = {o for n in proto.graph.node for o in n.output}
    consts = {t.name for t in inlined.graph.initializer} | {
        o for n in inlined.graph.node if n.op_type == "Constant" for o in n.output}
    not_checked: dict[str, str] = {}
    for node, in_body in _walk(inlined.graph, main_outputs):
        rep.nodes_checked += 1
        if node.domain not in ("", "ai.onnx"):
            continue  # custom nodes: _check_custom_nodes
        level = "warn" if in_body else "fail"
        where = f"{'function body ' if in_body else ''}{node.op_type} '{node.name or node.output[0]}'"
        row = table.get(node.op_type)
        if row is None or not row["supported"]:
            rep.add(level, where, "operator not supported by TensorRT's ONNX parser"
                    + (" (not in its table)" if row is None else ""))
            continue
        idx = _TYPED_INPUT.get(node.op_type, 0)
        if idx is not None and idx < len(node.input) and node.input[idx]:
            t = types.get(node.input[idx], 0)
            if t and row["types"] and t not in row["types"]:
                rep.add(
                    level, where, f"input type {TensorProto.DataType.Name(t)} not among TensorRT's {_type_list(row)}"
                )
        problem = _restriction(node, consts)
        if problem:
            rep.add(level, where, problem)
        elif row["restrictions"] and node.op_type not in _CHECKED_OPS:
            not_checked.setdefault(node.op_type, row["restrictions"])
    for op, text in sorted(not_checked.items()):
        rep.add("info", op, f"restriction not checked statically: {text}")


def _walk(graph, main_outputs, in_body=None):
    for node in graph.node:
        body = in_body if in_body is not None else not (set(node.output) <= main_outputs)
        yield node, body
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from _walk(attr.g, main_outputs, body)


_CHECKED_OPS = set(_CONST_INPUT) | {"ScatterND", "Constant"}  # TopK: `sorted` checked, K often is not constant


def _restriction(node, consts) -> str | None:
    """The table's restriction for this node, where the graph alone can decide it."""
    op = node.op_type
    if op in _CONST_INPUT:
        i = _CONST_INPUT[op]
        if i < len(node.input) and node.input[i] and node.input[i] not in consts:
            return f"input {i} (axes) must be a build-time constant (initializer), it is computed at run time"
    attrs = {a.name: a for a in node.attribute}
    if op == "TopK":
        if "sorted" in attrs and attrs["sorted"].i != 1:
            return "`sorted` must be 1"
    if op == "ScatterND" and "reduction" in attrs and attrs["reduction"].s not in (b"", b"none"):
        return "`reduction` is not supported"
    if op == "Constant" and set(attrs) & {"sparse_value", "value_string", "value_strings"}:
        return "`sparse_value`, `value_string`, `value_strings` are unsupported"
    return None


def _type_list(row) -> str:
    return ", ".join(sorted(TensorProto.DataType.Name(t) for t in row["types"]))


# --- custom nodes -------------------------------------------------------------
def _check_custom_nodes(proto, rep):
    functions = {(f.domain, f.name) for f in proto.functions}
    for node in proto.graph.node:
        if node.domain in ("", "ai.onnx"):
            continue
        where = f"{node.domain}::{node.op_type} '{node.name or node.output[0]}'"
        contract = CONTRACTS.get(node.op_type)
        if node.domain != NAMESPACE or contract is None:
            rep.add("fail", where, "unknown custom operator (no contract, no TensorRT plugin)")
            continue
        if (node.domain, node.op_type) not in functions:
            rep.add("fail", where, "no model-local function attached (ONNX Runtime could not run it)")
        _check_plugin_node(node, contract, where, rep)


def _check_plugin_node(node, contract, where: str, rep, extra: tuple = (), why: str = "") -> dict:
    """What every clover plugin node needs, in model.onnx and model.trt.onnx alike: plugin_namespace and
    plugin_version (STEP_GRAPH.md 2), exactly the contract's attributes besides those and `extra` (whose
    values the caller checks), values TensorRT's plugin API accepts, the contract's inputs and outputs.
    Returns the node's attributes by name."""
    attrs = {a.name: a for a in node.attribute}
    for key, want in (("plugin_namespace", NAMESPACE), ("plugin_version", PLUGIN_VERSION)):
        got = attrs[key].s.decode() if key in attrs and attrs[key].type == AttributeProto.STRING else None
        if got != want:
            rep.add("fail", where, f"attribute {key} is {got!r}, expected {want!r}{why}")
    meta = {"plugin_namespace", "plugin_version", *extra}
    expected = {a.name for a in contract.attributes} | meta
    for name in sorted(expected - set(attrs) - meta):
        rep.add("fail", where, f"attribute {name} missing")
    for name in sorted(set(attrs) - expected):
        rep.add("fail", where, f"attribute {name} is not in the contract")
    for a in attrs.values():
        bad = _plugin_attr_problem(a)
        if bad:
            rep.add("fail", where, f"attribute {a.name}: {bad}")
    if len(node.input) != len(contract.inputs) or len(node.output) != len(contract.outputs):
        rep.add("fail", where, f"{len(node.input)} inputs / {len(node.output)} outputs, contract has "
                f"{len(contract.inputs)} / {len(contract.outputs)}")
    return attrs


def _plugin_attr_problem(a) -> str | None:
    """TensorRT plugin fields: int (int32 range), float, str, or 1-D arrays of those."""
    if a.type == AttributeProto.INT:
        return None if INT32[0] <= a.i <= INT32[1] else f"{a.i} outside the int32 range"
    if a.type == AttributeProto.INTS:
        return None if all(INT32[0] <= v <= INT32[1] for v in a.ints) else "values outside the int32 range"
    if a.type in (AttributeProto.FLOAT, AttributeProto.STRING, AttributeProto.FLOATS):
        return None
    return f"type {AttributeProto.AttributeType.Name(a.type)} is not a TensorRT plugin field type"


# --- external data ----------------------------------------------------------------
def _check_external_data(proto, folder: Path, manifest: A.Manifest, rep):
    mode = manifest.weights.mode
    wmap = {}
    if mode == "map":
        wmap = json.loads((folder / manifest.weight_map).read_text())["tensors"]
    sizes: dict[Path, int] = {}
    hard: dict[str, int] = {}  # location -> its link count
    root = folder.resolve()
    problems: dict[str, str | None] = {}  # per location (a few shards for ~1000 initializers)

    def path_problem(loc: str) -> str | None:
        """What the file system says of a relative location: checked once per location."""
        if loc not in problems:
            if _has_symlink(folder, Path(loc)):
                problems[loc] = f"{loc} is or passes through a symlink (onnx and ONNX Runtime reject them)"
            elif root not in (folder / loc).resolve().parents:
                problems[loc] = f"{loc} resolves outside the folder"
            else:
                problems[loc] = None
        return problems[loc]

    for t in proto.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        where = f"initializer '{t.name}'"
        if not loc or os.path.isabs(loc) or "\\" in loc or ".." in Path(loc).parts:
            rep.add("fail", where, f"external data location {loc!r} must be relative, without '..'")
            continue
        path = folder / loc
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
        if mode == "map" and not wmap.get(t.name, {}).get("converted", True):
            path = Path(wmap[t.name]["file"])  # mapped: the shard in place, read by ort_session
            offset, length = wmap[t.name]["offset"], wmap[t.name]["length"]
        elif why := path_problem(loc):
            rep.add("fail", where, why)
            continue
        if path not in sizes:
            if not path.exists():
                rep.add("fail", where, f"{path} does not exist")
                sizes[path] = -1
                continue
            st = path.stat()
            sizes[path] = st.st_size
            if st.st_nlink > 1 and mode != "map":
                hard[loc] = st.st_nlink
        if sizes[path] >= 0 and offset + max(length, 0) > sizes[path]:
            rep.add(
                "fail", where, f"bytes {offset}..{offset + length} lie beyond the end of {path} ({sizes[path]} bytes)"
            )
    for loc in sorted(hard):
        rep.add("warn", loc, f"hard link ({hard[loc]} links): onnx >= 1.21 refuses it (\"potential hardlink "
                "attack\"); ONNX Runtime and TensorRT read it")
    if mode == "map":
        rep.add("info", "weights", "map mode: external data is supplied from weights.json "
                "(ONNX Runtime only: clover_export.exporter.session.ort_session)")
    _report_readers(rep, "mapped" if mode == "map" else "hardlink" if hard else "copy", hard)


def _report_readers(rep, placement: str, hard: dict[str, int]) -> None:
    """Which tools read the folder as it is now on disk (a copied or reflinked shard is a plain file, so
    both report as "copy"; hard links are seen by their link count, whatever the manifest says)."""
    from clover_export.exporter.weights import REMEDY, read_by, refused_by

    if placement == "copy":
        rep.readers.append("external data: plain files inside the folder, read by every tool ("
                           + ", ".join(read_by("copy", short=True)) + ")")
        return
    what = {"hardlink": "hard links (" + ", ".join(f"{loc}: {n} links" for loc, n in sorted(hard.items())) + ")",
            "mapped": "not in the folder (map mode: the checkpoint is referenced in place through weights.json)"}
    rep.readers.append(f"external data: {what[placement]}")
    rep.readers.append("  refused by: " + "; ".join(refused_by(placement)))
    if read_by(placement):
        rep.readers.append("  read by: " + "; ".join(read_by(placement)))
    rep.readers.append(f"  what to do: {REMEDY[placement]}")


def _has_symlink(folder: Path, rel: Path) -> bool:
    cur = folder
    for part in rel.parts:
        cur = cur / part
        if cur.is_symlink():
            return True
    return False


# --- profiles -----------------------------------------------------------------------
def _check_profiles(proto, manifest: A.Manifest, rep):
    profiles = manifest.profiles
    if not profiles:
        rep.add("fail", "manifest", "no optimisation profiles")
    for vi in list(proto.graph.input) + list(proto.graph.output):
        for i, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                continue
            if not d.HasField("dim_param"):
                rep.add("fail", vi.name, f"dimension {i} is unnamed and dynamic: no profile can cover it")
                continue
            for p in profiles:
                r = p.dims.get(d.dim_param)
                if not r or len(r) != 3 or not (1 <= r[0] <= r[1] <= r[2]):
                    rep.add(
                        "fail",
                        vi.name,
                        f"dimension {d.dim_param!r} has no valid min/opt/max in profile {p.name!r}",
                    )


# --- TensorRT: model.trt.onnx ------------------------------------------------------
def _check_tensorrt(folder: Path, manifest: A.Manifest, proto, rep):
    from clover_export.exporter.trt_graph import AOT_ATTR, TRT_GRAPH, plugin_nodes
    from clover_export.plugins.contracts import TRT_CONTRACTS
    from clover_export.plugins.trt.versions import FEATURES, MIN_TENSORRT, version_text

    if manifest.weights.mode == "map":
        rep.add("fail", "weights", "map mode (the checkpoint referenced in place through weights.json) cannot reach "
                "TensorRT, which reads external data from files beside the graph: export with --weights link or copy")
        rep.tensorrt.append("TensorRT: no graph (map-mode weights)")
        return
    name = manifest.tensorrt.graph if manifest.tensorrt else TRT_GRAPH
    path = folder / name
    if not path.exists():
        if manifest.dtype == "fp32":
            rep.add("info", TRT_GRAPH, "fp32 graph, for ONNX Runtime: TensorRT engines are built from bf16 graphs")
            rep.tensorrt.append("TensorRT: not an engine-bound graph (fp32)")
        else:
            rep.add("fail", TRT_GRAPH, f"missing: TensorRT parses {TRT_GRAPH}, not {A.GRAPH} (export the folder again)")
        return
    try:
        trt = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError / OSError
        rep.add("fail", TRT_GRAPH, f"cannot read the graph ({e})")
        return
    for f in trt.functions:
        rep.add("fail", f"{TRT_GRAPH} function {f.domain}::{f.name}", "a model-local function is left: TensorRT "
                "would silently import its body instead of a missing plugin (no aliasing, no plugin)")
    if trt.ir_version != IR_VERSION or {o.domain: o.version for o in trt.opset_import}.get("") != OPSET:
        rep.add("fail", TRT_GRAPH, f"IR {trt.ir_version} / opset not pinned at IR {IR_VERSION} / opset {OPSET}")
    for node in trt.graph.node:
        if node.domain in ("", "ai.onnx"):
            continue
        where = f"{TRT_GRAPH} {node.domain}::{node.op_type} '{node.name or node.output[0]}'"
        contract = TRT_CONTRACTS.get(node.op_type)
        if node.domain != NAMESPACE or contract is None:
            rep.add("fail", where, "not a clover TensorRT plugin op" + (
                " (CoresetMoE must be split into its AOT sub-ops)" if node.op_type.startswith("CoresetMoE") else ""))
            continue
        attrs = _check_plugin_node(node, contract, where, rep, extra=(AOT_ATTR,),
                                   why=": without it the parser does not look for a plugin")
        if AOT_ATTR not in attrs or attrs[AOT_ATTR].type != AttributeProto.INT or attrs[AOT_ATTR].i != 1:
            rep.add("fail", where, f"attribute {AOT_ATTR}=1 missing: the plugin has only an AOT implementation")
    ext = lambda p: {t.name: [(e.key, e.value) for e in t.external_data] for t in p.graph.initializer}  # noqa: E731
    mine, theirs = ext(trt), ext(proto)
    for t in sorted(set(mine) ^ set(theirs)):
        rep.add("fail", f"{TRT_GRAPH} initializer '{t}'", f"only in {TRT_GRAPH if t in mine else A.GRAPH}")
    for t in sorted(set(mine) & set(theirs)):
        if mine[t] != theirs[t]:
            rep.add("fail", f"{TRT_GRAPH} initializer '{t}'", f"external data differs from {A.GRAPH}")
    counts = plugin_nodes(trt)
    rep.tensorrt.append(f"TensorRT parses {name}: {sum(counts.values())} plugin nodes in namespace {NAMESPACE} ("
                        + ", ".join(f"{op} {n}" for op, n in sorted(counts.items())) + "), one plugin layer each")
    left = [f"{f.domain}::{f.name}" for f in trt.functions]
    rep.tensorrt.append("clover functions left: " + (", ".join(left) if left else "none"))
    needs = [f.name for f in FEATURES if f.since == MIN_TENSORRT]
    rep.tensorrt.append(f"minimum TensorRT {version_text()} ({'; '.join(needs)})")
