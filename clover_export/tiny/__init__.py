"""The embedded default model ("tiny"): trained weights shipped in `trained/`, copied to a cache folder on first use.

Same architecture pattern as Clover-35B-A3B at toy size: 3 GDN layers then 1
attention layer (repeated), a few experts, GQA, partial RoPE; byte-level BPE
tokenizer with chat template. Weights are BF16 safetensors in the real layout.
The shipped weights were trained for block diffusion on synthetic digit-list
tasks (`clover_export.train`; facts in `trained/training.json`);
`generate_random_tiny` still makes random folders of any shape for tests.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from clover_export.core.config import CloverConfig, config_from_dict
from clover_export.tiny import tokenizer_assets as tok

TINY_VERSION = 6  # bump when the shipped folder changes (tests/train/test_train.py keeps the pairing with the weights)
TRAINED_DIR = Path(__file__).parent / "trained"  # written by `python -m clover_export.train`


def tiny_config_dict(**overrides) -> dict:
    ids = tok.special_token_ids()
    d = {
        "model_type": "clover_moe",
        "architectures": ["CloverMoeModelLM"],
        "vocab_size": tok.VOCAB_SIZE,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "mask_token_id": ids[tok.MASK_TOKEN],
        "block_size": 32,
        "moe_block_coreset_enabled": True,
        "moe_block_coreset_top_p": 0.9,
        "max_context": 2048,
        "torch_dtype": "bfloat16",
    }
    d.update(overrides)
    return d


def tiny_config(**overrides) -> CloverConfig:
    return config_from_dict(tiny_config_dict(**overrides), source="<tiny>")


def generation_config_dict() -> dict:
    ids = tok.special_token_ids()
    return {
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "threshold": 0.95,
        "max_new_tokens": 256,
        "repetition_penalty": 1.05,
        "presence_penalty": 0.9,
        "frequency_penalty": 0.0,
        "dllm_length_penalty": 10.0,
        "dllm_think_end_bias": 10.0,
    }


def cache_root() -> Path:
    return Path(os.environ.get("CLOVER_EXPORT_CACHE", Path.home() / ".cache" / "clover-export"))


def write_model_folder(out_dir: Path, state: dict[str, torch.Tensor], config: dict, **save_kwargs) -> Path:
    """A complete model folder (weights, config, generation config, tokenizer), atomically."""
    from clover_export.core.checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tok.build_tokenizer_files(Path(tmp))
        extra = {p.name: p.read_text() for p in Path(tmp).iterdir()}
    extra["config.json"] = json.dumps(config, indent=2)
    extra["generation_config.json"] = json.dumps(generation_config_dict(), indent=2)
    return save_checkpoint(state, out_dir, extra_files=extra, **save_kwargs)


def generate_random_tiny(out_dir: Path, seed: int = 0, dtype=torch.bfloat16, **config_overrides) -> Path:
    """Random-weight tiny Clover folder (deterministic for a seed)."""
    from clover_export.model.model import CloverModel, init_random_  # not clover_export.model.loading: it imports us

    cfg_dict = tiny_config_dict(**config_overrides)
    model = init_random_(CloverModel(config_from_dict(cfg_dict)), seed=seed)
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    return write_model_folder(out_dir, state, cfg_dict)


def ensure_tiny() -> Path:
    """Path of the embedded default: the shipped trained folder, copied once into the cache folder."""
    from clover_export.core.atomic import publish_dir
    from clover_export.core.errors import CloverError

    target = cache_root() / f"tiny-v{TINY_VERSION}"
    if (target / "config.json").exists():
        return target
    if not (TRAINED_DIR / "config.json").exists():
        raise CloverError("model", f"{TRAINED_DIR}: the embedded default's trained weights are missing",
                          "reinstall clover-export, or rebuild them with `python -m clover_export.train "
                          f"--out {TRAINED_DIR}`")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for f in TRAINED_DIR.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        publish_dir(tmp, target)  # another process copying at the same time may finish first: its copy is kept
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def clear_cache() -> None:
    shutil.rmtree(cache_root(), ignore_errors=True)
