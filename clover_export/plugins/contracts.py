"""The custom ops, each described once (STEP_GRAPH.md 2, 4).

The exported step graph uses three (`BlockGDN`, `BlockAttention`,
`CoresetMoE`, the model's `Cores`); the FP8 graph (`quantize/graph.py`)
replaces each `CoresetMoE` by `CoresetMoEFP8`, the same op on e4m3 expert
weights with fp32 per-output-channel scales (`variant_of`).

Plain data, no torch / onnx / tensorrt import: the torch custom ops
(`torch_ops.py`), the ONNX emitters and function bodies (`onnx_ops.py`),
the Triton kernels and the TensorRT plugin registrations all read these.

Conventions
- Inputs come first, then attributes, in the argument order of the
  plain-torch core named by `reference` (that core *is* the op's semantics).
- Shapes are tuples of symbolic dimension names. A name that is also an
  attribute takes the attribute's value. Every name of an output shape is
  bound by some input shape or attribute (`output_shapes` resolves them).
- dtype rules: "float" (any of FLOAT_DTYPES: the graph's model dtype or
  float32), a fixed dtype of FIXED_DTYPES ("float32", "int32",
  "float8_e4m3fn": e4m3 weights, torch's name), or "like:<input>" (same
  dtype as that input).
- `aliases`: output -> input it updates in place on TensorRT (the plugin
  declares the alias; nothing is copied). ONNX function bodies compute the
  same values functionally.
- Per batch row the step holds C = T - block_size causal rows (the first
  `n_causal` valid, left-aligned) followed by block_size block rows
  (STEP_GRAPH.md 1). Causal rows update the row's cache slot `slot_ids[b]`;
  block rows only read it. `slot_ids` are unique within a step.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

NAMESPACE = "clover"  # ONNX domain, TensorRT plugin namespace, torch.library namespace
PLUGIN_VERSION = "1"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
FIXED_DTYPES = ("float32", "int32", "float8_e4m3fn")  # torch.<name>; ONNX float8e4m3fn
ATTR_TYPES = ("int", "float", "bool")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[str, ...]
    dtype: str  # "float" | one of FIXED_DTYPES | "like:<input name>"
    doc: str = ""

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class AttrSpec:
    name: str
    type: str  # one of ATTR_TYPES; bool travels as an int 0/1 in ONNX
    doc: str = ""


@dataclass(frozen=True)
class OpContract:
    name: str
    reference: str  # "module:function" of the plain-torch core
    inputs: tuple[TensorSpec, ...]
    attributes: tuple[AttrSpec, ...]
    outputs: tuple[TensorSpec, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # output name -> input name
    doc: str = ""
    variant_of: str = ""  # a quantized form of that op (the exporter emits the base op; quantize/graph.py rewrites)
    namespace: str = NAMESPACE
    version: str = PLUGIN_VERSION

    @property
    def qualname(self) -> str:
        return f"{self.namespace}::{self.name}"

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["qualname"] = self.qualname
        return d

    def fingerprint(self) -> str:
        """Hash of everything a kernel or plugin depends on (docs included: they carry the semantics)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _t(name: str, shape: str, dtype: str, doc: str = "") -> TensorSpec:
    return TensorSpec(name, tuple(shape.split()), dtype, doc)


