"""The reference model run one decoder layer at a time, its weights streamed from the checkpoint.

FP8 calibration of the 35B model cannot hold the whole reference model in
memory (~130 GB in fp32). `streamed_model` builds the usual `CloverModel`
on the meta device and gives each decoder layer a pre-forward hook that
loads its weights (read past the page cache, `direct_io`; converted to the
model dtype; moved to the device) and a forward hook that drops them again:
one layer's weights are in use at a time, the next layer's are being read in
a thread, next to the embedding (kept as stored, rows cast on lookup), final
norm and lm_head. Routed experts stay as stored, views into the arena they
were read into (`DirectReader.read_views`: no copy of the layer's 1.6 GiB),
handed to the MoE core by the loader (the module's expert parameters stay
on the meta device); the other weights are cast into reused buffers too.
The embedding and lm_head can be handed over already read (`preloaded`: the
slice validation's, in a build). The model's own `step` runs unchanged (but for the MoE
core, below), so calibration hooks on its Linear modules see what the whole
model would show them (tests/pipeline/test_build_fullsize.py compares the two).

The reference `moe_core` is dense over experts (no data-dependent control
flow, as the graph needs): 256 experts x every row is ~1.6 GFLOP per token
and layer at full size, hours of CPU for calibration. `routed_moe_core`
computes each expert only on the rows routed to it: the same routing and
sum in the same expert order; the dense core adds exact zeros elsewhere.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from clover_export.core.checkpoint import TORCH_DTYPES, locate_tensors, plan_tensors
from clover_export.core.direct_io import Arena, DirectReader, empty, plan_targets, read_into
from clover_export.core.names import EMBED

EXPERTS = "<routed experts>"  # a layer state's entry for `_LayerLoader.experts`, never a parameter name


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
    """`model.moe.moe_core` with each expert run only on its routed rows (module docstring).

    gate_up, down: [E, out, in] tensors, or per expert a tuple of row blocks of its [out, in] weight (a
    per-expert checkpoint's gate and up, as read: `_LayerLoader`); any float dtype, cast one expert at a time."""
    from clover_export.core import assumed
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
    bufs: dict = {}  # one cast buffer per weight shape, reused by every expert (trained routing runs all 256)
    for e in torch.nonzero(picked.any(0)).flatten().tolist():
        rows = torch.nonzero(picked[:, e]).flatten()
        gate, up = F.linear(flat[rows], expert_weight(gate_up[e], x.dtype, bufs)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, expert_weight(down[e], x.dtype, bufs))
        out.index_add_(0, rows, y * weights[rows, e:e + 1])
    distinct = chosen[:, Tc:].any(dim=1).sum(-1).to(torch.int32)
    return out.reshape(B, T, D), distinct


def expert_weight(w, dtype: torch.dtype, bufs: dict | None = None) -> torch.Tensor:
    """One expert's [out, in] weight in `dtype`: w itself cast, or its row blocks cast into one tensor (the
    cast is the copy: a per-expert checkpoint costs no more than a fused one). bufs: shape -> a tensor the
    cast is written into, kept there for the next expert (fresh pages for each of 256 experts a layer cost
    more than the cast); the result is then valid until the next call with the same bufs."""
    parts = (w,) if isinstance(w, torch.Tensor) else tuple(w)
    if len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0]
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    out = None if bufs is None else bufs.get((shape, dtype, parts[0].device))
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=parts[0].device)
        if bufs is not None:
            bufs[(shape, dtype, parts[0].device)] = out
    row = 0
    for p in parts:
        out[row:row + p.shape[0]].copy_(p)
        row += p.shape[0]
    return out


def keeps_stored(name: str, stored: torch.dtype, dtype: torch.dtype) -> bool:
    """Routed experts stored narrower than the reference model's dtype stay as stored (bf16: 1.6 GiB a layer at
    full size, not 3.2 in fp32): `routed_moe_core` casts one expert at a time, exactly."""
    return ".mlp.experts." in name and stored.itemsize < dtype.itemsize


