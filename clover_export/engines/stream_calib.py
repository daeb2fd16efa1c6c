"""The reference model run one decoder layer at a time over memory-mapped weights (issue 11).

FP8 calibration of the 35B model cannot hold the whole reference model in
memory (~130 GB in fp32). `streamed_model` builds the usual `CloverModel`
on the meta device and gives each decoder layer a pre-forward hook that
reads its weights from the checkpoint's shards (memory-mapped, converted
to the model dtype, moved to the device) and a forward hook that drops them
again: one layer's weights are resident at a time, next to the embedding,
final norm and lm_head. The model's own `step` runs unchanged (but for the
MoE core, below), so calibration hooks on its Linear modules see what the
whole model would show them (tests/test_build_fullsize.py compares the two).

The reference `moe_core` is dense over experts (no data-dependent control
flow, as the graph needs): 256 experts x every row is ~1.6 GFLOP per token
and layer at full size, hours of CPU for calibration. `routed_moe_core`
computes each expert only on the rows routed to it: the same routing and
sum in the same expert order; the dense core adds exact zeros elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from clover_export.checkpoint import TensorReader, locate_tensors, plan_tensors


class _Progress:
    """One tqdm bar for the whole calibration: one tick per decoder layer played."""

    def __init__(self, total_layers: int, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=0, desc=desc, unit="layer", leave=False, dynamic_ncols=True)
        self.layers = total_layers

    def new_step(self) -> None:
        self.bar.total += self.layers
        self.bar.refresh()

    def tick(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def routed_moe_core(x, router_w, gate_up, down, top_k: int, top_p: float, coreset: bool, block_size: int):
    """`model.moe.moe_core` with each expert run only on its routed rows (module docstring)."""
    from clover_export import assumed
    from clover_export.model.moe import route

    B, T, D = x.shape
    Tc, E = T - block_size, router_w.shape[0]
    probs = torch.softmax(F.linear(x, router_w).float(), dim=-1)  # as moe_core from here to `route`
    allowed = torch.ones_like(probs, dtype=torch.bool)
    if coreset and block_size > 0:
        keep = assumed.coreset_mask(probs[:, Tc:], top_k, top_p)
        allowed = torch.cat([allowed[:, :Tc], keep.unsqueeze(1).expand(B, block_size, E)], dim=1)
    weights, chosen = route(probs, allowed, top_k)
    weights = weights.to(x.dtype).reshape(-1, E)
    flat, picked = x.reshape(-1, D), chosen.reshape(-1, E)
    out = torch.zeros_like(flat)
    for e in torch.nonzero(picked.any(0)).flatten().tolist():
        rows = torch.nonzero(picked[:, e]).flatten()
        # experts may be stored narrower than x (the slice reference keeps them bf16): cast one at a time
        gate, up = F.linear(flat[rows], gate_up[e].to(x.dtype)).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, down[e].to(x.dtype)) * weights[rows, e:e + 1])
    distinct = chosen[:, Tc:].any(dim=1).sum(-1).to(torch.int32)
    return out.reshape(B, T, D), distinct


def reference_weight(name: str, t: torch.Tensor, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A checkpoint tensor for a reference model run with `routed_moe_core`, in `dtype` -- except routed experts
    stored narrower, which stay as stored (bf16: 1.6 GiB a layer at full size, not 3.2 in fp32): the routed
    core casts one expert at a time, exactly."""
    if ".mlp.experts." in name and t.dtype.itemsize < dtype.itemsize:
        return t.to(device=device)
    return t.to(device=device, dtype=dtype)


def streamed_model(model_dir: Path, block_size: int | None = None, dtype: torch.dtype = torch.float32,
                   device: str | None = None, desc: str = "calibrate"):
    """A `CloverModel` whose decoder layers load their weights on entry and drop them on exit."""
    from dataclasses import replace

    from clover_export.config import load_config
    from clover_export.models import build_model

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config(model_dir)
    plans = plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=True)
    reader = TensorReader()
    model = build_model(cfg, dtype, device="meta", block_size=block_size)

    def state(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in module.named_parameters():
            full = prefix + name
            t = reader.read(plans[full]) if full in plans else torch.zeros(p.shape)  # opted-in Qwen: zero-filled
            out[name] = reference_weight(full, t, dtype, device)
        return out

    for prefix, module in (("model.embed_tokens.", model.model.embed_tokens), ("model.norm.", model.model.norm),
                           ("lm_head.", model.lm_head)):
        module.load_state_dict(state(prefix, module), strict=True, assign=True)
    reader.close()
    progress = _Progress(len(model.model.layers), desc)
    model.stream_progress = progress

    for i, layer in enumerate(model.model.layers):
        def load(mod, args, prefix=f"model.layers.{i}."):
            mod.load_state_dict(state(prefix, mod), strict=True, assign=True)
            reader.close()  # the layer's tensors are copies: its shard pages need not stay mapped

        def drop(mod, args, output):
            mod.to("meta")
            progress.tick()

        layer.register_forward_pre_hook(load)
        layer.register_forward_hook(drop)
    model.cores = replace(model.cores, moe=routed_moe_core)
    model.eval().requires_grad_(False)
    inner_step = model.step

    def step(inputs, pools):
        progress.new_step()
        inputs = {k: v.to(device) for k, v in inputs.items()}
        pools = {k: v.to(device) for k, v in pools.items()}
        logits, coreset, new_pools = inner_step(inputs, pools)
        return logits.cpu(), coreset.cpu(), {k: v.cpu() for k, v in new_pools.items()}

    model.step = step
    return model


def resident_layers(model) -> list[int]:
    """Indices of the decoder layers whose weights are in memory (not on the meta device)."""
    return [i for i, layer in enumerate(model.model.layers)
            if any(p.device.type != "meta" for p in layer.parameters())]
