"""A fleet-wide refit as data: the transaction record and the pure rules that move it.

One refit changes every engine of a pool (or of a local stack) to new weights in place:
pause → drain → suspend → refit → resume → verify → unpause, engine by engine in waves
(`Rolling`) or all together (`AllAtOnce`). Everything here is pure and torch-free: the
operator and `tandem refit` both call it, and the record (`Transaction.to_dict`) is what
the operator keeps in the pool's status, so a restarted operator continues exactly where
the last one stopped.

Each engine's next step is a function of what the engine reports (state, weight version,
draining) and the goal, never of remembered progress — so a step that was taken but not
recorded is simply not taken again. What is recorded per engine is only when its current
step started (for deadlines and the drain timeout), its verification, and failures.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem_engine.admin_wire import EngineStatus, RefitRequest
from tandem_engine.fleet.verify import DEFAULT_MIN_UNCERTAINTY_RATIO, CanaryReading
from tandem_engine.lifecycle import TRANSIENT_STATES, EngineState, KVMode
from tandem_engine.refit_policy import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_UNAVAILABLE,
    InFlight,
    OnFailure,
    RefitStrategy,
    choices,
)
from tandem_engine.weights import WeightsRef


class Phase(str, enum.Enum):
    PROGRESSING = "Progressing"  # moving every engine to the target
    ROLLING_BACK = "RollingBack"  # a failure: moving every engine back to the previous weights
    HALTING = "Halting"  # a failure with onFailure Halt: bringing touched engines back to serving
    SUCCEEDED = "Succeeded"
    ROLLED_BACK = "RolledBack"
    HALTED = "Halted"

    def __str__(self) -> str:
        return self.value

    @property
    def finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.HALTED)


class Act(str, enum.Enum):
    """What to do to one engine now (one admin API call, or nothing yet)."""

    DRAIN = "drain"  # stop admitting new requests; in-flight ones finish
    PAUSE = "pause"
    SUSPEND = "suspend"
    REFIT = "refit"
    RESUME = "resume"
    UNPAUSE = "unpause"  # still draining: no router traffic until verified
    VERIFY = "verify"  # canary generation, then undrain
    WAIT = "wait"  # a transition in progress, a drain not done, an unreachable engine
    DONE = "done"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class EngineObs:
    """One engine as observed now (`GET /v1/state` of its admin API)."""

    name: str  # unique in the fleet: the pod name, or the local engine id
    role: str  # prefill, decode or mixed
    admin_url: str
    state: EngineState | None  # None when the engine does not answer
    version: str = ""
    epoch: int = 0
    draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    uri: str = ""

    def __post_init__(self) -> None:
        if self.state is not None:  # the admin API's JSON gives the name as a plain str
            object.__setattr__(self, "state", EngineState(self.state))

    @property
    def serving(self) -> bool:
        return self.state is EngineState.RUNNING and not self.draining

    @classmethod
    def from_state(cls, name: str, role: str, admin_url: str,
                   status: EngineStatus | None) -> EngineObs:
        """What the engine's `GET /v1/state` says (None: it does not answer)."""
        if status is None:
            return cls(name, role, admin_url, None)
        return cls(name, role, admin_url, status.state, status.weight_version,
                   status.weight_epoch, status.draining, status.num_running,
                   status.num_waiting, status.weight_uri)


@dataclass
class EngineRecord:
    """What the transaction remembers of one engine it touched."""

    step: str = ""  # the last Act taken
    since: float = 0.0  # when that step was taken (wall clock, seconds)
    version: str = ""  # the engine's version when last observed
    drained_at: float | None = None  # when it started draining (Drain mode)
    verified: bool = False


@dataclass
class Failure:
    engine: str
    step: str
    message: str


