"""Time `clover-export build` (bf16 and fp8) on a full-size sparse Clover-35B-A3B checkpoint.

The checkpoint is `clover_export.testing.fullsize.write_sparse_checkpoint`'s: the
real config, real safetensors headers, experts stored per expert, zero (sparse) data. Each build runs as a
subprocess. Printed per build: wall time, CPU seconds (the build and its
child processes), peak RSS of the whole process tree (the build runs its bf16
export in a child process beside its own stages: the RSS of every process
in the tree is summed, sampled every 0.1 s; pages shared between processes
-- libraries, and a parent's pages in a child between its fork and its exec,
microseconds -- count once per process, so this can only overstate; the
line shows what each process held at the peak), bytes written (each inode
counted once, the checkpoint's hard-linked shards excluded) and the build
log's stage lines, each with the time it was printed;
for fp8 also the FP8 weight bytes, and the disk write rate achieved vs a
plain sequential write of the same number of bytes measured in the same run
(written, fsynced, deleted before the fp8 build starts).

Targets (on a 2-core 24 GB machine): bf16 <= 3 min and <= 12 GB peak
RSS, no weight bytes written; fp8 <= 12 GB peak RSS, bytes written <= 1.05 x
the FP8 weight bytes, wall <= 1.5 x the plain write time + 2 min.

    python bench/build_fullsize.py [--work DIR] [--only bf16|fp8] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from clover_export.testing.fullsize import full_size_config, write_sparse_checkpoint

GiB = 2**30
PAGE = os.sysconf("SC_PAGE_SIZE")


class TreeRss:
    """Peak of the summed RSS of a process and its descendants, sampled every `period` seconds in a thread."""

    def __init__(self, pid: int, period: float = 0.1):
        self.pid, self.period, self.peak, self.at_peak = pid, period, 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> dict[int, int]:
        """pid -> RSS bytes of self.pid and its descendants (one scan of /proc)."""
        parent, rss = {}, {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):  # gone meanwhile
                    continue
        tree, todo = set(), [self.pid]
        while todo:
            p = todo.pop()
            tree.add(p)
            todo.extend(c for c, pp in parent.items() if pp == p and c not in tree)
        for p in tree:
            try:
                with open(f"/proc/{p}/statm") as f:
                    rss[p] = int(f.read().split()[1]) * PAGE
            except (OSError, IndexError, ValueError):
                pass
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            rss = self._tree()
            if sum(rss.values()) > self.peak:
                self.peak, self.at_peak = sum(rss.values()), rss

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def written_bytes(folder: Path, skip: set) -> int:
    """Allocated bytes of the files under folder, each inode once, `skip` inodes excluded."""
    seen, total = set(skip), 0
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def run_build(ckpt: Path, out: Path, precision: str) -> dict:
    r = run_tree([sys.executable, "-m", "clover_export.cli", "build", str(ckpt), "--out", str(out),
                  "--precision", precision, "--max-batch", "1", "--max-context", "4096"], f"{precision} build")
    r["log"] = [f"[{at:6.1f} s] {line}" for at, line in r["lines"]
                if line.startswith("[") or "plan" in line or "build" in line]
    return r


def run_tree(cmd: list[str], what: str) -> dict:
    """Run cmd; wall, CPU seconds, peak tree RSS (`TreeRss`) and its stdout lines, each with when it came."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rss = TreeRss(proc.pid)
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)  # progress bars
    drain.start()
    lines = [(time.perf_counter() - t, line.rstrip("\n")) for line in proc.stdout]  # stamped as printed
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    peak = rss.stop()
    drain.join()
    proc.stdout.close()
    proc.stderr.close()
    cpu = usage.ru_utime + usage.ru_stime  # the build's and its (waited-for) child processes'
    if proc.returncode:
        print("\n".join(line for _, line in lines[-30:]), "\n", "".join(err)[-3000:])
        raise SystemExit(f"{what} failed (exit {proc.returncode})")
    return {"wall": wall, "peak": peak, "cpu": cpu, "lines": lines, "max_single": usage.ru_maxrss * 1024,
            "at_peak": rss.at_peak}


def peak_line(r: dict) -> str:
    """Peak RSS of the process tree, with what each process held at that moment."""
    parts = " + ".join(f"{v / GiB:.2f}" for v in sorted(r["at_peak"].values(), reverse=True))
    return (f"peak RSS {r['peak'] / GiB:.2f} GiB (process tree: {parts} GiB; largest single process "
            f"{r['max_single'] / GiB:.2f} GiB)")


