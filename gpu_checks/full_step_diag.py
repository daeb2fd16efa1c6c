"""Which core differs? Each kernel against its plain-torch core at full-size layer shapes in bf16, on a GPU.

The inputs of a real layer (random full-size weights, 4 layers: 3 GDN + 1
attention): B = 8 rows of 32 causal + 32 block rows over a 4096-position
cache. Prints the relative error of each kernel's output against the bf16
core and of the bf16 core against the fp32 core (the yardstick), and whether
the pools the kernels write equal the core's.

    python gpu_checks/full_step_diag.py      # CUDA GPU with ~10 GB free
"""

from __future__ import annotations

import argparse

import torch

from clover_export.model.model import CloverModel, Cores, allocate_pools
from clover_export.plugins.cuda_ops import cuda_cores
from clover_export.testing.cuda import init_random_on_device_
from clover_export.testing.fullsize import full_size_config
from clover_export.testing.kernel_cases import rel


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    cfg = full_size_config()
    cfg = cfg.replace(num_hidden_layers=4, layer_types=cfg.layer_types[:4])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = CloverModel(cfg).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    init_random_on_device_(model, router_std=0.5)
    K, P = cuda_cores(), Cores()
    g = torch.Generator(device="cuda").manual_seed(1)
    B, N, C, past = 8, 32, 32, 4096
    x = torch.randn(B, C + N, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    pools = allocate_pools(cfg, B, past + 64, dtype=torch.bfloat16, device="cuda")
    for k, v in pools.items():
        v.normal_(0, 0.5 if "key" in k or "value" in k else 0.05, generator=g)
    i32 = dict(dtype=torch.int32, device="cuda")
    slot, nc, pl = torch.arange(B, **i32), torch.full((B,), C, **i32), torch.full((B,), past, **i32)
    with torch.no_grad():
        lay = model.model.layers[0].linear_attn
        args = (lay.in_proj_qkv(x), lay.in_proj_a(x), lay.in_proj_b(x), lay.conv1d.weight.squeeze(1),
                lay.conv1d_right.weight.squeeze(1), lay.A_log, lay.dt_bias, lay.block_softmax_scale,
                lay.block_softmax_gate)
        tail = (slot, nc, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, N)
        p0 = pools["past_key_values.0.conv_state"], pools["past_key_values.0.recurrent_state"]
        ref = P.gdn(*args, p0[0].clone(), p0[1].clone(), *tail)
        ker = K.gdn(*args, p0[0].clone(), p0[1].clone(), *tail)
        ref32 = P.gdn(*[a.float() if a.dtype == torch.bfloat16 else a for a in args], p0[0].float(), p0[1].clone(),
                      *tail)
        print("GDN o: kernel vs bf16 ref", rel(ker[0], ref[0]), "bf16 ref vs fp32 ref", rel(ref[0], ref32[0]),
              "kernel vs fp32", rel(ker[0], ref32[0]))
        print("GDN o causal rows", rel(ker[0][:, :C], ref32[0][:, :C]),
              "block rows", rel(ker[0][:, C:], ref32[0][:, C:]))
        print("GDN conv", rel(ker[1], ref[1]), "rec", rel(ker[2], ref[2]))
        moe = model.model.layers[0].mlp
        margs = (x, moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj, cfg.num_experts_per_tok,
                 cfg.moe_block_coreset_top_p, True, N)
        r, k = P.moe(*margs), K.moe(*margs)
        r32 = P.moe(x.float(), moe.gate.weight.float(), moe.experts.gate_up_proj.float(),
                    moe.experts.down_proj.float(), *margs[4:])
        print("MoE: kernel vs bf16 ref", rel(k[0], r[0]), "bf16 ref vs fp32", rel(r[0], r32[0]), "kernel vs fp32",
              rel(k[0], r32[0]), "sizes", k[1].tolist(), r[1].tolist())
        H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = torch.randn(B, C + N, H, hd, device="cuda", generator=g).to(torch.bfloat16)
        kk = torch.randn(B, C + N, Hkv, hd, device="cuda", generator=g).to(torch.bfloat16)
        vv = torch.randn(B, C + N, Hkv, hd, device="cuda", generator=g).to(torch.bfloat16)
        kp, vp = pools["past_key_values.3.key"], pools["past_key_values.3.value"]
        ra = P.attention(q, kk, vv, kp.clone(), vp.clone(), slot, pl, nc, N, hd ** -0.5)
        ka = K.attention(q, kk, vv, kp.clone(), vp.clone(), slot, pl, nc, N, hd ** -0.5)
        print("attention o", rel(ka[0], ra[0]), "k pool", rel(ka[1], ra[1]))


if __name__ == "__main__":
    main()
