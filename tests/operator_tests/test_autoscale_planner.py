"""The autoscaling planner (`tandem_operator.autoscale.decide`): metrics and spec in, the
targets per role out, as a table of scenarios, then the time-dependent rules (stabilization,
no flapping) as sequences of decisions."""

from __future__ import annotations

import pytest
from tandem_operator.autoscale import (
    SLO,
    Autoscaling,
    AutoscalingError,
    Bounds,
    History,
    Observation,
    RoleLoad,
    decide,
)

SPEC = Autoscaling(SLO(ttft_seconds=1.0, itl_seconds=0.1, kv_usage_ceiling=0.9,
                       queue_depth=4),
                   prefill=Bounds(1, 4), decode=Bounds(1, 6),
                   scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=0)


def obs(p: int = 2, d: int = 2, ttft: float | None = 0.7, itl: float | None = 0.07, *,
        refit: bool = False, rollout: bool = False, **loads: float) -> Observation:
    """An observation in the hysteresis band unless told otherwise; `loads` sets RoleLoad
    fields as prefill_<field> / decode_<field>."""
    def role(name: str, replicas: int) -> RoleLoad:
        fields = {k.split("_", 1)[1]: v for k, v in loads.items() if k.startswith(name + "_")}
        return RoleLoad(replicas, **fields)
    return Observation(role("prefill", p), role("decode", d), ttft, itl, refit, rollout)


def targets(spec: Autoscaling, o: Observation) -> tuple[int, int]:
    decision = decide(spec, o, History(), now=1000.0)
    return decision.prefill.target, decision.decode.target


@pytest.mark.parametrize("what,spec,observation,want", [
    ("in the band: nothing moves", SPEC, obs(), (2, 2)),
    ("TTFT over its bound: prefill up", SPEC, obs(ttft=1.5), (3, 2)),
    ("ITL over its bound: decode up", SPEC, obs(itl=0.2), (2, 3)),
    ("KV usage over the ceiling: decode up", SPEC, obs(decode_kv_usage=0.95), (2, 3)),
    ("prefill queue over its bound: prefill up", SPEC, obs(prefill_queue_depth=9), (3, 2)),
    ("both SLOs comfortably met: both down one", SPEC, obs(ttft=0.2, itl=0.02), (1, 1)),
    ("never below minReplicas", SPEC, obs(p=1, d=1, ttft=0.1, itl=0.01), (1, 1)),
    ("never above maxReplicas", SPEC, obs(p=4, d=6, ttft=9, itl=9), (4, 6)),
    ("a measured capacity sizes the step, within maxStep",
     Autoscaling(SPEC.slo, SPEC.prefill, Bounds(1, 8), scale_up_stabilization_seconds=0,
                 scale_down_stabilization_seconds=0, max_step=3),
     obs(itl=0.3, decode_demand=700, decode_capacity=100), (2, 5)),
    ("met with room and a capacity: down towards the demand, one step",
     SPEC, obs(d=4, ttft=0.2, itl=0.02, decode_demand=100, decode_capacity=100), (1, 3)),
    ("met with room, but one engine fewer would run over 60% of its capacity: hold",
     SPEC, obs(d=2, ttft=0.2, itl=0.01, decode_demand=130, decode_capacity=100), (1, 2)),
    ("met with room but demand fills the engines: hold",
     SPEC, obs(d=3, ttft=0.7, itl=0.02, decode_demand=290, decode_capacity=100), (2, 3)),
    ("a draining engine: no further scale-down", SPEC,
     obs(ttft=0.2, itl=0.02, decode_draining=1), (1, 2)),
    ("a refit running: no scale-down", SPEC, obs(ttft=0.2, itl=0.02, refit=True), (2, 2)),
    ("violated while the last scale-up still starts: wait for it", SPEC,
     obs(itl=0.2, decode_starting=1), (2, 2)),
    ("violated with a starting engine but a measured need: up to the need", SPEC,
     obs(itl=0.2, decode_starting=1, decode_demand=400, decode_capacity=100), (2, 3)),
    ("a refit running: scale-up still happens", SPEC, obs(ttft=2, refit=True), (3, 2)),
    ("a rollout: the targets count desired engines, surge pods apart", SPEC,
     obs(ttft=2, rollout=True), (3, 2)),
    ("ratio band: decode follows prefill up",
     Autoscaling(SPEC.slo, SPEC.prefill, SPEC.decode, scale_up_stabilization_seconds=0,
                 scale_down_stabilization_seconds=0, min_decode_per_prefill=1.0,
                 max_decode_per_prefill=2.0),
     obs(p=2, d=2, ttft=2), (3, 3)),
    ("ratio band: decode at its maxReplicas holds prefill back",
     Autoscaling(SPEC.slo, SPEC.prefill, Bounds(1, 2), scale_up_stabilization_seconds=0,
                 scale_down_stabilization_seconds=0, min_decode_per_prefill=1.0),
     obs(p=2, d=2, ttft=2), (2, 2)),
])
def test_a_decision_per_scenario(what: str, spec: Autoscaling, observation: Observation,
                                 want: tuple[int, int]) -> None:
    assert targets(spec, observation) == want, what


