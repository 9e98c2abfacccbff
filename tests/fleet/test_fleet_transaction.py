"""The refit transaction's pure rules (`tandem_engine.fleet.transaction`), without engines.

Each engine's next step is a function of what it reports; waves keep a prefill and a
decode engine serving on each version while both exist; the record survives a round
trip through the operator's status. No I/O, no sockets: milliseconds."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from tandem_engine.admin_wire import decode_status
from tandem_engine.fleet.orchestrator import advance, new_transaction, refit_body
from tandem_engine.fleet.transaction import (
    Act,
    EngineObs,
    EngineRecord,
    Failure,
    Phase,
    Transaction,
    choose_wave,
    finished_phase,
    held_by,
    next_act,
    retreats,
    suspend_mode,
)
from tandem_engine.lifecycle import TRANSIENT_STATES, EngineState, KVMode
from tandem_engine.refit_policy import InFlight, OnFailure, RefitStrategy
from tandem_engine.router.routing import EngineView, retired, serving_version
from tandem_engine.weights import WeightsRef

V1 = WeightsRef("file:///models/v1", "v1")
V2 = WeightsRef("file:///models/v2", "v2")
INFLIGHT = list(InFlight)
NOW = 1000.0
DRAIN_TIMEOUT = 60.0


def engine(name: str, role: str = "mixed", state: str | None = "RUNNING",
           version: str = "v1", *, draining: bool = False, busy: int = 0,
           epoch: int = 1) -> EngineObs:
    return EngineObs(name, role, f"http://{name}:9000", state, version, epoch, draining,
                     num_running=busy, uri=f"file:///models/{version}")


def tx_for(**options) -> Transaction:
    return Transaction(target=V2, previous=V1, epoch=2, **options)


# ---- next_act: one engine's next step ----------------------------------------------------------

# (state, on goal, draining, drain status) -> the act, for inflight Drain / Recompute.
# Drain status: "idle" (nothing in flight), "busy" (in flight, drain timeout not reached),
# "late" (in flight, drain timeout reached). Unlisted combinations: WAIT.
_RUNNING_TABLE: dict[tuple[bool, bool, str], tuple[Act, Act]] = {}
for _status in ("idle", "busy", "late"):
    _RUNNING_TABLE[(True, False, _status)] = (Act.DONE, Act.DONE)
    _RUNNING_TABLE[(True, True, _status)] = (Act.VERIFY, Act.VERIFY)
    _RUNNING_TABLE[(False, False, _status)] = (Act.DRAIN, Act.PAUSE)
_RUNNING_TABLE[(False, True, "idle")] = (Act.PAUSE, Act.PAUSE)
_RUNNING_TABLE[(False, True, "busy")] = (Act.WAIT, Act.WAIT)
_RUNNING_TABLE[(False, True, "late")] = (Act.PAUSE, Act.PAUSE)

_STABLE_TABLE = {  # (state, on goal) -> act, whatever the inflight mode
    ("PAUSED", True): Act.UNPAUSE, ("PAUSED", False): Act.SUSPEND,
    ("RESUMED", True): Act.UNPAUSE, ("RESUMED", False): Act.SUSPEND,
    ("SUSPENDED", True): Act.RESUME, ("SUSPENDED", False): Act.REFIT,
}


def _expected(state: str | None, on_goal: bool, draining: bool, status: str,
              inflight: str) -> Act:
    if state == "RUNNING":
        return _RUNNING_TABLE[(on_goal, draining, status)][INFLIGHT.index(inflight)]
    return _STABLE_TABLE.get((state, on_goal), Act.WAIT)


_STATES = [None, *(s.value for s in EngineState)]


@pytest.mark.parametrize(("state", "goal", "draining", "status", "inflight"), list(
    itertools.product(_STATES, ["on", "off", "halting"], [False, True],
                      ["idle", "busy", "late"], INFLIGHT)))
def test_next_act_for_every_combination(state: str | None, goal: str, draining: bool,
                                        status: str, inflight: str) -> None:
    version = "v2" if goal == "on" else "v1"
    obs = engine("e", state=state, version=version, draining=draining,
                 busy=0 if status == "idle" else 2)
    drained_at = NOW - (DRAIN_TIMEOUT + 1 if status == "late" else 5)
    record = EngineRecord(drained_at=drained_at if draining else None)
    act = next_act(obs, None if goal == "halting" else V2, inflight, record, DRAIN_TIMEOUT,
                   NOW)
    # While halting every engine is "on goal": it only has to serve again.
    assert act is _expected(state, goal != "off", draining, status, inflight), (
        state, goal, draining, status, inflight)


def test_transient_states_and_unreachable_engines_wait() -> None:
    assert {"LOADING", "PAUSING", "UNPAUSING", "SUSPENDING", "RESUMING",
            "STOPPING"} == TRANSIENT_STATES
    for state in [None, *TRANSIENT_STATES, "STOPPED"]:
        for version in ("v1", "v2"):
            assert next_act(engine("e", state=state, version=version), V2, InFlight.DRAIN,
                            EngineRecord(), DRAIN_TIMEOUT, NOW) is Act.WAIT


def test_drain_timeout_counts_from_when_the_drain_started() -> None:
    busy = engine("e", version="v1", draining=True, busy=3)
    started = EngineRecord(drained_at=NOW)
    assert next_act(busy, V2, InFlight.DRAIN, started, DRAIN_TIMEOUT, NOW + 59.9) is Act.WAIT
    assert next_act(busy, V2, InFlight.DRAIN, started, DRAIN_TIMEOUT, NOW + 60.0) is Act.PAUSE
    # A draining engine the record knows nothing of (a restarted operator lost the
    # moment): the timeout starts now, the engine is not cut short.
    assert next_act(busy, V2, InFlight.DRAIN, EngineRecord(), DRAIN_TIMEOUT, NOW + 1e6) is Act.WAIT
    waiting = EngineObs("e", "mixed", "http://e", "RUNNING", "v1", 1, True, 0, 1)
    assert next_act(waiting, V2, InFlight.DRAIN, started, DRAIN_TIMEOUT, NOW) is Act.WAIT


def test_a_refit_walks_one_engine_through_every_step() -> None:
    """Feeding each act's effect back in gives the documented order, for both modes."""
    effects = {Act.DRAIN: ("RUNNING", "v1", True), Act.PAUSE: ("PAUSED", "v1", False),
               Act.SUSPEND: ("SUSPENDED", "v1", False), Act.REFIT: ("SUSPENDED", "v2", False),
               Act.RESUME: ("RESUMED", "v2", False), Act.UNPAUSE: ("RUNNING", "v2", True),
               Act.VERIFY: ("RUNNING", "v2", False)}
    for inflight, order in ((InFlight.DRAIN, ["drain", "pause", "suspend", "refit", "resume",
                                              "unpause", "verify", "done"]),
                            (InFlight.RECOMPUTE, ["pause", "suspend", "refit", "resume",
                                                  "unpause", "verify", "done"])):
        obs, record, acts = engine("e"), EngineRecord(drained_at=NOW), []
        while not acts or acts[-1] is not Act.DONE:
            act = next_act(obs, V2, inflight, record, DRAIN_TIMEOUT, NOW)
            acts.append(act)
            if act is not Act.DONE:
                state, version, draining = effects[act]
                obs = engine("e", state=state, version=version, draining=draining)
        assert [str(a) for a in acts] == order


