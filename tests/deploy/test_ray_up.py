"""`ray up` for real: deploy/ray/cluster-local.yaml launched with Ray's own `ray up` / `ray down`
CLI against this machine, `pdserve serve --address` joining the cluster, one request over gRPC.

The "remote" head is this machine reached over SSH at 127.0.0.1: an asyncssh server
(tests/deploy/local_sshd.py; no sshd here) run as the first process of its own PID namespace, so
that the `ray stop` of the shipped head_start_ray_commands and of `ray down` sees, and stops, this
cluster's processes only, and whatever is left when the test ends dies with the namespace. Its
commands get a home of their own (where `~/pdserve-venv` is this test's environment, already
installed) and `$RAY_TMPDIR`. The ssh client is OpenSSH's; Ray's file mounts need rsync, which
this machine does not have: tests/deploy/fake_rsync.py stands in for it, over Ray's own ssh
command line.

From the shipped file, the test changes only what one machine must (`OVERRIDDEN`, checked by
`test_the_local_config_differs_from_the_shipped_one_only_where_it_must`): the head's address and
no workers, the login (user, a throwaway key, the server's port through `ssh_proxy_command`: Ray
offers no port option), the setup commands that install pdserve (the venv is there already: they
make the synced checkout the one imported instead), and the head's Ray port (a free one, not 6379
that another Ray on the machine may hold). The file mounts, the venv and PATH setup and the head's
`ray start` command run as shipped.

Ray on a loopback-only host: Ray rewrites a loopback node IP (and a loopback address to join) to
the address it probes for the machine unless it believes multi-node clusters are off, so the
host's environment says so, and so does `pdserve serve`'s (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
ray_constants.ENABLE_RAY_CLUSTER). The shipped head command takes as its node IP the address
`ray up` gives it (provider.head_ip), here 127.0.0.1; a loopback node IP makes Ray listen on
loopback only, and every listening socket of the cluster's processes is checked to be there.

Needs asyncssh (the [test] extra), OpenSSH's `ssh`, `tar`, and `unshare` with the right to make a
PID namespace (root, or unprivileged user namespaces); it skips, saying which, without them (and
fails under CI=true, as the helm checks do: CI's machines have all of it).
Takes ~1.5 minutes on 2 cores (CI runs it with the rest); `make test-ray-up` runs it alone.
"""

from __future__ import annotations

import copy
import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from pdserve.engine.config import default_cache_dir
from tests.deploy.conftest import ROOT

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SHIPPED = ROOT / "deploy" / "ray" / "cluster-local.yaml"
RAY = Path(sys.executable).with_name("ray")

# Every field of the shipped file the local test changes; all others are used as shipped.
OVERRIDDEN = {
    ("provider", "head_ip"), ("provider", "worker_ips"),
    ("auth", "ssh_user"), ("auth", "ssh_private_key"), ("auth", "ssh_proxy_command"),
    ("setup_commands",), ("head_start_ray_commands",),
}
SHIPPED_RAY_PORT = "--port=6379"

# Instead of the pip installs: the synced checkout (~/pdserve-src, a file mount) is the pdserve
# that the head's Ray processes import, through a `pdserve` link on their PYTHONPATH.
LINK_SOURCE = [
    "mkdir -p ~/pdserve-ns && ln -sfn ~/pdserve-src ~/pdserve-ns/pdserve",
    "grep -q pdserve-ns ~/.bashrc || echo 'export PYTHONPATH=~/pdserve-ns' >> ~/.bashrc",
    "~/pdserve-venv/bin/python -c 'import pdserve.cluster as c; print(c.__file__)' | grep pdserve-ns/pdserve/",
]

SERVE_CONFIG = """\
engine:
  model: {device: cpu, dtype: float32}
  cache: {cpu_kv_cache_gib: 0.25}
pools: {gpus_per_worker: 0}
"""

