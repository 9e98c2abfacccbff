"""What a local stack claims before it starts anything, so that it never touches another.

Its router port must be free (`check_port_free`), and its log dir (`$TMPDIR/tandem-PORT`)
is taken with a lock (`serve.lock`, an flock held until the stack stops): a port in use,
or a folder a live stack holds, is refused at once, naming the port and `--port`; a
folder a dead stack left is reused. The engines' ports are picked together, all free and
distinct, below the kernel's ephemeral range (`free_ports`). While the stack serves,
`stack.json` in that folder describes it (`read_stack`; written by `LocalStack`).
Torch-free.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path

from tandem_engine.errors import TandemError
from tandem_engine.ports import address_family, port_problem

STACK_FILE = "stack.json"
LOCK_FILE = "serve.lock"  # flock'ed by the live `tandem serve` that owns the log dir


def default_log_dir(port: int) -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-{port}"


def read_stack(port: int) -> dict:
    """The description a running `tandem serve --port PORT` wrote (see `LocalStack`)."""
    path = default_log_dir(port) / STACK_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TandemError(f"no local stack on port {port}: {path} does not exist; is "
                          f"`tandem serve --port {port}` running?") from None
    except (OSError, ValueError) as exc:
        raise TandemError(f"cannot read the local stack's description {path} ({exc}); is "
                          f"`tandem serve --port {port}` running?") from exc


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10000  # below: the well-known services' registered ports


def pickable_ports() -> range:
    """The ports `free_ports` picks from: below the kernel's ephemeral range
    (net.ipv4.ip_local_port_range, the ports it gives outgoing connections and `bind(0)`),
    so a port picked now and bound a moment later by a child cannot be taken in between
    by some process's outgoing connection. Empty where that range leaves no room."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return range(LOWEST_PICKED_PORT, low) if low - LOWEST_PICKED_PORT >= 1000 else range(0)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server started a moment later (`free_ports`)."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int, besides: Sequence[int] = ()) -> list[int]:
    """`count` distinct ports free on `host` now, none of `besides`: all held open while
    they are picked, so none repeats. Drawn at random from `pickable_ports` (then from the
    kernel's own choice, `bind(0)`, where that range is empty or full)."""
    pool = pickable_ports()
    draw = secrets.SystemRandom()
    sockets: list[socket.socket] = []
    ports: list[int] = []
    tries = 0
    try:
        while len(ports) < count:
            s = socket.socket(address_family(host))
            sockets.append(s)
            candidate = draw.choice(pool) if pool and tries < 64 * count else 0
            tries += 1
            if candidate in besides or candidate in ports:
                continue
            try:
                s.bind((host, candidate))
            except OSError:
                if candidate == 0:
                    raise
                continue  # in use: draw again
            if (port := s.getsockname()[1]) not in besides:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()


def folder_holder(log_dir: Path) -> int | None:
    """The pid of the live `tandem serve` holding `log_dir` (its `serve.lock`), or None
    when none does (no lock, or one a dead stack left)."""
    try:
        fd = os.open(log_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return int(os.pread(fd, 32, 0).split()[0])
        except (OSError, ValueError, IndexError):
            return -1  # held, pid not written yet
    finally:
        os.close(fd)
    return None



def claim_log_dir(host: str, port: int, log_dir: Path) -> int:
    """Check that `port` on `host` is free and that no live stack holds `log_dir`, then
    take the folder's lock (this process's pid in it); returns the lock's fd, to close
    when the stack stops. TandemError (naming the port and `--port`) otherwise, with
    nothing changed."""
    fix = busy_fix(port)
    check_port_free(host, port, log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = folder_holder(log_dir)
        raise TandemError(f"port {port}: its log folder {log_dir} is held by "
                          f"another `tandem serve` (pid {holder}) that is still running "
                          f"(its router restarting?); {fix}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def busy_fix(port: int) -> str:
    return (f"nothing was started; give this stack another port with `tandem serve "
            f"--port N` (or stop the one on {port} first)")


def check_port_free(host: str, port: int, log_dir: Path | None = None) -> None:
    """TandemError naming the port, whoever holds it and `--port` when `port` on `host`
    cannot be bound; `tandem serve` asks before anything else (even pulling its model)."""
    if (why := port_problem(host, port)) is None:
        return
    log_dir = log_dir or default_log_dir(port)
    holder = folder_holder(log_dir)
    whose = ("" if holder is None else
             f": another `tandem serve` (pid {holder}) serves there, its logs and "
             f"stack.json in {log_dir}")
    raise TandemError(f"port {port} on {host} is not free ({why}){whose}; {busy_fix(port)}")