@dataclass
class Transaction:
    """A refit of a fleet from `previous` to `target`; `epoch` numbers it pool-wide."""

    target: WeightsRef
    previous: WeightsRef
    epoch: int
    strategy: RefitStrategy = RefitStrategy.ROLLING
    inflight: InFlight = InFlight.DRAIN
    drain_timeout: float = float(DEFAULT_DRAIN_TIMEOUT_S)
    on_failure: OnFailure = OnFailure.ROLLBACK
    max_unavailable: int = DEFAULT_MAX_UNAVAILABLE
    step_timeout: float = 300.0  # any one step of one engine (beyond the drain)
    phase: Phase = Phase.PROGRESSING
    wave: int = 0
    started_at: float = 0.0
    finished_at: float | None = None
    engines: dict[str, EngineRecord] = field(default_factory=dict)
    canary: dict[str, list[int]] = field(default_factory=dict)  # version -> tokens
    # The previous weights' canary, read before any engine is touched (fleet/verify.py),
    # and the perplexity factor a refitted engine may not exceed over it (None: no check),
    # and the least fraction of its uncertainty it must keep while fitting worse (0: none).
    baseline: CanaryReading | None = None
    max_perplexity_ratio: float | None = None
    min_uncertainty_ratio: float = DEFAULT_MIN_UNCERTAINTY_RATIO
    # Stream the new weights into the serving ones tensor by tensor (the engine's
    # `low_memory`, spec.refit.lowMemory): peak memory 1x the weights plus one tensor
    # instead of old + new, but a load that fails midway leaves that engine's weights
    # mixed, so its rollback reloads the previous checkpoint rather than keeping it.
    low_memory: bool = False
    # The draft checkpoints (speculative method draft) that go with `target` and with
    # `previous`: each engine's refit reloads the goal's draft with the goal's weights, so a
    # rollback restores the previous draft too. None: the refit names no draft (the engine
    # keeps whatever draft it has, or runs none).
    target_draft: str | None = None
    previous_draft: str | None = None
    failure: Failure | None = None
    rollback_epoch: int | None = None
    # The fleet's unavailable window: when no engine served new requests (AllAtOnce, or a
    # 1 prefill + 1 decode pool), as seen by the passes.
    dark_since: float | None = None
    unavailable_seconds: float = 0.0
    # Since when the next wave waits for an absent engine (`held_by`); a wait longer than
    # `step_timeout` fails the transaction rather than strand a version's requests.
    held_since: float | None = None

    def __post_init__(self) -> None:
        for name, kind in (("strategy", RefitStrategy), ("inflight", InFlight),
                           ("on_failure", OnFailure)):
            value = getattr(self, name)
            try:
                setattr(self, name, kind(value))
            except ValueError:
                raise ValueError(f"refit {name} {value!r} is not one of "
                                 f"{', '.join(choices(kind))}") from None
        self.phase = Phase(self.phase)

    # ---- where it is going ---------------------------------------------------------------------

    @property
    def goal(self) -> WeightsRef:
        return self.previous if self.phase is Phase.ROLLING_BACK else self.target

    @property
    def goal_draft(self) -> str | None:
        """The draft checkpoint URI loaded with `goal`."""
        return self.previous_draft if self.phase is Phase.ROLLING_BACK else self.target_draft

    @property
    def goal_epoch(self) -> int:
        if self.phase is Phase.ROLLING_BACK and self.rollback_epoch is not None:
            return self.rollback_epoch
        return self.epoch

    def goal_for(self, engine: EngineObs) -> WeightsRef | None:
        """The weights `engine` must end on; while halting, whatever it has (it only has
        to serve again)."""
        if self.phase is Phase.HALTING:
            return None
        return self.goal

    def refit_request(self, goal: WeightsRef) -> RefitRequest:
        """The `/v1/refit` that moves an engine to `goal`: under the goal's epoch, with the
        goal's draft checkpoint (None when the transaction names none)."""
        return RefitRequest(uri=goal.uri, version=goal.version, epoch=self.goal_epoch,
                            low_memory=self.low_memory, draft_uri=self.goal_draft)

    # ---- persistence (the operator's status.refit) -----------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("phase", "strategy", "inflight", "on_failure"):
            data[name] = str(data[name])  # plain strings in the pool's status
        data["target"], data["previous"] = self.target.to_dict(), self.previous.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transaction:
        data = dict(data)
        data["target"] = WeightsRef.from_dict(data["target"])
        data["previous"] = WeightsRef.from_dict(data["previous"])
        data["engines"] = {k: EngineRecord(**v) for k, v in (data.get("engines") or {}).items()}
        failure = data.get("failure")
        data["failure"] = Failure(**failure) if failure else None
        data["canary"] = {k: list(v) for k, v in (data.get("canary") or {}).items()}
        baseline = data.get("baseline")
        data["baseline"] = CanaryReading.from_dict(baseline) if baseline else None
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