def plain_write(path: Path, nbytes: int, chunk: int = 64 * 2**20) -> float:
    """Seconds to write `nbytes` sequentially (fsync included); the file is deleted afterwards."""
    buf = b"\1" * chunk
    t = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(buf[:min(chunk, left)])
        f.flush()
        os.fsync(f.fileno())
    sec = time.perf_counter() - t
    path.unlink()
    return sec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder in /tmp)")
    ap.add_argument("--only", choices=["bf16", "fp8", "fp8-weights"], default=None,
                    help="fp8-weights: only the FP8 weight stage (quantize + write) vs the plain write")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the build folders")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="clover-build-fullsize-"))
    ckpt = work / "checkpoint"
    app, alloc = write_sparse_checkpoint(ckpt)
    print(f"checkpoint: {app / 1e9:.1f} GB apparent, {alloc / 2**20:.1f} MiB on disk (sparse, per-expert layout)")
    shards = {(p.stat().st_dev, p.stat().st_ino) for p in ckpt.glob("*.safetensors")}
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (shared: timings are noisy; "
          "CPU seconds are the child's user + system time)")
    try:
        if args.only in (None, "bf16"):
            r = run_build(ckpt, work / "build-bf16", "bf16")
            print("\n".join("  " + line for line in r["log"]))
            print(f"bf16 build: wall {r['wall']:.1f} s (CPU {r['cpu']:.1f} s), {peak_line(r)}, bytes written "
                  f"{written_bytes(work / 'build-bf16', shards) / 2**20:.1f} MiB  (targets: <= 180 s, <= 12 GiB, "
                  "no weight bytes)")
            if not args.keep:
                shutil.rmtree(work / "build-bf16")
        if args.only in (None, "fp8"):
            from clover_export.model.sizing import weight_bytes
            from clover_export.pipeline.disk_plan import fp8_weight_file_bytes

            cfg = full_size_config()
            fp8_file = fp8_weight_file_bytes(cfg)
            fp8_gemm = weight_bytes(cfg, "fp8")  # "the FP8 weight bytes" of the target (34.08 GiB)
            plain = plain_write(work / "plain-write.bin", fp8_file)
            print(f"plain sequential write of {fp8_file / GiB:.2f} GiB: {plain:.1f} s "
                  f"({fp8_file / plain / 2**20:.0f} MiB/s)")
            r = run_build(ckpt, work / "build-fp8", "fp8")
            print("\n".join("  " + line for line in r["log"]))
            written = written_bytes(work / "build-fp8", shards)
            import json

            stages = json.loads((work / "build-fp8" / "build.json").read_text())["stages"]
            qsec = stages["fp8-weights"]["result"]["seconds"]
            print(
                f"fp8 build: wall {r['wall']:.1f} s (CPU {r['cpu']:.1f} s), {peak_line(r)}, bytes written "
                f"{written / GiB:.2f} GiB = {written / fp8_gemm:.3f} x the FP8 weight bytes ({fp8_gemm / GiB:.2f} GiB)"
            )
            print(
                f"  quantization stage: {fp8_file / GiB:.2f} GiB in {qsec:.1f} s = {fp8_file / qsec / 2**20:.0f} MiB/s "
                f"vs plain write {fp8_file / plain / 2**20:.0f} MiB/s; wall {r['wall']:.0f} s vs target "
                f"1.5 x {plain:.0f} s + 120 s = {1.5 * plain + 120:.0f} s"
            )
        if args.only == "fp8-weights":
            fp8_weights_only(ckpt, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def fp8_weights_only(ckpt: Path, work: Path) -> None:
    """The FP8 weight stage of `build` alone (as a subprocess) next to a plain write of the same bytes."""
    from clover_export.pipeline.disk_plan import fp8_weight_file_bytes

    nbytes = fp8_weight_file_bytes(full_size_config())
    plain = plain_write(work / "plain-write.bin", nbytes)
    print(f"plain sequential write of {nbytes / GiB:.2f} GiB: {plain:.1f} s ({nbytes / plain / 2**20:.0f} MiB/s)")
    code = (
        "import sys, time, os; from pathlib import Path; from clover_export.core.config import load_config; "
        "from clover_export.core.checkpoint import locate_tensors, plan_tensors; "
        "from clover_export.model.sizing import fp8_weight_names; "
        "from clover_export.quantize.weights import quantize_weights; "
        "m = Path(sys.argv[1]); cfg = load_config(m); plans = plan_tensors(cfg, locate_tensors(m)); "
        "w = quantize_weights(plans, fp8_weight_names(cfg), Path(sys.argv[2])); "
        "f = os.open(w.bin, os.O_RDONLY); os.fsync(f); print('written', w.bytes_written)"
    )
    r = run_tree([sys.executable, "-c", code, str(ckpt), str(work / "fp8-weights")], "the fp8-weights stage")
    wall, peak, cpu = r["wall"], r["peak"], r["cpu"]
    written = written_bytes(work / "fp8-weights", set())
    print(f"fp8-weights stage: wall {wall:.1f} s (CPU {cpu:.1f} s, fsync included), peak RSS {peak / GiB:.2f} GiB, "
          f"{written / GiB:.2f} GiB written = {written / nbytes:.3f} x planned; {written / wall / 2**20:.0f} MiB/s "
          f"vs plain {nbytes / plain / 2**20:.0f} MiB/s; wall / plain = {wall / plain:.2f}")
    shutil.rmtree(work / "fp8-weights")


if __name__ == "__main__":
    main()
