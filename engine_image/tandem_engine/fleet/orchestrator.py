"""Moving a refit transaction forward: observe the engines, take each one's next step,
record what happened. The operator calls `advance` from its reconcile loop (persisting
`tx.to_dict()` in the pool's status after each call); `tandem refit` calls `run` against
a local stack. One function, so both behave the same way.

Before touching any engine it reads a canary from the previous weights (the baseline);
every refitted engine's canary is checked against it by the rules of `fleet/verify.py`.
An engine that does not answer a call (killed, restarting) is not a failure by itself: the
next pass goes on from what it reports, and a wave that would take the last reachable
engine of a version while another engine is away waits for it (`held_by`) or gives a
draining engine back to serving (`retreats`), so the away engine's requests always have an
engine of their version to continue on. A failure (an engine refuses the refit, its canary
fails, differs from the version's other engines or breaks a rule, or a step — or such a
wait — outlives its deadline) turns the transaction around: with
`Rollback` every engine goes back to the previous weights (under a new epoch, so routers
prefer them again); with `Halt` the engines it touched are brought back to serving on
whatever weights they have, and the transaction stops there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem_engine.admin_wire import SuspendRequest
from tandem_engine.fleet.admin import AdminError, EngineAdmin
from tandem_engine.fleet.transaction import (
    Act,
    EngineObs,
    EngineRecord,
    Failure,
    Phase,
    Transaction,
    absent,
    choose_wave,
    finished_phase,
    held_by,
    next_act,
    retreats,
    suspend_mode,
)
from tandem_engine.fleet.verify import (
    CANARY_TIMEOUT_S,
    CanaryReading,
    canary_request,
    problem,
)
from tandem_engine.lifecycle import EngineState
from tandem_engine.refit_policy import OnFailure
from tandem_engine.weights import WeightsRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """Something a human wants to see (a Kubernetes Event, a progress line)."""

    reason: str
    message: str
    warning: bool = False


async def observe(admin: EngineAdmin, engines: Sequence[tuple[str, str, str]]
                  ) -> list[EngineObs]:
    """(name, role, admin URL) → what each engine reports now."""
    states = await asyncio.gather(*(admin.probe(url) for _, _, url in engines))
    return [EngineObs.from_state(name, role, url, state)
            for (name, role, url), state in zip(engines, states, strict=True)]


async def advance(tx: Transaction, engines: list[EngineObs], admin: EngineAdmin,
                  now: float | None = None) -> list[Event]:
    """One pass: start the next wave if the last one is done, take one step on every
    engine of the wave, fail or finish the transaction. Returns the events of the pass."""
    now = time.time() if now is None else now
    events: list[Event] = []
    if tx.phase.finished:
        return events
    if not tx.started_at:
        tx.started_at = now
        events.append(Event("RefitStarted", f"refit to {tx.target.version} "
                            f"({tx.target.uri}), {tx.strategy}, in-flight requests: "
                            f"{tx.inflight}, epoch {tx.epoch}"))
        events.extend(await _read_baseline(tx, engines, admin))
    by_name = {e.name: e for e in engines}
    if tx.phase in (Phase.PROGRESSING, Phase.ROLLING_BACK):
        events += await _retreat(tx, engines, admin)
        wave = choose_wave(tx, engines)
        if wave:
            tx.wave += 1
            for name in wave:
                tx.engines[name] = EngineRecord(version=by_name[name].version, since=now)
            events.append(Event("RefitWave", f"wave {tx.wave}: {', '.join(wave)} → "
                                f"{tx.goal.version}"))
        events += _hold(tx, engines, now)
    touched = [by_name[n] for n in tx.engines if n in by_name]
    results = await asyncio.gather(*(_step(tx, e, admin, now) for e in touched),
                                   return_exceptions=True)
    for engine, result in zip(touched, results, strict=True):
        if isinstance(result, Event):
            events.append(result)
        elif isinstance(result, AdminError) and result.no_answer:
            # Killed or restarting mid-step, not refusing the new weights: the next pass
            # decides from what it reports then, within the step's deadline.
            events.append(Event("RefitStepRetry", f"{engine.name}: {result.call}: "
                                f"{result.message}; no answer, retrying from what it "
                                "reports next", warning=True))
        elif isinstance(result, AdminError | _StepFailed):
            events += _fail(tx, engine, result, now)
        elif isinstance(result, BaseException):
            raise result
    _track_window(tx, engines, now)
    done = finished_phase(tx, engines)
    if done is not None:
        tx.phase, tx.finished_at = done, now
        took = now - tx.started_at
        window = (f"; the fleet served no new request for {tx.unavailable_seconds:.1f} s"
                  if tx.unavailable_seconds else "")
        if done is Phase.SUCCEEDED:
            events.append(Event("RefitSucceeded", f"every engine serves "
                                f"{tx.target.version} (epoch {tx.epoch}) after {took:.1f} s"
                                f"{window}"))
        elif done is Phase.ROLLED_BACK:
            events.append(Event("RefitRolledBack", f"every engine serves "
                                f"{tx.previous.version} again after {took:.1f} s: "
                                f"{_describe(tx.failure)}", warning=True))
        else:
            events.append(Event("RefitHalted", f"refit halted after {took:.1f} s: "
                                f"{_describe(tx.failure)}", warning=True))
    return events


async def _retreat(tx: Transaction, engines: list[EngineObs], admin: EngineAdmin
                   ) -> list[Event]:
    """Re-plan the wave while an engine is away: a draining engine that is the last
    reachable one of its version and role serves again (`/v1/undrain`) and leaves the
    wave, so the away engine's requests have somewhere to continue."""
    events: list[Event] = []
    away = ", ".join(e.name for e in absent(engines))
    by_name = {e.name: e for e in engines}
    for name in retreats(tx, engines):
        engine = by_name[name]
        try:
            await admin.call(name, engine.admin_url, "/v1/undrain")
        except AdminError as exc:  # still draining: the next pass tries again
            events.append(Event("RefitStepFailed", f"{name}: {exc.call}: {exc.message} "
                                f"(giving it back to serving while {away} is away)",
                                warning=True))
            continue
        del tx.engines[name]
        events.append(Event("RefitWaveReplanned", f"{away} away: {name} ({engine.role}) is "
                            f"the last reachable engine of {engine.version}; it serves "
                            "again, and takes its turn once the others are back",
                            warning=True))
    return events


