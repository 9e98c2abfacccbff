"""Starts one container of the test kubelet's image mode: `python launcher.py SPEC.json`.

What a container runtime does, in the few steps a test needs: in a new mount and pid
namespace (the network namespace stays the host's, so pods keep their 127.x addresses) it
mounts a tmpfs-backed overlay over the image's read-only root (so each start sees the
image as built and writes stay private), bind-mounts /dev, /sys, the pod's volumes and
files (/etc/hosts...) into it, makes the root read-only if asked, then forks the
container's first process, which mounts a fresh /proc, chroots, takes the container's
user and execs the command as pid 1 of its namespace, as in a real container (so it
ignores SIGTERM unless it installs a handler, as there).

This process stays outside, in the host's pid namespace: the test kubelet watches and
signals it, it forwards every catchable signal to the container and exits as the
container did (by the same signal, or with its exit code). The container gets SIGKILL
when this process dies (PR_SET_PDEATHSIG), which takes its whole pid namespace down; when
the kubelet dies first, the container gets SIGTERM, then SIGKILL after a few seconds.
A command that cannot be started (not in the image, not executable) writes the reason
to `start_error_file` and exits with 128, the exit code runtimes report for StartError.

Standard library only: the host interpreter runs it before anything is chrooted.
The spec (written by `kcluster.rootfs`): root, layer, lower, read_only, mounts
[{source, target, read_only, recursive}], dirs, argv, env, cwd, uid, gid, groups,
pid_file, start_error_file.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Any

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_SECONDS = 5  # then a container that outlived the kubelet is killed
START_ERROR_EXIT = 128
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGWINCH)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str | Path, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), str(target).encode(),
                       fstype and fstype.encode(), ctypes.c_ulong(flags),
                       data and data.encode()), f"mount {source} on {target}")


def in_root(root: Path, path: str) -> Path:
    """`path` inside the container's root, symlinks resolved as the container sees them
    (Debian's /var/run -> /run must not lead to the host's /run)."""
    resolved = root
    parts = [p for p in path.split("/") if p]
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved.parent if resolved != root else root
            continue
        if part == ".":
            continue
        candidate = resolved / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise OSError(f"too many symlinks resolving {path} in {root}")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = root
            parts = [p for p in target.split("/") if p] + parts
            continue
        resolved = candidate
    return resolved


def _mount_point(root: Path, target: str, is_file: bool) -> Path:
    point = in_root(root, target)
    if is_file:
        point.parent.mkdir(parents=True, exist_ok=True)
        if not point.exists():
            point.touch()
    else:
        point.mkdir(parents=True, exist_ok=True)
    return point


def prepare_root(spec: dict[str, Any]) -> Path:
    """In this (new) mount namespace: the container's root with every mount in place."""
    root, layer = Path(spec["root"]), Path(spec["layer"])
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", layer, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    (layer / "upper").mkdir()
    (layer / "work").mkdir()
    mount("overlay", root, "overlay", 0,
          f"lowerdir={spec['lower']},upperdir={layer / 'upper'},workdir={layer / 'work'}")
    for folder in spec.get("dirs") or []:
        in_root(root, folder).mkdir(parents=True, exist_ok=True)
    for m in sorted(spec.get("mounts") or [], key=lambda m: m["target"].count("/")):
        source = m["source"]
        point = _mount_point(root, m["target"], not stat.S_ISDIR(os.stat(source).st_mode))
        mount(source, point, None, MS_BIND | (MS_REC if m.get("recursive") else 0))
        if m.get("read_only"):
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    if spec.get("read_only"):
        mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    return root


def _which(argv0: str, env: dict[str, str]) -> str:
    if "/" in argv0:
        candidates = [argv0]
    else:
        path = env.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        candidates = [os.path.join(d or ".", argv0) for d in path.split(":")]
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f'exec: "{argv0}": executable file not found in $PATH')


def container_main(spec: dict[str, Any], root: Path, errors: int) -> None:
    """The forked child, pid 1 of the new pid namespace: never returns."""
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        os.setsid()  # signals reach it only through the launcher, as through a runtime
        mount("proc", root / "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.chroot(root)
        os.chdir(spec["cwd"])
        os.setgroups(spec["groups"])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
        # Again: a change of credentials clears the parent-death signal.
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        env = spec["env"]
        os.execve(_which(spec["argv"][0], env), spec["argv"], env)
    except BaseException as exc:  # reported to the kubelet, then exit
        message = str(exc) if isinstance(exc, FileNotFoundError) and not exc.filename \
            else f"{type(exc).__name__}: {exc}"
        os.write(errors, message.encode())
    os._exit(START_ERROR_EXIT)


def main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
    try:
        root = prepare_root(spec)
    except OSError as exc:
        return _start_error(spec, f"creating the container's root: {exc}")
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        os.close(read_end)
        container_main(spec, root, write_end)
    os.close(write_end)
    parent = os.getppid()

    def forward(number: int, _frame: object) -> None:
        os.kill(child, number)
        if os.getppid() != parent:  # the kubelet died (PR_SET_PDEATHSIG): no SIGKILL follows
            signal.alarm(ORPHAN_GRACE_SECONDS)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(child, signal.SIGKILL))
    Path(spec["pid_file"]).write_text(str(child))
    chunks = []
    while chunk := os.read(read_end, 4096):  # EOF: exec succeeded, or the child exited
        chunks.append(chunk)
    _, status = os.waitpid(child, 0)
    if chunks:
        return _start_error(spec, b"".join(chunks).decode(errors="replace"))
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # die the same way, so the kubelet sees the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _start_error(spec: dict[str, Any], message: str) -> int:
    Path(spec["start_error_file"]).write_text(message)
    print(f"===== StartError: {message}", file=sys.stderr, flush=True)
    return START_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
