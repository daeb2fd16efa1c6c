"""Clover-35B-A3B at full size without its weights: the config, its layer sizes, a sparse checkpoint.

The sparse checkpoint has the real config (MODEL.md 2), real safetensors
headers and offsets and zero data: each shard is its header followed by
`truncate` to full size, so ~69 GB of checkpoint take a few MB of disk.
Experts are stored per expert (the layout that needs the exporter's Concat
fusion). Zero router weights tie every router logit, so a model read from it
routes every row to the same top-k experts.
"""

from __future__ import annotations

import json
import shutil
import struct
from functools import lru_cache
from importlib import resources
from pathlib import Path

from clover_export.core import names
from clover_export.core.config import CloverConfig, config_from_dict
from clover_export.tiny import ensure_tiny

SHARD_BYTES = 5 * 2**30
FULL_CONFIG = "data/clover_35b_a3b_config.json"


@lru_cache(maxsize=1)
def full_size_config() -> CloverConfig:
    """Clover-35B-A3B's config as shipped with the package (the model card's config.json)."""
    return config_from_dict(json.loads(resources.files("clover_export").joinpath(FULL_CONFIG).read_text()),
                            source=FULL_CONFIG)


def layer_sizes(cfg: CloverConfig | None = None) -> dict:
    """The sizes a kernel case at real layer size needs, by the short names the kernel contracts use."""
    c = cfg or full_size_config()
    return dict(D=c.hidden_size, E=c.num_experts, k=c.num_experts_per_tok, I=c.moe_intermediate_size,
                Hk=c.linear_num_key_heads, Hv=c.linear_num_value_heads, dk=c.linear_key_head_dim,
                dv=c.linear_value_head_dim, K=c.linear_conv_kernel_dim, H=c.num_attention_heads,
                Hkv=c.num_key_value_heads, hd=c.head_dim, N=c.block_size, top_p=c.moe_block_coreset_top_p)


def stored_tensors(cfg: CloverConfig) -> dict[str, tuple[int, ...]]:
    """Stored tensors: the canonical ones with experts split per expert (as many HF checkpoints store them)."""
    out = {}
    for name, shape in names.expected_tensors(cfg).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            E, rows, cols = shape
            for grp in names.per_expert_names(name, E):
                for part in grp:
                    out[part] = (rows // len(grp), cols)
        else:
            out[name] = shape
    return out


def write_sparse_checkpoint(folder: Path) -> tuple[int, int]:
    """Shards with real headers and zero (sparse) data; returns (apparent bytes, allocated bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = full_size_config()
    shards, cur, size = [], [], 0
    for name, shape in sorted(stored_tensors(cfg).items()):
        n = 2  # bf16
        for s in shape:
            n *= s
        if cur and size + n > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape, n))
        size += n
    shards.append(cur)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, n in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)
    # the real checkpoint ships Qwen's tokenizer; the embedded default's gives ids inside the full vocabulary,
    # which is all the build's FP8 calibration prompts need
    for fname in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(ensure_tiny() / fname, folder / fname)
    total = sum(n for shard in shards for _, _, n in shard)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({**cfg.to_dict(), "full_attention_interval": 4}, indent=1))
    return disk_usage(folder)


def disk_usage(folder: Path, skip_inodes: set | None = None) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files under folder (files whose inode is skipped excluded)."""
    app = alloc = 0
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if skip_inodes and (st.st_dev, st.st_ino) in skip_inodes:
                continue
            app += st.st_size
            alloc += st.st_blocks * 512
    return app, alloc