def _hold(tx: Transaction, engines: list[EngineObs], now: float) -> list[Event]:
    """Wait for absent engines before a wave that would strand their version, at most
    `step_timeout`; then fail the transaction (roll back or halt), naming them."""
    names = held_by(tx, engines)
    if not names:
        tx.held_since = None
        return []
    if tx.held_since is None:
        tx.held_since = now
        return [Event("RefitWaiting", f"wave {tx.wave + 1} waits for {', '.join(names)} "
                      "(unreachable or loading): every engine that could go is the last "
                      "reachable one of its version and role (at most "
                      f"{tx.step_timeout:.0f} s)", warning=True)]
    waited = now - tx.held_since
    if waited <= tx.step_timeout:
        return []
    tx.held_since = now  # a rollback held the same way reports it once per timeout
    by_name = {e.name: e for e in engines}
    return _fail(tx, by_name[names[0]], _StepFailed(
        "wave", f"unreachable or loading for {waited:.0f} s (deadline {tx.step_timeout:.0f} "
        f"s): the next wave would take the last reachable engine of a version whose "
        "requests may be failing over from it; bring it back, or remove it from the "
        "fleet"), now)


def _track_window(tx: Transaction, engines: list[EngineObs], now: float) -> None:
    """Add up the time no engine served new requests (routers queue requests meanwhile)."""
    serving = any(e.serving for e in engines)
    if not serving and tx.dark_since is None:
        tx.dark_since = now
    elif serving and tx.dark_since is not None:
        tx.unavailable_seconds += now - tx.dark_since
        tx.dark_since = None


