"""`tandem refit`: a fleet-wide refit of a running `tandem serve`, with a progress display.
(`--adapter` / `--remove-adapter` change a LoRA adapter instead: cli/adapter_refit.py.)

The same transaction the operator runs on a pool (`tandem_engine.fleet`): it finds the
stack by its router port (the `stack.json` that `tandem serve` writes), drives every
engine to the new weights, and prints one line per event plus a compact line of the
engines' states whenever one changes. Exit status: 0 when every engine serves the new
weights, verified; 1 when the refit failed and was rolled back or halted (the reason —
engine, step, the engine's own message — goes to stderr); 2 for bad input; 3 when a newer
`tandem refit` of the same stack superseded it.

Pre-flight, before any engine is touched: the target (and `--draft`) must be a readable
checkpoint inside the weights roots the stack recorded in its `stack.json` (the folder
holding its `--model` and each `tandem serve --weights-root`), the rule the engines
themselves apply. A refusal names the path, the allowed folders and the flag that adds
one, and no engine drains, pauses or suspends.

One refit at a time: `tandem refit` holds a lock file (`refit.pid`: its pid and target) in
the stack's log dir. A second `tandem refit` started meanwhile — a second edit — supersedes
the first: it sends it SIGTERM, which stops it between passes, waits for it to exit (then
SIGKILL), and takes over; engines the first left draining, paused or suspended join the
new refit at once, so every engine ends on the newest target. A lock whose process is gone
is taken over with a note.

For `AllAtOnce` it also reports the fleet's unavailable window, measured at the admin
API from the calls the orchestrator makes: from the start of the call that took the last
serving engine out of service (`/v1/drain`, or `/v1/pause` with `Recompute`) to the
return of the first `/v1/undrain` (an engine verified and admitting requests again).
Engines announce each state change to the router at once, so this is what a client sees,
give or take one HTTP round trip (the bounds are taken on the long side). Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tandem_engine.admin_wire import EngineStatus
from tandem_engine.cli.stack_claim import default_log_dir, read_stack
from tandem_engine.errors import TandemError
from tandem_engine.fleet import (
    EngineAdmin,
    EngineObs,
    EngineRecord,
    Event,
    Phase,
    Transaction,
    new_transaction,
    observe,
    run,
)
from tandem_engine.fleet.verify import uncertainty_ratio_problem
from tandem_engine.lifecycle import EngineState
from tandem_engine.refit_policy import RefitStrategy, perplexity_ratio_problem
from tandem_engine.weights import (
    CHECKPOINT_FORMS,
    WeightsRef,
    checkpoint_problem,
    local_checkpoint_path,
    weights_root_problem,
)

# Calls that take a serving engine out of service (no new requests reach it).
_STOP_SERVING = ("/v1/drain", "/v1/pause")
LOCK_FILE = "refit.pid"
SUPERSEDED = 3  # exit status of a refit a newer one superseded
SUPERSEDE_WAIT = 15.0  # seconds a superseded refit gets to stop before SIGKILL


def checkpoint_folder(uri: str, what: str = "--uri", roots: list[str] | None = None,
                      port: int | None = None) -> Path:
    """The checkpoint a `file://` refit target (`what`: --uri, --draft) names (a folder or
    a .gguf file); ValueError (naming the input) unless it is a readable local folder with
    a config.json or a local .gguf file — and, with `roots` (the weights roots of the
    stack on `port`), inside one of them (the message then names them and the flag)."""
    path = Path(local_checkpoint_path(uri, what=what))
    problem = checkpoint_problem(path)
    if problem is None and roots is not None:
        problem = weights_root_problem(path, roots)
    if problem is None:
        return path
    if roots is None:
        raise ValueError(f"{what} {uri!r}: {problem}; give {CHECKPOINT_FORMS}")
    raise ValueError(f"{what} {uri!r}: {problem}. The stack on port {port} loads "
                     f"checkpoints only from inside {' or '.join(roots)}: give {CHECKPOINT_FORMS} "
                     "there, or restart the stack with `tandem serve --weights-root DIR` "
                     "(repeatable) to allow the folder DIR holding it; no engine was touched")


def _check_options(args: argparse.Namespace) -> None:
    if not args.version or len(args.version) > 253:
        raise ValueError(f"--weights-version {args.version!r}: give 1 to 253 characters")
    if args.max_unavailable < 1:
        raise ValueError(f"--max-unavailable {args.max_unavailable}: must be >= 1 (engines "
                         "of each role refitted at once in a Rolling refit)")
    for name, value in (("--drain-timeout", args.drain_timeout), ("--timeout", args.timeout)):
        if not value > 0:
            raise ValueError(f"{name} {value}: must be > 0 seconds")
    ratio = args.max_perplexity_ratio
    if ratio is not None and (why := perplexity_ratio_problem(ratio)) is not None:
        raise ValueError(f"--max-perplexity-ratio {why}")
    if (why := uncertainty_ratio_problem(args.min_uncertainty_ratio)) is not None:
        raise ValueError(f"--min-uncertainty-ratio {why}")


@dataclass(frozen=True)
class AdminCall:
    engine: str
    path: str
    started: float  # wall clock, seconds
    ended: float


class RecordingAdmin(EngineAdmin):
    """The engine admin client, remembering every call it made (for the unavailable window
    and per-engine step times) and the last observation of every engine (the display)."""

    def __init__(self, token: str | None = None, **options: Any) -> None:
        super().__init__(token, **options)
        self.calls: list[AdminCall] = []
        self.last: dict[str, EngineStatus | None] = {}

    async def probe(self, url: str) -> EngineStatus | None:
        self.last[url] = reply = await super().probe(url)
        return reply

    async def call(self, engine: str, url: str, path: str, body: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        started = time.time()
        reply = await super().call(engine, url, path, body, timeout)
        self.calls.append(AdminCall(engine, path, started, time.time()))
        return reply


def unavailable_window(calls: list[AdminCall], engines: list[str]) -> float | None:
    """Seconds during which no engine served new requests: from the start of the call
    that took the last engine out of service to the return of the first undrain after it.
    None when some engine never left (the fleet was never fully away) or none came back."""
    stopped: dict[str, float] = {}
    for c in calls:
        if c.path in _STOP_SERVING:
            stopped.setdefault(c.engine, c.started)
    if not engines or any(n not in stopped for n in engines):
        return None
    last_out = max(stopped[n] for n in engines)
    first_back = min((c.ended for c in calls if c.path == "/v1/undrain"
                      and c.ended >= last_out), default=None)
    return None if first_back is None else first_back - last_out


def _engine_line(engines: list[tuple[str, str, str]],
                 last: dict[str, EngineStatus | None]) -> str:
    parts = []
    for name, _, url in engines:
        state = last.get(url)
        if state is None:
            parts.append(f"{name} unreachable")
            continue
        what = str(state.state).lower()
        if state.state is EngineState.RUNNING:
            what = "draining" if state.draining else "serving"
        parts.append(f"{name} {state.weight_version}/{state.weight_epoch} {what}")
    return " | ".join(parts)


class _Progress:
    """One line per event; the engines' line whenever it changes."""

    def __init__(self, engines: list[tuple[str, str, str]], admin: RecordingAdmin,
                 out: TextIO) -> None:
        self.engines, self.admin, self.out = engines, admin, out
        self.started = time.monotonic()
        self.shown = ""

    def __call__(self, events: list[Event], tx: Transaction) -> None:
        # What the pass observed, then what it did.
        stamp = f"[{time.monotonic() - self.started:6.1f} s]"
        line = _engine_line(self.engines, self.admin.last)
        if line != self.shown:
            self.shown = line
            print(f"{stamp}  engines: {line}", file=self.out, flush=True)
        for event in events:
            mark = "!" if event.warning else " "
            print(f"{stamp}{mark}{event.reason}: {event.message}", file=self.out, flush=True)