# The host is loopback only: see the module docstring.
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_cluster_config(shipped: dict[str, Any], *, user: str, key: Path, proxy_command: str,
                         ray_port: int) -> dict[str, Any]:
    """The shipped config, pointed at this machine (see the module docstring)."""
    config = copy.deepcopy(shipped)
    config["provider"]["head_ip"] = "127.0.0.1"
    config["provider"]["worker_ips"] = []
    config["auth"]["ssh_user"] = user
    config["auth"]["ssh_private_key"] = str(key)
    config["auth"]["ssh_proxy_command"] = proxy_command
    setup = shipped["setup_commands"]
    installs = [i for i, c in enumerate(setup) if "pip install" in c]
    assert installs == list(range(installs[0], installs[-1] + 1)), setup  # one block of installs
    config["setup_commands"] = setup[:installs[0]] + LINK_SOURCE + setup[installs[-1] + 1:]
    head = shipped["head_start_ray_commands"]
    assert sum(c.count(SHIPPED_RAY_PORT) for c in head) == 1, head
    config["head_start_ray_commands"] = [c.replace(SHIPPED_RAY_PORT, f"--port={ray_port}") for c in head]
    return config


def differing_fields(a: Any, b: Any, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return {p for k in a.keys() | b.keys() for p in differing_fields(a.get(k), b.get(k), (*path, k))}
    return set() if a == b else {path}


def test_the_local_config_differs_from_the_shipped_one_only_where_it_must(tmp_path: Path) -> None:
    shipped = yaml.safe_load(SHIPPED.read_text())
    local = local_cluster_config(shipped, user="u", key=tmp_path / "k", proxy_command="p", ray_port=1234)
    assert differing_fields(shipped, local) == OVERRIDDEN
    # What stays: the file mounts, the venv and PATH setup, and the head's start command but its port.
    assert local["file_mounts"] == shipped["file_mounts"] == {"~/pdserve-src": "."}
    assert [c for c in local["setup_commands"] if c not in LINK_SOURCE] == \
        [c for c in shipped["setup_commands"] if "pip install" not in c]
    assert [c.replace("--port=1234", SHIPPED_RAY_PORT) for c in local["head_start_ray_commands"]] == \
        shipped["head_start_ray_commands"]


# ---------------------------------------------------------------------------------------------
# The host: an SSH server in a PID namespace of its own.


def ns_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


@dataclass
class Host:
    root: Path  # everything of this test: keys, homes, $RAY_TMPDIR, configs
    home: Path  # the "remote" home
    key: Path
    proxy_command: str
    env: dict[str, str]  # for ray up / ray down / ray status / pdserve serve, run here
    sshd: subprocess.Popen[bytes]
    namespace: str
    init_pids: frozenset[int]  # the SSH server's own processes

    def processes(self) -> list[Any]:
        """The live processes of the host (its PID namespace), but the SSH server's own."""
        found = []
        for p in psutil.process_iter(["name", "cmdline", "status"]):
            try:
                if p.pid not in self.init_pids and ns_of(p.pid) == self.namespace \
                        and p.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (OSError, psutil.Error):
                pass
        return found


def namespace_command() -> list[str]:
    base = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    return base if os.geteuid() == 0 else [*base[:1], "--user", "--map-root-user", *base[1:]]


def need(what: str, ok: bool) -> None:
    """Skip without `what`; under CI (CI=true), whose machines have all of it, fail instead."""
    if not ok:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(f"`ray up` test needs {what}")


@pytest.fixture
def host(model_folder: Path) -> Iterator[Host]:
    try:
        import asyncssh
    except ImportError:
        asyncssh = None
    need("asyncssh (pip install -e '.[test]')", asyncssh is not None)
    for tool in ("ssh", "tar", "unshare"):
        need(f"`{tool}` on PATH", shutil.which(tool) is not None)
    need(f"Ray's CLI at {RAY}", RAY.exists())
    probe = subprocess.run([*namespace_command(), "true"], capture_output=True, text=True)
    need(f"a PID namespace of its own ({' '.join(namespace_command())}: {probe.stderr.strip()})",
         probe.returncode == 0)

    # Short: Ray's session folder holds Unix sockets (108-byte paths).
    root = Path(tempfile.mkdtemp(prefix="pdray-", dir="/tmp"))
    home, bin_dir, ray_tmp = root / "home", root / "bin", root / "tmp"
    for d in (home, bin_dir, ray_tmp):
        d.mkdir()
    (home / "pdserve-venv").symlink_to(sys.prefix)  # pdserve and torch already installed there
    (home / ".bashrc").write_text("# ~/.bashrc of a fresh machine\n")  # Ray's commands source it
    user = getpass.getuser()
    key = root / "id_ed25519"
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key.write_private_key(str(key))
    key.chmod(0o600)
    client_key.write_public_key(str(root / "authorized_keys"))
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(root / "host_key"))
    rsync = bin_dir / "rsync"
    rsync.write_text(f"#!/bin/sh\nexec {shlex.join([sys.executable, str(HERE / 'fake_rsync.py')])} \"$@\"\n")
    rsync.chmod(0o755)

    common = {"RAY_TMPDIR": str(ray_tmp), **LOOPBACK_RAY}
    host_env = {**common, "PDSERVE_CACHE_DIR": str(default_cache_dir())}  # the default model, converted
    port_file, sshd_log = root / "sshd.port", open(root / "sshd.log", "wb")
    sshd = subprocess.Popen(
        [*namespace_command(), sys.executable, str(HERE / "local_sshd.py"), "serve",
         "--host-key", str(root / "host_key"), "--authorized-keys", str(root / "authorized_keys"),
         "--user", user, "--home", str(home), "--port-file", str(port_file),
         *[f"--env={k}={v}" for k, v in host_env.items()]],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sshd_log)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert sshd.poll() is None, (root / "sshd.log").read_text()
            assert time.monotonic() < deadline, "the SSH server did not start"
            time.sleep(0.1)
        port = int(port_file.read_text())
        init = psutil.Process(sshd.pid).children()[0]
        server = init.children()[0]
        # TMPDIR: ray up / ray down's config cache and bootstrap config files stay in root too.
        # Not the RAY_* variables a Ray started in this test process left behind: ray.init sets
        # RAY_AUTH_MODE=token in os.environ (Ray 2.60), and a driver with it cannot talk to the
        # ray-up cluster, which runs without tokens (its workers' creation is cancelled).
        mine = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env = {**mine, **common, "TMPDIR": str(root), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        proxy = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'local_sshd.py'))} bridge {port}"
        yield Host(root, home, key, proxy, env, sshd, ns_of(init.pid), frozenset({init.pid, server.pid}))
    finally:
        # unshare ignores SIGTERM while it waits: the server's init gets it and ends the server, and
        # with it the namespace, everything still in it included. SIGKILL to unshare does the same
        # at once (--kill-child).
        try:
            os.kill(psutil.Process(sshd.pid).children()[0].pid, signal.SIGTERM)
            sshd.wait(30)
        except (IndexError, psutil.Error, subprocess.TimeoutExpired):
            sshd.kill()
            sshd.wait(10)
        sshd_log.close()
        if port_file.exists():
            _end_bridges(port_file.read_text())
        shutil.rmtree(root, ignore_errors=True)
        _remove_ssh_control_dir()


