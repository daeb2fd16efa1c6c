"""`clover-export serve` as a process: SIGTERM drains and exits 0, CLI errors, Ray Serve replicas (SERVING.md 3, 4)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from click.testing import CliRunner

from clover_export.cli import main
from clover_export.testing.server import engine_processes, free_port, gone, start_server


def stream_events(url, body, accepted: threading.Event, out: list):
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        accepted.set()
        out.append(r.status_code)
        try:
            out.append(r.read().decode())
        except httpx.HTTPError as e:  # the server cut the stream (past the grace period)
            out.append(f"<cut: {type(e).__name__}>")


def test_sigterm_finishes_running_requests_cancels_past_the_grace_period_and_exits_0():
    proc, url = start_server("--drain-timeout", "8", "--log-level", "warning")
    try:
        short = {"prompt": "What is 2 + 3?", "max_tokens": 40, "stream": True, "ignore_eos": True}
        endless = {"prompt": "Please sort the list 3 1 2 4 9", "max_tokens": 1000, "stream": True, "threshold": 1.0,
                   "ignore_eos": True}
        results = {}
        threads = []
        for name, body in (("short", short), ("endless", endless)):
            ev, out = threading.Event(), []
            t = threading.Thread(target=stream_events, args=(url, body, ev, out), daemon=True)
            t.start()
            assert ev.wait(60)
            results[name] = out
            threads.append(t)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        took = time.monotonic() - started
        for t in threads:
            t.join(10)
        status, text = results["short"]
        events = [e for e in text.split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]"  # finished during the drain
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        # the endless one (~1000 steps) was cut at the grace period, not waited for
        assert '"finish_reason": "length"' not in results["endless"][1]  # cut at the grace period
        assert took < 40
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_serve_help_and_busy_port():
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0
    for opt in ("--replicas", "--max-batch", "--served-model-name", "--port", "--host", "--backend"):
        assert opt in r.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = CliRunner().invoke(main, ["serve", "--port", str(port)])
    assert r.exit_code == 1 and "cannot listen on 127.0.0.1" in r.output and "Traceback" not in r.output


def test_missing_or_unloadable_model_is_one_line_and_exit_1(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "nope")])
    assert r.exit_code == 1 and "no such file or folder" in r.output
    # a folder that exists but holds no model: the engine fails to load, the server stops, exit 1
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "clover_export.cli",
            "serve",
            str(tmp_path),
            "--port",
            str(free_port()),
            "--log-level",
            "critical",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "could not be loaded" in lines[0] and "Traceback" not in proc.stderr


def test_replicas_of_a_folder_without_a_model_are_one_line_before_ray_starts(tmp_path):
    """--replicas reads the model's config in the command's own process: a folder holding no model is the
    same one-line error as without Ray, in seconds, and no Ray instance is started."""
    pytest.importorskip("ray.serve")
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{}")  # an artifact folder written by another version
    for folder, says in ((tmp_path, "no config.json in this folder"), (tmp_path / "art", "format None")):
        proc = subprocess.run([sys.executable, "-m", "clover_export.cli", "serve", str(folder), "--replicas", "2",
                               "--port", str(free_port())], capture_output=True, text=True, timeout=120)
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1 and says in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr and "Ray instance" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_ray_serve_two_cpu_replicas_give_the_same_answers(tiny_dir):
    pytest.importorskip("ray.serve")
    import openai

    from clover_export.runtime import Generator

    proc, url = start_server("--replicas", "2", timeout=400)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ref = Generator.load(None, max_slots=1)
        cases = [("What is 2 + 3?", 40), ("The answer is", 12), ("12*12=", 40), ("What is 2 + 3?", 40)]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda c: client.completions.create(model="clover-tiny", prompt=c[0],
                                                                      max_tokens=c[1], stream=True), cases))
        for (prompt, max_tokens), out in zip(cases, outs):
            assert "".join(p.choices[0].text for p in out) == ref.generate(prompt, raw=True,
                                                                           max_new_tokens=max_tokens).text
        chat = client.chat.completions.create(
            model="clover-tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert chat.choices[0].message.content == ref.generate("Hi", max_new_tokens=8, enable_thinking=False).content
        bad = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "n": 9})  # n is 1 to 8
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
        engines = engine_processes(proc.pid)  # each replica's engine runs in a process of its own
        assert len(engines) == 2, engines
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        out = proc.communicate()[0]
        assert rc == 0 and "SIGTERM received" not in out, (rc, out[-4000:])  # not Ray's crash handler's dump
        assert all(gone(pid, 30) for pid in engines)  # none outlives the server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
