"""Time `clover-export export` on a full-size Clover-35B-A3B checkpoint made of sparse files.

The checkpoint is synthetic: the real config (MODEL.md 2: `CloverConfig()`
defaults, layer_types from full_attention_interval 4, a mask_token_id),
real safetensors headers and offsets, zero data. Each shard is its header
followed by `truncate` to full size, so ~69 GB of checkpoint take ~0 bytes of
disk. Experts are stored per expert (the layout that needs the Concat
fusion). The export runs as a subprocess; its wall time, peak RSS and the
bytes it wrote are printed.

    python bench/export_fullsize.py [--work DIR] [--dtype bf16] [--weights link] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD_BYTES = 5 * 2**30


def full_config() -> dict:
    from clover_export.config import CloverConfig, config_from_dict

    d = {k: v for k, v in CloverConfig().to_dict().items() if k != "layer_types"}
    d.update(full_attention_interval=4, mask_token_id=248077)
    cfg = config_from_dict(d, source="<bench>")
    return {**cfg.to_dict(), "full_attention_interval": 4}


def tensors(cfg_dict: dict) -> dict[str, tuple[int, ...]]:
    """Stored tensors: the canonical ones with experts split per expert (as many HF checkpoints store them)."""
    from clover_export import names
    from clover_export.config import config_from_dict

    cfg = config_from_dict(cfg_dict)
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
    cfg = full_config()
    items = sorted(tensors(cfg).items())
    shards, cur, size = [], [], 0
    for name, shape in items:
        n = 2
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
    from clover_export.tiny import ensure_tiny

    for fname in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(ensure_tiny() / fname, folder / fname)
    total = sum(n for _, _, n in (t for s in shards for t in s))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder in /tmp)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--weights", default="link")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the export")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="clover-fullsize-"))
    ckpt, out = work / "checkpoint", work / "export"
    t = time.perf_counter()
    app, alloc = write_sparse_checkpoint(ckpt)
    print(f"checkpoint: {app / 1e9:.1f} GB apparent, {alloc / 1e6:.1f} MB on disk, "
          f"{len(list(ckpt.glob('*.safetensors')))} shards, written in {time.perf_counter() - t:.1f} s")
    shard_inodes = {(p.stat().st_dev, p.stat().st_ino) for p in ckpt.glob("*.safetensors")}
    free_before = shutil.disk_usage(work).free
    cmd = [sys.executable, "-m", "clover_export.cli", "export", str(ckpt), "--out", str(out),
           "--dtype", args.dtype, "--weights", args.weights]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(proc.stdout.strip())
    if proc.returncode:
        print(proc.stderr.strip())
        sys.exit(proc.returncode)
    e_app, e_alloc = disk_usage(out, skip_inodes=shard_inodes)
    linked = sum(1 for p in out.rglob("*.safetensors") if (p.stat().st_dev, p.stat().st_ino) in shard_inodes)
    manifest = json.loads((out / "manifest.json").read_text())
    print(f"export: wall {wall:.1f} s, peak RSS {peak / 2**30:.2f} GiB, "
          f"bytes written {e_app / 2**20:.1f} MiB ({e_alloc / 2**20:.1f} MiB allocated; shards sharing the "
          f"checkpoint's inodes: {linked}), weight bytes written {manifest['weights']['weight_bytes_written']}, "
          f"free space change {(free_before - shutil.disk_usage(work).free) / 2**20:.1f} MiB (other processes too)")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
