"""Time `clover-export export` on a full-size Clover-35B-A3B checkpoint made of sparse files.

The checkpoint is synthetic (`clover_export.testing.fullsize.write_sparse_checkpoint`):
the real config (MODEL.md 2), real safetensors headers and offsets, zero
data. Each shard is its header followed by `truncate` to full size, so ~69 GB
of checkpoint take ~0 bytes of disk. Experts are stored per expert (the
layout that needs the Concat fusion). The export runs as a subprocess; its
wall time, peak RSS and the bytes it wrote are printed.

    python bench/export_fullsize.py [--work DIR] [--dtype bf16] [--weights link] [--keep]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clover_export.artifact.manifest import load_artifact
from clover_export.testing.fullsize import disk_usage, write_sparse_checkpoint


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
    weights = load_artifact(out).manifest.weights
    print(f"export: wall {wall:.1f} s, peak RSS {peak / 2**30:.2f} GiB, "
          f"bytes written {e_app / 2**20:.1f} MiB ({e_alloc / 2**20:.1f} MiB allocated; shards sharing the "
          f"checkpoint's inodes: {linked}), weight bytes written {weights.report['weight_bytes_written']}, "
          f"free space change {(free_before - shutil.disk_usage(work).free) / 2**20:.1f} MiB (other processes too)")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