BLOCK_GDN = OpContract(
    name="BlockGDN",
    reference="clover_export.model.gdn:gdn_core",
    doc=(
        "Gated DeltaNet core over a step's rows (MODEL.md 4, 5.2). Causal rows: depthwise causal conv "
        "reading the slot's conv state, SiLU, L2-normalised q/k (q scaled by dk^-1/2), "
        "beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), gated delta rule from the slot's "
        "recurrent state; padding rows (>= n_causal) change nothing. Block rows: causal + anti-causal "
        "conv from the state after the causal rows, then the [assumed] block mixer. Output before the "
        "gated norm. v-head j uses k-head floor(j Hk / Hv)."
    ),
    inputs=(
        _t("mixed_qkv", "B T C", "float", "pre-conv projections x W_qkv^T, rows q|k|v"),
        _t("a", "B T Hv", "like:mixed_qkv", "x W_a^T"),
        _t("b", "B T Hv", "like:mixed_qkv", "x W_b^T"),
        _t("conv_w", "C K", "float", "causal depthwise conv taps; tap K-1 multiplies the current row"),
        _t("conv_w_right", "C K", "float", "[assumed] anti-causal taps; tap 0 multiplies the current row"),
        _t("A_log", "Hv", "float"),
        _t("dt_bias", "Hv", "float"),
        _t("block_scale", "Hv", "float", "[assumed] block softmax scale, used as stored"),
        _t("block_gate", "Hv", "float", "[assumed] block output gate (sigmoid)"),
        _t("conv_pool", "S C Km1", "like:mixed_qkv", "slot pool: last K-1 pre-conv rows"),
        _t("rec_pool", "S Hv dk dv", "float32", "slot pool: recurrent state"),
        _t("slot_ids", "B", "int32"),
        _t("n_causal", "B", "int32", "valid causal rows (0..C)"),
    ),
    attributes=(
        AttrSpec("num_k_heads", "int", "Hk"),
        AttrSpec("head_k_dim", "int", "dk"),
        AttrSpec("head_v_dim", "int", "dv"),
        AttrSpec("block_size", "int", "N: the last N rows of T are block rows"),
    ),
    outputs=(
        _t("o", "B T Hv head_v_dim", "like:mixed_qkv", "core output per v-head, before the gated norm"),
        _t("conv_pool_out", "S C Km1", "like:conv_pool"),
        _t("rec_pool_out", "S Hv dk dv", "like:rec_pool"),
    ),
    aliases={"conv_pool_out": "conv_pool", "rec_pool_out": "rec_pool"},
)

BLOCK_ATTENTION = OpContract(
    name="BlockAttention",
    reference="clover_export.model.attention:attention_core",
    doc=(
        "Softmax attention of the step's rows against the slot's cached K/V (MODEL.md 4, 5.1). "
        "Causal row j sees cached positions < past_len + j + 1 after the step's valid causal rows "
        "are written at past_len + j (j < n_causal); block rows see positions < past_len + n_causal "
        "and the whole block. GQA: q-head h uses kv-head floor(h Hkv / H). Scores scaled by `scale`."
    ),
    inputs=(
        _t("q", "B T H hd", "float", "after q_norm and RoPE"),
        _t("k", "B T Hkv hd", "like:q", "after k_norm and RoPE"),
        _t("v", "B T Hkv hd", "like:q"),
        _t("key_pool", "S Hkv L hd", "like:q"),
        _t("value_pool", "S Hkv L hd", "like:q"),
        _t("slot_ids", "B", "int32"),
        _t("past_len", "B", "int32", "cached length of the slot = position of the first causal row"),
        _t("n_causal", "B", "int32"),
    ),
    attributes=(
        AttrSpec("block_size", "int", "N: the last N rows of T are block rows"),
        AttrSpec("scale", "float", "score scale, hd^-1/2"),
    ),
    outputs=(
        _t("o", "B T H hd", "like:q"),
        _t("key_pool_out", "S Hkv L hd", "like:key_pool"),
        _t("value_pool_out", "S Hkv L hd", "like:value_pool"),
    ),
    aliases={"key_pool_out": "key_pool", "value_pool_out": "value_pool"},
)

CORESET_MOE = OpContract(
    name="CoresetMoE",
    reference="clover_export.model.moe:moe_core",
    doc=(
        "Routed experts (MODEL.md 4, 5.3): p = softmax_fp32(x W_router^T); causal rows take plain "
        "top-k; block rows (per batch row) take top-min(k, |set|) within the block's expert coreset "
        "when `coreset` is set; weights renormalised, cast to x's dtype; expert e: "
        "W_down[e] (silu(g) * u) with [g; u] = W_gate_up[e] x. Ties go to the lower expert id. "
        "Also returns the number of distinct experts the block rows chose per batch row."
    ),
    inputs=(
        _t("x", "B T D", "float", "post-attention-normalised hidden states"),
        _t("router_w", "E D", "like:x"),
        _t("gate_up", "E I2 D", "like:x", "rows: gate (I) then up (I)"),
        _t("down", "E D I", "like:x"),
    ),
    attributes=(
        AttrSpec("top_k", "int"),
        AttrSpec("top_p", "float", "coreset mass fraction"),
        AttrSpec("coreset", "bool", "route block rows within the block coreset"),
        AttrSpec("block_size", "int", "N: the last N rows of T are block rows"),
    ),
    outputs=(
        _t("routed", "B T D", "like:x", "routed expert output (shared expert stays outside)"),
        _t("coreset_size", "B", "int32", "distinct experts chosen by the block rows"),
    ),
)