class _Superseded(Exception):
    """A newer `tandem refit` of the stack asked this one to stop (SIGTERM)."""


@dataclass
class _Stop:
    """Set by SIGTERM; the refit checks it after every pass, so it stops between steps,
    never in the middle of an admin call."""

    requested: bool = False

    def check(self) -> None:
        if self.requested:
            raise _Superseded


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie — exited, not yet reaped — does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc to tell: the signal reached it
    return stat.rsplit(")", 1)[-1].split()[:1] not in (["Z"], ["X"])


def _is_refit(pid: int) -> bool:
    """Whether `pid` is a `tandem refit` (and not another process that reused the pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # cannot tell: assume it is
    return b"refit" in argv


class RefitLock:
    """`refit.pid` in the stack's log dir: the running `tandem refit` (pid, target).

    Taken atomically (a complete file hard-linked into place, which fails if one is
    there). A live holder is superseded: SIGTERM, up to `SUPERSEDE_WAIT` s to exit, then
    SIGKILL; a holder that is gone left a stale lock, taken over with a note."""

    def __init__(self, port: int, target: WeightsRef, out: TextIO,
                 wait: float = SUPERSEDE_WAIT) -> None:
        self.path = default_log_dir(port) / LOCK_FILE
        self.mine = {"pid": os.getpid(), "version": target.version, "uri": target.uri}
        self.out, self.wait = out, wait

    def _holder(self) -> dict[str, Any] | None:
        """The lock's content; None when there is none; {} when it cannot be read."""
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def acquire(self) -> None:
        tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(self.mine))
        superseded: set[int | None] = set()
        try:
            for _ in range(10):
                try:
                    os.link(tmp, self.path)
                    return
                except FileExistsError:
                    pass
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile
                pid, version = holder.get("pid"), holder.get("version", "?")
                pid = pid if isinstance(pid, int) else None
                if pid is not None and pid != os.getpid() and _alive(pid) and _is_refit(pid):
                    self._supersede(pid, version)
                    superseded.add(pid)
                    continue
                if pid not in superseded:  # (one it just stopped left its lock: no news)
                    print(f"tandem refit: taking over a stale lock {self.path} (refit to "
                          f"{version}, pid {pid}, no longer running)", file=self.out,
                          flush=True)
                if self._holder() == holder:
                    self.path.unlink(missing_ok=True)
            raise RuntimeError(f"cannot take the refit lock {self.path}: other `tandem "
                               "refit` runs of this stack keep taking it")
        finally:
            tmp.unlink(missing_ok=True)

    def _supersede(self, pid: int, version: str) -> None:
        print(f"superseding the refit to {version} (pid {pid})", file=self.out, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if self._wait_exit(pid, self.wait):
            return
        print(f"tandem refit: the refit to {version} (pid {pid}) did not stop within "
              f"{self.wait:.0f} s; killing it", file=self.out, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._wait_exit(pid, 10.0)

    @staticmethod
    def _wait_exit(pid: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while _alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def release(self) -> None:
        holder = self._holder()
        if holder and holder.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)


async def _refit(args: argparse.Namespace, stack: dict[str, Any], target: WeightsRef,
                 draft: str | None, out: TextIO, stop: _Stop) -> int:
    engines = [(e["name"], e["role"], e["admin_url"]) for e in stack["engines"]]
    admin = RecordingAdmin(stack.get("admin_token"))
    try:
        seen = await observe(admin, engines)
        missing = [e.name for e in seen if e.state is None]
        if missing:
            raise RuntimeError(
                f"engine(s) {', '.join(missing)} of the stack on port {args.port} do not "
                f"answer their admin API; is `tandem serve --port {args.port}` running "
                "(and healthy)?")
        basis, epoch = _continuing(target, seen)
        tx = new_transaction(target, basis, epoch=epoch, strategy=args.strategy,
                             inflight=args.inflight, on_failure=args.on_failure,
                             max_unavailable=args.max_unavailable,
                             drain_timeout=args.drain_timeout,
                             max_perplexity_ratio=args.max_perplexity_ratio,
                             min_uncertainty_ratio=args.min_uncertainty_ratio,
                             low_memory=args.low_memory, target_draft=draft)
        _adopt_unsettled(tx, seen)
        print(f"refit of the stack at {stack['router']}: {_versions(seen)} → "
              f"{target.version} ({target.uri})", file=out, flush=True)
        progress = _Progress(engines, admin, out)

        def on_events(events: list[Event], tx: Transaction) -> None:
            progress(events, tx)
            if not tx.phase.finished:
                stop.check()

        try:
            stop.check()
            tx = await run(tx, engines, admin, on_events, timeout=args.timeout)
        except TimeoutError as exc:
            print(f"tandem refit: {exc}; engines now: {_engine_line(engines, admin.last)}",
                  file=sys.stderr)
            return 1
        except _Superseded:
            # Every engine's next step is decided from what it reports: the newer refit
            # takes the engines left mid-way (draining, paused, suspended) to its target.
            print(f"tandem refit: superseded by a newer `tandem refit` of this stack; "
                  f"stopped between steps, engines now: {_engine_line(engines, admin.last)}",
                  file=sys.stderr, flush=True)
            return SUPERSEDED
        if tx.strategy == RefitStrategy.ALL_AT_ONCE:
            window = unavailable_window(admin.calls, [n for n, _, _ in engines])
            shown = "none (some engine kept serving)" if window is None else f"{window:.3f} s"
            print(f"fleet unavailable window: {shown}", file=out, flush=True)
        return _outcome(tx, out)
    finally:
        await admin.close()


def _continuing(target: WeightsRef, engines: list[EngineObs]) -> tuple[list[EngineObs],
                                                                       int | None]:
    """(engines the previous weights are read from, the epoch) for `new_transaction`.
    Engines already on the target — an interrupted `tandem refit` to it — keep their
    epoch, so they verify as refitted by this transaction; the previous weights are
    the ones the other engines run."""
    behind = [e for e in engines if e.version != target.version]
    ahead = [e.epoch for e in engines if e.version == target.version]
    if behind and ahead and max(ahead) > max(e.epoch for e in behind):
        return behind, max(ahead)
    return behind or engines, None


def _adopt_unsettled(tx: Transaction, engines: list[EngineObs]) -> None:
    """Engines an interrupted `tandem refit` left mid-way (draining, paused, suspended)
    join the new transaction at once: they are taken to the target and serve again
    before any wave starts."""
    now = time.time()
    for e in engines:
        if not e.serving:
            tx.engines[e.name] = EngineRecord(version=e.version, since=now,
                                              drained_at=now if e.draining else None)


def _versions(engines: list[EngineObs]) -> str:
    counts: dict[str, int] = {}
    for e in engines:
        counts[e.version] = counts.get(e.version, 0) + 1
    return ", ".join(f"{n}× {v}" for v, n in sorted(counts.items()))


def _outcome(tx: Transaction, out: TextIO) -> int:
    took = (tx.finished_at or time.time()) - tx.started_at
    if tx.phase is Phase.SUCCEEDED:
        print(f"refit succeeded: every engine serves {tx.target.version} (epoch {tx.epoch}), "
              f"verified, in {took:.1f} s", file=out, flush=True)
        return 0
    f = tx.failure
    reason = (f"engine {f.engine} failed at {f.step}: {f.message}" if f is not None
              else "no failure recorded")
    if tx.phase is Phase.ROLLED_BACK:
        then = f"rolled back: every engine serves {tx.previous.version} again"
    else:
        then = "halted: every engine it touched serves again, on the weights it has"
    print(f"tandem refit: refit to {tx.target.version} failed and was {then} "
          f"({took:.1f} s). {reason}", file=sys.stderr, flush=True)
    return 1


def _weights_roots(stack: dict[str, Any] | None) -> list[str] | None:
    """The folders the stack's engines may load refits from, as its stack.json records
    them; None when it records none (a stack started by an older `tandem serve`: its
    engines still check)."""
    roots = None if stack is None else stack.get("weights_roots")
    if not isinstance(roots, list) or not all(isinstance(r, str) for r in roots):
        return None
    return roots


def _checked_input(args: argparse.Namespace, roots: list[str] | None) -> tuple[Path, str | None]:
    """(the target's checkpoint, the draft's URI or None), checked against the stack's
    weights `roots` when it has them; ValueError naming the input otherwise."""
    path = checkpoint_folder(args.uri, roots=roots, port=args.port)
    draft = (checkpoint_folder(args.draft, "--draft", roots, args.port).as_uri()
             if args.draft else None)
    _check_options(args)
    return path, draft


def refit(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """`tandem refit`: ValueError for bad input (the CLI exits 2), else the exit status.
    Every check of the input comes before any engine is touched. `--adapter` and
    `--remove-adapter` change a LoRA adapter instead (cli/adapter_refit.py)."""
    if args.adapter or args.remove_adapter:
        if args.uri is not None or args.version is not None:
            raise ValueError("--adapter/--remove-adapter change a LoRA adapter, --uri and "
                             "--weights-version the weights: one change at a time")
        from tandem_engine.cli.adapter_refit import refit_adapter

        return refit_adapter(args, out)
    if args.uri is None or args.version is None:
        raise ValueError("give the new weights, --uri file:///dir and --weights-version "
                         "NAME (or a LoRA adapter: --adapter NAME=URI, --remove-adapter "
                         "NAME)")
    try:
        stack = read_stack(args.port)
    except TandemError:
        _checked_input(args, None)  # the input's own problems are said first
        raise
    path, draft = _checked_input(args, _weights_roots(stack))
    target = WeightsRef(path.as_uri(), args.version)
    out = out or sys.stdout
    stop = _Stop()
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread: no superseding signal
        previous = signal.signal(signal.SIGTERM,
                                 lambda *_: setattr(stop, "requested", True))
    lock = RefitLock(args.port, target, out)
    try:
        lock.acquire()
        return asyncio.run(_refit(args, stack, target, draft, out, stop))
    except KeyboardInterrupt:
        # Every engine's next step is decided from what it reports, so the same command
        # picks the refit up where it stopped.
        print("tandem refit: interrupted; engines may be mid-refit (paused, suspended or "
              "draining): run the same command again to finish", file=sys.stderr)
        return 130
    finally:
        lock.release()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
