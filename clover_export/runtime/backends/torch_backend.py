"""The `torch` backend: the reference `CloverModel`, on CPU or CUDA, caches updated in place.

The model's cores compute new pools functionally; here they are wrapped so
that each core sees only the step's slots and the result is written back into
the runtime's pools in place (`index_copy_`), so no step copies the whole
pool.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clover_export.errors import CloverError
from clover_export.model.model import CloverModel, Cores, allocate_pools
from clover_export.models import load_model, resolve_model_dir


def _local(slot_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(slot_ids.shape[0], dtype=slot_ids.dtype, device=slot_ids.device)


def in_place_cores(base: Cores) -> Cores:
    """Cores that update the slot pools in place and return them."""

    def gdn(*args):
        conv_pool, rec_pool, slot_ids = args[9], args[10], args[11]
        idx = slot_ids.long()
        o, conv, rec = base.gdn(*args[:9], conv_pool.index_select(0, idx), rec_pool.index_select(0, idx),
                                _local(slot_ids), *args[12:])
        conv_pool.index_copy_(0, idx, conv)
        rec_pool.index_copy_(0, idx, rec)
        return o, conv_pool, rec_pool

    def attention(q, k, v, key_pool, value_pool, slot_ids, *rest):
        idx = slot_ids.long()
        o, keys, vals = base.attention(q, k, v, key_pool.index_select(0, idx), value_pool.index_select(0, idx),
                                       _local(slot_ids), *rest)
        key_pool.index_copy_(0, idx, keys)
        value_pool.index_copy_(0, idx, vals)
        return o, key_pool, value_pool

    return Cores(gdn=gdn, attention=attention, moe=base.moe)


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

    def __init__(self, model: CloverModel, source_dir: Path | None = None):
        self.model = model.eval()
        self.cfg = model.cfg
        self.block_size = model.block_size
        self.max_context = model.cfg.max_context
        self.device = model.lm_head.weight.device
        self.source_dir = Path(source_dir) if source_dir is not None else None
        self.cores = in_place_cores(model.cores)

    @classmethod
    def load(cls, model=None, *, dtype: str = "auto", device: str | None = None, block_size: int | None = None,
             allow_qwen: bool = False) -> "TorchBackend":
        device = check_device(device) if device else default_device()
        if block_size is not None and block_size < 1:
            raise CloverError("runtime", f"block_size must be >= 1, got {block_size}")
        if dtype == "auto":
            dtype = "bf16" if str(device).startswith("cuda") else "fp32"
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        model_dir = resolve_model_dir(model)
        ref = load_model(model_dir, dtype=torch_dtype, allow_qwen=allow_qwen, device=device, block_size=block_size)
        return cls(ref, model_dir)

    def allocate_pools(self, num_slots: int, max_len: int) -> dict[str, torch.Tensor]:
        return allocate_pools(self.cfg, num_slots, max_len, dtype=self.model.dtype, device=self.device)

    @torch.inference_mode()
    def step(self, inputs, pools):
        saved, self.model.cores = self.model.cores, self.cores
        try:
            return self.model.step(inputs, pools)
        finally:
            self.model.cores = saved

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Causal next-token logits [P, V] of the prompt (for golden comparisons)."""
        P, N = len(prompt_ids), self.block_size
        pools = self.allocate_pools(1, P)
        ids = torch.tensor([list(prompt_ids) + [0] * N], dtype=torch.int32, device=self.device)
        one = lambda v: torch.tensor([v], dtype=torch.int32, device=self.device)  # noqa: E731
        order = list(pools)
        h, _, _ = self.model.trunk(ids, one(P), one(0), one(0), one(0), *(pools[n] for n in order))
        return self.model.logits(h[0, :P])
