"""Past one GPU: the same FastAPI app as Ray Serve replicas, one engine each (SERVING.md 4).

Ray Serve does the routing and autoscaling; each replica runs the app's
lifespan, so it owns one engine (on one GPU where the cluster has GPUs, on
CPUs elsewhere); a replica whose engine stopped fails Ray's health check
(`check_health`) and is replaced. Three ways in:

- `clover-export serve --replicas N`: a local Ray instance on this machine.
- `serve run clover_export/serve/ray_serve.yaml`: the config for a cluster
  (KubeRay's RayService takes the same `applications:` block).
- `serve run clover_export.serve.ray_app:app_builder model=/models/clover`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any

from clover_export.artifact.manifest import is_artifact, load_artifact
from clover_export.core.config import load_config
from clover_export.core.errors import CloverError
from clover_export.model.loading import resolve_model_dir
from clover_export.runtime.config import RuntimeConfig
from clover_export.serve.app import ServeOptions, build_app

DEPLOYMENT_NAME = "CloverServer"
APP_NAME = "clover"
PROXY_READY_TIMEOUT_S = 60  # Ray Serve's own limit for serve.start (HTTP_PROXY_TIMEOUT)


def _ray():
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError:
        raise CloverError("serve", "--replicas needs Ray Serve, which is not installed",
                          "pip install 'clover-export[ray]'") from None
    return ray, serve


def _gpus_per_replica() -> float:
    """1 on machines (clusters) with GPUs, 0 (CPU replicas) elsewhere."""
    ray, _ = _ray()
    if ray.is_initialized():
        return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    import torch

    return 1 if torch.cuda.is_available() else 0


def deployment(opts: ServeOptions, replicas: int | None = None, num_gpus: float | None = None):
    """The bound Ray Serve application: `@serve.ingress` around `build_app(opts)`."""
    _, serve = _ray()
    # a replica takes traffic only once its engine is loaded (Ray waits for the app's startup)
    app = build_app(dataclasses.replace(opts, wait_until_loaded=True))
    gpus = _gpus_per_replica() if num_gpus is None else num_gpus
    scaling: dict[str, Any] = ({"num_replicas": replicas} if replicas else
                               {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                       "target_ongoing_requests": opts.max_batch}})

    @serve.deployment(name=DEPLOYMENT_NAME, ray_actor_options={"num_gpus": gpus, "num_cpus": 1},
                      max_ongoing_requests=opts.max_batch + opts.max_queue, **scaling)
    @serve.ingress(app)
    class CloverServer:
        def check_health(self) -> None:
            """Ray Serve's periodic health check (`health_check_period_s`): a replica that raises here is
            replaced by a fresh one. `self.app` is this replica's copy of the app, whose lifespan started
            its engine."""
            check_engine(self.app)

    return CloverServer.bind()


def check_engine(app) -> None:
    """Raise when the replica's engine can no longer serve: it failed to load, or it stopped (a fault
    no request could be blamed for, serve/engine.py; or a shutdown). Before the app's lifespan has started
    an engine there is nothing to judge."""
    engine = getattr(app.state, "engine", None)
    if engine is None:
        return
    if engine.load_error:
        raise RuntimeError(f"the engine failed to load: {engine.load_error}")
    if engine.stopped.is_set():
        raise RuntimeError(f"the engine stopped ({engine.died or 'shut down'})")


def app_builder(args: dict[str, Any]):
    """`serve run` entry point: args are ServeOptions fields and the runtime's (RuntimeConfig fields; `max_batch`,
    as the command's --max-batch, is its max_slots); strings from the command line are converted."""
    args = {("max_slots" if name == "max_batch" else name): value for name, value in args.items()}
    runtime_fields = {f.name: f for f in dataclasses.fields(RuntimeConfig)}
    fields = {f.name: f for f in dataclasses.fields(ServeOptions) if f.name != "runtime"} | runtime_fields
    unknown = set(args) - set(fields) - {"replicas", "num_gpus"}
    if unknown:
        raise CloverError("serve", f"unknown argument(s) {sorted(unknown)}; known: {sorted(fields)}")
    kw = {}
    for name, value in args.items():
        kind = str(fields[name].type).split(" ")[0] if name in fields else None
        if isinstance(value, str) and kind in ("int", "float"):
            value = int(value) if kind == "int" else float(value)
        kw[name] = value
    replicas, num_gpus = kw.pop("replicas", None), kw.pop("num_gpus", None)
    runtime = RuntimeConfig.of(ServeOptions().runtime, **{k: kw.pop(k) for k in list(kw) if k in runtime_fields})
    return deployment(ServeOptions(runtime=runtime, **kw), int(replicas) if replicas else None,
                      float(num_gpus) if num_gpus is not None else None)


def check_replicas(opts: ServeOptions) -> None:
    """What `run_replicas` needs, checked before Ray starts: Ray Serve installed, and the model's config (a
    model folder) or manifest (an artifact) readable, so a wrong path is one line rather than replicas that
    fail behind Ray Serve's "ASGI lifespan startup failed"."""
    _ray()
    if opts.runtime.backend_for(opts.model) == "trt":
        return  # an engine: the replicas' own load checks it
    if is_artifact(opts.model):
        load_artifact(opts.model)
    else:  # a model folder (ort exports it on first use)
        load_config(resolve_model_dir(opts.model))


def _deploy_failure(serve) -> str:
    """The last line of the failed deployment's status message (a replica's constructor error ends with
    the exception it raised), or "" when Ray Serve has none."""
    try:
        app = serve.status().applications[APP_NAME]
        messages = [d.message for d in app.deployments.values() if d.message] or [app.message]
    except Exception:  # no status to read (Ray Serve itself is failing): the caller keeps its own error
        return ""
    lines = [ln.strip() for ln in messages[0].splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class _StoppedWhileStarting(BaseException):
    """SIGTERM/SIGINT before the deployment is up (a BaseException, so no `except Exception` in Ray keeps it)."""


def run_replicas(opts: ServeOptions, replicas: int, host: str, port: int) -> None:
    """`clover-export serve --replicas N` on this machine; SIGTERM/SIGINT shut it down, exit 0."""
    ray, serve = _ray()
    stop, starting = threading.Event(), [True]

    def on_signal(*_) -> None:
        stop.set()
        if starting[0]:  # leave serve.start / serve.run now rather than when every replica is up
            starting[0] = False
            raise _StoppedWhileStarting

    # Ray Serve kills an HTTP proxy not ready within 5 s and serve.start then fails: too short where the
    # replicas' engines load beside it. The cluster's processes inherit this (a user's own value wins).
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_TIMEOUT_S))
    ray.init(num_cpus=max(os.cpu_count() or 1, replicas), include_dashboard=False, log_to_driver=False)
    # At once after ray.init, which installs its own C++ SIGTERM handler (a stack dump, then abort): the first
    # replica answers /health while serve.run still waits for the others, so a SIGTERM can come this early.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(deployment(opts, replicas), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # Ray Serve gave up on the replicas: say why, from the deployment's status
            raise CloverError("serve", f"the replicas did not start: {_deploy_failure(serve) or e}",
                              "the replicas' own logs are in Ray's session folder (by default "
                              "/tmp/ray/session_latest/logs/serve/)") from None
        starting[0] = False
        print(f"clover-export: {replicas} replica(s) of {opts.model_id} serving on http://{host}:{port}", flush=True)
        stop.wait()
    except _StoppedWhileStarting:
        pass
    finally:
        starting[0] = False  # a signal while shutting down only sets `stop`
        serve.shutdown()
        ray.shutdown()  # also ends the agents the raylet started (they outlive a process that skips it)