CORESET_MOE_FP8 = OpContract(
    name="CoresetMoEFP8",
    reference="clover_export.model.moe:moe_core_fp8",
    variant_of=CORESET_MOE.name,
    doc=(
        "CoresetMoE with e4m3 (float8e4m3fn) expert weights (STEP_GRAPH.md 4): W = fp8 * scale, one fp32 "
        "scale per output channel (row), cast to x's dtype; then exactly CoresetMoE. Activations and the "
        "router stay in the model dtype."
    ),
    inputs=(
        CORESET_MOE.input("x"),
        CORESET_MOE.input("router_w"),
        _t("gate_up_fp8", "E I2 D", "float8_e4m3fn", "rows: gate (I) then up (I)"),
        _t("gate_up_scale", "E I2", "float32", "per output channel"),
        _t("down_fp8", "E D I", "float8_e4m3fn"),
        _t("down_scale", "E D", "float32", "per output channel"),
    ),
    attributes=CORESET_MOE.attributes,
    outputs=CORESET_MOE.outputs,
)

CONTRACTS: dict[str, OpContract] = {c.name: c for c in (BLOCK_GDN, BLOCK_ATTENTION, CORESET_MOE, CORESET_MOE_FP8)}
STEP_OPS = tuple(c.name for c in CONTRACTS.values() if not c.variant_of)  # what the exporter's graph holds

# ---- the MoE as single-kernel sub-ops: what `model.trt.onnx` holds instead of CoresetMoE(FP8) (STEP_GRAPH.md 2, 4)
# A TensorRT AOT plugin is exactly one kernel launch with no workspace, so the MoE is split with its
# intermediates as graph tensors: router logits (a standard MatMul), MoERoute, MoEAlign, MoEGateUp,
# MoEDown, MoECombine. "Pairs" are the B*T*top_k (token, slot) routing choices, row-major over [B, T, top_k].
_SUB = "clover_export.model.moe_split:"
_ROUTING_ATTRS = CORESET_MOE.attributes
_E_ATTR = AttrSpec("num_experts", "int", "E: routing ids are 0..E-1, E marks an unused slot")
MOE_ROUTE = OpContract(
    name="MoERoute", reference=_SUB + "route_core",
    doc="Routing of CoresetMoE from the router logits: softmax_fp32, top-k / block coreset, renormalised weights "
        "cast to the logits' dtype; unused slots (fewer than k kept experts) get id E and weight 0.",
    inputs=(_t("logits", "B T E", "float", "x W_router^T in the model dtype"),),
    attributes=_ROUTING_ATTRS,
    outputs=(_t("idx", "B T top_k", "int32"), _t("w", "B T top_k", "like:logits"),
             _t("coreset_size", "B", "int32", "distinct experts chosen by the block rows")),
)
MOE_ALIGN = OpContract(
    name="MoEAlign", reference=_SUB + "align_core",
    doc="Pairs grouped by expert (a stable counting sort): order[r] = pair index, expert e owns "
        "order[offsets[e]:offsets[e+1]]; unused pairs (id E) come last, from offsets[E].",
    inputs=(_t("idx", "B T top_k", "int32"),),
    attributes=(_E_ATTR,),
    outputs=(_t("offsets", "num_experts+1", "int32"), _t("order", "B T top_k", "int32")),
)
_GU_DOC = ("h[pair] = silu(g) * u with [g; u] = W_gate_up[e] x[token], rounded to the model dtype like the "
           "reference; rows of unused pairs are not written")
