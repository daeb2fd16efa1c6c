"""The bytes a step must read and its time bound, by PERF.md 1's rule (one place; benchmarks and tests use it).

Per step, over the layers: the dense weights (GDN / attention projections,
router + shared expert, norms; plus final norm and `lm_head` when logits are
computed); the embedding as a gather of the step's rows only; the routed
experts as **the union of experts selected by any row of the step** times
one expert's bytes (bf16, or e4m3 + fp32 scales); the attention K/V read
(past_len per row) plus the step's own K/V written; the GDN conv and
recurrent state of each row's slot, read and written. Parameter counts come
from the model built on the meta device, so the figures follow the config.

Bound = max(bytes / copy bandwidth, 2 x active parameters x rows / matmul rate).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from clover_export.core.config import CloverConfig


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of each weight group of the model at `dtype_bytes` per parameter."""

    gdn_layer: int  # one GDN layer's mixer (projections, convs, small vectors) + its norms
    attention_layer: int  # one attention layer's mixer + its norms
    router_shared: int  # one layer's router + shared expert (+ its gate)
    head: int  # final norm + lm_head
    embedding_row: int  # one row of the embedding table
    expert: int  # one routed expert (gate, up, down)
    expert_params: int


@lru_cache(maxsize=8)
def _param_counts(cfg: CloverConfig) -> dict[str, int]:
    import torch

    from clover_export.model.model import CloverModel

    with torch.device("meta"):
        model = CloverModel(cfg)
    counts: dict[str, int] = {"gdn": 0, "attention": 0, "router_shared": 0, "head": 0, "embedding": 0, "experts": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts." in name:
            counts["experts"] += n
        elif name.startswith("model.embed_tokens"):
            counts["embedding"] += n
        elif name.startswith(("lm_head", "model.norm")):
            counts["head"] += n
        elif ".mlp." in name:
            counts["router_shared"] += n
        elif ".linear_attn." in name or ("layernorm" in name and cfg.layer_types[_layer(name)] == "linear_attention"):
            counts["gdn"] += n
        else:
            counts["attention"] += n
    return counts


def _layer(name: str) -> int:
    return int(name.split(".")[2])


def weight_bytes(cfg: CloverConfig, dtype_bytes: int = 2) -> WeightBytes:
    c = _param_counts(cfg)
    L, G, A = cfg.num_hidden_layers, len(cfg.gdn_layers), len(cfg.attention_layers)
    expert_params = c["experts"] // (L * cfg.num_experts)
    return WeightBytes(
        gdn_layer=c["gdn"] * dtype_bytes // max(G, 1), attention_layer=c["attention"] * dtype_bytes // max(A, 1),
        router_shared=c["router_shared"] * dtype_bytes // L, head=c["head"] * dtype_bytes,
        embedding_row=cfg.hidden_size * dtype_bytes, expert=expert_params * dtype_bytes, expert_params=expert_params)


def expert_bytes(cfg: CloverConfig, fp8: bool = False, dtype_bytes: int = 2) -> int:
    """One routed expert: bf16 weights, or e4m3 weights plus one fp32 scale per output channel."""
    params = weight_bytes(cfg, dtype_bytes).expert_params
    if not fp8:
        return params * dtype_bytes
    scales = 2 * cfg.moe_intermediate_size + cfg.hidden_size
    return params + 4 * scales


def active_params(cfg: CloverConfig) -> int:
    """Parameters one token touches (PERF.md 1: 3.46 B for Clover-35B-A3B): all but the routed experts,
    plus top-k experts per layer (the embedding table counted, as PERF.md does)."""
    c = _param_counts(cfg)
    per_expert = c["experts"] // (cfg.num_hidden_layers * cfg.num_experts)
    return sum(v for k, v in c.items() if k != "experts") + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert


@dataclass(frozen=True)
class StepBytes:
    dense: int
    head: int
    embedding: int
    experts: int
    kv: int
    state: int

    @property
    def total(self) -> int:
        return self.dense + self.head + self.embedding + self.experts + self.kv + self.state

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def step_bytes(
    cfg: CloverConfig,
    *,
    rows: int,
    past_len: list[int],
    experts_per_layer: list[float] | float,
    batch_rows: int | None = None,
    fp8: bool = False,
    logits: bool = True,
    dtype_bytes: int = 2,
) -> StepBytes:
    """Bytes one step must read (and write for K/V and states) by PERF.md 1.

    rows: the step's valid rows (causal rows below n_causal plus block rows,
    all batch rows); past_len: cached positions per batch row;
    experts_per_layer: the union of experts selected by any row of the step,
    per layer (a list) or the same for every layer (a number).
    """
    w = weight_bytes(cfg, dtype_bytes)
    B = len(past_len) if batch_rows is None else batch_rows
    G, A, L = len(cfg.gdn_layers), len(cfg.attention_layers), cfg.num_hidden_layers
    per_layer = experts_per_layer if isinstance(experts_per_layer, list) else [experts_per_layer] * L
    if len(per_layer) != L:
        raise ValueError(f"experts_per_layer has {len(per_layer)} entries for {L} layers")
    kv_row = A * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes  # K and V of one position, all layers
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # fp32
    conv = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes
    return StepBytes(
        dense=G * w.gdn_layer + A * w.attention_layer + L * w.router_shared,
        head=w.head if logits else 0,
        embedding=rows * w.embedding_row,
        experts=round(sum(per_layer) * expert_bytes(cfg, fp8, dtype_bytes)),
        kv=(sum(past_len) + rows) * kv_row,
        state=2 * B * G * (rec + conv),
    )


def bound_seconds(cfg: CloverConfig, nbytes: int, rows: int, copy_bytes_per_s: float,
                  matmul_flops: float | None = None) -> dict:
    """{'memory_s', 'compute_s', 'bound_s'}: the step bound is the larger of the two (PERF.md 1)."""
    mem = nbytes / copy_bytes_per_s
    comp = 2 * active_params(cfg) * rows / matmul_flops if matmul_flops else 0.0
    return {"memory_s": mem, "compute_s": comp, "bound_s": max(mem, comp)}