def test_suspend_mode_keeps_requests_only_when_needed() -> None:
    paused, busy = engine("e", state="PAUSED"), engine("e", state="PAUSED", busy=1)
    assert suspend_mode(paused, InFlight.DRAIN) is KVMode.PERSIST
    assert suspend_mode(busy, InFlight.DRAIN) is KVMode.RECOMPUTE
    assert suspend_mode(paused, InFlight.RECOMPUTE) is KVMode.RECOMPUTE


# ---- waves --------------------------------------------------------------------------------------


def pool(prefill: int, decode: int, mixed: int = 0, version: str = "v1") -> list[EngineObs]:
    names = ([(f"prefill-{i}", "prefill") for i in range(prefill)]
             + [(f"decode-{i}", "decode") for i in range(decode)]
             + [(f"engine-{i}", "mixed") for i in range(mixed)])
    return [engine(n, role, version=version) for n, role in names]


def finish_wave(tx: Transaction, engines: list[EngineObs], wave: list[str]) -> list[EngineObs]:
    """Record `wave` as started and put its engines on the goal, serving (what `advance`
    and the engines do between two waves)."""
    for name in wave:
        tx.engines[name] = EngineRecord(verified=True)
    return [engine(e.name, e.role, version=tx.goal.version) if e.name in wave else e
            for e in engines]


