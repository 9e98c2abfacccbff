"""`tandem refit`: a fleet-wide refit of a running `tandem serve`, with a progress display.

The same transaction the operator runs on a pool (`tandem_engine.fleet`): it finds the
stack by its router port (the `stack.json` that `tandem serve` writes), drives every
engine to the new weights, and prints one line per event plus a compact line of the
engines' states whenever one changes. Exit status: 0 when every engine serves the new
weights, verified; 1 when the refit failed and was rolled back or halted (the reason —
engine, step, the engine's own message — goes to stderr); 2 for bad input.

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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlparse

from tandem_engine.fleet import (
    EngineObs,
    EngineRecord,
    Event,
    FleetAdmin,
    Phase,
    Transaction,
    Weights,
    new_transaction,
    observe,
    run,
)
from tandem_engine.serve import read_stack

# Calls that take a serving engine out of service (no new requests reach it).
_STOP_SERVING = ("/v1/drain", "/v1/pause")


def checkpoint_uri(uri: str) -> Path:
    """The folder a `file://` refit target names; ValueError (naming the input) unless it
    is a local folder with a config.json."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ValueError(f"--uri {uri!r}: a local refit target must be a file:// URI "
                         "naming a checkpoint folder, e.g. file:///models/my-model-v2")
    path = Path(unquote(parsed.path))
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise ValueError(f"--uri {uri!r}: {path} {what}; give the checkpoint folder "
                         "(config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--uri {uri!r}: {path} has no config.json; give a HuggingFace-"
                         "format checkpoint folder")
    return path


def _check_options(args: argparse.Namespace) -> None:
    if not args.version or len(args.version) > 253:
        raise ValueError(f"--version {args.version!r}: give 1 to 253 characters")
    if args.max_unavailable < 1:
        raise ValueError(f"--max-unavailable {args.max_unavailable}: must be >= 1 (engines "
                         "of each role refitted at once in a Rolling refit)")
    for name, value in (("--drain-timeout", args.drain_timeout), ("--timeout", args.timeout)):
        if not value > 0:
            raise ValueError(f"{name} {value}: must be > 0 seconds")


@dataclass(frozen=True)
class AdminCall:
    engine: str
    path: str
    started: float  # wall clock, seconds
    ended: float


class RecordingAdmin(FleetAdmin):
    """The fleet admin client, remembering every call it made (for the unavailable window
    and per-engine step times) and the last observation of every engine (the display)."""

    def __init__(self, token: str | None = None, **options: Any) -> None:
        super().__init__(token, **options)
        self.calls: list[AdminCall] = []
        self.last: dict[str, dict[str, Any] | None] = {}

    async def state(self, url: str) -> dict[str, Any] | None:
        self.last[url] = reply = await super().state(url)
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
                 last: dict[str, dict[str, Any] | None]) -> str:
    parts = []
    for name, _, url in engines:
        state = last.get(url)
        if state is None:
            parts.append(f"{name} unreachable")
            continue
        what = str(state["state"]).lower()
        if what == "running":
            what = "draining" if state.get("draining") else "serving"
        parts.append(f"{name} {state['weight_version']}/{state['weight_epoch']} {what}")
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


async def _refit(args: argparse.Namespace, target: Weights, out: TextIO) -> int:
    stack = read_stack(args.port)
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
                             drain_timeout=args.drain_timeout)
        _adopt_unsettled(tx, seen)
        print(f"refit of the stack at {stack['router']}: {_versions(seen)} → "
              f"{target.version} ({target.uri})", file=out, flush=True)
        try:
            tx = await run(tx, engines, admin, _Progress(engines, admin, out),
                           timeout=args.timeout)
        except TimeoutError as exc:
            print(f"tandem refit: {exc}; engines now: {_engine_line(engines, admin.last)}",
                  file=sys.stderr)
            return 1
        if tx.strategy == "AllAtOnce":
            window = unavailable_window(admin.calls, [n for n, _, _ in engines])
            shown = "none (some engine kept serving)" if window is None else f"{window:.3f} s"
            print(f"fleet unavailable window: {shown}", file=out, flush=True)
        return _outcome(tx, out)
    finally:
        await admin.close()


def _continuing(target: Weights, engines: list[EngineObs]) -> tuple[list[EngineObs],
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


def refit(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """`tandem refit`: ValueError for bad input (the CLI exits 2), else the exit status."""
    path = checkpoint_uri(args.uri)
    _check_options(args)
    target = Weights(path.as_uri(), args.version)
    try:
        return asyncio.run(_refit(args, target, out or sys.stdout))
    except KeyboardInterrupt:
        # Every engine's next step is decided from what it reports, so the same command
        # picks the refit up where it stopped.
        print("tandem refit: interrupted; engines may be mid-refit (paused, suspended or "
              "draining): run the same command again to finish", file=sys.stderr)
        return 130
