"""`clover-export serve` as a real process on a free local port: started, waited for, stopped.

One helper for the tests that drive a server the way users do, `bench/soak.py` and the GPU serve check.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from clover_export.serve import engine_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, timeout: float = 240, env: dict | None = None,
                 log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`clover-export serve *args` on a free port, once /health is 200: (process, url). Output goes to a pipe
    read at the end (communicate), so keep it short (--log-level warning) for servers that answer many requests;
    or, given `log`, to that file, readable while the server runs. A server that exits or does not come up
    within `timeout` seconds raises AssertionError with the end of its output."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log, "w") if log else contextlib.nullcontext(subprocess.PIPE) as out:
        proc = subprocess.Popen([sys.executable, "-m", "clover_export.cli", "serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"server did not come up:\n{server_output(proc, log)[-3000:]}")


def server_output(proc: subprocess.Popen, log: Path | None = None) -> str:
    """What the server wrote: the file `log`, or the pipe (once the process has ended)."""
    return log.read_text(errors="replace") if log else proc.communicate()[0]


def stop_server(proc: subprocess.Popen, log: Path | None = None) -> str:
    """SIGTERM a server still running, give it 60 s to exit (then kill it); its output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
    return server_output(proc, log)


# --- the server's processes, from /proc (Linux) ------------------------------------------------------------
def _stat(path: Path) -> list[str]:
    """A /proc/<pid>/stat file's fields after "pid (comm)": state, ppid, ..."""
    return path.read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """Process ids below `pid`, from each process's parent id in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(_stat(stat)[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def engine_processes(pid: int) -> list[int]:
    """The engine processes (`python -m` serve/engine_process.py) anywhere below process `pid`: a server's own,
    or its Ray replicas'."""
    module = engine_process.__name__.encode()
    out = []
    for p in descendants(pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if module in argv:
            out.append(p)
    return out


def gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` has exited (or is a zombie, exited and not yet reaped) within `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if _stat(Path(f"/proc/{pid}/stat"))[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):  # gone, or going as we read
            return True
        time.sleep(0.1)
    return False
