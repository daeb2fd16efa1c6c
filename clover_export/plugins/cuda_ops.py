"""The Triton kernels as the CUDA implementation of the `clover::` torch ops (STEP_GRAPH.md 2).

`register()` makes the kernels the CUDA kernels of the functional ops of
`torch_ops.py` (`clover::BlockGDN`, `clover::BlockAttention`,
`clover::CoresetMoE`, `clover::CoresetMoEFP8`). The first two are functional
(they return new pools), so their CUDA kernels copy the pools first and
update the copies in place. `kernel(name)` is the MoE ops' Triton path in
the contract's argument order (the TensorRT JIT plugins call it too).

The runtime wants no copy: `register()` also defines in-place twins,
`clover::BlockGDNInPlace` and `clover::BlockAttentionInPlace`, which mutate
the pools (schema `Tensor(a!)`) and return only `o`; `cuda_cores()` gives a
`Cores` built on them, whose functions return the mutated pools themselves
(the reference model threads them through unchanged). Nothing here syncs
with the host, so a step is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from clover_export.plugins import torch_ops
from clover_export.plugins.contracts import (
    BLOCK_ATTENTION,
    BLOCK_GDN,
    CORESET_MOE,
    CORESET_MOE_FP8,
    OpContract,
    output_shapes,
)

_REGISTERED: set[str] = set()


def _kernels():
    from clover_export.plugins.triton import ops

    return ops


def coreset_moe(x, router_w, gate_up, down, top_k: int, top_p: float, coreset: bool, block_size: int):
    """`clover::CoresetMoE` on the Triton kernels: (routed, coreset_size)."""
    return tuple(_kernels().coreset_moe(x, router_w, gate_up, down, top_k, top_p, coreset, block_size))


def coreset_moe_fp8(x, router_w, gate_up_fp8, gate_up_scale, down_fp8, down_scale, top_k: int, top_p: float,
                    coreset: bool, block_size: int):
    """`clover::CoresetMoEFP8` on the Triton kernels (e4m3 weights widened in registers, fp32 scales)."""
    return tuple(_kernels().coreset_moe(x, router_w, gate_up_fp8, down_fp8, top_k, top_p, coreset, block_size,
                                        gate_up_scale=gate_up_scale, down_scale=down_scale))


_MOE_KERNELS = {CORESET_MOE.name: coreset_moe, CORESET_MOE_FP8.name: coreset_moe_fp8}


def kernel(name: str):
    """The Triton implementation of a MoE op, taking its contract's arguments in order."""
    return _MOE_KERNELS[name]


def inplace_schema(contract: OpContract) -> str:
    """Schema of the in-place twin: aliased inputs become `Tensor(x!)`, the aliased outputs are dropped."""
    mutated = set(contract.aliases.values())
    args, tags = [], iter("abcdefgh")
    for t in contract.inputs:
        args.append(f"Tensor({next(tags)}!) {t.name}" if t.name in mutated else f"Tensor {t.name}")
    args += [f"{torch_ops._SCHEMA_TYPES[a.type]} {a.name}" for a in contract.attributes]
    outs = [o for o in contract.outputs if o.name not in contract.aliases]
    ret = "Tensor" if len(outs) == 1 else "(" + ", ".join("Tensor" for _ in outs) + ")"
    return f"({', '.join(args)}) -> {ret}"


def _pool_positions(contract: OpContract) -> list[int]:
    names = [t.name for t in contract.inputs]
    return [names.index(src) for src in contract.aliases.values()]


def _functional(contract: OpContract, fn):
    """CUDA kernel of the functional op: copy the pools, update the copies in place."""
    pools = _pool_positions(contract)

    def impl(*args):
        args = list(args)
        for i in pools:
            args[i] = args[i].clone()
        return tuple(fn(*args))

    return impl


def _define_inplace(contract: OpContract, fn):
    """The in-place twin, defined once per process for every device (the Triton kernel decides what runs)."""
    name = f"{contract.namespace}::{contract.name}InPlace"
    mutated = tuple(contract.aliases.values())
    n_in = len(contract.inputs)

    def impl(*args):
        return fn(*args)[0]

    def fake(*args):
        shapes = output_shapes(contract, {t.name: tuple(a.shape) for t, a in zip(contract.inputs, args)},
                               {a.name: v for a, v in zip(contract.attributes, args[n_in:])})
        return args[0].new_empty(shapes[0])

    op = torch.library.custom_op(name, impl, mutates_args=mutated, schema=inplace_schema(contract))
    op.register_fake(fake)
    return op


def register(device_type: str = "cuda") -> dict[str, object]:
    """Register the Triton kernels (idempotent). Returns the in-place twins by contract name.

    `device_type="cpu"` is for tests under TRITON_INTERPRET=1 only.
    """
    ops = _kernels()
    torch_ops.ops()  # the functional ops must exist first
    impls = ((BLOCK_GDN, ops.block_gdn), (BLOCK_ATTENTION, ops.block_attention))
    for contract, fn in impls:
        key = f"{contract.qualname}:{device_type}"
        if key not in _REGISTERED:
            torch.library.register_kernel(contract.qualname, device_type, _functional(contract, fn))
            _REGISTERED.add(key)
        if f"{contract.qualname}InPlace" not in _REGISTERED:
            _define_inplace(contract, fn)
            _REGISTERED.add(f"{contract.qualname}InPlace")
    for contract in (CORESET_MOE, CORESET_MOE_FP8):
        key = f"{contract.qualname}:{device_type}"
        if key not in _REGISTERED:
            torch.library.register_kernel(contract.qualname, device_type, kernel(contract.name))
            _REGISTERED.add(key)
    ns = getattr(torch.ops, BLOCK_GDN.namespace)
    return {c.name: getattr(ns, f"{c.name}InPlace").default for c, _ in impls}


def cuda_cores(device_type: str = "cuda"):
    """A `Cores` whose GDN and attention update the pools in place (no copy) and whose MoE is the kernels."""
    from clover_export.model.model import Cores

    twins = register(device_type)
    gdn_, attn_ = twins["BlockGDN"], twins["BlockAttention"]
    gdn_pools, attn_pools = _pool_positions(BLOCK_GDN), _pool_positions(BLOCK_ATTENTION)

    def gdn(*args):
        return (gdn_(*args), *(args[i] for i in gdn_pools))

    def attention(*args):
        return (attn_(*args), *(args[i] for i in attn_pools))

    return Cores(gdn=gdn, attention=attention, moe=getattr(torch.ops, CORESET_MOE.namespace).CoresetMoE.default)
