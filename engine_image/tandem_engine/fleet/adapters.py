"""A pool's LoRA adapters changed as one transaction: the record, its rules, its steps.

The operator keeps a pool's adapters (`spec.adapters`: name, version, uri each) the way it
keeps its weights: an edit starts a transaction from the set the pool served (`previous`)
to the new one (`target`), which moves the engines in waves, verifies each engine it
changed, and on a failure puts every engine back (or halts, as `spec.refit.onFailure`
says). It shares the weights refit's words and parts — `Phase`, `Failure`, the strategy,
the per-role wave size (`max_unavailable`), `fleet.verify`'s canary rules, the admin
client — but not its steps: an adapter is loaded in place. The engine reads and checks the
folder, then serves the name at the new version; requests already running finish under
the version they began with; nothing drains or pauses, so a wave takes no engine out of
service and unrelated traffic never waits.

Per engine, in its wave:

1. **load** each goal adapter it does not serve at the goal's version, **unload** each
   managed name (one of `target` or `previous`) the goal no longer has. Adapters the pool
   does not manage (loaded through the router's admin endpoint) are left alone.
   Moving forward, each load is **verified before it serves**: the engine first loads the
   folder under a staging name (`staging_name`: `tandem-canary.` and the name, which no
   client uses), runs a canary under it (`/v1/canary` with `lora_name` and `lora_version`)
   that must run with finite logprobs and not degenerate where the engine's base-model
   canary does not (`verify.problem`'s rules 1 and 3), and whose probe-text score must
   agree with the first engine verified on that adapter version (`same_score`: the canary
   shares the engine's batch with live traffic, so the teacher-forced score is compared
   within a tolerance, where greedy tokens could flip on a near-tie). Only then is the
   staging name unloaded and the folder loaded under the adapter's own name. So an adapter
   that loads but computes garbage (NaN, a collapsed output) never answers a request. A
   rollback loads versions already verified, directly.

Waves (Rolling): up to `max_unavailable` engines per role, prefill and decode together, in
name order; AllAtOnce: every engine behind at once. While a version of an adapter is
loaded on a prefill engine and not yet on any decode engine, the router runs those
requests on one engine (it pairs a prefill and a decode engine only at the same adapter
version), so a wave never fails a request.

A failure: an engine refusing a load (a 4xx: a missing or corrupt folder, an adapter
whose shapes or rank do not fit), or a canary failing. An engine that does not answer is
not a failure (it may be restarting: its pod comes back with the pool's adapters and
joins a later wave). Each engine's next step is a function of what it reports (the
identities in `/v1/state`'s `loras`), so a pass repeated after an operator crash takes
no step twice. Torch-free.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem_engine.admin_wire import (
    CanaryRequest,
    EngineStatus,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from tandem_engine.fleet.admin import AdminError, EngineAdmin
from tandem_engine.fleet.orchestrator import Event
from tandem_engine.fleet.transaction import Failure, Phase
from tandem_engine.fleet.verify import (
    CANARY_TIMEOUT_S,
    CANARY_TOKENS,
    PROBE_TEXT,
    CanaryReading,
    problem,
)
from tandem_engine.lifecycle import EngineState
from tandem_engine.refit_policy import OnFailure, RefitStrategy

LOAD_TIMEOUT_S = 120.0  # one engine reading and checking one adapter folder
# An engine of a wave that makes no progress this long (it keeps answering 5xx, or not at
# all while it still reports RUNNING) fails the transaction, naming its last error.
STEP_TIMEOUT_S = 300.0
# Two canaries of one adapter version agree when their probe-text scores (mean negative
# log-likelihood per token) differ by no more than this, relative, plus an absolute floor:
# the same weights batched differently differ by float rounding (1e-6); another file, by
# far more.
SCORE_RTOL, SCORE_ATOL = 1e-3, 1e-4


@dataclass(frozen=True)
class AdapterRef:
    """One adapter of a pool: served under `name` at `version`, read from `uri`."""

    name: str
    version: str
    uri: str

    @property
    def identity(self) -> str:
        return f"{self.name}@{self.version}"

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version, "uri": self.uri}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterRef:
        return cls(str(data["name"]), str(data["version"]), str(data["uri"]))


AdapterSet = dict[str, AdapterRef]  # by name


def adapter_set(refs: Iterable[AdapterRef]) -> AdapterSet:
    return {a.name: a for a in refs}


def describe(adapters: Mapping[str, AdapterRef]) -> str:
    """`sql@2, chat@1`, or `none`."""
    return ", ".join(a.identity for _, a in sorted(adapters.items())) or "none"


@dataclass(frozen=True)
class AdapterObs:
    """One engine as an adapter transaction sees it (`GET /v1/state`)."""

    name: str  # the pod's name, or the local engine id
    role: str
    admin_url: str
    state: EngineState | None  # None: it does not answer
    loras: tuple[str, ...] | None = None  # identities it serves; None: LoRA is off

    @property
    def serving(self) -> bool:
        return self.state is EngineState.RUNNING

    @classmethod
    def from_state(cls, name: str, role: str, admin_url: str, status: EngineStatus | None
                   ) -> AdapterObs:
        if status is None:
            return cls(name, role, admin_url, None)
        loras = None if not isinstance(status.loras, list) else tuple(status.loras)
        return cls(name, role, admin_url, status.state, loras)


STAGING_PREFIX = "tandem-canary."  # adapter names the pool may not use (spec.py refuses them)


def staging_name(name: str) -> str:
    """The name an adapter is verified under before it serves under its own."""
    return (STAGING_PREFIX + name)[:128]


@dataclass
class AdapterEngineRecord:
    """An engine of a wave: when it joined, and the adapter versions verified on it."""

    since: float = 0.0
    verified: list[str] = field(default_factory=list)
    last_error: str = ""  # the last error a pass retried


@dataclass
class AdapterTransaction:
    """A change of a fleet's adapters from `previous` to `target` (sets by name)."""

    target: AdapterSet
    previous: AdapterSet
    strategy: RefitStrategy = RefitStrategy.ROLLING
    on_failure: OnFailure = OnFailure.ROLLBACK
    max_unavailable: int = 1
    step_timeout: float = STEP_TIMEOUT_S
    phase: Phase = Phase.PROGRESSING
    wave: int = 0
    started_at: float = 0.0
    finished_at: float | None = None
    engines: dict[str, AdapterEngineRecord] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)  # identity -> first canary's score
    failure: Failure | None = None

    @property
    def goal(self) -> AdapterSet:
        """What the engines are moved to: the target, or the previous set when rolling back."""
        return self.previous if self.phase in (Phase.ROLLING_BACK, Phase.ROLLED_BACK) \
            else self.target

    @property
    def names(self) -> frozenset[str]:
        """The adapter names this transaction manages."""
        return frozenset(self.target) | frozenset(self.previous)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["target"] = [a.to_dict() for _, a in sorted(self.target.items())]
        data["previous"] = [a.to_dict() for _, a in sorted(self.previous.items())]
        for key in ("phase", "strategy", "on_failure"):
            data[key] = str(data[key])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterTransaction:
        """From `to_dict`'s form; KeyError, TypeError or ValueError when it is not one."""
        failure = data.get("failure")
        return cls(
            target=adapter_set(AdapterRef.from_dict(a) for a in data["target"]),
            previous=adapter_set(AdapterRef.from_dict(a) for a in data["previous"]),
            strategy=RefitStrategy(data.get("strategy", RefitStrategy.ROLLING.value)),
            on_failure=OnFailure(data.get("on_failure", OnFailure.ROLLBACK.value)),
            max_unavailable=int(data.get("max_unavailable", 1)),
            step_timeout=float(data.get("step_timeout", STEP_TIMEOUT_S)),
            phase=Phase(data.get("phase", Phase.PROGRESSING.value)),
            wave=int(data.get("wave", 0)),
            started_at=float(data.get("started_at", 0.0)),
            finished_at=None if data.get("finished_at") is None
            else float(data["finished_at"]),
            engines={str(k): AdapterEngineRecord(float(v.get("since", 0.0)),
                                                 [str(i) for i in v.get("verified") or ()],
                                                 str(v.get("last_error") or ""))
                     for k, v in (data.get("engines") or {}).items()},
            scores={str(k): float(v) for k, v in (data.get("scores") or {}).items()},
            failure=Failure(**failure) if failure else None)


