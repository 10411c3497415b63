"""Starting or joining Ray from pdserve's driver, so that what Ray starts is private and
does not depend on the folder the driver was started in."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from pdserve.engine.config import default_cache_dir

logger = logging.getLogger(__name__)

LOCAL_START_ATTEMPTS = 3


def init_ray(address: str | None, node_ip_address: str, *, host_token: bool = False, **options: Any) -> None:
    """Join (`address`: "auto" or host:port) or start Ray, unless this process already has.

    A local cluster on a loopback node IP (the default) is private: its GCS, raylets, agents
    and workers listen on loopback only, and it runs no dashboard. Joining a cluster binds
    to the interface Ray finds for this node. `options` go to `ray.init` as they are.
    Without an address the cluster is always a new one: `ray.init()` alone joins whichever
    Ray it finds running on this host (another `pdserve serve`, a test's), and that one's
    end would take this server's workers with it.

    Either way the driver connects from an empty working directory of pdserve's own: Ray
    puts the driver's working directory first on every worker's `sys.path`, and from a
    checkout's root that would let the checkout's folders (`kernels/`, `proto/`, `engine/`
    ...) shadow installed packages of the same names in every actor and in the
    tensor-parallel ranks the actors spawn (they inherit the path). A local cluster's Ray
    processes also start there, so nothing they do reads or writes the user's folder.
    """
    if ray.is_initialized():
        return
    options = {"_node_ip_address": node_ip_address, "include_dashboard": False,
               "logging_level": logging.WARNING, **options}
    with _working_directory(neutral_directory()):
        if address:
            if host_token:
                _token_auth_as_a_local_start_would()
            # Joining a cluster on this host's loopback (`pdserve frontend --join 127.0.0.1:port`):
            # Ray would rewrite the address to the probed one, where that GCS does not listen.
            host = address.rpartition(":")[0]
            with _keep_loopback_node_ip(node_ip_address if host in ("127.0.0.1", "localhost") else "0.0.0.0"):
                ray.init(address=address, **options)
            return
        _start_local(node_ip_address, options)


def _token_auth_as_a_local_start_would() -> None:
    """A process joining a cluster speaks Ray's token auth when this host has a token and
    RAY_AUTH_MODE is unset, as `ray.init()` of a local cluster decides (it does not for a join:
    `pdserve frontend --join` beside a `pdserve serve` of this host would be refused). Only
    for a join that asks (`host_token`): a cluster started without token auth (`ray up`'s, in
    tests/deploy/test_ray_up.py) kills a token-speaking driver's actors before they run."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _start_local(node_ip_address: str, options: dict[str, Any]) -> None:
    """A new local cluster, started again if its raylet gave up on its agents: the raylet
    waits a fixed 15 s for the dashboard agent (a Python process) to write its ports and
    exits past it (ray-project/ray#65983), which a loaded machine meets (CI's 2 cores did:
    Ray then raises that the node "timed out during startup").

    Its workers run at niceness 0, not Ray's 15: the workers are the server's compute, and
    at 15 every process of niceness 0 on the cores (the frontend, a client, anything else)
    takes the CPU from them first (on a 2-core machine with other work, a served decode
    step of the default model then took ~1.5x its time; a cluster joined by `address`
    keeps its own setting, `RAY_worker_niceness`)."""
    system_config = {"worker_niceness": 0, **options.pop("_system_config", {})}
    options = {**options, "_system_config": system_config}
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            with _keep_loopback_node_ip(node_ip_address):
                ray.init(address="local", **options)
            return
        except Exception as e:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(e) or attempt == LOCAL_START_ATTEMPTS:
                raise
            logger.warning("Ray's local node did not start (attempt %d of %d), starting it again: %s",
                           attempt, LOCAL_START_ATTEMPTS, e)
            ray.shutdown()


@contextlib.contextmanager
def ray_ending_with(grace_s: float = 5.0) -> Iterator[None]:
    """Ray, started or joined within, ends with the block: `ray.shutdown()`, and then a kill of
    every process started under this one within the block that outlived the shutdown.

    `ray.shutdown()` ends a local cluster's GCS and raylet, but a worker process does not always
    go with its raylet: one that was loading its model when Ctrl-C stopped `pdserve serve`'s start
    lived on, orphaned (a `ray::DecodeWorker`, found 2026-12-06). So the processes under this one
    are listed before the shutdown (Ray's, their workers and whatever those started; not those
    that were there before the block) and whichever is still there `grace_s` after it is killed.
    A process that joined a cluster has none of Ray's under it: the cluster's own are not touched.
    A Ray this process had before the block is not ours to end: nothing is done then. Linux only
    (/proc); elsewhere it is `ray.shutdown()`."""
    if ray.is_initialized():
        yield
        return
    before = set(_descendants(os.getpid()))
    try:
        yield
    finally:
        started = [p for p in _descendants(os.getpid()) if p not in before]
        ray.shutdown()
        deadline = time.monotonic() + grace_s
        while (alive := [p for p in started if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid, _ in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            logger.warning("killed process %d, left running after Ray's shutdown", pid)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command (state, ppid, ...), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below `root`; the start time tells a pid reused later."""
    children: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit() and (fields := _stat(int(name))) is not None:
            children.setdefault(int(fields[1]), []).append((int(name), fields[19]))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def _alive(process: tuple[int, str]) -> bool:
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def neutral_directory() -> Path:
    """An empty folder that only pdserve uses, private to this user: the working directory
    Ray's processes and workers get (under $PDSERVE_CACHE_DIR or ~/.cache/pdserve)."""
    folder = default_cache_dir() / "ray-cwd"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise RuntimeError(f"{folder} must be empty: Ray's workers would import from it")
    return folder


@contextlib.contextmanager
def _working_directory(folder: Path) -> Iterator[None]:
    saved = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(saved)


@contextlib.contextmanager
def _keep_loopback_node_ip(node_ip: str) -> Iterator[None]:
    """ray.init rewrites a loopback node IP to the address it probes for this host
    (`services.resolve_ip_for_localhost`), so that a local cluster would bind and advertise
    every interface, unless Ray believes multi-node clusters are off (as it does on macOS
    and Windows). That flag is read at call time: turn it off for the start of a local,
    loopback-only cluster and back on at once. Ray's processes get the node IP on their
    command lines and bind it; nothing else of Ray's reads the flag later."""
    try:
        loopback = ipaddress.ip_address(node_ip).is_loopback
    except ValueError:  # a host name: Ray resolves it
        loopback = False
    if not loopback:
        yield
        return
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
