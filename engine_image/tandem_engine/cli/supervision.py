"""The local stack's children: started so none outlives `tandem serve`, and restarted.

Each child is a `python -m` process with its log file; the kernel sends it SIGTERM if
`tandem serve` dies (PR_SET_PDEATHSIG, `die_with_parent`), so no orphan survives.
A child that dies is restarted with back-off (1 s, 2 s, 4 s … capped at 30 s) with the
same arguments — an engine keeps its id, role and ports, so the router reconnects to its
new incarnation and fails over meanwhile; the router keeps its port. Only a child that
crash-loops (more than `restart_limit` restarts within `restart_window` s) stops the
stack. The budget refills: a restart older than the window no longer counts, nor
lengthens the back-off (as the kubelet's crash-loop back-off resets once a container has
run a while), so a child that dies now and then is restarted for ever. Torch-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn for child processes: the kernel sends them SIGTERM when we die."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_cause(returncode: int) -> str:
    """`exit code N`, or the signal's name (`SIGKILL`) for a process a signal ended."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"



@dataclass
class Child:
    name: str
    process: subprocess.Popen
    ready_url: str
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None  # None: this process's environment
    restarts: int = 0
    last_exit: str | None = None
    restart_times: list[float] = field(default_factory=list)  # monotonic, recent ones
    restart_at: float | None = None  # dead, to be restarted then
    awaiting_ready: bool = False  # restarted, /readyz not yet 200

    def describe(self) -> dict:
        return {"pid": self.process.pid, "restarts": self.restarts,
                "last_exit": self.last_exit}

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.ready_url, timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, lines: int = 15, max_bytes: int = 65536) -> str:
        """The log's last lines, reading at most its last `max_bytes` (a log can be huge,
        or a device such as /dev/full that never ends)."""
        try:
            with self.log.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
                data = f.read(max_bytes)
            return "\n".join(data.decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""



def start_process(args: list[str], log: Path, mode: str,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m *args`, its output to `log` (opened with `mode`), dying with us."""
    with log.open(mode) as out:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent, env=env)


def supervise_round(children: list[Child], *, restart_limit: int, restart_window: float,
                    backoff_base: float, backoff_cap: float, out: TextIO,
                    before_restart: Callable[[Child], None]) -> tuple[str | None, bool]:
    """One round of supervision: notice dead children, restart those whose back-off
    is over (`before_restart` may change a child's arguments first), note restarted
    ones that are ready again. Returns why the stack must stop (a child crash-looping),
    else None; and whether any child changed."""
    now = time.monotonic()
    changed = False
    for child in children:
        if child.restart_at is None and child.process.poll() is not None:
            cause = exit_cause(child.process.returncode)
            child.last_exit = cause
            child.awaiting_ready = False
            child.restart_times = [t for t in child.restart_times
                                   if now - t < restart_window]
            changed = True
            if len(child.restart_times) >= restart_limit:
                return (f"{child.name} exited ({cause}) after {len(child.restart_times)} "
                        f"restarts within {restart_window:.0f} s: it is "
                        f"crash-looping, stopping. Its log ({child.log}) ends with:\n"
                        f"{child.tail()}"), changed
            delay = min(backoff_cap, backoff_base * 2 ** len(child.restart_times))
            child.restart_at = now + delay
            print(f"{child.name} exited unexpectedly ({cause}); restarting it in "
                  f"{delay:g} s. Its log ({child.log}) ends with:\n{child.tail(5)}",
                  file=sys.stderr, flush=True)
        elif child.restart_at is not None and now >= child.restart_at:
            child.restart_at = None
            child.restarts += 1
            child.restart_times.append(now)
            with contextlib.suppress(OSError), child.log.open("ab") as log:
                log.write(f"\n--- tandem serve: restart {child.restarts} after "
                          f"{child.last_exit} ---\n".encode())
            before_restart(child)
            child.process = start_process(child.args, child.log, "ab", child.env)
            child.awaiting_ready = True
            changed = True
            print(f"{child.name}: restarted (restart {child.restarts}, pid "
                  f"{child.process.pid}, after {child.last_exit})", file=out, flush=True)
        elif child.awaiting_ready and child.process.poll() is None and child.ready():
            child.awaiting_ready = False
            print(f"{child.name}: ready again", file=out, flush=True)
    return None, changed
