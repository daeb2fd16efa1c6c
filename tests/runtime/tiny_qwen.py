"""A tiny random transformers Qwen3_5MoeForCausalLM saved with our tokenizer files: the upstream model for
tests that need it next to our runtime (golden files, `ar` decoding)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch


def save_random_qwen(out: Path, tokenizer_dir: Path, seed: int):
    """Build a random Qwen3_5MoeForCausalLM (every tensor random and mattering), save it to `out` with the
    tokenizer files of `tokenizer_dir`; returns the model."""
    import transformers

    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / f, out / f)
    return model