def all_waves(tx: Transaction, engines: list[EngineObs]) -> list[list[str]]:
    waves = []
    while wave := choose_wave(tx, engines):
        waves.append(wave)
        engines = finish_wave(tx, engines, wave)
        assert len(waves) < 20, waves
    assert all(e.version == tx.goal.version for e in engines)
    return waves


def serving_by_version(engines: list[EngineObs]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in engines:
        if e.serving:
            out.setdefault(e.version, set()).add(e.role)
    return out


def test_rolling_2p2d_max_unavailable_1_keeps_both_versions_whole() -> None:
    tx, engines = tx_for(max_unavailable=1), pool(2, 2)
    waves = all_waves(tx, engines)
    assert waves == [["decode-0", "prefill-0"], ["decode-1", "prefill-1"]]


def test_rolling_2p2d_max_unavailable_2_still_leaves_one_of_each_role_serving() -> None:
    tx, engines = tx_for(max_unavailable=2), pool(2, 2)
    first = choose_wave(tx, engines)
    assert first == ["decode-0", "prefill-0"]  # taking both of a role would leave v1 half
    away = [e for e in engines if e.name not in first]
    assert serving_by_version(away) == {"v1": {"prefill", "decode"}}
    assert all_waves(tx_for(max_unavailable=2), engines)[1:] == [["decode-1", "prefill-1"]]


def test_rolling_larger_pool_takes_max_unavailable_per_role() -> None:
    tx, engines = tx_for(max_unavailable=2), pool(4, 3)
    waves = all_waves(tx, engines)
    assert waves[0] == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert waves[1] == ["decode-2", "prefill-2", "prefill-3"]
    for wave in waves:  # never more than max_unavailable of one role at a time
        for role in ("prefill", "decode"):
            assert sum(n.startswith(role) for n in wave) <= 2


def test_every_rolling_wave_leaves_the_routed_version_a_prefill_and_a_decode() -> None:
    """While a wave is away, the version the router sends new requests to (the goal once
    one of its engines serves: it has the higher epoch; else the old one) keeps a prefill
    and a decode engine serving; the old version keeps serving until the goal can."""
    for prefill, decode, max_unavailable in itertools.product((2, 3, 5), (2, 4), (1, 2, 3)):
        tx, engines = tx_for(max_unavailable=max_unavailable), pool(prefill, decode)
        while wave := choose_wave(tx, engines):
            serving = serving_by_version([e for e in engines if e.name not in wave])
            routed = "v2" if "v2" in serving else "v1"
            assert serving[routed] == {"prefill", "decode"}, (prefill, decode, wave)
            engines = finish_wave(tx, engines, wave)


def test_1p1d_goes_anyway_one_of_each_role() -> None:
    """No wave keeps the invariant: the router waits out the short window."""
    tx, engines = tx_for(max_unavailable=1), pool(1, 1)
    assert all_waves(tx, engines) == [["decode-0", "prefill-0"]]


def test_mixed_only_pools() -> None:
    assert all_waves(tx_for(), pool(0, 0, 3)) == [["engine-0"], ["engine-1"], ["engine-2"]]
    assert all_waves(tx_for(max_unavailable=2), pool(0, 0, 3)) == [
        ["engine-0", "engine-1"], ["engine-2"]]
    assert all_waves(tx_for(max_unavailable=5), pool(0, 0, 2)) == [["engine-0"],
                                                                   ["engine-1"]]
    assert all_waves(tx_for(), pool(0, 0, 1)) == [["engine-0"]]  # a forced window


def test_all_at_once_takes_every_engine_not_on_the_goal() -> None:
    engines = pool(2, 2)
    engines[1] = engine("prefill-1", "prefill", version="v2")  # already there
    engines.append(engine("gone", "decode", state=None))  # unreachable: not planned
    tx = tx_for(strategy=RefitStrategy.ALL_AT_ONCE)
    assert choose_wave(tx, engines) == ["decode-0", "decode-1", "prefill-0"]


def test_no_wave_starts_while_one_is_in_progress() -> None:
    tx, engines = tx_for(), pool(2, 2)
    wave = choose_wave(tx, engines)
    for name in wave:
        tx.engines[name] = EngineRecord()
    for state, version, draining in (("RUNNING", "v1", True), ("PAUSED", "v1", False),
                                     ("SUSPENDED", "v2", False), ("RUNNING", "v2", True),
                                     (None, "v1", False)):
        mid = [engine(e.name, e.role, state, version, draining=draining)
               if e.name == wave[0] else e for e in engines]
        assert choose_wave(tx, mid) == [], (state, version, draining)
    # Serving the goal: the wave is done, the next one starts.
    done = [engine(e.name, e.role, version="v2") if e.name in wave else e for e in engines]
    assert choose_wave(tx, done) == ["decode-1", "prefill-1"]
    assert choose_wave(tx_for(), []) == []


def test_rollback_replans_waves_toward_the_previous_weights() -> None:
    tx, engines = tx_for(max_unavailable=1), pool(2, 2)
    engines = finish_wave(tx, engines, choose_wave(tx, engines))  # wave 1 on v2, verified
    # Wave 2 fails; the orchestrator turns around, forgetting the verified engines.
    tx.phase, tx.rollback_epoch = Phase.ROLLING_BACK, 3
    tx.failure = Failure("prefill-1", "POST /v1/refit", "HTTP 422: bad checkpoint")
    tx.engines = {"decode-1": EngineRecord(), "prefill-1": EngineRecord()}
    assert tx.goal == V1 and tx.goal_epoch == 3
    assert tx.goal_for(engines[0]) == V1
    # Wave 2's engines, back on v1, are settled; the v2 ones go back in waves that keep
    # v2 whole while it serves.
    assert choose_wave(tx, engines) == ["decode-0", "prefill-0"]
    tx.engines.clear()
    assert all_waves(tx, engines) == [["decode-0", "prefill-0"]]



# ---- a superseded refit: a third version in the fleet -------------------------------------------

V3 = WeightsRef("file:///models/v3", "v3")
EPOCHS = {"v1": 1, "v2": 2, "v3": 3}  # v2: the target of a refit that v3's superseded


def fleet(versions: dict[str, str]) -> list[EngineObs]:
    """Serving engines by name (prefill-*, decode-*) -> version, each under its epoch."""
    return [engine(n, n.split("-")[0], version=v, epoch=EPOCHS[v]) for n, v in versions.items()]


def routed(engines: list[EngineObs]) -> str | None:
    """The router's own rule over the same fleet (router/routing.py `serving_version`)."""
    return serving_version([EngineView(e.name, True, str(e.state), e.version, e.epoch, 0, 0,
                                       0.0, 0, 16, 512, e.draining) for e in engines])


def test_a_superseded_target_is_kept_like_the_previous_weights() -> None:
    """A refit to v2 was superseded by one to v3 after its first wave: v2 serves a prefill
    and a decode engine and, the newest epoch, gets the router's new requests. The wave
    takes the v1 pair, not v2's last engines: a v2 request between its prefill and its
    decode engine (or failing over) still finds a v2 engine to continue on."""
    tx = Transaction(target=V3, previous=V1, epoch=3, max_unavailable=1)
    engines = fleet({"prefill-0": "v2", "prefill-1": "v1", "decode-0": "v2", "decode-1": "v1"})
    assert routed(engines) == "v2"
    assert choose_wave(tx, engines) == ["decode-1", "prefill-1"]
    # v3 then serves both roles and gets the new requests: v2 goes like any old version.
    engines = fleet({"prefill-0": "v2", "prefill-1": "v3", "decode-0": "v2", "decode-1": "v3"})
    tx.engines = {"decode-1": EngineRecord(verified=True), "prefill-1": EngineRecord(verified=True)}
    assert routed(engines) == "v3"
    assert choose_wave(tx, engines) == ["decode-0", "prefill-0"]


def test_a_version_keeps_each_role_serving_until_the_goal_serves_that_role() -> None:
    """The first refit's wave was half done: v2 serves one prefill engine only."""
    tx = Transaction(target=V3, previous=V1, epoch=3, max_unavailable=2)
    engines = fleet({"prefill-0": "v2", "prefill-1": "v1", "decode-0": "v1", "decode-1": "v1"})
    assert choose_wave(tx, engines) == ["decode-0"]  # each version keeps its last prefill


@pytest.mark.parametrize(("prefill", "decode"), [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("max_unavailable", [1, 2])
def test_no_wave_takes_the_routed_versions_last_engine_of_a_role(
        prefill: int, decode: int, max_unavailable: int) -> None:
    """Every mix of v1 (previous), v2 (a superseded target) and v3 (the goal) over a pool
    with at least two engines per role: while a wave is away, the version new requests
    were just sent to keeps a serving engine of each role it had, until the goal serves
    that role; and the waves end with every engine on the goal."""
    names = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]
    for versions in itertools.product(("v1", "v2", "v3"), repeat=len(names)):
        tx = Transaction(target=V3, previous=V1, epoch=3, max_unavailable=max_unavailable)
        engines = fleet(dict(zip(names, versions, strict=True)))
        for _ in range(len(names) + 1):
            wave = choose_wave(tx, engines)
            if not wave:
                break
            before, left = routed(engines), [e for e in engines if e.name not in wave]
            for role in ("prefill", "decode"):
                had = [e for e in engines if e.role == role and e.version == before]
                on_goal = [e for e in engines if e.role == role and e.version == "v3"]
                if had and not on_goal:
                    assert any(e.role == role and e.version == before for e in left), (
                        versions, wave)
            for name in wave:
                tx.engines[name] = EngineRecord(verified=True)
            engines = [engine(e.name, e.role, version="v3", epoch=3) if e.name in wave else e
                       for e in engines]
        assert all(e.version == "v3" for e in engines), (versions, max_unavailable)


# ---- an engine away during a rolling refit ------------------------------------------------------


@pytest.mark.parametrize("away", [None, "LOADING"])
def test_no_wave_takes_the_last_reachable_engine_of_a_version_while_one_is_away(
        away: str | None) -> None:
    """engine-1 was killed (or is loading again): the requests it had fail over to v1's
    engines, of which engine-0 is the last reachable one. It is not taken, not even by
    the forced wave of a pool too small to keep the invariant; the wave waits for
    engine-1. Once it is back, the waves go as before."""
    tx = tx_for()
    engines = [engine("engine-0"), engine("engine-1", state=away)]
    assert choose_wave(tx, engines) == []
    assert held_by(tx, engines) == ["engine-1"]
    back = [engine("engine-0"), engine("engine-1")]
    assert choose_wave(tx, back) == ["engine-0"] and held_by(tx, back) == []
    # Where the goal serves already, v1's last engine is still kept while one is away.
    tx.engines["engine-0"] = EngineRecord(verified=True)
    engines = [engine("engine-0", version="v2", epoch=2), engine("engine-1"),
               engine("engine-2", state=away)]
    assert choose_wave(tx, engines) == [] and held_by(tx, engines) == ["engine-2"]
    assert choose_wave(tx, engines[:2]) == ["engine-1"]  # engine-2 left the fleet
    # Per role: the role with two v1 engines still gives one; the other keeps its last.
    tx = tx_for()
    engines = [*pool(2, 1), engine("decode-1", "decode", state=away)]
    assert choose_wave(tx, engines) == ["prefill-0"] and held_by(tx, engines) == []
    # A 1 prefill + 1 decode pool with its decode engine away: no forced window.
    engines = [engine("prefill-0", "prefill"), engine("decode-0", "decode", state=away)]
    assert choose_wave(tx, engines) == [] and held_by(tx, engines) == ["decode-0"]


def test_a_draining_engine_serves_again_when_it_is_the_last_of_its_version() -> None:
    """engine-0 was taken and is draining when engine-1 dies: engine-0 is given back to
    serving (the wave re-planned), so engine-1's requests have a v1 engine to continue on.
    An engine past its drain (paused), or one with another serving engine of its version
    and role, stays in the wave."""
    tx = tx_for()
    tx.engines["engine-0"] = EngineRecord(step="drain", since=NOW, drained_at=NOW)
    draining = engine("engine-0", draining=True, busy=2)
    assert retreats(tx, [draining, engine("engine-1", state=None)]) == ["engine-0"]
    assert retreats(tx, [draining, engine("engine-1")]) == []  # nobody is away
    assert retreats(tx, [engine("engine-0", state="PAUSED"), engine("engine-1", state=None)]
                    ) == []
    assert retreats(tx, [draining, engine("engine-1", state=None), engine("engine-2")]) == []
    verifying = engine("engine-0", version="v2", epoch=2, draining=True)
    assert retreats(tx, [verifying, engine("engine-1", state=None)]) == []


def test_advance_re_plans_then_waits_for_the_away_engine_then_fails_by_its_deadline() -> None:
    tx = tx_for(started_at=NOW, step_timeout=60.0)
    tx.wave = 1
    tx.engines["engine-0"] = EngineRecord(step="drain", since=NOW, drained_at=NOW)
    engines = [engine("engine-0", draining=True, busy=2), engine("engine-1", state=None)]
    admin = RecordingAdmin()
    events = asyncio.run(advance(tx, engines, admin, NOW + 1))
    assert admin.calls == [("engine-0", "/v1/undrain", None)]
    assert [e.reason for e in events] == ["RefitWaveReplanned", "RefitWaiting"], events
    assert "engine-1" in events[1].message and tx.engines == {} and tx.held_since == NOW + 1
    engines = [engine("engine-0"), engine("engine-1", state=None)]
    assert asyncio.run(advance(tx, engines, admin, NOW + 30)) == []  # still waiting
    assert tx.phase is Phase.PROGRESSING and admin.calls[1:] == []
    assert Transaction.from_dict(tx.to_dict()).held_since == NOW + 1
    # Back before the deadline: the wave goes, the hold is over.
    events = asyncio.run(advance(tx, [engine("engine-0"), engine("engine-1")], admin, NOW + 40))
    assert [e.reason for e in events] == ["RefitWave"] and tx.held_since is None
    # Away past the deadline: the transaction fails honestly (rolls back), naming it.
    tx = tx_for(started_at=NOW, step_timeout=60.0)
    asyncio.run(advance(tx, engines, admin, NOW))
    events = asyncio.run(advance(tx, engines, admin, NOW + 61))
    assert tx.phase is Phase.ROLLING_BACK and tx.failure is not None
    assert (tx.failure.engine, tx.failure.step) == ("engine-1", "wave")
    assert "unreachable or loading for 61 s" in tx.failure.message, tx.failure
    assert [e.reason for e in events] == ["RefitFailed"]
    assert finished_phase(tx, engines) is None  # never a success while it is away


def test_an_engine_that_dies_mid_call_is_no_refit_failure() -> None:
    """A call the engine never answered (killed, restarting) fails nothing: the next pass
    goes on from what the engine reports then, within the step's deadline; an engine that
    answers with an error still fails the refit."""
    from tandem_engine.fleet.admin import AdminError

    class DyingAdmin(RecordingAdmin):
        def __init__(self, **error: Any) -> None:
            super().__init__()
            self.error = error

        async def call(self, name: str, url: str, path: str, body: dict[str, Any] | None = None,
                       timeout: float | None = None) -> dict[str, Any]:
            await super().call(name, url, path, body, timeout)
            raise AdminError(name, f"POST {path}", "refused", **self.error)

    for error, reasons, phase in (({"no_answer": True}, ["RefitStepRetry"], Phase.PROGRESSING),
                                  ({"status": 422}, ["RefitFailed"], Phase.ROLLING_BACK)):
        tx = tx_for(started_at=NOW)
        tx.engines["engine-0"] = EngineRecord(step="pause", since=NOW)
        engines = [engine("engine-0", "mixed", "PAUSED"), engine("engine-1")]
        events = asyncio.run(advance(tx, engines, DyingAdmin(**error), NOW + 1))
        assert [e.reason for e in events] == reasons and tx.phase is phase, events
        assert tx.engines["engine-0"].since == NOW + (phase is Phase.ROLLING_BACK)


def test_a_retired_version_is_continued_on_the_serving_one() -> None:
    """The router's rule: a request with tokens of v1 waits for a v1 engine while any
    alive engine runs v1 (paused, suspended, draining, reconnected); once none does and v2
    serves, it continues on v2 by recompute rather than wait out the failover timeout."""
    def view(key: str, version: str, state: str = "RUNNING", alive: bool = True,
             draining: bool = False) -> EngineView:
        return EngineView(key, alive, state, version, {"v1": 1, "v2": 2}[version], 0, 0, 0.0,
                          0, 16, 512, draining)
    dead_v1, v2 = view("e1", "v1", alive=False), view("e0", "v2")
    assert retired([dead_v1, v2], "v1")
    assert not retired([dead_v1, v2], "v2")
    for holding in (view("e2", "v1", "SUSPENDED"), view("e2", "v1", draining=True),
                    view("e2", "v1", "PAUSED")):
        assert not retired([dead_v1, v2, holding], "v1"), holding
    assert retired([dead_v1, v2, view("e2", "v1", "STOPPING")], "v1")
    # Nothing serves (v2 verifying, or every engine away): wait, it may come back.
    assert not retired([dead_v1, view("e0", "v2", draining=True)], "v1")
    assert not retired([dead_v1], "v1")


def test_halting_targets_no_version() -> None:
    tx = tx_for(on_failure=OnFailure.HALT)
    tx.phase = Phase.HALTING
    assert tx.goal_for(engine("e", version="v1")) is None
    assert tx.goal == V2 and tx.goal_epoch == 2


# ---- the end of a transaction -------------------------------------------------------------------


def test_finished_phase() -> None:
    tx = tx_for()
    engines = pool(1, 1)
    assert finished_phase(tx, engines) is None
    on_target = pool(1, 1, version="v2")
    assert finished_phase(tx, on_target) is Phase.SUCCEEDED
    draining = [engine("prefill-0", "prefill", version="v2", draining=True), on_target[1]]
    assert finished_phase(tx, draining) is None  # not verified yet
    gone = [on_target[0], engine("decode-0", "decode", state=None, version="")]
    assert finished_phase(tx, gone) is None  # an engine that does not answer: not done
    tx.phase = Phase.ROLLING_BACK
    assert finished_phase(tx, engines) is Phase.ROLLED_BACK
    assert finished_phase(tx, on_target) is None
    tx.phase = Phase.HALTING
    tx.engines = {"prefill-0": EngineRecord()}
    mixed = [engine("prefill-0", "prefill", version="v2"), engine("decode-0", "decode")]
    assert finished_phase(tx, mixed) is Phase.HALTED  # serving, on whatever weights
    paused = [engine("prefill-0", "prefill", "PAUSED"), engine("decode-0", "decode")]
    assert finished_phase(tx, paused) is None
    assert all(p.finished for p in (Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.HALTED))
    assert not any(p.finished for p in (Phase.PROGRESSING, Phase.ROLLING_BACK,
                                        Phase.HALTING))


# ---- the record ---------------------------------------------------------------------------------


def test_transaction_round_trips_through_a_json_status() -> None:
    tx = Transaction(target=V2, previous=V1, epoch=7, strategy=RefitStrategy.ALL_AT_ONCE,
                     inflight=InFlight.RECOMPUTE, drain_timeout=30.0, on_failure=OnFailure.HALT,
                     max_unavailable=2, step_timeout=90.0, phase=Phase.HALTING, wave=3,
                     started_at=123.5, finished_at=None,
                     engines={"decode-0": EngineRecord("refit", 124.0, "v1", 123.6, False),
                              "prefill-0": EngineRecord("verify", 125.0, "v2", None, True)},
                     canary={"v2": [5, 6, 7, 8]},
                     failure=Failure("decode-0", "POST /v1/refit", "HTTP 422: bad"),
                     rollback_epoch=None, target_draft="file:///drafts/v2",
                     previous_draft="file:///drafts/v1")
    record = tx.to_dict()
    # Plain strings, the CRD's CamelCase words, whatever serialises the status.
    assert [type(record[k]) for k in ("phase", "strategy", "inflight", "on_failure")] == [str] * 4
    status = json.loads(json.dumps(record))  # what the pool's status holds
    assert status["phase"] == "Halting" and status["target"] == V2.to_dict()
    assert (status["strategy"], status["inflight"], status["on_failure"]) == (
        "AllAtOnce", "Recompute", "Halt")
    back = Transaction.from_dict(status)
    assert back == tx
    assert back.phase is Phase.HALTING and isinstance(back.engines["decode-0"], EngineRecord)
    # A status written by a newer operator may carry fields this one does not know.
    assert Transaction.from_dict({**status, "somethingNew": 1}) == tx
    minimal = Transaction.from_dict({"target": V2.to_dict(), "previous": V1.to_dict(),
                                     "epoch": 2})
    assert minimal == tx_for() and minimal.failure is None and minimal.engines == {}


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("strategy", "BlueGreen", "Rolling, AllAtOnce"),
    ("inflight", "drain", "Drain, Recompute"),
    ("on_failure", "Retry", "Rollback, Halt"),
])
def test_bad_options_are_refused_by_name(field: str, value: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        tx_for(**{field: value})
    assert str(info.value) == f"refit {field} {value!r} is not one of {allowed}"
    with pytest.raises(ValueError, match=field):
        Transaction.from_dict({**tx_for().to_dict(), field: value})


def test_engine_observation_from_the_admin_state() -> None:
    state = {"state": "RUNNING", "weight_version": "v2", "weight_epoch": 4, "draining": True,
             "num_running": 2, "num_waiting": 1, "weight_uri": "file:///models/v2"}
    obs = EngineObs.from_state("decode-0", "decode", "http://d:9", decode_status(state))
    assert obs == EngineObs("decode-0", "decode", "http://d:9", "RUNNING", "v2", 4, True, 2, 1,
                            "file:///models/v2")
    assert obs.state is EngineState.RUNNING and not obs.serving
    gone = EngineObs.from_state("decode-0", "decode", "http://d:9", None)
    assert gone.state is None and not gone.serving


def test_the_unavailable_window_adds_up_the_time_no_engine_served() -> None:
    from tandem_engine.fleet.orchestrator import _track_window

    tx = Transaction(target=WeightsRef("file:///v2", "v2"),
                     previous=WeightsRef("file:///v1", "v1"), epoch=1,
                     strategy=RefitStrategy.ALL_AT_ONCE)
    serving = EngineObs("e0", "mixed", "http://e0", "RUNNING", "v1")
    paused = EngineObs("e0", "mixed", "http://e0", "PAUSED", "v1")
    verifying = EngineObs("e0", "mixed", "http://e0", "RUNNING", "v2", draining=True)
    for now, engine in ((10.0, serving), (11.0, paused), (12.5, verifying),
                        (14.0, serving), (20.0, paused), (20.5, serving)):
        _track_window(tx, [engine], now)
    assert tx.unavailable_seconds == (14.0 - 11.0) + (20.5 - 20.0) and tx.dark_since is None
    assert Transaction.from_dict(tx.to_dict()).unavailable_seconds == 3.5


# ---- the refit call: the draft checkpoint travels with the weights ------------------------------

D1, D2 = "file:///drafts/v1", "file:///drafts/v2"


class RecordingAdmin:
    """The admin client as `advance` uses it: every call recorded, every call answered."""

    refit_timeout = 600.0

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any] | None]] = []

    async def call(self, name: str, url: str, path: str, body: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        self.calls.append((name, path, body))
        return {}


@pytest.mark.parametrize(("phase", "on", "goal", "epoch", "draft"), [
    (Phase.PROGRESSING, "v1", V2, 2, D2),
    (Phase.ROLLING_BACK, "v2", V1, 3, D1),  # the rollback reloads the previous draft
])
def test_the_refit_body_carries_the_goals_draft(phase: Phase, on: str, goal: WeightsRef,
                                                 epoch: int, draft: str) -> None:
    tx = tx_for(phase=phase, rollback_epoch=3, started_at=NOW, low_memory=True,
                target_draft=D2, previous_draft=D1)
    tx.engines["decode-0"] = EngineRecord(since=NOW)
    admin = RecordingAdmin()
    asyncio.run(advance(tx, [engine("decode-0", "decode", "SUSPENDED", on)], admin, NOW))
    assert admin.calls == [("decode-0", "/v1/refit", {
        "uri": goal.uri, "version": goal.version, "epoch": epoch, "low_memory": True,
        "draft_uri": draft})]


def test_a_refit_without_a_draft_sends_the_body_it_always_did() -> None:
    assert refit_body(tx_for(), V2) == {"uri": V2.uri, "version": "v2", "epoch": 2,
                                       "low_memory": False}
    # A rollback to weights that had no draft names none either.
    back = tx_for(phase=Phase.ROLLING_BACK, rollback_epoch=3, target_draft=D2)
    assert "draft_uri" not in refit_body(back, V1)
    assert back.goal_draft is None and tx_for(target_draft=D2).goal_draft == D2


def test_a_local_transaction_may_name_the_drafts() -> None:
    tx = new_transaction(V2, pool(1, 1), target_draft=D2, previous_draft=D1)
    assert (tx.target_draft, tx.previous_draft, tx.goal_draft) == (D2, D1, D2)
