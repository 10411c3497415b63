"""`pdserve serve` as a real process whose pools ask for more CPU slots than its Ray cluster has
(`--num-prefill 1 --num-decode 2`, three workers of one CPU each, on a local cluster of two): it
says within seconds which worker waits, what it needs and what the cluster has, and goes on
saying it while it waits (it used to sit silent for `health.start_timeout_s`, 300 s); Ctrl-C
(SIGINT) early in that start or while it waits ends it with one line and leaves no process of
its own behind (a `ray::DecodeWorker` used to live on, orphaned, after the server had exited)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import SmallModel

pytestmark = pytest.mark.slow

MARK = "PDSERVE_TEST_STARTUP_MARK"  # in the server's environment, inherited by every process it starts


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries `mark`: the server and whatever it started."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and f"{MARK}={mark}".encode() in Path(f"/proc/{name}/environ").read_bytes():
                found.append(int(name))
        except OSError:
            pass
    return found


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Serve:
    """`pdserve serve` in a session of its own; its output lines collected as they come."""

    def __init__(self, small_model: SmallModel, folder: Path) -> None:
        self.mark = uuid.uuid4().hex
        env = {**os.environ, MARK: self.mark, "RAY_OVERRIDE_RESOURCES": '{"CPU": 2}'}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--num-prefill", "1", "--num-decode", "2",
             "--engine.model.source", str(small_model.folder), "--engine.model.device", "cpu",
             "--engine.model.dtype", "float32", "--engine.cache.cpu_kv_cache_gib", "0.25", "--port", "0",
             "--http-port", "0", "--pools.gpus_per_worker", "0"],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            # As from a terminal: SIGINT at its default. An xdist worker ignores SIGINT and a child
            # inherits that, so Python would never raise KeyboardInterrupt in it (CI, 2026-12-06).
            preexec_fn=_sigint_default)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, words: str, count: int, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(found := [line for line in self.lines if words in line]) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {count} lines with {words!r} (exit {self.proc.poll()}):\n"
                                     + "".join(self.lines[-40:]))
            time.sleep(0.1)
        return found

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 120 s after signal {sig}:\n" + "".join(self.lines[-60:])) from None
        finally:
            self._reader.join(10)

    def kill_all(self) -> None:
        for pid in _marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _nothing_left(serve: _Serve) -> list[int]:
    deadline = time.monotonic() + 15  # the server has exited; its processes have had their grace
    while (left := _marked(serve.mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.timeout(400)
def test_a_start_that_cannot_place_a_worker_says_so_and_a_ctrl_c_leaves_nothing(small_model, tmp_path):
    serve = _Serve(small_model, tmp_path)
    try:
        # Said again and again (every health.start_report_s, 5 s): which worker, what it needs and
        # what the cluster has, two placed workers holding both slots.
        waiting = serve.wait_for("waiting for room", 2, 120)
        assert all("not started after" in line for line in waiting), waiting
        assert "decode worker" in waiting[0] and "it needs 1 CPU" in waiting[0], waiting
        assert "the cluster has 2 CPU (0 free)" in waiting[0] and "RAY_OVERRIDE_RESOURCES" in waiting[0], waiting
        assert serve.stop(signal.SIGINT) == 130
        out = "".join(serve.lines)
        assert "pdserve: interrupted while starting; stopped" in out and "Traceback" not in out, out[-3000:]
        assert _nothing_left(serve) == []
    finally:
        serve.kill_all()


def test_a_ctrl_c_early_in_the_start_leaves_nothing(small_model, tmp_path):
    """While Ray's local cluster starts and the workers are created (the first seconds)."""
    serve = _Serve(small_model, tmp_path)
    try:
        deadline = time.monotonic() + 120  # once Ray has started processes under the server
        while len(_marked(serve.mark)) < 3 and time.monotonic() < deadline and serve.proc.poll() is None:
            time.sleep(0.1)
        assert serve.stop(signal.SIGINT) == 130, "".join(serve.lines)
        assert "Traceback" not in "".join(serve.lines)
        assert _nothing_left(serve) == [], "".join(serve.lines)
    finally:
        serve.kill_all()
