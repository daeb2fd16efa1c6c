"""The FP8 weight file written in a thread beside the build's CPU-bound stages (issue 11).

Writing 30.7 GiB of e4m3 weights is disk-bound (the process mostly waits on
writeback), while exporting, validating and calibrating keep both cores
busy: run one under the other. The writer depends on the checkpoint alone,
so it starts with the build; the FP8 stages wait for it. Its stage is
recorded by the build's own thread (`Stages` is not shared across threads).
If the build fails or is interrupted first, the writer is told to stop
before its next piece (tensor or expert) and leaves nothing written
(`quantize_weights`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


class BackgroundWeights:
    def __init__(self, model_dir: Path, cfg, folder: Path):
        self.folder = folder
        self.cancel = threading.Event()
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self._box: dict = {}
        self._thread = threading.Thread(target=self._run, args=(model_dir, cfg), name="fp8-weights", daemon=True)
        self._thread.start()

    def _run(self, model_dir: Path, cfg) -> None:
        from clover_export.checkpoint import locate_tensors, plan_tensors
        from clover_export.engines.fp8_weights import quantize_weights
        from clover_export.sizing import fp8_weight_names

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