def begin(target: AdapterSet, previous: AdapterSet, now: float) -> AdapterTransaction:
    return AdapterTransaction(target=dict(target), previous=dict(previous), started_at=now)


# ---- the rules (pure) ---------------------------------------------------------------------------


def managed(tx: AdapterTransaction, engine: AdapterObs) -> frozenset[str]:
    """The identities `engine` serves of the names `tx` manages."""
    names = tx.names
    return frozenset(i for i in engine.loras or () if i.partition("@")[0] in names)


def on_goal(tx: AdapterTransaction, engine: AdapterObs) -> bool:
    return managed(tx, engine) == frozenset(a.identity for a in tx.goal.values())


def changes(tx: AdapterTransaction, engine: AdapterObs
            ) -> tuple[list[AdapterRef], list[str]]:
    """What `engine` needs to serve the goal: adapters to load (a new version of a name it
    serves replaces that version in place), names to unload."""
    served = managed(tx, engine)
    goal = tx.goal
    loads = [a for _, a in sorted(goal.items()) if a.identity not in served]
    unloads = sorted({i.partition("@")[0] for i in served} - set(goal))
    return loads, unloads


def done(tx: AdapterTransaction, engine: AdapterObs) -> bool:
    """On the goal (moving forward, an adapter serves under its name only once verified)."""
    return on_goal(tx, engine)


