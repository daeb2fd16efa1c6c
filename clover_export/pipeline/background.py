"""Build stages run beside the others: the FP8 weight file in a thread, the bf16 export in a process.

Writing 30.7 GiB of e4m3 weights is disk-bound (the process mostly waits on
writeback), while exporting, validating and calibrating keep both cores
busy: run one under the other. The writer depends on the checkpoint alone,
so it starts with the build; the FP8 stages wait for it. Its stage is
recorded by the build's own thread (`Stages` is not shared across threads).
If the build fails or is interrupted first, the writer is told to stop
before its next piece (tensor or expert) and leaves nothing written
(`quantize_weights`).

At full size the stages in the build's own process left one of the two
cores idle about a third of the time (the exports are single-threaded
Python), and nothing but the FP8 graph stages needs the bf16 graph: so the
bf16 export -- ~35 s of single-threaded CPU -- runs in a child process from
the build's start (`BackgroundExport`; a process, not a thread: it is
Python-bound and would share the GIL), beside the fp32 export, the slice
validation and the calibration. The child writes its folder atomically, as
`export` always does; interrupted, it removes its temporary folder; results
and errors come back through a pipe. (Measured with the fp32 export in the
child too, the slice validation then tracing its own graph: 221 s instead
of 216 s, the slice slowed 55 -> 98 s by the exports beside it. The build
is CPU-bound there: ~360 CPU-seconds on 2 cores; `bench/build_fullsize.py`.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from clover_export.core.errors import CloverError
from clover_export.pipeline.context import BuildContext
from clover_export.pipeline.stages import EXPORT, FP8_WEIGHTS, export_args, fp8_weights_record

log = logging.getLogger(__name__)


@contextlib.contextmanager
def beside_the_stages(ctx: BuildContext):
    """Run the FP8 weight writer (fp8, unless reused) and, with slice validation, the bf16 export (unless
    reused) beside the stages in the block; collected by their stages (`FP8_WEIGHTS`, `export_graph("bf16")`).
    Leaving the block, whatever is still running is stopped and leaves nothing written; a weight file that
    finished before a later stage failed is recorded, for the next run to reuse."""
    weights_dir = ctx.out / FP8_WEIGHTS.folder
    if FP8_WEIGHTS in ctx.plan and not ctx.done(FP8_WEIGHTS):
        for stale in ctx.out.glob(f".{weights_dir.name}.*"):  # a writer killed outright (SIGKILL, power): its temp
            shutil.rmtree(stale, ignore_errors=True)
        ctx.writer = BackgroundWeights(ctx.model_dir, ctx.cfg, weights_dir)  # disk-bound: beside the CPU-bound stages
        log.info(f"[quantize] {weights_dir.name}: writing in the background (disk-bound) while the graphs are "
                 "exported, validated and calibrated")
    if not ctx.whole and not ctx.done(EXPORT["bf16"]):
        ctx.bf16_job = BackgroundExport(**export_args(ctx, "bf16"))  # Python-bound: beside the stages below
        log.info("[export bf16] in a background process beside the stages below")
    try:
        yield
    finally:
        if ctx.bf16_job is not None:
            ctx.bf16_job.stop()  # after a failure or Ctrl-C: its temporary folder removed; else it has finished
        if ctx.writer is not None:
            ctx.writer.stop()  # after a failure or Ctrl-C: nothing of it stays written; else it has finished
            weights = ctx.writer.finished()
            if weights is not None and not ctx.done(FP8_WEIGHTS):
                record = fp8_weights_record(weights, ctx.writer.seconds)
                ctx.stages.record(FP8_WEIGHTS.name, ctx.key(FP8_WEIGHTS), record)


class BackgroundWeights:
    def __init__(self, model_dir: Path, cfg, folder: Path):
        self.folder = folder
        self.cancel = threading.Event()
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self._box: dict = {}
        self._thread = threading.Thread(target=self._run, args=(model_dir, cfg), name=folder.name, daemon=True)
        self._thread.start()

    def _run(self, model_dir: Path, cfg) -> None:
        from clover_export.core.checkpoint import locate_tensors, plan_tensors
        from clover_export.model.sizing import fp8_weight_names
        from clover_export.quantize.weights import quantize_weights

        try:
            plans = plan_tensors(cfg, locate_tensors(model_dir), allow_qwen=True)
            self._box["weights"] = quantize_weights(plans, fp8_weight_names(cfg), self.folder, cancel=self.cancel)
        except BaseException as e:  # handed to the build's thread by `result`
            self._box["error"] = e
        finally:
            self.seconds = time.perf_counter() - self.started

    def result(self):
        """The `Fp8Weights`, waiting for the writer; its error, raised here."""
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["weights"]

    def finished(self):
        """The `Fp8Weights` if the writer has finished without error, else None (no waiting)."""
        return None if self._thread.is_alive() else self._box.get("weights")

    def stop(self) -> None:
        """Stop the writer if it is still running (nothing of it stays written) and wait for it: one piece
        (an expert) at most. A second Ctrl-C does not cut that wait short, or the writer's temporary
        folder would be left behind."""
        self.cancel.set()
        while self._thread.is_alive():
            try:
                self._thread.join()
            except KeyboardInterrupt:
                continue


def _die_with_parent() -> None:
    """Linux: SIGINT to this process when the build's process dies (no orphan export left running)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _interrupt_once(signum, frame) -> None:
    """The first SIGINT interrupts the export; later ones are ignored, so its clean-up runs to the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _export_child(conn, kwargs: dict) -> None:
    """Run `export(**kwargs)`; send its result, or the error that stopped it."""
    signal.signal(signal.SIGINT, _interrupt_once)
    _die_with_parent()
    try:
        from clover_export.exporter.export import export

        conn.send(("ok", export(**kwargs)))
    except KeyboardInterrupt:  # export has removed its temporary folder
        conn.send(("interrupted", None))
    except BaseException as e:  # handed to the build by `result`
        try:
            conn.send(("error", e))
        except Exception:  # an error that does not pickle: its text
            conn.send(("error", CloverError("export", f"{type(e).__name__}: {e}")))


class BackgroundExport:
    """`exporter.export.export(**kwargs)` in a child process (module docstring); `result()` waits for it."""

    def __init__(self, **kwargs):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # not fork: the parent's OpenMP / torch threads
        self.out = Path(kwargs["out"])
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_export_child, args=(send, kwargs), daemon=True, name=f"export-{self.out.name}")
        self._proc.start()
        send.close()
        self._result = None

    def result(self):
        """The `ExportResult`, waiting for the child; its error, raised here."""
        if self._result is None:
            try:
                kind, value = self._recv.recv()
            except EOFError:
                self._proc.join()
                raise CloverError("build", f"the background export of {self.out.name} ended without a result "
                                  f"(exit code {self._proc.exitcode})", "nothing of it was kept; run the build again") \
                    from None
            self._proc.join()
            if kind == "error":
                raise value
            if kind == "interrupted":
                raise KeyboardInterrupt
            self._result = value
        return self._result

    def stop(self) -> None:
        """Interrupt the child if it still runs and wait for it (it removes its temporary folder); a child
        that does not stop within a minute is killed and its temporary folder removed here."""
        if self._proc.is_alive():
            try:
                os.kill(self._proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            self._proc.join(60)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
                for stale in self.out.parent.glob(f".{self.out.name}.*"):
                    shutil.rmtree(stale, ignore_errors=True)
        self._recv.close()