MOE_GATE_UP = OpContract(
    name="MoEGateUp", reference=_SUB + "gate_up_core", doc=_GU_DOC,
    inputs=(CORESET_MOE.input("x"), CORESET_MOE.input("gate_up"), _t("offsets", "E1", "int32"),
            _t("order", "B T top_k", "int32")),
    attributes=(),
    outputs=(_t("h", "B T top_k I2/2", "like:x"),),
)
MOE_GATE_UP_FP8 = OpContract(
    name="MoEGateUpFP8", reference=_SUB + "gate_up_fp8_core", doc=_GU_DOC,
    inputs=(CORESET_MOE.input("x"), CORESET_MOE_FP8.input("gate_up_fp8"), CORESET_MOE_FP8.input("gate_up_scale"),
            _t("offsets", "E1", "int32"), _t("order", "B T top_k", "int32")),
    attributes=(),
    outputs=(_t("h", "B T top_k I2/2", "like:x"),),
)
_DOWN_DOC = "y[pair] = (W_down[e] h[pair]) * w[pair], rounded like the reference; rows of unused pairs are not written"
MOE_DOWN = OpContract(
    name="MoEDown", reference=_SUB + "down_core", doc=_DOWN_DOC,
    inputs=(_t("h", "B T top_k I", "float"), _t("down", "E D I", "like:h"), _t("w", "B T top_k", "like:h"),
            _t("offsets", "E1", "int32"), _t("order", "B T top_k", "int32")),
    attributes=(),
    outputs=(_t("y", "B T top_k D", "like:h"),),
)
MOE_DOWN_FP8 = OpContract(
    name="MoEDownFP8", reference=_SUB + "down_fp8_core", doc=_DOWN_DOC,
    inputs=(_t("h", "B T top_k I", "float"), CORESET_MOE_FP8.input("down_fp8"), CORESET_MOE_FP8.input("down_scale"),
            _t("w", "B T top_k", "like:h"), _t("offsets", "E1", "int32"), _t("order", "B T top_k", "int32")),
    attributes=(),
    outputs=(_t("y", "B T top_k D", "like:h"),),
)
MOE_COMBINE = OpContract(
    name="MoECombine", reference=_SUB + "combine_core",
    doc="routed[token] = sum over the token's used pairs of y (fp32), cast to y's dtype.",
    inputs=(_t("y", "B T top_k D", "float"), _t("idx", "B T top_k", "int32")),
    attributes=(_E_ATTR,),
    outputs=(_t("routed", "B T D", "like:y"),),
)
MOE_SUBOPS: dict[str, OpContract] = {c.name: c for c in (MOE_ROUTE, MOE_ALIGN, MOE_GATE_UP, MOE_GATE_UP_FP8, MOE_DOWN,
                                                          MOE_DOWN_FP8, MOE_COMBINE)}

# ---- BlockAttention's split-KV form on TensorRT: two single-kernel sub-ops, the partials a graph tensor
# (`exporter/trt_graph.py` splits a BlockAttention node when the pools hold >= 2048 positions). The partials are
# S x B x T query rows flattened, S = the split count (launch.attention_splits, a non-monotone expression of B and
# T). TensorRT sizes activations from each dimension's upper bound over the profile, so a [S, B, T, ...] shape
# would be allocated at cap x max B x max T; "rows" is instead a monotone bound on S x B x T
# (launch.attention_partial_rows, computed by the plan), and the split kernel writes S itself for the merge.
_SPLIT = "clover_export.model.attention_split:"
BLOCK_ATTENTION_SPLIT = OpContract(
    name="BlockAttentionSplit", reference=_SPLIT + "split_core",
    doc="BlockAttention's pool update and, per split s of the visible prefix (the block's own K/V in the last), "
        "unnormalised base-2 partials of query row r = (b, t, h) at row s * B * T + (b * T + t): "
        "m = max(score * scale * log2 e), l = sum 2^(. - m), acc = sum 2^(. - m) v; an empty split has "
        "m = -1e30, l = 0. Rows past S * B * T are not written; `splits` holds S.",
    inputs=BLOCK_ATTENTION.inputs,
    attributes=(*BLOCK_ATTENTION.attributes,
                AttrSpec("max_splits", "int", "the most splits: launch.attention_split_cap of the pools' capacity")),
    outputs=(_t("acc", "rows H hd", "float32"), _t("ml", "rows H 2", "float32", "(m, l)"),
             _t("splits", "1", "int32", "S, the split count the kernel ran"), *BLOCK_ATTENTION.outputs[1:]),
    aliases=BLOCK_ATTENTION.aliases,
)
BLOCK_ATTENTION_MERGE = OpContract(
    name="BlockAttentionMerge", reference=_SPLIT + "merge_core",
    doc="o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s, over the first S = splits[0] "
        "partials of each query row, in q's dtype (q is not read).",
    inputs=(_t("acc", "rows H hd", "float32"), _t("ml", "rows H 2", "float32"), _t("splits", "1", "int32"),
            _t("q", "B T H hd", "float", "gives o its shape and dtype; not read")),
    attributes=(),
    outputs=(_t("o", "B T H hd", "like:q"),),
)
ATTENTION_SPLIT_OPS: dict[str, OpContract] = {c.name: c for c in (BLOCK_ATTENTION_SPLIT, BLOCK_ATTENTION_MERGE)}
# every plugin TensorRT sees: the ops of `model.trt.onnx` (all AOT: one Triton kernel each, no Python per step)
TRT_CONTRACTS: dict[str, OpContract] = {BLOCK_GDN.name: BLOCK_GDN, BLOCK_ATTENTION.name: BLOCK_ATTENTION,
                                        **ATTENTION_SPLIT_OPS, **MOE_SUBOPS}


