"""The `torch` backend: the reference `CloverModel`, on CPU or CUDA, caches updated in place.

The model's own cores are functional (they are the op contracts the ONNX
bodies and Triton kernels are tested against). For a step the backend swaps
in their in-place twins (STEP_GRAPH.md 1), given the slot ids the model passes:
- attention writes each row's n_causal new K/V positions into its slot and
  reads positions < read_len of the rows' slots, read_len = max(past_len +
  n_causal) over the step's rows (one host read per step): a view for one row,
  a gather of B x Hkv x read_len x hd for several;
- GDN reads and rewrites the rows' conv and recurrent states (fixed size).
Nothing per step grows with the pools' capacity (max_context).
On the CPU the MoE core is `moe_core_gathered` (only the experts some row
selected, each on its rows) in place of the dense reference `moe_core`. A
step in which no row has a block (prefill chunks, commits, `ar`) runs the
causal rows alone (STEP_GRAPH.md 1's N = 0 layout, `causal_only_step`).
The export traces the model's own cores and whole step, and sees neither.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from clover_export.backends.threads import check_threads, flops_per_row, torch_thread_scope, torch_threads
from clover_export.core import names
from clover_export.core.errors import CloverError
from clover_export.model.attention import attention_core_in_place
from clover_export.model.gdn import gdn_core_in_place
from clover_export.model.loading import load_model, resolve_model_dir
from clover_export.model.model import CloverModel, Cores, StepResult, allocate_pools, with_logit_rows
from clover_export.model.moe import moe_core, moe_core_gathered


def in_place_cores(base: Cores, read_len: int, device: torch.device) -> Cores:
    """The model's cores with attention and GDN updating the slot pools in place, attention reading the first
    `read_len` positions of each row's slot; the MoE as given, but gathered for the dense reference on the CPU."""
    moe = moe_core_gathered if base.moe is moe_core and device.type == "cpu" else base.moe
    return Cores(gdn=gdn_core_in_place, attention=partial(attention_core_in_place, read_len=read_len), moe=moe)


def causal_only_step(model: CloverModel, inputs, pools) -> StepResult:
    """`model.step` for a step whose rows have no block: the decoder stack over the C causal rows alone.

    Causal rows never see block rows (MODEL.md 4), so their hidden states, pools and `causal_logits` are
    the whole step's; `coreset_size` is 0 as the graph's (has_block 0). The block rows' logits are read by
    nobody but, with `logits_shift`, row 0 (the last valid causal row's, which the runtime keeps for the
    slot's next step: runner._first_from_last_row); that row is computed, the others are zero."""
    ids, N = inputs[names.INPUT_IDS], model.block_size
    B, C = ids.shape[0], ids.shape[1] - N
    order = names.pool_names(model.cfg)
    model.block_size = 0
    try:
        h, _, new_pools = model.trunk(ids[:, :C], *(inputs[n] for n in names.STEP_SCALARS[1:]),
                                      *(pools[n] for n in order))
    finally:
        model.block_size = N
    rows = [with_logit_rows(inputs)[names.LOGIT_ROWS].long().clamp(0, C - 1)]
    if model.cfg.logits_shift:
        rows.insert(0, (inputs[names.N_CAUSAL].long() - 1).clamp(min=0).unsqueeze(1))
    picked = torch.cat(rows, 1)
    out = model.logits(torch.gather(h, 1, picked.unsqueeze(-1).expand(-1, -1, h.shape[-1])))
    logits = out.new_zeros(B, N, out.shape[-1])
    shift = len(rows) - 1
    logits[:, :shift] = out[:, :shift]
    coreset = torch.zeros(B, model.cfg.num_hidden_layers, dtype=torch.int32, device=ids.device)
    return StepResult(logits, coreset, dict(zip(order, new_pools)), out[:, shift:])


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    """A device string torch accepts and this machine has, else a CloverError naming it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CloverError("runtime", f"--device {device!r} is not a torch device", "use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise CloverError("runtime", f"--device {device}: no CUDA device here (torch {torch.__version__})",
                              "use --device cpu; `clover-export doctor` lists what this machine has")
        if dev.index is not None and dev.index >= n:
            raise CloverError("runtime", f"--device {device}: this machine has {n} CUDA device(s)")
    return device


class TorchBackend:
    name = "torch"
    step_shapes = None  # any C, any batch

    def __init__(self, model: CloverModel, source_dir: Path | None = None, threads: int | None = None,
                 in_place: bool = True):
        self.model = model.eval()
        # False: each step runs the model's own functional cores (the semantics the graph is exported from,
        # what verify/ compares graphs with) and returns new pools, leaving the given ones untouched
        self.in_place = in_place
        self.cfg = model.cfg
        self.block_size = model.block_size
        self.max_context = model.cfg.max_context
        self.device = model.lm_head.weight.device
        self.source_dir = Path(source_dir) if source_dir is not None else None
        self.threads = check_threads(threads)  # explicit CPU threads, else the policy of backends/threads.py
        self.row_flops = flops_per_row(self.cfg)

    @classmethod
    def load(cls, model=None, *, dtype: str = "auto", device: str | None = None, block_size: int | None = None,
             allow_qwen: bool = False, threads: int | None = None) -> "TorchBackend":
        device = check_device(device) if device else default_device()
        if block_size is not None and block_size < 1:
            raise CloverError("runtime", f"block_size must be >= 1, got {block_size}")
        if dtype == "auto":
            dtype = "bf16" if str(device).startswith("cuda") else "fp32"
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        model_dir = resolve_model_dir(model)
        ref = load_model(model_dir, dtype=torch_dtype, allow_qwen=allow_qwen, device=device, block_size=block_size)
        return cls(ref, model_dir, threads=check_threads(threads))

    def thread_scope(self, rows: int):
        """torch's CPU threads for a step of `rows` rows, the caller's count restored after (backends/threads.py)."""
        n = torch_threads(self.threads, rows * self.row_flops) if self.device.type == "cpu" else None
        return torch_thread_scope(n)

    def allocate_pools(self, num_slots: int, max_len: int) -> dict[str, torch.Tensor]:
        return allocate_pools(self.cfg, num_slots, max_len, dtype=self.model.dtype, device=self.device)

    @torch.inference_mode()
    def step(self, inputs, pools):
        if not self.in_place:
            return self.model.step(inputs, pools)
        read_len = int((inputs[names.PAST_LEN].long() + inputs[names.N_CAUSAL].long()).max())
        causal_only = not bool(inputs[names.HAS_BLOCK].any())  # a host read, as read_len's
        saved = self.model.cores
        self.model.cores = in_place_cores(saved, read_len, self.device)
        try:
            return causal_only_step(self.model, inputs, pools) if causal_only else self.model.step(inputs, pools)
        finally:
            self.model.cores = saved

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Causal next-token logits [P, V] of the prompt (for golden comparisons)."""
        P, N = len(prompt_ids), self.block_size
        ids = torch.tensor([list(prompt_ids) + [0] * N], dtype=torch.int32, device=self.device)
        h = self.model.causal_hidden(ids, torch.tensor([P], dtype=torch.int32, device=self.device))
        return self.model.logits(h[0, :P])