# ---- one engine ---------------------------------------------------------------------------------


def next_act(engine: EngineObs, goal: WeightsRef | None, inflight: InFlight,
             record: EngineRecord, drain_timeout: float, now: float) -> Act:
    """The next step for `engine` toward serving `goal` (None: toward serving whatever it
    has). Decided from what the engine reports, so repeating it after a crash is safe."""
    state, on_goal = engine.state, goal is None or engine.version == goal.version
    if state is None or state in TRANSIENT_STATES:
        return Act.WAIT  # unreachable, loading, or a transition (PAUSING, ...) under way
    if state is EngineState.RUNNING:
        if on_goal:
            if not engine.draining:
                return Act.DONE
            return Act.VERIFY  # refitted and unpaused, still refusing traffic
        if not engine.draining:
            return Act.DRAIN if inflight == InFlight.DRAIN else Act.PAUSE
        drained = engine.num_running + engine.num_waiting == 0
        started = record.drained_at if record.drained_at is not None else now
        return Act.PAUSE if drained or now - started >= drain_timeout else Act.WAIT
    if state in (EngineState.PAUSED, EngineState.RESUMED):
        return Act.UNPAUSE if on_goal else Act.SUSPEND
    if state is EngineState.SUSPENDED:
        return Act.RESUME if on_goal else Act.REFIT
    return Act.WAIT  # STOPPED: the engine is leaving; the fleet no longer counts it


def suspend_mode(engine: EngineObs, inflight: InFlight) -> KVMode:
    """Recompute keeps in-flight requests (they finish on the new weights); a drained
    engine has none, so its KV stays where it is."""
    busy = engine.num_running + engine.num_waiting > 0
    return KVMode.RECOMPUTE if inflight == InFlight.RECOMPUTE or busy else KVMode.PERSIST


# ---- waves --------------------------------------------------------------------------------------


def choose_wave(tx: Transaction, engines: list[EngineObs]) -> list[str]:
    """Engines to start now (none while a wave is in progress).

    Rolling: up to `max_unavailable` per role, prefill and decode together, never taking
    the last serving engine of a role from any version behind the goal — the previous
    weights, or the target of a superseded refit (`intermediate` weights some engines were
    verified on) — while the goal has no serving engine of that role. So every version
    keeps a prefill and a decode serving while it serves: requests that already have
    tokens of a version continue only on an engine of it, and an intermediate version may
    be the one the router sends new requests to (the newest epoch that serves). Older
    versions go first. When no wave keeps that (a 1 prefill + 1 decode pool), the smallest
    wave that makes progress goes anyway, sparing the version routed to when another can
    go: the router waits out the short window instead of failing.
    While an engine is away (`absent`: unreachable or loading again), the requests it had
    fail over to engines of their own version, which it may have been the only other one
    of: then every version keeps its last reachable serving engine of each role, even
    where the goal serves that role, and no forced wave goes; the wave waits for the
    engine (`held_by`, bounded by the step timeout in the orchestrator).
    AllAtOnce: every engine not on the goal."""
    goal = tx.goal
    behind = [e for e in engines if e.state is not None and e.version != goal.version
              and e.name not in tx.engines]
    if not behind or any(not _settled(tx, e) for e in engines if e.name in tx.engines):
        return []
    if tx.strategy == RefitStrategy.ALL_AT_ONCE:
        return sorted(e.name for e in behind)
    missing = bool(absent(engines))
    epochs = version_epochs(engines)

    def oldest_first(e: EngineObs) -> tuple[int, str]:
        return epochs.get(e.version, e.epoch), e.name

    wave: list[str] = []
    roles = sorted({e.role for e in behind})
    for role in roles:
        goal_serving = not missing and any(
            e.role == role and e.serving and e.version == goal.version for e in engines)
        takeable: list[EngineObs] = []
        for version in sorted({e.version for e in behind if e.role == role}):
            same = sorted((e for e in behind if e.role == role and e.version == version
                           and e.serving), key=lambda e: e.name)
            takeable += same if goal_serving else same[:-1]  # its last one serves on
        takeable.sort(key=oldest_first)
        wave += [e.name for e in takeable[:max(1, tx.max_unavailable)]]
    if not wave and not missing:  # nothing keeps the invariant: the smallest wave that
        # makes progress
        forced = [min((e for e in behind if e.role == role), key=oldest_first)
                  for role in roles]
        routed = routed_version(engines)
        spared = [e for e in forced if e.version != routed]
        wave = [e.name for e in spared or forced]
    return wave