def bind_dims(contract: OpContract, shapes: dict[str, tuple], attrs: dict[str, object],
              derived: dict[str, object] | None = None) -> dict[str, object]:
    """Symbolic dim name -> value, from input shapes and attributes; raises ValueError on a mismatch.

    Values may be ints or symbolic sizes (torch SymInt under fake tensors): those are bound, not compared.
    `derived`: dims no input carries (BlockAttentionSplit's partial "rows", computed by the plan).
    """
    dims: dict[str, object] = {a.name: attrs[a.name] for a in contract.attributes if a.name in attrs}
    dims.update(derived or {})
    for spec in contract.inputs:
        shape = tuple(shapes[spec.name])
        if len(shape) != spec.rank:
            raise ValueError(
                f"{contract.qualname}: input '{spec.name}' has rank {len(shape)}, expected {spec.rank} {spec.shape}"
            )
        for dim, size in zip(spec.shape, shape):
            if dim.isdigit():  # a fixed size
                if isinstance(size, int) and size != int(dim):
                    raise ValueError(f"{contract.qualname}: input '{spec.name}' has {size} where {dim} is fixed")
            elif dim not in dims:
                dims[dim] = size
            elif isinstance(size, int) and isinstance(dims[dim], int) and dims[dim] != size:
                raise ValueError(
                    f"{contract.qualname}: input '{spec.name}' dim {dim} is {size}, elsewhere {dims[dim]}"
                )
    return dims


def output_shapes(contract: OpContract, shapes: dict[str, tuple], attrs: dict[str, object],
                  derived: dict[str, object] | None = None) -> list[tuple]:
    dims = bind_dims(contract, shapes, attrs, derived)
    return [tuple(_dim(d, dims) for d in spec.shape) for spec in contract.outputs]


def _dim(name: str, dims: dict[str, object]):
    """A bound dim, or "<dim>+<int>" / "<dim>/<int>" of one (ints or TensorRT shape expressions)."""
    if name.isdigit():
        return int(name)
    if "+" in name:
        base, k = name.split("+")
        return dims[base] + int(k)
    if "/" in name:
        base, k = name.split("/")
        if isinstance(dims[base], int) and dims[base] % int(k):
            raise ValueError(f"dim {base} = {dims[base]} is not a multiple of {k}")
        return dims[base] // int(k)
    return dims[name]


def output_dtype_source(spec: TensorSpec) -> str | None:
    """For "like:<input>" rules the input name; None for fixed dtypes."""
    return spec.dtype.split(":", 1)[1] if spec.dtype.startswith("like:") else None


def manifest_entry(names=STEP_OPS) -> dict[str, dict]:
    """What an artifact records about the ops it uses (contract names; default: the exported graph's)."""
    return {CONTRACTS[n].qualname: {"version": CONTRACTS[n].version, "fingerprint": CONTRACTS[n].fingerprint()}
            for n in sorted(names)}