def test_the_reason_names_the_violated_slo() -> None:
    d = decide(SPEC, obs(ttft=1.5, decode_kv_usage=0.95), History(), now=0.0)
    assert "p90 TTFT 1.500 s > 1 s" in d.prefill.reason
    assert "KV usage 95% > 90%" in d.decode.reason
    assert (d.prefill.current, d.prefill.target, d.prefill.changed) == (2, 3, True)


def test_a_short_spike_does_not_scale_up_and_a_lasting_one_does() -> None:
    spec = Autoscaling(SPEC.slo, SPEC.prefill, SPEC.decode, scale_up_stabilization_seconds=30,
                       scale_down_stabilization_seconds=300)
    history = History()
    seen = []
    for now, ttft in [(0, 0.7), (10, 1.5), (20, 0.7), (30, 1.5), (40, 1.5), (50, 1.5),
                      (60, 1.5)]:
        d = decide(spec, obs(ttft=ttft), history, now=now)
        history = d.history
        seen.append(d.prefill.target)
    # the spike at 10 s is gone by 20 s; from 30 s on TTFT stays over: up once every
    # recommendation of the last 30 s asks for more (the 20 s one is out at 50 s)
    assert seen == [2, 2, 2, 2, 2, 3, 3]


def test_a_dip_scales_down_only_after_the_scale_down_window() -> None:
    spec = Autoscaling(SPEC.slo, SPEC.prefill, SPEC.decode, scale_up_stabilization_seconds=0,
                       scale_down_stabilization_seconds=120)
    history = History()
    seen = []
    for now in range(0, 200, 20):
        d = decide(spec, obs(ttft=0.2 if now else 0.7, itl=0.07), history, now=float(now))
        history = d.history
        seen.append(d.prefill.target)
    # comfortable from 20 s: the 0 s recommendation (hold at 2) is the highest until it is
    # out of the 120 s window
    assert seen == [2, 2, 2, 2, 2, 2, 1, 1, 1, 1]


def test_load_alternating_every_decision_does_not_flap() -> None:
    spec = Autoscaling(SPEC.slo, SPEC.prefill, SPEC.decode, scale_up_stabilization_seconds=30,
                       scale_down_stabilization_seconds=120)
    history = History()
    replicas, changes = 2, 0
    for i in range(40):
        ttft = 1.4 if i % 2 else 0.2  # over the bound, then comfortably under
        d = decide(spec, obs(p=replicas, ttft=ttft), history, now=10.0 * i)
        history = d.history
        changes += d.prefill.target != replicas
        replicas = d.prefill.target
    assert changes == 0


def test_the_history_keeps_only_what_the_windows_need() -> None:
    spec = Autoscaling(SPEC.slo, scale_up_stabilization_seconds=30,
                       scale_down_stabilization_seconds=60)
    history = History()
    for now in range(0, 500, 10):
        history = decide(spec, obs(), history, now=float(now)).history
    assert [t for t, _ in history.prefill] == [440, 450, 460, 470, 480, 490]


@pytest.mark.parametrize("spec,field", [
    (Autoscaling(SLO(1, 0.1), prefill=Bounds(0, 2)), "spec.autoscaling.prefill"),
    (Autoscaling(SLO(1, 0.1), decode=Bounds(3, 2)), "spec.autoscaling.decode"),
    (Autoscaling(SLO(0, 0.1)), "spec.autoscaling.slo.ttftSeconds"),
    (Autoscaling(SLO(1, 0.1, percentile=1.0)), "spec.autoscaling.slo.percentile"),
    (Autoscaling(SLO(1, 0.1, kv_usage_ceiling=1.5)), "spec.autoscaling.slo.kvUsageCeiling"),
    (Autoscaling(SLO(1, 0.1), window_seconds=1), "spec.autoscaling.window"),
    (Autoscaling(SLO(1, 0.1), max_step=0), "spec.autoscaling.maxStep"),
    (Autoscaling(SLO(1, 0.1), min_decode_per_prefill=3, max_decode_per_prefill=2),
     "spec.autoscaling.ratio"),
])
def test_a_bad_spec_names_its_field_and_the_limit(spec: Autoscaling, field: str) -> None:
    with pytest.raises(AutoscalingError, match=field.replace(".", r"\.")) as info:
        spec.check()
    assert "must" in str(info.value)


def test_the_defaults_pass_their_own_check() -> None:
    assert Autoscaling(SLO(1, 0.1)).check() == Autoscaling(SLO(1, 0.1))