def _remove_ssh_control_dir() -> None:
    """Ray's SSHCommandRunner makes /tmp/ray_ssh_<user hash>/<cluster hash> for its ControlPath."""
    import hashlib

    def short(s: str) -> str:
        return hashlib.sha256(s.encode()).hexdigest()[:10]

    parent = Path("/tmp") / f"ray_ssh_{short(getpass.getuser())}"
    for d in (parent / short(yaml.safe_load(SHIPPED.read_text())["cluster_name"]), parent):
        try:
            d.rmdir()  # only if empty: another cluster's masters may live there
        except OSError:
            return


def _end_bridges(port: str) -> None:
    """Ray's ssh keeps a ControlMaster for 10 s (ControlPersist) through a ProxyCommand bridge; a bridge
    ends when the server closes its connection, and its master with it. Any still here go now."""
    bridge = [str(HERE / "local_sshd.py"), "bridge", port]
    deadline = time.monotonic() + 5
    while bridges := [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-3:] == bridge]:
        if time.monotonic() > deadline:
            for p in bridges:
                p.terminate()
            return
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# The test.


def run(cmd: list[str], env: dict[str, str], timeout: float, log: Path, **kw: Any) -> subprocess.CompletedProcess:
    with open(log, "ab") as out:
        out.write(f"\n$ {shlex.join(cmd)}\n".encode())
        out.flush()
        return subprocess.run(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout, **kw)


def tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:]


def ray_log_problems(ray_tmp: Path, n: int = 60) -> str:
    """The last warnings and errors of the host's Ray processes (their logs die with the host)."""
    lines = []
    for path in sorted((ray_tmp / "ray" / "session_latest" / "logs").glob("*")):
        if path.suffix in (".out", ".err", ".log") and path.is_file() and not path.name.startswith("dashboard"):
            lines += [f"{path.name}: {line}" for line in path.read_text(errors="replace").splitlines()
                      if " E " in line[:40] or " W " in line[:40] or line.startswith(("Traceback", "E", "ray."))]
    return "\n".join(lines[-n:])


