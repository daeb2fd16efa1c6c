"""The reference Clover model: one step over per-row causal rows then a block (MODEL.md 4-5).

Parameters are named exactly like the checkpoint's canonical tensors, so a
state dict loads as is and a traced graph references weights by checkpoint
name. The three cores are looked up in `model.cores`; the exporter swaps in
custom ops from outside, the model never knows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from clover_export.core import names
from clover_export.core.config import CloverConfig
from clover_export.model.attention import attention_core
from clover_export.model.functional import (
    apply_partial_rope,
    gated_residual,
    gated_rms_norm,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from clover_export.model.gdn import gdn_core
from clover_export.model.moe import moe_core


@dataclass
class Cores:
    """The step's custom ops (STEP_GRAPH.md 2: OP_CORES) and the glue between them.

    Glue left None is the plain torch of this module (what the export traces); the Triton backend sets
    fused kernels with the same semantics (plugins/triton/norms.py; `functional.add_rms_norm`,
    `functional.norm_rope` state what they fuse)."""

    gdn: Callable = gdn_core
    attention: Callable = attention_core
    moe: Callable = moe_core
    rms_norm: Callable | None = None
    add_rms_norm: Callable | None = None
    norm_rope: Callable | None = None
    gated_rms_norm: Callable | None = None
    sigmoid_gate: Callable | None = None
    swiglu: Callable | None = None
    gated_residual: Callable | None = None
    moe_block: Callable | None = None  # the whole SparseMoe (routed + gated shared expert) in one core


OP_CORES = ("gdn", "attention", "moe")  # the Cores fields that are custom ops (the rest is glue)


class Weight(nn.Module):
    """A module holding one `.weight`, so parameter names match the checkpoint."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


def linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class StepResult(tuple):
    """What one step returns, in every backend: unpacks as (logits [B, N, V], coreset_size [B, layers],
    new pools by name); `causal_logits` [B, R, V] fp32 holds the next-token logits of the causal rows named
    by the step's `logit_rows` input (STEP_GRAPH.md 6), read by the lossless decoding modes."""

    causal_logits: torch.Tensor

    def __new__(cls, logits, coreset_size, pools, causal_logits):
        result = super().__new__(cls, (logits, coreset_size, pools))
        result.causal_logits = causal_logits
        return result


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [B, T]
    n_causal: torch.Tensor  # [B]
    has_block: torch.Tensor  # [B]
    slot_ids: torch.Tensor  # [B]
    past_len: torch.Tensor  # [B]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        D, C, K, Hv = cfg.hidden_size, cfg.conv_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads
        self.cfg = cfg
        self.in_proj_qkv = linear(D, C)
        self.in_proj_z = linear(D, cfg.value_dim)
        self.in_proj_b = linear(D, Hv)
        self.in_proj_a = linear(D, Hv)
        self.conv1d = Weight(C, 1, K)
        self.A_log = nn.Parameter(torch.empty(Hv))
        self.dt_bias = nn.Parameter(torch.empty(Hv))
        self.norm = Weight(cfg.linear_value_head_dim)
        self.out_proj = linear(cfg.value_dim, D)
        # [assumed] block-mixer tensors (MODEL.md 3, 5.2)
        self.conv1d_right = Weight(C, 1, K)
        self.block_softmax_scale = nn.Parameter(torch.empty(Hv))
        self.block_softmax_gate = nn.Parameter(torch.empty(Hv))

    def forward(self, x, conv_pool, rec_pool, step: StepInputs, block_size: int, cores: Cores):
        cfg = self.cfg
        B, T, _ = x.shape
        o, conv_pool, rec_pool = cores.gdn(
            self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x),
            self.conv1d.weight.squeeze(1), self.conv1d_right.weight.squeeze(1),
            self.A_log, self.dt_bias, self.block_softmax_scale, self.block_softmax_gate,
            conv_pool, rec_pool, step.slot_ids, step.n_causal,
            cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, block_size,
        )
        z = self.in_proj_z(x).reshape(B, T, -1, cfg.linear_value_head_dim)
        o = (cores.gated_rms_norm or gated_rms_norm)(o, z, self.norm.weight, cfg.rms_norm_eps)
        return self.out_proj(o.reshape(B, T, -1)), conv_pool, rec_pool


