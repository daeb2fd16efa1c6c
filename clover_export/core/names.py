"""Every name in one place: checkpoint tensors (MODEL.md 3) and step-graph I/O (STEP_GRAPH.md 1).

Canonical checkpoint names use the text-only prefix `model.` and fused
experts; `canonical_name` maps the other accepted spellings onto them.
"""

from __future__ import annotations

import re

from clover_export.core import assumed
from clover_export.core.config import CloverConfig

TEXT_PREFIX = "model."
WRAPPER_PREFIX = "model.language_model."
IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")

# dtypes a checkpoint tensor may have (safetensors spelling)
FLOAT_DTYPES = ("BF16", "F32", "F16")
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def canonical_name(name: str) -> str | None:
    """Checkpoint name -> canonical name, or None for tensors we ignore."""
    if name.startswith(WRAPPER_PREFIX):
        name = TEXT_PREFIX + name[len(WRAPPER_PREFIX):]
    if name.startswith(IGNORED_PREFIXES):
        return None
    return name


def layer(i: int) -> str:
    return f"model.layers.{i}."


def expected_tensors(cfg: CloverConfig, clover: bool = True) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for every tensor the model needs (fused experts)."""
    D, V, E, I = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    Ish = cfg.shared_expert_intermediate_size
    t: dict[str, tuple[int, ...]] = {
        EMBED: (V, D),
        "model.norm.weight": (D,),
        LM_HEAD: (V, D),
    }
    for i, kind in enumerate(cfg.layer_types):
        L = layer(i)
        t[L + "input_layernorm.weight"] = (D,)
        t[L + "post_attention_layernorm.weight"] = (D,)
        if kind == "linear_attention":
            A = L + "linear_attn."
            C, K, Hv = cfg.conv_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads
            t[A + "in_proj_qkv.weight"] = (C, D)
            t[A + "in_proj_z.weight"] = (cfg.value_dim, D)
            t[A + "in_proj_b.weight"] = (Hv, D)
            t[A + "in_proj_a.weight"] = (Hv, D)
            t[A + "conv1d.weight"] = (C, 1, K)
            t[A + "A_log"] = (Hv,)
            t[A + "dt_bias"] = (Hv,)
            t[A + "norm.weight"] = (cfg.linear_value_head_dim,)
            t[A + "out_proj.weight"] = (D, cfg.value_dim)
            if clover:
                for name, shape in assumed.CLOVER_GDN_TENSORS.items():
                    t[A + name] = shape(C, K, Hv)
        else:
            S = L + "self_attn."
            H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            t[S + "q_proj.weight"] = (H * 2 * hd, D)
            t[S + "k_proj.weight"] = (Hkv * hd, D)
            t[S + "v_proj.weight"] = (Hkv * hd, D)
            t[S + "o_proj.weight"] = (D, H * hd)
            t[S + "q_norm.weight"] = (hd,)
            t[S + "k_norm.weight"] = (hd,)
        M = L + "mlp."
        t[M + "gate.weight"] = (E, D)
        t[M + "experts.gate_up_proj"] = (E, 2 * I, D)
        t[M + "experts.down_proj"] = (E, D, I)
        t[M + "shared_expert.gate_proj.weight"] = (Ish, D)
        t[M + "shared_expert.up_proj.weight"] = (Ish, D)
        t[M + "shared_expert.down_proj.weight"] = (D, Ish)
        t[M + "shared_expert_gate.weight"] = (1, D)
    return t


def clover_tensor_names(cfg: CloverConfig) -> list[str]:
    """The [assumed] block-mixer tensors of every GDN layer."""
    return [layer(i) + "linear_attn." + n for i in cfg.gdn_layers for n in assumed.CLOVER_GDN_TENSORS]


def per_expert_names(fused: str, num_experts: int) -> list[list[str]]:
    """`...experts.gate_up_proj` -> [[gate_j, up_j] for j]; `...experts.down_proj` -> [[down_j] for j]."""
    base = fused.rsplit(".", 1)[0]
    parts = ("gate", "up") if fused.endswith("gate_up_proj") else ("down",)
    return [[f"{base}.{j}.{p}_proj.weight" for p in parts] for j in range(num_experts)]


# --- Step graph I/O (STEP_GRAPH.md 1) ----------------------------------------
INPUT_IDS = "input_ids"
N_CAUSAL = "n_causal"
HAS_BLOCK = "has_block"
SLOT_IDS = "slot_ids"
PAST_LEN = "past_len"
LOGITS = "logits"
CORESET_SIZE = "coreset_size"  # [B, num_layers] int32 kept-set size per MoE layer (0 for rows without a block)
STEP_SCALARS = (INPUT_IDS, N_CAUSAL, HAS_BLOCK, SLOT_IDS, PAST_LEN)
LOGIT_ROWS = "logit_rows"  # [B, R] int32: causal rows whose next-token logits the step returns (STEP_GRAPH.md 6)
CAUSAL_LOGITS = "causal_logits"  # [B, R, V] float32, the graph's last output (after the present.* pools)
STEP_INPUTS = (*STEP_SCALARS, LOGIT_ROWS)  # graph inputs before the pools, in order


def pool_names(cfg: CloverConfig) -> list[str]:
    """Cache-pool input names in graph order; outputs are the same with `present.`."""
    out = []
    for i, kind in enumerate(cfg.layer_types):
        parts = ("conv_state", "recurrent_state") if kind == "linear_attention" else ("key", "value")
        out += [f"past_key_values.{i}.{p}" for p in parts]
    return out


def present_name(pool_name: str) -> str:
    return "present." + pool_name[len("past_key_values."):]