def start_serving(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float,
                  ray_tmp: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    out = open(log, "a")

    def copy_the_rest() -> None:  # a full pipe would stop the server (Ray forwards its workers' output)
        with out:
            for line in proc.stdout:
                out.write(line)

    while True:
        line = proc.stdout.readline()
        out.write(line)
        if line.startswith("pdserve: serving"):
            threading.Thread(target=copy_the_rest, daemon=True).start()
            return proc
        if not line and proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            out.close()
            pytest.fail(f"pdserve serve did not start (exit {proc.poll()}):\n{tail(log)}\n"
                        f"Ray's logs on the host:\n{ray_log_problems(ray_tmp)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def listeners(procs: list[Any]) -> list[tuple[str, int, str]]:
    names = {p.pid: p.name() for p in procs}
    return [(c.laddr.ip, c.laddr.port, names[c.pid]) for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in names]


def alive(pid: int, create_time: float) -> bool:
    try:
        return psutil.Process(pid).create_time() == create_time
    except psutil.NoSuchProcess:
        return False


def is_loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback


def test_ray_up_then_pdserve_joins_and_serves_then_ray_down_stops_everything(host: Host, tmp_path: Path) -> None:
    from pdserve.engine.sampling import SamplingParams
    from tests.cluster.streams import collect

    log = tmp_path / "ray-up.log"  # kept by pytest (the host's folder is not)
    ray_port = free_port()
    config = local_cluster_config(yaml.safe_load(SHIPPED.read_text()), user=getpass.getuser(), key=host.key,
                                  proxy_command=host.proxy_command, ray_port=ray_port)
    config_file = host.root / "cluster-local.yaml"
    config_file.write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{ray_port}"
    status = [str(RAY), "status", "--address", address]
    up = [str(RAY), "up", "-y", "--no-config-cache", "--log-color", "false", str(config_file)]
    down = [str(RAY), "down", "-y", str(config_file)]
    started = time.monotonic()
    try:
        proc = run(up, host.env, 300, log)
        assert proc.returncode == 0, f"ray up failed:\n{tail(log)}"
        assert run(status, host.env, 60, log).returncode == 0, tail(log)
        cluster = {(p.pid, p.create_time()): p.name() for p in host.processes()}
        assert {"gcs_server", "raylet"} <= set(cluster.values()), cluster
        synced = host.home / "pdserve-src"
        assert (synced / "deploy" / "ray" / "cluster-local.yaml").exists()  # the file mount
        assert not (synced / ".git").exists()  # ... with rsync_exclude
        assert (host.home / "ray_bootstrap_config.yaml").exists()

        serve_config = host.root / "serve.yaml"
        serve_config.write_text(SERVE_CONFIG)
        port = free_port()
        serve = [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--config", str(serve_config),
                 "--address", address, "--port", str(port), "--metrics-port", str(free_port()), "--no-http"]
        server = start_serving(serve, host.env, log, timeout_s=300, ray_tmp=host.root / "tmp")
        try:
            out = collect(f"127.0.0.1:{port}", "Hi", SamplingParams(temperature=0.0, max_tokens=4))
            assert out.token_ids and out.text, out
            procs = host.processes()
            workers = {p.name() for p in procs if p.name().startswith("ray::")}
            assert any(w.startswith("ray::DecodeWork") for w in workers), workers  # on the ray-up cluster
            sockets = listeners(procs)
            assert {"gcs_server", "raylet"} <= {x[2] for x in sockets}, sockets  # the cluster's sockets were read
            exposed = [x for x in sockets if not is_loopback(x[0])]
            assert exposed == [], exposed
        finally:
            stop(server)
        assert server.returncode == 0, tail(log)

        proc = run(down, host.env, 180, log)
        assert proc.returncode == 0, f"ray down failed:\n{tail(log)}"
        deadline = time.monotonic() + 30
        while (left := host.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], [(p.pid, p.info["name"], p.info["cmdline"]) for p in left]
        assert not [(pid, name) for (pid, t), name in cluster.items() if alive(pid, t)]
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", ray_port)) != 0, "the GCS port still answers after ray down"
    except BaseException:
        try:
            run(down, host.env, 180, log)  # best effort; the namespace ends with the fixture anyway
        except subprocess.TimeoutExpired:
            pass
        print(tail(log, 20000))
        raise
    finally:
        print(f"ray up .. ray down: {time.monotonic() - started:.0f} s")
