"""The op contracts (plugins/contracts.py) against the plain-torch cores they describe."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from clover_export.plugins import contracts as C
from clover_export.plugins.torch_ops import export_cores, ops, reference_core, schema


def test_contracts_import_without_heavy_dependencies():
    src = Path(C.__file__).read_text()
    imported = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import)}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "hashlib", "json", "dataclasses"}, imported


@pytest.mark.parametrize("name", list(C.CONTRACTS))
def test_argument_order_is_the_cores(name):
    c = C.CONTRACTS[name]
    params = list(inspect.signature(reference_core(c)).parameters)
    assert params == [t.name for t in c.inputs] + [a.name for a in c.attributes]


@pytest.mark.parametrize("name", list(C.CONTRACTS))
def test_contract_is_well_formed(name):
    c = C.CONTRACTS[name]
    ins = {t.name for t in c.inputs}
    for spec in c.inputs + c.outputs:
        rule = spec.dtype
        assert rule in ("float", *C.FIXED_DTYPES) or (rule.startswith("like:") and rule[5:] in ins), rule
    for a in c.attributes:
        assert a.type in C.ATTR_TYPES
    for out, inp in c.aliases.items():  # an aliased output has the input's shape and dtype
        o, i = next(t for t in c.outputs if t.name == out), c.input(inp)
        assert o.shape == i.shape and o.dtype == f"like:{inp}"
    bound = {d for t in c.inputs for d in t.shape} | {a.name for a in c.attributes}
    for spec in c.outputs:
        assert set(spec.shape) <= bound, f"{spec.name}: unbound dims {set(spec.shape) - bound}"


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=g)

    B, S, Hk, dk, dv, Hv, K, N, Tc = 2, 3, 2, 8, 8, 4, 4, 5, 6
    Cc = 2 * Hk * dk + Hv * dv
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    gdn = dict(mixed_qkv=rn(B, Tc + N, Cc), a=rn(B, Tc + N, Hv), b=rn(B, Tc + N, Hv), conv_w=rn(Cc, K),
               conv_w_right=rn(Cc, K), A_log=rn(Hv), dt_bias=rn(Hv), block_scale=rn(Hv), block_gate=rn(Hv),
               conv_pool=rn(S, Cc, K - 1), rec_pool=rn(S, Hv, dk, dv), slot_ids=i32([2, 0]), n_causal=i32([6, 2]))
    att = dict(q=rn(B, Tc + N, 4, 8), k=rn(B, Tc + N, 2, 8), v=rn(B, Tc + N, 2, 8), key_pool=rn(S, 2, 20, 8),
               value_pool=rn(S, 2, 20, 8), slot_ids=i32([1, 2]), past_len=i32([0, 7]), n_causal=i32([6, 3]))
    moe = dict(x=rn(B, Tc + N, 16), router_w=rn(8, 16), gate_up=rn(8, 24, 16), down=rn(8, 16, 12))
    fp8 = dict(x=moe["x"], router_w=moe["router_w"])
    for w in ("gate_up", "down"):  # e4m3 with one scale per output row, amax -> 448
        scale = moe[w].abs().amax(-1) / 448
        fp8[f"{w}_fp8"], fp8[f"{w}_scale"] = (moe[w] / scale[..., None]).to(torch.float8_e4m3fn), scale
    moe_attrs = dict(top_k=2, top_p=0.9, coreset=True, block_size=N)
    attrs = {"BlockGDN": dict(num_k_heads=Hk, head_k_dim=dk, head_v_dim=dv, block_size=N),
             "BlockAttention": dict(block_size=N, scale=8**-0.5), "CoresetMoE": moe_attrs, "CoresetMoEFP8": moe_attrs}
    return {"BlockGDN": gdn, "BlockAttention": att, "CoresetMoE": moe, "CoresetMoEFP8": fp8}, attrs


@pytest.mark.parametrize("name", list(C.CONTRACTS))
def test_output_shapes_and_dtypes_match_the_core(name):
    tensors, attrs = _inputs()
    c = C.CONTRACTS[name]
    out = reference_core(c)(*tensors[name].values(), *attrs[name].values())
    want = C.output_shapes(c, {k: tuple(v.shape) for k, v in tensors[name].items()}, attrs[name])
    assert [tuple(o.shape) for o in out] == want
    for spec, o in zip(c.outputs, out):
        src = C.output_dtype_source(spec)
        assert o.dtype == (tensors[name][src].dtype if src else getattr(torch, spec.dtype))


def test_bind_dims_rejects_inconsistent_shapes():
    tensors, attrs = _inputs()
    shapes = {k: tuple(v.shape) for k, v in tensors["BlockAttention"].items()}
    shapes["value_pool"] = (3, 2, 21, 8)  # L differs from key_pool
    with pytest.raises(ValueError, match="dim L"):
        C.bind_dims(C.BLOCK_ATTENTION, shapes, attrs["BlockAttention"])


@pytest.mark.parametrize("name", list(C.CONTRACTS))
def test_torch_op_equals_core_and_traces_on_meta(name):
    tensors, attrs = _inputs(1)
    op = ops()[name]
    core = reference_core(C.CONTRACTS[name])
    for a, b in zip(
        op(*tensors[name].values(), *attrs[name].values()), core(*tensors[name].values(), *attrs[name].values())
    ):
        assert torch.equal(a, b)
    meta = [t.to("meta") for t in tensors[name].values()]
    out = op(*meta, *attrs[name].values())
    assert all(o.device.type == "meta" for o in out)
    c = C.CONTRACTS[name]
    assert [a.name for a in op._schema.arguments] == [t.name for t in c.inputs] + [a.name for a in c.attributes]
    assert len(op._schema.returns) == len(c.outputs)
    assert schema(c).count("Tensor") == len(c.inputs) + len(c.outputs)


def test_export_cores_swap_in_without_changing_the_model(tiny_model):
    from clover_export.model.model import Cores, allocate_pools

    cfg = tiny_model.cfg
    g = torch.Generator().manual_seed(0)
    N = tiny_model.block_size
    inp = {"input_ids": torch.randint(0, cfg.vocab_size, (2, 4 + N), generator=g, dtype=torch.int32),
           "n_causal": torch.tensor([4, 2], dtype=torch.int32), "has_block": torch.tensor([1, 1], dtype=torch.int32),
           "slot_ids": torch.tensor([1, 0], dtype=torch.int32), "past_len": torch.tensor([0, 3], dtype=torch.int32)}
    pools = allocate_pools(cfg, 2, 16)
    with torch.no_grad():
        ref = tiny_model.step(inp, pools)
        tiny_model.cores = export_cores()
        try:
            got = tiny_model.step(inp, pools)
        finally:
            tiny_model.cores = Cores()
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_manifest_entry_changes_when_a_contract_changes():
    import dataclasses

    before = C.BLOCK_GDN.fingerprint()
    changed = dataclasses.replace(C.BLOCK_GDN, attributes=C.BLOCK_GDN.attributes[:-1])
    assert changed.fingerprint() != before
    assert set(C.manifest_entry()) == {"clover::BlockGDN", "clover::BlockAttention", "clover::CoresetMoE"}
    fp8 = C.manifest_entry(["BlockGDN", "CoresetMoEFP8"])
    assert set(fp8) == {"clover::BlockGDN", "clover::CoresetMoEFP8"}
    assert fp8["clover::CoresetMoEFP8"]["fingerprint"] == C.CORESET_MOE_FP8.fingerprint() != C.CORESET_MOE.fingerprint()


def test_fp8_variant_keeps_the_base_interface():
    """CoresetMoEFP8 is CoresetMoE on dequantized weights: same attributes, outputs, x and router inputs."""
    fp8, base = C.CORESET_MOE_FP8, C.CONTRACTS[C.CORESET_MOE_FP8.variant_of]
    assert base is C.CORESET_MOE and C.STEP_OPS == ("BlockGDN", "BlockAttention", "CoresetMoE")
    assert fp8.attributes == base.attributes and fp8.outputs == base.outputs
    assert fp8.inputs[:2] == base.inputs[:2]
    for w in ("gate_up", "down"):  # same [E, out, in] layout, scales [E, out]
        assert fp8.input(f"{w}_fp8").shape == base.input(w).shape
        assert fp8.input(f"{w}_scale").shape == base.input(w).shape[:2]
        assert (fp8.input(f"{w}_fp8").dtype, fp8.input(f"{w}_scale").dtype) == ("float8_e4m3fn", "float32")


def test_fp8_reference_is_the_core_on_dequantized_weights():
    tensors, attrs = _inputs(2)
    t, a = tensors["CoresetMoEFP8"], attrs["CoresetMoEFP8"]
    deq = {w: t[f"{w}_fp8"].float() * t[f"{w}_scale"][..., None] for w in ("gate_up", "down")}
    got = reference_core(C.CORESET_MOE_FP8)(*t.values(), *a.values())
    want = reference_core(C.CORESET_MOE)(t["x"], t["router_w"], deq["gate_up"], deq["down"], *a.values())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    exact = reference_core(C.CORESET_MOE)(*tensors["CoresetMoE"].values(), *a.values())[0]
    err = (got[0] - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.1, err  # the weights really are e4m3-rounded, and only that
