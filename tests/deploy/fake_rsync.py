"""`rsync` for `ray up`'s file mounts where no rsync is installed (tests/deploy/test_ray_up.py).

Ray's SSHCommandRunner syncs with `rsync --rsh "ssh OPTS" -avz [--exclude PAT ...] SRC USER@HOST:DST`
(a folder as `SRC/` into `DST/`, a file as a file). This does the same over the same ssh
command: a folder as a tar stream (`--exclude` patterns go to tar, which matches a pattern without
a slash against every path component, as rsync does), a file through `cat`. Other rsync features
(`--filter`, copying down, local copies) are refused rather than half done. A file goes into a
temporary file renamed over the target, with the source's permission bits, as rsync does it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys


def remote_path(path: str) -> str:
    """A remote path for the remote shell: `~/x` stays relative to the remote home, the rest quoted."""
    if path == "~" or path.startswith("~/"):
        return '"$HOME"' + (shlex.quote(path[1:]) if len(path) > 1 else "")
    return shlex.quote(path)


def main(argv: list[str]) -> int:
    rsh, excludes, operands = None, [], []
    it = iter(argv)
    for arg in it:
        if arg in ("--rsh", "-e"):
            rsh = next(it)
        elif arg.startswith("--rsh="):
            rsh = arg.split("=", 1)[1]
        elif arg == "--exclude":
            excludes.append(next(it))
        elif arg.startswith("--exclude="):
            excludes.append(arg.split("=", 1)[1])
        elif arg.startswith("-") and not arg.startswith("--") and set(arg[1:]) <= set("avzrlptgoD"):
            pass  # -avz: archive mode is what a tar stream keeps anyway
        elif arg.startswith("-"):
            print(f"fake rsync: unsupported option {arg}", file=sys.stderr)
            return 1
        else:
            operands.append(arg)
    if rsh is None or len(operands) != 2 or ":" not in operands[1] or ":" in operands[0]:
        print(f"fake rsync: only `--rsh CMD SRC HOST:DST` uploads are supported, got {argv}", file=sys.stderr)
        return 1
    source, (host, target) = operands[0], operands[1].split(":", 1)
    ssh = [*shlex.split(rsh), host]
    if source.endswith("/"):
        dest = remote_path(target.rstrip("/") or "/")
        tar = ["tar", "-C", source, "-cf", "-", *[f"--exclude={p}" for p in excludes], "."]
        sender = subprocess.Popen(tar, stdout=subprocess.PIPE)
        receiver = subprocess.run([*ssh, f"mkdir -p {dest} && tar -C {dest} -xf -"], stdin=sender.stdout)
        sender.stdout.close()
        return sender.wait() or receiver.returncode
    # As rsync does: into a temporary file renamed over the target (which may be the source
    # itself when the "remote" is this machine), with the source's permission bits.
    dest, tmp, mode = remote_path(target), remote_path(target + ".fake-rsync.tmp"), os.stat(source).st_mode & 0o7777
    with open(source, "rb") as f:
        return subprocess.run([*ssh, f"umask 077 && cat > {tmp} && chmod {mode:o} {tmp} && mv -f {tmp} {dest}"],
                              stdin=f).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