class Attention(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = linear(D, H * 2 * hd)
        self.k_proj = linear(D, Hkv * hd)
        self.v_proj = linear(D, Hkv * hd)
        self.o_proj = linear(H * hd, D)
        self.q_norm = Weight(hd)
        self.k_norm = Weight(hd)

    def forward(self, x, key_pool, value_pool, step: StepInputs, cos, sin, block_size: int, cores: Cores):
        cfg = self.cfg
        B, T, _ = x.shape
        hd, eps = cfg.head_dim, cfg.rms_norm_eps
        q, gate = self.q_proj(x).view(B, T, -1, 2 * hd).chunk(2, dim=-1)  # per head: hd query rows, hd gate rows
        k = self.k_proj(x).view(B, T, -1, hd)
        if cores.norm_rope is None:
            q = apply_partial_rope(rms_norm(q, self.q_norm.weight, eps), cos, sin)
            k = apply_partial_rope(rms_norm(k, self.k_norm.weight, eps), cos, sin)
        else:
            q = cores.norm_rope(q, self.q_norm.weight, eps, cos, sin)
            k = cores.norm_rope(k, self.k_norm.weight, eps, cos, sin)
        v = self.v_proj(x).view(B, T, -1, hd)
        o, key_pool, value_pool = cores.attention(
            q, k, v, key_pool, value_pool, step.slot_ids, step.past_len, step.n_causal, block_size, hd**-0.5
        )
        if cores.sigmoid_gate is None:
            o = o.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        else:
            o = cores.sigmoid_gate(o, gate).reshape(B, T, -1)
        return self.o_proj(o), key_pool, value_pool


class Experts(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


class SharedExpert(nn.Module):
    def __init__(self, D: int, I: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(D, I), linear(D, I), linear(I, D)

    def forward(self, x, fused_swiglu=None):
        return self.down_proj((fused_swiglu or swiglu)(self.gate_proj(x), self.up_proj(x)))


class SparseMoe(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Weight(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg)
        self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = linear(cfg.hidden_size, 1)

    def forward(self, x, block_size: int, cores: Cores):
        cfg = self.cfg
        if cores.moe_block is not None:
            s = self.shared_expert
            return cores.moe_block(
                x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, s.gate_proj.weight,
                s.up_proj.weight, s.down_proj.weight, self.shared_expert_gate.weight, cfg.num_experts_per_tok,
                cfg.moe_block_coreset_top_p, cfg.moe_block_coreset_enabled, block_size,
            )
        routed, distinct = cores.moe(
            x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
            cfg.num_experts_per_tok, cfg.moe_block_coreset_top_p, cfg.moe_block_coreset_enabled, block_size,
        )
        shared = self.shared_expert(x, cores.swiglu)
        return (cores.gated_residual or gated_residual)(routed, self.shared_expert_gate(x), shared), distinct


class DecoderLayer(nn.Module):
    def __init__(self, cfg: CloverConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.input_layernorm = Weight(cfg.hidden_size)
        self.post_attention_layernorm = Weight(cfg.hidden_size)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = SparseMoe(cfg)
        self.eps = cfg.rms_norm_eps

    def forward(self, h, pools, step, cos, sin, block_size, cores):
        x = (cores.rms_norm or rms_norm)(h, self.input_layernorm.weight, self.eps)
        if self.kind == "linear_attention":
            mixed, *pools = self.linear_attn(x, *pools, step, block_size, cores)
        else:
            mixed, *pools = self.self_attn(x, *pools, step, cos, sin, block_size, cores)
        if cores.add_rms_norm is None:
            h = h + mixed
            x = rms_norm(h, self.post_attention_layernorm.weight, self.eps)
        else:
            h, x = cores.add_rms_norm(h, mixed, self.post_attention_layernorm.weight, self.eps)
        out, distinct = self.mlp(x, block_size, cores)
        return h + out, pools, distinct


class TextModel(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, kind) for kind in cfg.layer_types])
        self.norm = Weight(cfg.hidden_size)


class CloverModel(nn.Module):
    """One forward step (STEP_GRAPH.md 1): flat tensors in, logits + new pools out."""

    def __init__(self, cfg: CloverConfig, block_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.block_size = cfg.block_size if block_size is None else block_size
        self.model = TextModel(cfg)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)
        self.cores = Cores()

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, input_ids, n_causal, has_block, slot_ids, past_len, logit_rows, *pools):
        """input_ids [B, T] (C causal rows then block_size block rows); logit_rows [B, R] causal row indices
        whose next-token logits are wanted (STEP_GRAPH.md 1, 6); pools in `names.pool_names` order.

        Returns (logits [B, N, V] fp32, coreset_size [B, layers] int32, *new pools, causal_logits [B, R, V]
        fp32). Row i of the logits predicts block position i (with `logits_shift` see `predicting_rows`);
        causal_logits row r is the upstream model's next-token prediction after causal row logit_rows[b, r]
        (indices are clamped to the step's rows; the lm_head runs over N + R rows, never the whole chunk).
        """
        h, coreset_size, new_pools = self.trunk(input_ids, n_causal, has_block, slot_ids, past_len, *pools)
        N = self.block_size
        rows, last = logit_rows.long(), h.shape[1] - 1  # clamped by Where (TensorRT's Clip takes no integers)
        rows = torch.where(rows < 0, 0, torch.where(rows > last, last, rows))
        causal = torch.gather(h, 1, rows.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        both = self.logits(torch.cat([self.predicting_rows(h, n_causal), causal], 1))
        return (both[:, :N], coreset_size, *new_pools, both[:, N:])

    def predicting_rows(self, h: torch.Tensor, n_causal: torch.Tensor) -> torch.Tensor:
        """The hidden rows [B, N, D] whose logits predict the block's positions (MODEL.md 5.1).

        Unshifted: the block rows. `logits_shift`: position i is predicted by the row before it, so
        block rows 0..N-2 predict positions 1..N-1 and position 0 comes from the last prefix row: the
        last valid causal row when the step has causal rows (prefill end, commit), else a placeholder
        (block row 0) that the runtime replaces by the row it kept per slot (runtime/runner.py).
        """
        N = self.block_size
        Tc = h.shape[1] - N
        if not self.cfg.logits_shift:
            return h[:, Tc:]
        n = n_causal.long()
        first = torch.where(n > 0, n - 1, torch.full_like(n, Tc))  # [B]
        idx = torch.cat([first.unsqueeze(1), Tc + torch.arange(N - 1, device=h.device).expand(h.shape[0], -1)], 1)
        return torch.gather(h, 1, idx.unsqueeze(-1).expand(-1, -1, h.shape[-1]))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head((self.cores.rms_norm or rms_norm)(h, self.model.norm.weight, self.cfg.rms_norm_eps)).float()

    def trunk(self, input_ids, n_causal, has_block, slot_ids, past_len, *pools):
        """The decoder stack: (hidden states of every row [B, T, D], coreset_size, new pools)."""
        cfg, N = self.cfg, self.block_size
        step = StepInputs(input_ids, n_causal, has_block, slot_ids, past_len)
        B, T = input_ids.shape
        Tc = T - N
        rows = torch.arange(T, device=input_ids.device).unsqueeze(0)
        # causal row j sits at past_len + j; block row i at past_len + n_causal + i
        positions = past_len.long().unsqueeze(1) + torch.where(
            rows < Tc, rows, rows - Tc + n_causal.long().unsqueeze(1)
        )
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, self.dtype)
        h = self.model.embed_tokens(input_ids.long())
        new_pools, distinct = [], []
        for i, layer in enumerate(self.model.layers):
            h, p, d = layer(h, list(pools[2 * i: 2 * i + 2]), step, cos, sin, N, self.cores)
            new_pools += p
            distinct.append(d)
        coreset_size = torch.stack(distinct, dim=1) * (has_block.view(B, 1) != 0).to(torch.int32)
        return h, coreset_size, new_pools

    def causal_hidden(self, input_ids: torch.Tensor, n_causal: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, T, D] of a step of causal rows alone (`has_block` 0) from empty caches: the plain
        causal forward, row t seeing rows 0..t. input_ids [B, C + block_size] (the block rows are unused)."""
        B, T = input_ids.shape
        dev = input_ids.device
        pools = allocate_pools(self.cfg, B, max(T - self.block_size, 1), dtype=self.dtype, device=dev)
        zeros = torch.zeros(B, dtype=torch.int32, device=dev)
        h, _, _ = self.trunk(input_ids, n_causal, zeros, torch.arange(B, dtype=torch.int32, device=dev), zeros,
                             *pools.values())
        return h

    def step(self, inputs: dict[str, torch.Tensor], pools: dict[str, torch.Tensor]):
        """Dict form: a StepResult (logits, coreset_size, new pools keyed by past_key_values name).
        Without `logit_rows` in `inputs` the logits of causal row 0 are computed."""
        order = names.pool_names(self.cfg)
        rows = with_logit_rows(inputs)[names.LOGIT_ROWS]
        out = self(*(inputs[n] for n in names.STEP_SCALARS), rows, *(pools[n] for n in order))
        return StepResult(out[0], out[1], dict(zip(order, out[2:-1])), out[-1])


def with_logit_rows(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step's inputs with `logit_rows`: as given, or [B, 1] zeros (causal row 0 of each batch row), the
    default of every backend's step when the caller asks for no rows."""
    if names.LOGIT_ROWS in inputs:
        return inputs
    ids = inputs[names.INPUT_IDS]
    return {**inputs, names.LOGIT_ROWS: torch.zeros(ids.shape[0], 1, dtype=torch.int32, device=ids.device)}


def allocate_pools(
    cfg: CloverConfig, num_slots: int, max_len: int, dtype=torch.float32, device="cpu"
) -> dict[str, torch.Tensor]:
    """Zeroed cache pools in graph order (STEP_GRAPH.md 1)."""
    pools = {}
    for name in names.pool_names(cfg):
        pools[name] = torch.zeros(
            pool_shape(cfg, name, num_slots, max_len), dtype=pool_dtype(name, dtype), device=device
        )
    return pools


def pool_shape(cfg: CloverConfig, name: str, num_slots, max_len) -> tuple:
    part = name.rsplit(".", 1)[1]
    if part in ("key", "value"):
        return (num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
    if part == "conv_state":
        return (num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    return (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)


def pool_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith("recurrent_state") else model_dtype


def cache_bytes_per_token_and_fixed(cfg: CloverConfig, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes that grow per cached token, fixed bytes per sequence) of one sequence's caches."""
    per_token = len(cfg.attention_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    fixed = len(cfg.gdn_layers) * (
        cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    )
    return per_token, fixed


def init_random_(model: CloverModel, seed: int = 0, std: float = 0.02) -> CloverModel:
    """Deterministic random weights with every parameter mattering (norms too)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("A_log"):
                val = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("block_softmax_scale"):
                val = torch.empty(p.shape).uniform_(2.0, 8.0, generator=gen)
            elif name.endswith(("conv1d.weight", "conv1d_right.weight")):
                val = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            elif name.endswith("linear_attn.norm.weight"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif p.dim() == 1 or name.endswith("block_softmax_gate"):
                val = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                val = std * torch.randn(p.shape, generator=gen)
            p.copy_(val.to(p.dtype))
    return model
