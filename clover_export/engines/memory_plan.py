"""GPU memory plan for an engine: weights + cache pools + activations + workspace (STEP_GRAPH.md 4).

`build` refuses a plan that does not fit; `info` and `doctor` print the same arithmetic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from clover_export.core.config import CloverConfig
from clover_export.core.errors import CloverError
from clover_export.model.sizing import GiB, cache_bytes, weight_bytes

DEFAULT_WORKSPACE = 4 * GiB
HEADROOM = 0.05  # fraction of GPU memory left for the CUDA context, allocator slack and fragmentation


@dataclass(frozen=True)
class MemoryPlan:
    precision: str
    max_batch: int
    max_context: int
    chunk: int
    weights: int
    attention_kv_pool: int
    gdn_state_pool: int
    activations: int
    workspace: int
    gpu_bytes: int | None

    @property
    def total(self) -> int:
        return self.weights + self.attention_kv_pool + self.gdn_state_pool + self.activations + self.workspace

    @property
    def usable(self) -> int | None:
        return None if self.gpu_bytes is None else int(self.gpu_bytes * (1 - HEADROOM))

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.total <= self.usable

    def max_batch_that_fits(self) -> int:
        """Largest batch (= cache slots) at this context that fits, 0 if none."""
        if self.usable is None:
            return self.max_batch
        per_row = (self.attention_kv_pool + self.gdn_state_pool + self.activations) / self.max_batch
        free = self.usable - self.weights - self.workspace
        return max(0, int(free // per_row))

    def lines(self) -> list[str]:
        def g(n):
            return f"{n / GiB:8.2f} GiB"

        out = [
            f"memory plan ({self.precision}, batch {self.max_batch}, context {self.max_context}, chunk {self.chunk}):",
            f"  weights             {g(self.weights)}",
            f"  attention K/V pool  {g(self.attention_kv_pool)}",
            f"  GDN state pool      {g(self.gdn_state_pool)}",
            f"  activations (est.)  {g(self.activations)}",
            f"  workspace           {g(self.workspace)}",
            f"  total               {g(self.total)}",
        ]
        if self.gpu_bytes is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            share = f"{100 * (1 - HEADROOM):.0f}% of {self.gpu_bytes / GiB:.1f} GiB"
            out.append(f"  GPU usable          {g(self.usable)}  ({share}): {verdict}")
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits}


PLAN_MAX_SMS = 192  # at least any GPU's SM count (H200 132, B200 148, RTX PRO 6000 188): the partials' floor


def activation_bytes(cfg: CloverConfig, batch: int, rows: int, block: int) -> int:
    """Peak step activations, estimated: the logits (`logits_bytes`) plus a few live [rows, width] bf16
    buffers at the widest layer (conv channels, q+gate, expert gate/up), plus the split-KV attention
    partials on TensorRT (`attention_partial_bytes`)."""
    width = max(cfg.conv_dim + cfg.value_dim, 2 * cfg.num_attention_heads * cfg.head_dim,
                2 * cfg.moe_intermediate_size * cfg.num_experts_per_tok, 4 * cfg.hidden_size)
    return logits_bytes(cfg, batch, block) + 6 * batch * rows * width * 2 + attention_partial_bytes(cfg, batch, rows)


def logits_bytes(cfg: CloverConfig, batch: int, block: int) -> int:
    """The step's logits at the profiles' max: fp32 `logits` of the block rows [batch, block, V], fp32
    `causal_logits` [batch, R, V] at R = block (the `logit_rows` dim's max) and the `logit_rows` input
    [batch, R] int32."""
    return 2 * batch * block * cfg.vocab_size * 4 + batch * block * 4


def attention_partial_bytes(cfg: CloverConfig, batch: int, rows: int) -> int:
    """BlockAttentionSplit's fp32 partials (acc + (m, l)) at launch.attention_partial_rows, counted per batch row
    (batch x max(rows, floor) >= max(batch x rows, floor): the plan stays linear in the batch)."""
    from clover_export.plugins.triton import launch

    consts = launch.attention_constexprs(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                         cfg.block_size, cfg.head_dim ** -0.5, "bfloat16", 90)
    per_batch_row = launch.attention_partial_rows(1, rows, consts, PLAN_MAX_SMS)
    return batch * per_batch_row * cfg.num_attention_heads * (cfg.head_dim + 2) * 4


def plan_memory(cfg: CloverConfig, precision: str, max_batch: int, max_context: int, chunk: int,
                gpu_bytes: int | None = None, workspace: int = DEFAULT_WORKSPACE) -> MemoryPlan:
    if precision not in ("bf16", "fp8"):
        raise CloverError("build", f"unknown precision {precision!r}", "expected bf16 or fp8")
    for name, v in (("max_batch", max_batch), ("max_context", max_context), ("chunk", chunk)):
        if v < 1:
            raise CloverError("build", f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if max_context > cfg.max_context:
        raise CloverError("build", f"--max-context {max_context} exceeds the model's max_context {cfg.max_context}")
    caches = cache_bytes(cfg, max_context)
    return MemoryPlan(
        precision=precision, max_batch=max_batch, max_context=max_context, chunk=chunk,
        weights=weight_bytes(cfg, precision),
        attention_kv_pool=max_batch * caches["attention_kv"],
        gdn_state_pool=max_batch * caches["gdn_states"],
        activations=activation_bytes(cfg, max_batch, chunk + cfg.block_size, cfg.block_size),
        workspace=workspace, gpu_bytes=gpu_bytes,
    )


def fit_advice(plan: MemoryPlan) -> str:
    """What to change so that a plan that does not fit does."""
    advice = []
    nb = plan.max_batch_that_fits()
    if nb >= 1:
        advice.append(f"--max-batch {nb}")
    per_token_row = plan.attention_kv_pool / (plan.max_batch * plan.max_context)
    free = plan.usable - plan.weights - plan.workspace - plan.activations - plan.gdn_state_pool
    ctx = int(free // (per_token_row * plan.max_batch)) if per_token_row else 0
    if ctx >= 1:
        advice.append(f"--max-context {ctx}")
    if plan.precision == "bf16":
        advice.append("--precision fp8")
    return "try " + " or ".join(advice) if advice else "the weights alone exceed this GPU"


def shortfall(plan: MemoryPlan) -> str | None:
    """One line saying that and by how much the plan does not fit, with the advice; None when it fits."""
    if plan.fits is not False:
        return None
    return (f"the engine does not fit in GPU memory: {plan.total / GiB:.2f} GiB planned ({plan.precision}, batch "
            f"{plan.max_batch}, context {plan.max_context}), GPU usable {plan.usable / GiB:.2f} GiB "
            f"({100 * (1 - HEADROOM):.0f}% of {plan.gpu_bytes / GiB:.1f} GiB); {fit_advice(plan)}")


def require_fit(plan: MemoryPlan) -> None:
    """Raise with the numbers and what to change when the plan does not fit."""
    if plan.fits is not False:
        return
    raise CloverError("build", "the engine does not fit in GPU memory:\n" + "\n".join(plan.lines()), fit_advice(plan))