def leftovers(engine: AdapterObs) -> list[str]:
    """Staging names an engine still serves (a pass that ended mid-verification)."""
    return sorted({i.partition("@")[0] for i in engine.loras or ()
                   if i.startswith(STAGING_PREFIX)})


def choose_wave(tx: AdapterTransaction, engines: list[AdapterObs]) -> list[str]:
    """Engines to start now: none while an engine of the wave under way is not done; then
    Rolling, up to `max_unavailable` serving engines per role behind the goal (prefill and
    decode together, in name order); AllAtOnce, every one."""
    if any(e.name in tx.engines and e.serving and not done(tx, e) for e in engines):
        return []
    behind = sorted((e for e in engines if e.serving and e.loras is not None
                     and e.name not in tx.engines and not on_goal(tx, e)),
                    key=lambda e: e.name)
    if tx.strategy is RefitStrategy.ALL_AT_ONCE:
        return [e.name for e in behind]
    wave: list[str] = []
    for role in sorted({e.role for e in behind}):
        wave += [e.name for e in behind if e.role == role][:max(1, tx.max_unavailable)]
    return wave


def lora_off(tx: AdapterTransaction, engines: list[AdapterObs]) -> list[str]:
    """Serving engines started without LoRA, while the goal has adapters: they cannot take
    part (the pool's pods start with --enable-lora when spec.engine.lora is set)."""
    return sorted(e.name for e in engines if e.serving and e.loras is None and tx.goal)


def same_score(a: float, b: float) -> bool:
    """Two canary scores of one adapter version agree (the near-tie rule)."""
    return math.isclose(a, b, rel_tol=SCORE_RTOL, abs_tol=SCORE_ATOL)


def finished(tx: AdapterTransaction, engines: list[AdapterObs]) -> bool:
    """Every engine that answers is done (at least one answers)."""
    answering = [e for e in engines if e.serving]
    return bool(answering) and all(done(tx, e) for e in answering)


# ---- the steps ---------------------------------------------------------------------------------


class VerifyFailed(Exception):
    """An engine's canary under an adapter failed a rule; the message says which."""


async def _canary(admin: EngineAdmin, engine: AdapterObs, adapter: AdapterRef | None
                  ) -> CanaryReading:
    body = CanaryRequest(prompt=PROBE_TEXT, max_tokens=CANARY_TOKENS, timeout=CANARY_TIMEOUT_S,
                         lora_name=adapter.name if adapter else None,
                         lora_version=adapter.version if adapter else None).to_body()
    reply = await admin.call(engine.name, engine.admin_url, "/v1/canary", body,
                             timeout=CANARY_TIMEOUT_S + 10)
    try:
        return CanaryReading.from_reply(engine.name, adapter.identity if adapter else "base",
                                        reply)
    except (ValueError, TypeError) as exc:
        raise AdminError(engine.name, "POST /v1/canary", f"malformed reply: {exc}",
                         200) from None


