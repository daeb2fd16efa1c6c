"""Ray Serve replicas: a replica whose engine stopped fails `check_health`, so Ray replaces it (SERVING.md 4).

The engine is the real `serve.engine.Engine` on its own thread; what it loads is a stand-in with the three
things the engine calls on a Generator (submit, step, loop.has_work), so each case is the engine state it
names, reached the way the engine reaches it. Ray itself is not started: the deployment's class is built
(`serve.deployment` + `serve.ingress`) and its `check_health` called on a stand-in replica holding the app.
"""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import pytest

from clover_export.core.errors import CloverError
from clover_export.serve.app import ServeOptions, build_app
from clover_export.serve.engine import Engine
from clover_export.serve.ray_app import check_engine


class StandInGenerator:
    def __init__(self, has_work=lambda: False):
        self.loop = SimpleNamespace(has_work=has_work)

    def submit(self, *args, **kwargs):
        return SimpleNamespace(cancel=lambda: None)

    def step(self):
        pass


def started_engine(load) -> Engine:
    eng = Engine(load, max_pending=4)
    eng.start()
    end = time.monotonic() + 5
    while not (eng.ready or eng.stopped.is_set()) and time.monotonic() < end:  # loaded, or ended
        time.sleep(0.01)
    return eng


def app_with(engine: Engine | None):
    app = build_app(ServeOptions())  # no lifespan runs: the test puts the engine where the lifespan would
    if engine is not None:
        app.state.engine = engine
    return app


def test_a_serving_engine_is_healthy_and_a_stopped_one_is_not():
    eng = started_engine(StandInGenerator)
    assert eng.ready and not eng.stopped.is_set()
    check_engine(app_with(eng))  # no exception
    eng.stop(5)
    assert eng.stopped.is_set()
    with pytest.raises(RuntimeError, match=r"the engine stopped \(shut down\)"):
        check_engine(app_with(eng))


def test_an_engine_thread_that_died_fails_the_check_with_the_reason():
    def fault():
        raise RuntimeError("injected scheduler fault")

    eng = started_engine(lambda: StandInGenerator(has_work=fault))
    eng.stopped.wait(5)
    assert eng.died and not eng._thread.is_alive()
    with pytest.raises(RuntimeError, match="the engine stopped .*injected scheduler fault"):
        check_engine(app_with(eng))


def test_an_engine_that_failed_to_load_fails_the_check():
    def load():
        raise CloverError("runtime", "/models/x: no config.json")

    eng = started_engine(load)
    with pytest.raises(RuntimeError, match="the engine failed to load: .*no config.json"):
        check_engine(app_with(eng))


def test_before_the_lifespan_started_an_engine_there_is_nothing_to_judge():
    check_engine(app_with(None))


def test_the_deployment_checks_the_engine_of_the_replicas_app():
    pytest.importorskip("ray.serve")
    from clover_export.serve.ray_app import deployment

    cls = deployment(ServeOptions(), replicas=1, num_gpus=0)._bound_deployment.func_or_class
    assert isinstance(inspect.getattr_static(cls, "app"), property)  # Ray's: the replica's own copy of the app
    replica = SimpleNamespace(app=app_with(started_engine(StandInGenerator)))  # Ray's constructor not run
    cls.check_health(replica)
    replica.app.state.engine.stop(5)
    with pytest.raises(RuntimeError, match="the engine stopped"):
        cls.check_health(replica)
