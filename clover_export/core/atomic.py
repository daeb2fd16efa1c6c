"""Nothing half-written: files and folders are written to a temporary name beside their target, then renamed."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def atomic_write(path: Path, data: bytes | memoryview | Callable) -> None:
    """Write `data` (bytes, or a function writing to a binary file object) to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            data(f) if callable(data) else f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temp folder into place; an existing folder is swapped out, then removed."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def publish_dir(tmp: Path, final: Path) -> Path:
    """Move a finished temp folder into place unless another writer already did: the first finished copy wins.

    For caches that several processes may fill at once with the same content (test workers, servers starting
    together): a rename onto a folder that appeared meanwhile fails, and this copy is dropped instead.
    """
    try:
        os.replace(tmp, final)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (made if missing) across processes; others wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
