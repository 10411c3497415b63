"""A throwaway SSH server on 127.0.0.1 for `ray up` with the local provider (tests/deploy/test_ray_up.py).

No sshd on the test machines, so this is one from PyPI (asyncssh): public-key login for one user,
exec requests run by the user's login shell with an environment like sshd's (HOME, USER, SHELL,
PATH, SSH_CONNECTION) plus the `--env` given, the command's own session (process group), its
stdin, stdout and stderr on the channel. The channel closes when the command exits, as with a
pty (Ray's `ssh -tt`): daemons the command started (`ray start`) keep running and may keep the
pipes; a client that leaves first has its command's process group terminated.

    local_sshd.py serve --host-key K --authorized-keys A --user U --home H --port-file P [--env K=V ...]
    local_sshd.py bridge PORT     # ssh's ProxyCommand: stdin/stdout <-> 127.0.0.1:PORT

Run as the first process of a PID namespace (`unshare --pid --fork --mount-proc`), `serve` forks:
the first process only reaps the daemons left to it (the namespace's init) and exits with the
server, which ends every process of the namespace. That is what makes a `ray stop` run through it
(Ray's own head_start_ray_commands and `ray down` run one) stop this cluster only.

Only the standard library is imported at the top: `bridge` runs for every ssh connection.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading


def bridge(port: int) -> int:
    sock = socket.create_connection(("127.0.0.1", port))

    def upstream() -> None:
        try:
            while data := os.read(0, 65536):
                sock.sendall(data)
        except OSError:
            pass
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=upstream, daemon=True).start()
    try:
        while data := sock.recv(65536):
            os.write(1, data)
    except OSError:
        pass
    return 0


def reap_as_init(child: int) -> int:
    """The namespace's init: reap every process that ends (orphans come here) until `child` does."""
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if pid == child:
            return os.waitstatus_to_exitcode(status)


async def serve(args: argparse.Namespace) -> None:
    import asyncio
    import pwd

    import asyncssh

    shell = pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    base_env = {
        "HOME": args.home, "USER": args.user, "LOGNAME": args.user, "SHELL": shell, "LANG": "C.UTF-8",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        **dict(kv.split("=", 1) for kv in args.env),
    }

    class Server(asyncssh.SSHServer):
        def begin_auth(self, username: str) -> bool:
            if username != args.user:
                raise asyncssh.PermissionDenied(f"only {args.user} may log in")
            return True

    async def pump(reader: asyncio.StreamReader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
        except (OSError, asyncssh.Error):
            pass

    async def feed(process, stdin) -> None:
        try:
            while data := await process.stdin.read(65536):
                stdin.write(data)
                await stdin.drain()
        except (OSError, asyncssh.Error):
            pass
        finally:
            stdin.close()

    async def handle(process: asyncssh.SSHServerProcess) -> None:
        peer = process.get_extra_info("peername") or ("127.0.0.1", 0)
        sockname = process.get_extra_info("sockname") or ("127.0.0.1", 0)
        env = {**base_env, "SSH_CONNECTION": f"{peer[0]} {peer[1]} {sockname[0]} {sockname[1]}"}
        command = process.command
        argv = [shell, "-c", command] if command else [shell, "-l"]
        child = await asyncio.create_subprocess_exec(
            *argv, cwd=args.home, env=env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        outputs = [asyncio.ensure_future(pump(child.stdout, process.stdout)),
                   asyncio.ensure_future(pump(child.stderr, process.stderr))]
        feeder = asyncio.ensure_future(feed(process, child.stdin))
        exited = asyncio.ensure_future(child.wait())
        gone = asyncio.ensure_future(process.channel.wait_closed())
        await asyncio.wait([exited, gone], return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():  # the client left: end its command like sshd's hangup
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            await exited
        # Output still in the pipes comes along; daemons holding them do not keep the channel
        # (nor block on a full pipe: its reading end closes, as a pty's would).
        await asyncio.wait(outputs, timeout=1.0)
        for task in (*outputs, feeder, gone):
            task.cancel()
        child._transport.close()
        if not process.channel.is_closing():
            process.exit(child.returncode if child.returncode >= 0 else 128 - child.returncode)

    server = await asyncssh.create_server(
        Server, "127.0.0.1", 0, server_host_keys=[args.host_key], authorized_client_keys=args.authorized_keys,
        process_factory=handle, encoding=None, line_editor=False, allow_pty=True, password_auth=False,
        kbdint_auth=False, agent_forwarding=False, x11_forwarding=False)
    port = server.sockets[0].getsockname()[1]
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, args.port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bridge")
    b.add_argument("port", type=int)
    s = sub.add_parser("serve")
    s.add_argument("--host-key", required=True)
    s.add_argument("--authorized-keys", required=True)
    s.add_argument("--user", required=True)
    s.add_argument("--home", required=True)
    s.add_argument("--port-file", required=True)
    s.add_argument("--env", action="append", default=[], help="KEY=VALUE for the commands' environment")
    args = parser.parse_args(argv)
    if args.command == "bridge":
        return bridge(args.port)
    if os.getpid() == 1:
        child = os.fork()
        if child:
            return reap_as_init(child)
    import asyncio

    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