def reference_weight(name: str, t: torch.Tensor, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A checkpoint tensor for a reference model run with `routed_moe_core`: in `dtype`, but for `keeps_stored`."""
    if keeps_stored(name, t.dtype, dtype):
        return t.to(device=device)
    return t.to(device=device, dtype=dtype)


def reference_dtype(name: str, stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor is read into for such a model: as `reference_weight`, but the embedding
    table also stays as stored (`embedding_as_stored`)."""
    return stored if name == EMBED or keeps_stored(name, stored, dtype) else dtype


def embedding_as_stored(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The model's embedding table stays as stored (bf16 at full size: 1 GiB, not 2 in fp32); the rows it
    looks up are cast to `dtype`, which is exact."""
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: out.to(dtype))


class _LayerLoader:
    """Decoder layers' weights, read from the checkpoint one layer at a time, the next layer read ahead in a
    thread while the current one runs (on a CPU, reading a layer's 1.6 GiB of experts takes about as long as
    running them).

    Reads go past the page cache (`direct_io`: a pass over 64 GiB of experts gains nothing from it on a
    24 GB machine). Routed experts are read into one of two reused arenas (the layer running, the layer
    being read) and used from there as stored (`DirectReader.read_views`), so nothing copies them;
    `experts` is the running layer's (gate_up, down), set by its pre-hook. The other weights are cast
    into two more (`dense`): no layer allocates afresh (11 GiB of fresh pages over the 80 layer loads, at
    ~1-2 s of kernel time a GiB where measured: bench/results/HISTORY.md, "Why fresh pages";
    `python bench/build_fullsize.py`)."""

    def __init__(self, plans: dict, model: torch.nn.Module, dtype: torch.dtype, device: str, direct: bool = True):
        self.plans, self.dtype, self.device = plans, dtype, device
        self.layers = model.model.layers
        self.arenas = (Arena(), Arena())  # routed experts, as stored
        self.dense = (Arena(), Arena())  # the other weights, in the model dtype (fresh pages cost ~1 s a GiB)
        self.reader = DirectReader(direct)
        self.slot = 0
        self.ahead: tuple[int, threading.Thread, dict] | None = None
        self.experts: tuple | None = None

    def state(self, prefix: str, module: torch.nn.Module, slot: int | None = 0,
              preloaded: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The module's weights for the reference model: read in file order past the page cache, cast to the
        model dtype; routed experts (read into the arena of `slot`, as stored) under `EXPERTS`, the module's
        expert parameters as meta tensors. The other weights are read into slot's `dense` arena (a decoder
        layer's: dropped before the slot is read again; on a GPU copied there from it), or, with slot None,
        into tensors of their own (kept); `preloaded` ones (`streamed_model`) are taken as they are."""
        out, dest, experts, dense = {}, {}, {}, []
        for name, p in module.named_parameters():
            full = prefix + name
            plan = self.plans.get(full)
            have = (preloaded or {}).get(full)
            if have is not None and plan is not None and tuple(have.shape) == tuple(plan.shape) and \
                    have.dtype == reference_dtype(full, TORCH_DTYPES[plan.parts[0][0].dtype], self.dtype):
                out[name] = have
                continue
            if ".mlp.experts." in full:  # a plan (read by `_experts`), or zeros where an opted-in Qwen has none
                experts[name] = plan if plan is not None else torch.zeros(p.shape, dtype=self.dtype, device=self.device)
                out[name] = torch.empty(p.shape, device="meta")
                continue
            if plan is None:  # opted-in Qwen: zero-filled
                out[name] = reference_weight(full, torch.zeros(p.shape), self.dtype, self.device)
                continue
            dtype = reference_dtype(full, TORCH_DTYPES[plan.parts[0][0].dtype], self.dtype)
            dense.append((name, plan, dtype))
        for (name, plan, _), t in zip(dense, self._dense([(plan.shape, d) for _, plan, d in dense], slot)):
            out[name] = t
            dest.update(plan_targets(plan, t))
        read_into(self.reader, dest)
        state = {n: t if t.device.type == "meta" else t.to(self.device) if prefix + n == EMBED else
                 reference_weight(prefix + n, t, self.dtype, self.device) for n, t in out.items()}
        if experts:
            state[EXPERTS] = self._experts(experts, slot)
        return state

    def _dense(self, specs: list[tuple[tuple[int, ...], torch.dtype]], slot: int | None) -> list[torch.Tensor]:
        """Empty tensors of these (shape, dtype)s: carved from slot's `dense` arena (the same pages every
        time), or allocated afresh when slot is None."""
        if slot is None:
            return [empty(shape, dtype) for shape, dtype in specs]
        spans = [-(-math.prod(shape) * dtype.itemsize // 64) * 64 for shape, dtype in specs]  # 64-byte aligned
        data, out, at = self.dense[slot].reserve(sum(spans)), [], 0
        for (shape, dtype), span in zip(specs, spans):
            out.append(data[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
            at += span
        return out

    def _experts(self, experts: dict, slot: int) -> tuple:
        """(gate_up, down) for `routed_moe_core`: views into the slot's arena, per expert a tuple of row blocks
        (or one [E, out, in] tensor when fused); on a GPU, fused there."""
        plans = {n: v for n, v in experts.items() if not isinstance(v, torch.Tensor)}
        views = self.reader.read_views([loc for plan in plans.values() for grp in plan.parts for loc in grp],
                                       self.arenas[slot]) if plans else {}
        out = []
        for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            v = experts[name]
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif v.fused:
                out.append(views[v.parts[0][0]].to(self.device))
            elif self.device == "cpu":
                out.append([tuple(views[loc] for loc in grp) for grp in v.parts])
            else:
                fused = torch.empty(v.shape, dtype=views[v.parts[0][0]].dtype, device=self.device)
                for e, grp in enumerate(v.parts):
                    row = 0
                    for loc in grp:
                        fused[e, row:row + loc.shape[0]].copy_(views[loc])
                        row += loc.shape[0]
                out.append(fused)
        return tuple(out)

    def _read(self, i: int, slot: int, box: dict) -> None:
        try:
            box["state"] = self.state(f"model.layers.{i}.", self.layers[i], slot)
        except BaseException as e:  # handed to the thread that uses the layer
            box["error"] = e

    def load(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's state (waiting for the read-ahead when it is this layer); starts reading layer i + 1."""
        if self.ahead is not None and self.ahead[0] == i:
            _, thread, box = self.ahead
            thread.join()
        else:
            if self.ahead is not None:  # read ahead for a layer not run next: let it finish, use nothing of it
                self.ahead[1].join()
            self.slot ^= 1
            box = {}
            self._read(i, self.slot, box)
        self.ahead = None
        if "error" in box:
            raise box["error"]
        if i + 1 < len(self.layers):  # not across steps: the next step may never come
            self.slot ^= 1
            nxt: dict = {}
            thread = threading.Thread(target=self._read, args=(i + 1, self.slot, nxt), daemon=True)
            thread.start()
            self.ahead = (i + 1, thread, nxt)
        return box["state"]


def streamed_model(model_dir: Path, block_size: int | None = None, dtype: torch.dtype = torch.float32,
                   device: str | None = None, desc: str = "calibrate", read_ahead: bool = True,
                   preloaded: dict[str, torch.Tensor] | None = None):
    """A `CloverModel` whose decoder layers load their weights on entry and drop them on exit.
    preloaded: checkpoint name -> a tensor already read as this model keeps it (the embedding as stored, the
    lm_head in `dtype`; `exporter.slice.validate_slices(keep=)`), used instead of reading it again."""
    from dataclasses import replace

    from clover_export.core.config import load_config
    from clover_export.model.loading import build_model
    from clover_export.model.model import StepResult

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config(model_dir)
    plans = plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=True)
    model = build_model(cfg, dtype, device="meta", block_size=block_size)
    loader = _LayerLoader(plans, model, dtype, device)

    for prefix, module in (("model.embed_tokens.", model.model.embed_tokens), ("model.norm.", model.model.norm),
                           ("lm_head.", model.lm_head)):
        module.load_state_dict(loader.state(prefix, module, slot=None, preloaded=preloaded), strict=True, assign=True)
    embedding_as_stored(model, dtype)
    progress = _Progress(len(model.model.layers), desc)
    model.stream_progress, model.stream_loader = progress, loader

    for i, layer in enumerate(model.model.layers):
        def load(mod, args, i=i):
            state = loader.load(i) if read_ahead else loader.state(f"model.layers.{i}.", mod, slot=0)
            loader.experts = state.pop(EXPERTS, None)
            mod.load_state_dict(state, strict=True, assign=True)

        def drop(mod, args, output):
            mod.to("meta")
            loader.experts = None
            progress.tick()

        layer.register_forward_pre_hook(load)
        layer.register_forward_hook(drop)

    def moe(x, router_w, gate_up, down, *rest):  # the running layer's experts as read, not its meta parameters
        return routed_moe_core(x, router_w, *loader.experts, *rest)

    model.cores = replace(model.cores, moe=moe)
    model.eval().requires_grad_(False)
    inner_step = model.step

    def step(inputs, pools):
        progress.new_step()
        inputs = {k: v.to(device) for k, v in inputs.items()}
        pools = {k: v.to(device) for k, v in pools.items()}
        res = inner_step(inputs, pools)
        logits, coreset, new_pools = res
        return StepResult(logits.cpu(), coreset.cpu(), {k: v.cpu() for k, v in new_pools.items()},
                          res.causal_logits.cpu())

    model.step = step
    return model


def resident_layers(model) -> list[int]:
    """Indices of the decoder layers whose weights are in memory (not on the meta device)."""
    return [i for i, layer in enumerate(model.model.layers)
            if any(p.device.type != "meta" for p in layer.parameters())]