def absent(engines: list[EngineObs]) -> list[EngineObs]:
    """Engines that serve nothing now but belong to the fleet: unreachable (killed,
    restarting) or loading again. Their requests are failing over to the others."""
    return [e for e in engines if e.state is None or e.state is EngineState.LOADING]


def held_by(tx: Transaction, engines: list[EngineObs]) -> list[str]:
    """The absent engines the next wave waits for: engines are behind, no wave is under
    way, and none of them can go without taking the last reachable engine of its version
    and role. Empty when a wave can start, or when nothing is left to start."""
    if tx.phase not in (Phase.PROGRESSING, Phase.ROLLING_BACK) or choose_wave(tx, engines):
        return []
    missing = absent(engines)
    behind = [e for e in engines if e.state is not None and e.version != tx.goal.version
              and e.name not in tx.engines]
    if not behind or any(not _settled(tx, e) for e in engines if e.name in tx.engines):
        return []
    return sorted(e.name for e in missing)


def retreats(tx: Transaction, engines: list[EngineObs]) -> list[str]:
    """Engines of the wave to give back to serving now: while another engine is absent,
    one still only draining (RUNNING, off the goal) that is the last reachable engine of
    its version and role, the one the absent engine's requests can continue on. The wave
    is re-planned: `choose_wave` takes it again once the absent engine is back."""
    if tx.phase not in (Phase.PROGRESSING, Phase.ROLLING_BACK) or not absent(engines):
        return []
    kept: set[str] = {e.name for e in engines if e.serving}
    out: list[str] = []
    for e in sorted(engines, key=lambda e: e.name):
        record = tx.engines.get(e.name)
        if (record is None or record.verified or e.state is not EngineState.RUNNING
                or not e.draining or e.version == tx.goal.version):
            continue
        if not any(o.name in kept and o.role == e.role and o.version == e.version
                   for o in engines):
            out.append(e.name)
            kept.add(e.name)
    return out


def version_epochs(engines: list[EngineObs]) -> dict[str, int]:
    """Each weight version's newest epoch among the engines serving it."""
    epochs: dict[str, int] = {}
    for e in engines:
        if e.serving:
            epochs[e.version] = max(epochs.get(e.version, -1), e.epoch)
    return epochs


def routed_version(engines: list[EngineObs]) -> str | None:
    """The version routers send new requests to: the same rule as the router's
    `routing.serving_version` (the newest epoch among serving engines; ties to the
    version with more of them, then the larger name), over the admin API's view."""
    epochs = version_epochs(engines)
    counts = {v: sum(1 for e in engines if e.serving and e.version == v) for v in epochs}
    return max(epochs, key=lambda v: (epochs[v], counts[v], v)) if epochs else None


def _settled(tx: Transaction, engine: EngineObs) -> bool:
    """Whether a touched engine is done (serving its goal)."""
    goal = tx.goal_for(engine)
    return engine.serving and (goal is None or engine.version == goal.version)


def finished_phase(tx: Transaction, engines: list[EngineObs]) -> Phase | None:
    """The phase the transaction ends in, once every engine is where it must be."""
    if tx.phase is Phase.HALTING:
        touched = [e for e in engines if e.name in tx.engines]
        return Phase.HALTED if all(e.serving for e in touched) else None
    goal = tx.goal
    live = [e for e in engines if e.state is not None]
    if live and all(e.serving and e.version == goal.version for e in live) and len(
            live) == len(engines):
        return Phase.ROLLED_BACK if tx.phase is Phase.ROLLING_BACK else Phase.SUCCEEDED
    return None