async def _verify(tx: AdapterTransaction, admin: EngineAdmin, engine: AdapterObs,
                  adapter: AdapterRef, staged: AdapterRef) -> None:
    """The canary rules for `adapter`, loaded on `engine` as `staged`; VerifyFailed or
    AdminError."""
    base = await _canary(admin, engine, None)
    try:
        reading = await _canary(admin, engine, staged)
    except AdminError as exc:
        if _transient(exc):
            raise
        # The engine's verdict on the adapter (409: NaN or Inf logits; 400: refused).
        raise VerifyFailed(f"canary under {adapter.identity}: {exc.message}") from None
    why = problem(reading, base, None, 0.0)
    if why is not None:
        raise VerifyFailed(f"canary under {adapter.identity}: {why}")
    first = tx.scores.get(adapter.identity)
    if first is None:
        tx.scores[adapter.identity] = reading.mean_nll
    elif not same_score(first, reading.mean_nll):
        raise VerifyFailed(
            f"canary under {adapter.identity}: the probe text scores {reading.mean_nll:.6g} "
            f"nats per token here and {first:.6g} on the first engine verified on it: one "
            "adapter version must give one model (were the files changed under the same "
            "version? give changed files a new version)")


async def _unload(admin: EngineAdmin, engine: AdapterObs, name: str) -> None:
    try:
        await admin.call(engine.name, engine.admin_url, "/v1/unload_lora_adapter",
                         UnloadLoRAAdapterRequest(lora_name=name).to_body())
    except AdminError as exc:
        if exc.status != 404:  # 404: it serves no version of it any more: done
            raise


async def _load(admin: EngineAdmin, engine: AdapterObs, adapter: AdapterRef, path: str
                ) -> None:
    reply = await admin.call(engine.name, engine.admin_url, "/v1/load_lora_adapter",
                             LoadLoRAAdapterRequest(lora_name=adapter.name, lora_path=path,
                                                    lora_version=adapter.version).to_body(),
                             timeout=LOAD_TIMEOUT_S)
    if adapter.identity not in (reply.get("loras") or []):
        raise VerifyFailed(f"engine {engine.name} answered the load of {adapter.identity} "
                           f"but does not list it among its adapters ({reply.get('loras')})")


async def _move(tx: AdapterTransaction, admin: EngineAdmin, engine: AdapterObs,
                paths: Mapping[str, str]) -> None:
    """Take `engine` to the goal, each load moving forward verified first under its
    staging name: AdminError or VerifyFailed."""
    loads, unloads = changes(tx, engine)
    record = tx.engines[engine.name]
    for name in [*leftovers(engine), *unloads]:
        await _unload(admin, engine, name)
    for adapter in loads:
        path = paths[adapter.name]
        if tx.phase is Phase.PROGRESSING:
            staged = AdapterRef(staging_name(adapter.name), adapter.version, adapter.uri)
            await _load(admin, engine, staged, path)
            try:
                await _verify(tx, admin, engine, adapter, staged)
            finally:
                await _unload(admin, engine, staged.name)
            record.verified.append(adapter.identity)
        await _load(admin, engine, adapter, path)


def _transient(exc: AdminError) -> bool:
    """An admin error the next pass retries: no answer, a 5xx, or a 409 of anything but
    the canary (an engine between states); a canary's 409 is its verdict (non-finite
    logits)."""
    if exc.no_answer or exc.status is None or exc.status >= 500:
        return True
    return exc.status == 409 and not exc.call.endswith("/v1/canary")


def _fail(tx: AdapterTransaction, engine: str, step: str, message: str, now: float
          ) -> list[Event]:
    tx.failure = Failure(engine, step, message)
    events = [Event("AdapterRefitFailed", f"adapters {describe(tx.target)}: engine {engine} "
                                          f"failed at {step}: {message}", warning=True)]
    if tx.on_failure is OnFailure.HALT:
        tx.phase, tx.finished_at = Phase.HALTED, now
        events.append(Event("AdapterRefitHalted", f"adapter change halted where it was: "
                                                  f"{message}", warning=True))
        return events
    tx.phase, tx.engines, tx.wave = Phase.ROLLING_BACK, {}, 0
    events.append(Event("AdapterRefitRollingBack", f"putting every engine back on "
                                                   f"{describe(tx.previous)}", warning=True))
    return events