class _StepFailed(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step, self.message = step, message


async def _step(tx: Transaction, engine: EngineObs, admin: EngineAdmin,
                now: float) -> Event | None:
    record = tx.engines[engine.name]
    goal = tx.goal_for(engine)
    act = next_act(engine, goal, tx.inflight, record, tx.drain_timeout, now)
    record.version = engine.version or record.version
    if act is Act.DONE:
        return None
    limit = tx.step_timeout + (tx.drain_timeout if record.drained_at is not None else 0)
    if act is Act.WAIT:
        if now - record.since > limit:
            raise _StepFailed(record.step or "start", f"no progress for {now - record.since:.0f}"
                              f" s (state {engine.state or 'unreachable'}, deadline "
                              f"{limit:.0f} s)")
        return None
    name, url = engine.name, engine.admin_url
    if act is Act.DRAIN:
        await admin.call(name, url, "/v1/drain")
        record.drained_at = now
    elif act is Act.PAUSE:
        await admin.call(name, url, "/v1/pause")
    elif act is Act.SUSPEND:
        await admin.call(name, url, "/v1/suspend",
                         SuspendRequest(mode=suspend_mode(engine, tx.inflight)).to_body())
    elif act is Act.REFIT:
        assert goal is not None
        await admin.call(name, url, "/v1/refit", refit_body(tx, goal),
                         timeout=admin.refit_timeout)
    elif act is Act.RESUME:
        await admin.call(name, url, "/v1/resume")
    elif act is Act.UNPAUSE:
        if not engine.draining:  # refused traffic until verified
            await admin.call(name, url, "/v1/drain")
        await admin.call(name, url, "/v1/unpause")
    elif act is Act.VERIFY:
        await _verify(tx, engine, admin)
        await admin.call(name, url, "/v1/undrain")
        record.verified = True
        record.step, record.since = str(act), now
        return Event("EngineRefitted", f"{name} ({engine.role}) serves {engine.version} "
                     f"(epoch {engine.epoch}), verified")
    record.step, record.since = str(act), now
    return None


def refit_body(tx: Transaction, goal: WeightsRef) -> dict[str, Any]:
    """The /v1/refit body that moves an engine to `goal` (`Transaction.refit_request`)."""
    return tx.refit_request(goal).to_body()


async def _verify(tx: Transaction, engine: EngineObs, admin: EngineAdmin) -> None:
    """The engine reports the goal and a short greedy generation succeeds — and matches the
    one every other engine of that version produced."""
    goal = tx.goal_for(engine)
    # An engine refitted by this transaction carries its epoch; one that never left the
    # previous weights (its refit was refused) keeps its own.
    refitted = engine.version != tx.previous.version
    if goal is not None and (engine.version != goal.version or (
            refitted and engine.epoch != tx.goal_epoch)):
        raise _StepFailed("verify", f"reports {engine.version} epoch {engine.epoch}, "
                          f"expected {goal.version} epoch {tx.goal_epoch}")
    reading = await _canary(admin, engine)
    reference = tx.canary.setdefault(engine.version, reading.token_ids)
    if reading.token_ids != reference:
        raise _StepFailed("verify", f"canary tokens {reading.token_ids} differ from "
                          f"{reference}, what other engines on {engine.version} produced")
    if tx.phase is Phase.PROGRESSING:  # new weights: they must also be as good as the old
        why = problem(reading, tx.baseline, tx.max_perplexity_ratio,
                      tx.min_uncertainty_ratio)
        if why is not None:
            raise _StepFailed("verify", why)


async def _canary(admin: EngineAdmin, engine: EngineObs) -> CanaryReading:
    reply = await admin.call(engine.name, engine.admin_url, "/v1/canary", canary_request(),
                             timeout=CANARY_TIMEOUT_S + 10)
    try:
        return CanaryReading.from_reply(engine.name, engine.version, reply)
    except (KeyError, TypeError, ValueError) as exc:  # msgspec.ValidationError included
        raise AdminError(engine.name, "/v1/canary", f"malformed reply {reply!r} ({exc!r})"
                         ) from exc


async def _read_baseline(tx: Transaction, engines: list[EngineObs], admin: EngineAdmin
                         ) -> list[Event]:
    """The previous weights' canary, from the first engine serving them that answers."""
    serving = [e for e in engines if e.version == tx.previous.version
               and e.state is EngineState.RUNNING]
    errors = []
    for engine in serving:
        try:
            tx.baseline = await _canary(admin, engine)
        except AdminError as exc:
            errors.append(f"{engine.name}: {exc.message}")
            continue
        b = tx.baseline
        sure = "" if b.top1_mass is None else f", top-1 mass {b.top1_mass:.4g}"
        return [Event("RefitBaseline", f"{tx.previous.version} on {engine.name}: perplexity "
                      f"{b.perplexity:.4g} on the probe text{sure}, canary tokens "
                      f"{b.token_ids}")]
    why = "; ".join(errors) or f"no engine serves {tx.previous.version}"
    return [Event("RefitBaseline", f"no baseline canary from {tx.previous.version} ({why}): "
                  "a degenerate canary fails outright, a perplexity limit cannot pass, "
                  "and over-confidence goes unchecked",
                  warning=True)]


def _fail(tx: Transaction, engine: EngineObs, error: Exception, now: float) -> list[Event]:
    step = error.call if isinstance(error, AdminError) else error.step
    message = error.message
    record = tx.engines.get(engine.name)  # None: a wave held for an untouched engine
    if record is not None:
        record.since = now
    if tx.phase is not Phase.PROGRESSING:
        # Already turning back: a second failure is reported, the way back keeps going.
        return [Event("RefitStepFailed", f"{engine.name}: {step}: {message}", warning=True)]
    tx.failure = Failure(engine.name, step, message)
    # Engines under way are driven back (or to serving) from wherever they are; with
    # Rollback, the ones already verified on the target are refitted back in waves.
    tx.engines = {n: r for n, r in tx.engines.items() if not r.verified}
    if tx.on_failure == OnFailure.ROLLBACK:
        tx.phase, tx.rollback_epoch = Phase.ROLLING_BACK, tx.epoch + 1
        then = f"rolling back to {tx.previous.version}"
    else:
        tx.phase, then = Phase.HALTING, "halting where it is"
    return [Event("RefitFailed", f"{_describe(tx.failure)}; {then}", warning=True)]


def _describe(failure: Failure | None) -> str:
    if failure is None:
        return "no failure recorded"
    return f"engine {failure.engine} failed at {failure.step}: {failure.message}"


async def run(tx: Transaction, engines: Sequence[tuple[str, str, str]], admin: EngineAdmin,
              on_events: Callable[[list[Event], Transaction], Awaitable[None] | None]
              | None = None, interval: float = 0.1, timeout: float = 3600.0) -> Transaction:
    """Drive `tx` to its end against a fixed set of engines (a local stack)."""
    deadline = time.monotonic() + timeout
    while not tx.phase.finished:
        if time.monotonic() > deadline:
            raise TimeoutError(f"refit not finished within {timeout:.0f} s (phase "
                               f"{tx.phase}, wave {tx.wave})")
        events = await advance(tx, await observe(admin, engines), admin)
        if on_events is not None:
            maybe = on_events(events, tx)
            if maybe is not None:
                await maybe
        if not tx.phase.finished:
            await asyncio.sleep(interval)
    return tx


def new_transaction(target: WeightsRef, engines: list[EngineObs], *, epoch: int | None = None,
                    **options) -> Transaction:
    """A transaction from what the engines serve now: the previous weights are the ones
    most of them run (every engine must report a version)."""
    live = [e for e in engines if e.state is not None]
    if not live:
        raise ValueError("no engine answers: nothing to refit")
    versions = [e.version for e in live]
    previous_version = max(sorted(set(versions)), key=versions.count)
    previous_uri = next(e.uri for e in live if e.version == previous_version)
    top = max(e.epoch for e in live)
    return Transaction(target=target, previous=WeightsRef(previous_uri, previous_version),
                       epoch=epoch if epoch is not None else top + 1, **options)
