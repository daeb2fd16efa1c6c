"""Streaming reads and writes past the page cache (O_DIRECT), for passes over the whole checkpoint.

A streamed pass (FP8 calibration) reads the 64 GiB of experts once
per pass on a machine with far less RAM: the page cache cannot keep any of
it for the next pass, and filling it is most of the cost of a memory-mapped
read (measured on 2 CPU cores: 1.6 GiB of a layer in 2-3 s through page
faults, 0.4 s with O_DIRECT into a buffer already mapped; on a real disk
O_DIRECT reads at the device's rate without evicting everything else).

O_DIRECT wants block-aligned file offsets, lengths and memory: tensors sit at
arbitrary offsets, so the locations asked for are sorted, merged into runs
of nearby bytes (a large tensor is cut into pieces), and each run is read,
widened to 4 KiB blocks, into one page-aligned staging buffer reused for
every run; a tensor (or piece) is a view into it until the next run is read. Where the file system refuses
O_DIRECT (tmpfs, some network file systems) the same runs are read through the page cache.

`read_views` is the other way to read: the tensors asked for stay readable as views into an `Arena` the
caller keeps (a streamed layer's routed experts, 1.6 GiB a layer at full size: copying them out of the
staging buffer took one of 2 cores ~0.6 s a layer away from the GEMMs beside it).

`DirectWriter` is the other direction, for the 30.7 GiB FP8 weight file: it
is written beside CPU-bound stages (`pipeline/background.py`), and through the
page cache its writeback and reclaim took as much CPU from them as the
overlap saved (the GDN slice 35 -> 61 s; `python bench/build_fullsize.py` times the stages). Bytes are gathered in
one aligned buffer and written in whole chunks; the file is cut to its
logical size at the end.

Written by hand: neither safetensors nor torch reads or writes past the page cache.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from clover_export.core.checkpoint import TORCH_DTYPES, TensorLocation, TensorPlan
from clover_export.core.errors import CloverError

BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and memory (covers 512-byte devices)
RUN_BYTES = 256 * 2**20  # nearby tensors are read together up to this size (a larger tensor is a run alone)
MAX_GAP = 2**20  # bytes between two tensors read through rather than split into two runs
READ_BYTES = 64 * 2**20  # one preadv at a time


class DirectReader:
    """Reads tensors' bytes in file order; one staging buffer, reused (grown to the largest run)."""

    def __init__(self, direct: bool = True):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._buf: mmap.mmap | None = None
        self.used_direct: set[bool] = set()  # which path the files were read through (tests)

    def _staging(self, nbytes: int) -> mmap.mmap:
        if self._buf is None or len(self._buf) < nbytes:  # the old one is unmapped once no view holds it
            self._buf = mmap.mmap(-1, -(-nbytes // BLOCK) * BLOCK)  # anonymous: page-aligned
        return self._buf

    def _open(self, path) -> tuple[int, bool]:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError:  # the file system has no O_DIRECT: through the page cache
                pass
        try:
            return os.open(path, os.O_RDONLY), False
        except OSError as e:
            raise CloverError("checkpoint", f"{path}: cannot open ({e.strerror})") from None

    def _read_run(self, fd: int, direct: bool, path, start: int, end: int) -> tuple[memoryview, int]:
        """Bytes [start, end) of the file; returns the buffer and where `start` sits in it."""
        lo = start - start % BLOCK if direct else start
        hi = end if not direct else -(-end // BLOCK) * BLOCK
        buf = memoryview(self._staging(hi - lo))
        _fill(fd, direct, path, buf, lo, hi, end)
        return buf, start - lo

    def read_views(self, locs: Iterable[TensorLocation], arena: "Arena") -> dict[TensorLocation, torch.Tensor]:
        """Every location's tensor as a view into `arena` (grown to fit; the views of its last use must be
        dropped): nearby tensors of a file are read as one window, in file order, straight into the arena."""
        by_file: dict = {}
        for loc in locs:
            by_file.setdefault(loc.file, []).append(loc)
        windows = []  # (file, first block, end, locations): each window sits in the arena block-aligned
        for path, group in by_file.items():
            group.sort(key=lambda l: l.offset)
            for loc in group:
                if windows and windows[-1][0] == path and loc.offset - windows[-1][2] <= MAX_GAP:
                    windows[-1][2] = max(windows[-1][2], loc.offset + loc.length)
                    windows[-1][3].append(loc)
                else:
                    windows.append([path, loc.offset - loc.offset % BLOCK, loc.offset + loc.length, [loc]])
        spans = [-(-(end - lo) // BLOCK) * BLOCK for _, lo, end, _ in windows]
        data = arena.reserve(sum(spans))
        mem, out, at = memoryview(arena.mm), {}, 0
        for (path, lo, end, members), span in zip(windows, spans):
            fd, direct = self._open(path)
            try:
                try:
                    _fill(fd, direct, path, mem[at:at + span], lo, lo + span, end)
                except _NoDirect:
                    os.close(fd)
                    fd, self.direct = -1, False
                    fd, direct = self._open(path)
                    _fill(fd, direct, path, mem[at:at + span], lo, lo + span, end)
            finally:
                if fd >= 0:
                    os.close(fd)
            self.used_direct.add(direct)
            for loc in members:
                dtype, first = TORCH_DTYPES[loc.dtype], at + loc.offset - lo
                raw = data[first:first + loc.length]
                # a misaligned tensor (not seen in safetensors files): a copy of its bytes
                out[loc] = (raw if first % dtype.itemsize == 0 else raw.clone()).view(dtype).view(loc.shape)
            at += span
        return out

    def read(self, locs: Iterable[TensorLocation]) -> Iterator[tuple[TensorLocation, int, torch.Tensor]]:
        """(location, first element, flat piece) in file order: a tensor larger than a run comes in pieces.
        A piece is a view into the staging buffer, valid until the next one is yielded: copy or cast it."""
        by_file: dict = {}
        for loc in locs:
            by_file.setdefault(loc.file, []).append(loc)
        for path, group in by_file.items():
            group.sort(key=lambda l: l.offset)
            fd, direct = self._open(path)
            try:
                for run in _runs(group):
                    try:
                        yield from self._pieces(fd, direct, path, run)
                    except _NoDirect:
                        os.close(fd)
                        fd, self.direct = -1, False
                        fd, direct = self._open(path)
                        yield from self._pieces(fd, direct, path, run)
            finally:
                if fd >= 0:
                    os.close(fd)

    def _pieces(self, fd, direct, path, run):
        """A run of whole tensors, or one piece of a large tensor (`_runs`)."""
        loc, first, nbytes = run[0]
        start = loc.offset + first
        last, f, n = run[-1]
        end = last.offset + f + n
        buf, base = self._read_run(fd, direct, path, start, end) if end > start else (None, 0)
        self.used_direct.add(direct)
        for loc, first, nbytes in run:
            dtype = TORCH_DTYPES[loc.dtype]
            at = base + loc.offset + first - start
            if nbytes == 0:  # frombuffer refuses an empty view
                piece = torch.empty(0, dtype=dtype)
            elif at % dtype.itemsize:  # a misaligned tensor (not seen in safetensors files): a copy of its bytes
                piece = torch.frombuffer(bytearray(buf[at:at + nbytes]), dtype=torch.uint8).view(dtype)
            else:
                piece = torch.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=at)
            yield loc, first // dtype.itemsize, piece


POPULATE_BYTES = 64 * 2**20  # tensors from this size up get their pages mapped up front (`empty`)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty`, but from POPULATE_BYTES up its pages are mapped when it is made (MAP_POPULATE): one
    pass in the kernel instead of a page fault per 4 KiB from whichever threads write it first (a parallel
    `copy_` faulting from 2 threads took 2x the kernel time of one pass: ~1.1 vs ~0.55 s a GiB on 2
    CPU cores). The tensor keeps its mapping alive; it is unmapped with the last view of it."""
    nbytes = math.prod(shape) * dtype.itemsize
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes == 0 or nbytes < POPULATE_BYTES or not populate:
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, -(-nbytes // BLOCK) * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def plan_targets(plan: TensorPlan, dest: torch.Tensor) -> dict[TensorLocation, torch.Tensor]:
    """Where each of the plan's locations goes in `dest` (its canonical tensor): the whole of it, or per
    expert its rows (contiguous in [E, out, in])."""
    if plan.fused:
        return {plan.parts[0][0]: dest}
    out = {}
    for e, grp in enumerate(plan.parts):
        row = 0
        for loc in grp:
            out[loc] = dest[e, row:row + loc.shape[0]]
            row += loc.shape[0]
    return out


def read_plan(reader: DirectReader, plan: TensorPlan, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The plan's canonical tensor (per-expert parts stacked), cast to `dtype` while copied out of the
    staging buffer: pages of its own only, none of the page cache (see the module docstring)."""
    dest = empty(plan.shape, dtype or TORCH_DTYPES[plan.parts[0][0].dtype])
    read_into(reader, plan_targets(plan, dest))
    return dest


def read_into(reader: DirectReader, targets: dict[TensorLocation, torch.Tensor]) -> None:
    """Copy (casting) each location's tensor into its target, a contiguous tensor of as many elements."""
    for loc, first, piece in reader.read(targets):
        targets[loc].view(-1)[first:first + piece.numel()].copy_(piece)


class _NoDirect(Exception):
    pass


def _fill(fd: int, direct: bool, path, buf: memoryview, lo: int, hi: int, end: int) -> None:
    """buf[i] = file byte lo + i, for i up to `end` - lo at least (reads ask for up to hi: O_DIRECT's whole
    blocks; the file's last block comes back short)."""
    got = 0
    while lo + got < end:
        try:
            n = os.preadv(fd, [buf[got:got + min(READ_BYTES, hi - lo - got)]], lo + got)
        except OSError as e:
            if direct and e.errno == 22 and got == 0:  # EINVAL: O_DIRECT refused at read time
                raise _NoDirect from None
            raise CloverError("checkpoint", f"{path}: read failed at byte {lo + got} ({e.strerror})") from None
        if n == 0:
            raise CloverError("checkpoint", f"{path}: ends at byte {lo + got}, a tensor needs bytes up to {end}")
        got += n


class Arena:
    """A page-aligned buffer for `DirectReader.read_views`, kept and reused by its owner; grown by replacing
    it (views of the old one keep it alive until they go)."""

    def __init__(self):
        self.mm: mmap.mmap | None = None
        self.bytes: torch.Tensor | None = None  # uint8 over mm: every view shares its storage

    def reserve(self, nbytes: int) -> torch.Tensor:
        if self.mm is None or len(self.mm) < nbytes:
            self.mm = mmap.mmap(-1, max(BLOCK, -(-nbytes // BLOCK) * BLOCK))  # anonymous: page-aligned
            self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self.bytes


def _runs(group: list[TensorLocation]) -> list[list[tuple[TensorLocation, int, int]]]:
    """(location, first byte, bytes) lists, each read at once: nearby tensors together up to RUN_BYTES; a
    larger tensor alone, in RUN_BYTES pieces (so the staging buffer never outgrows RUN_BYTES + 2 blocks)."""
    runs: list[list[tuple[TensorLocation, int, int]]] = []
    end = 0  # where the last run's bytes end
    for loc in group:
        if runs and loc.offset - end <= MAX_GAP and loc.offset + loc.length - runs[-1][0][0].offset <= RUN_BYTES:
            runs[-1].append((loc, 0, loc.length))
        elif loc.length <= RUN_BYTES:
            runs.append([(loc, 0, loc.length)])
        else:
            step = RUN_BYTES - RUN_BYTES % TORCH_DTYPES[loc.dtype].itemsize
            runs.extend([(loc, first, min(step, loc.length - first))] for first in range(0, loc.length, step))
        end = max(end, loc.offset + loc.length)
    return runs


class DirectWriter:
    """Appends to a new file in CHUNK-sized O_DIRECT writes (the page cache otherwise); `close` pads the
    last chunk to a block, cuts the file to what was written, and fsyncs it."""

    CHUNK = 64 * 2**20

    def __init__(self, path, direct: bool = True):
        self.path = path
        self.direct = direct and hasattr(os, "O_DIRECT")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError:
            self.direct = False
            self.fd = os.open(path, flags, 0o644)
        self.buf = mmap.mmap(-1, self.CHUNK)  # page-aligned
        # copies and fills through numpy release the GIL (a 64 MiB memcpy under it stalled the build's
        # Python-bound stages beside the writer thread)
        self._arr = np.frombuffer(self.buf, dtype=np.uint8)
        self.fill = 0  # bytes in buf
        self.flushed = 0  # bytes in the file

    def tell(self) -> int:
        return self.flushed + self.fill

    def write(self, data) -> None:
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        while src.size:
            n = min(src.size, self.CHUNK - self.fill)
            self._arr[self.fill:self.fill + n] = src[:n]
            self.fill += n
            src = src[n:]
            if self.fill == self.CHUNK:
                self._flush(self.CHUNK)

    def zeros(self, n: int) -> None:
        """n zero bytes, without building them in memory first."""
        while n:
            k = min(n, self.CHUNK - self.fill)
            self._arr[self.fill:self.fill + k] = 0
            self.fill += k
            n -= k
            if self.fill == self.CHUNK:
                self._flush(self.CHUNK)

    def _flush(self, nbytes: int) -> None:
        done = 0
        with memoryview(self.buf) as mv:  # released before any error leaves: `abort` can then unmap the buffer
            while done < nbytes:
                try:
                    done += os.write(self.fd, mv[done:nbytes])
                except OSError as e:
                    if self.direct and e.errno == 22:  # EINVAL: O_DIRECT refused at write time: the page cache
                        os.close(self.fd)
                        self.direct = False
                        self.fd = os.open(self.path, os.O_WRONLY)
                        os.lseek(self.fd, self.flushed + done, os.SEEK_SET)
                        continue
                    raise CloverError("write", f"{self.path}: write failed at byte {self.flushed + done} "
                                      f"({e.strerror})") from None
        self.flushed += nbytes
        self.fill = 0

    def close(self) -> int:
        """Write what is left and close; the file's size."""
        size = self.tell()
        if self.fill:
            pad = -self.fill % BLOCK
            self._arr[self.fill:self.fill + pad] = 0
            self._flush(self.fill + pad)
        os.ftruncate(self.fd, size)
        os.fsync(self.fd)
        self.abort()
        return size

    def abort(self) -> None:
        """Close without finishing (the caller removes the file); again after `close`: nothing."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
            self._arr = None  # numpy's view of the buffer: gone before it is unmapped
            try:
                self.buf.close()
            except BufferError:  # a view still held somewhere: unmapped when it goes
                pass