async def advance(tx: AdapterTransaction, engines: list[AdapterObs], admin: EngineAdmin,
                  paths: Mapping[str, str], now: float) -> list[Event]:
    """One pass: start a wave when the last is done, move every engine of the wave (the
    engines of one wave at once), and finish when every engine is. `paths`: the folder
    each goal adapter's name loads from, as the engines see it. The events to post."""
    if tx.phase.finished:
        return []
    events: list[Event] = []
    if tx.wave == 0 and not tx.engines:
        events.append(Event("AdapterRefitStarted",
                            f"adapters {describe(tx.previous)} → {describe(tx.target)}"
                            if tx.phase is Phase.PROGRESSING else
                            f"adapters back to {describe(tx.previous)}"))
    off = lora_off(tx, engines)
    if off:
        return [*events, *_fail(tx, off[0], "LoRA", f"engine {off[0]} serves no LoRA adapters "
                                "(started without --enable-lora): set spec.engine.lora so "
                                "the pool's pods start with LoRA slots", now)]
    wave = choose_wave(tx, engines)
    if wave:
        tx.wave += 1
        for name in wave:
            tx.engines[name] = AdapterEngineRecord(since=now)
        events.append(Event("AdapterRefitWave", f"wave {tx.wave}: {', '.join(wave)} → "
                                                f"{describe(tx.goal)}"))
    moving = [e for e in engines if e.name in tx.engines and e.serving
              and (not done(tx, e) or leftovers(e))]
    results = await asyncio.gather(*(_move(tx, admin, e, paths) for e in moving),
                                   return_exceptions=True)
    for engine, result in zip(moving, results, strict=True):
        if isinstance(result, AdminError) and _transient(result):
            record = tx.engines[engine.name]
            record.last_error = result.message[:500]
            if now - record.since > tx.step_timeout:
                return [*events, *_fail(tx, engine.name, result.call, (
                    f"no progress in {tx.step_timeout:g} s; last: {result.message}"), now)]
            continue  # not answering, or busy: the next pass tries again
        if isinstance(result, AdminError | VerifyFailed):
            step = result.call if isinstance(result, AdminError) else "verify"
            message = result.message if isinstance(result, AdminError) else str(result)
            return [*events, *_fail(tx, engine.name, step, message, now)]
        if isinstance(result, BaseException):
            raise result
    if finished(tx, [e for e in engines if e.loras is not None]):
        rolled_back = tx.phase is Phase.ROLLING_BACK
        tx.phase = Phase.ROLLED_BACK if rolled_back else Phase.SUCCEEDED
        tx.finished_at = now
        took = f"{now - tx.started_at:.1f} s"
        events.append(Event("AdapterRefitRolledBack", f"every engine serves "
                                                      f"{describe(tx.previous)} again after "
                                                      f"{took}", warning=True)
                      if rolled_back else
                      Event("AdapterRefitSucceeded", f"every engine serves "
                                                     f"{describe(tx.target)}, verified, "
                                                     f"after {took}"))
    return events


def reopen(tx: AdapterTransaction, engines: list[AdapterObs], now: float) -> list[Event]:
    """A finished transaction holds while every engine serves its final set; an engine on
    another (a pod started before the change settled, adapters unloaded by hand) reopens
    it, and it joins the next wave."""
    if tx.phase not in (Phase.SUCCEEDED, Phase.ROLLED_BACK):
        return []
    strays = [e for e in engines if e.serving and e.loras is not None and not on_goal(tx, e)]
    if not strays:
        return []
    tx.phase = Phase.PROGRESSING if tx.phase is Phase.SUCCEEDED else Phase.ROLLING_BACK
    tx.finished_at = None
    for e in strays:
        tx.engines.pop(e.name, None)
    names = ", ".join(f"{e.name} ({', '.join(sorted(managed(tx, e))) or 'none'})"
                      for e in strays)
    return [Event("AdapterRefitResumed", f"{names} not on {describe(tx.goal)}: loading it")]
