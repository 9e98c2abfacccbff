"""The planner with rollouts and refits: one test per row of the table in
docs/architecture.md ("Autoscaling: with rollouts and refits"). The planner's target is
written into the spec's replicas, so each row is the planner's decision (`decide` on the
`observation` the operator builds) followed by the plan that carries it out (`plan`)."""

from __future__ import annotations

from dataclasses import replace

from tandem_operator import manifests as m
from tandem_operator.autoscale import History, decide
from tandem_operator.autoscaler import observation
from tandem_operator.plan import Observed, plan, serving_weights
from tandem_operator.signals import RoleSignals, Signals
from test_operator_plan import V2, World, creates, drains, make_spec, pod, steady

AUTOSCALING = {"slo": {"ttftSeconds": "1", "itlSeconds": "0.1", "queueDepth": 2},
               "prefill": {"minReplicas": 1, "maxReplicas": 4},
               "decode": {"minReplicas": 1, "maxReplicas": 4},
               "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0}
BUSY = Signals(decode=RoleSignals(2, 500.0, 6.0), itl_seconds=0.05)  # decode queue 6 > 2
IDLE = Signals()  # no traffic in the window: every SLO met with room


def spec_for(generation: int = 1, decode: int = 2, **extra: object):  # type: ignore[no-untyped-def]
    return make_spec(generation, prefill={"replicas": 1}, decode={"replicas": decode},
                     autoscaling=AUTOSCALING, **extra)


def target(spec, observed: Observed, signals: Signals, refit: bool = False  # type: ignore[no-untyped-def]
           ) -> tuple[int, int]:
    o = observation(spec, observed, signals, {}, refit)
    d = decide(spec.autoscaling, o, History(), now=0.0)
    return d.prefill.target, d.decode.target


def test_row_rollout_scale_up_the_new_engines_are_the_new_templates() -> None:
    old = spec_for()
    new = spec_for(2, engine={"args": ["--seed", "2"]})  # a template change under way
    observed = steady(old)
    assert target(new, observed, BUSY) == (1, 3)
    scaled = spec_for(3, decode=3, engine={"args": ["--seed", "2"]})
    made = creates(plan(scaled, observed), "decode")
    assert made and all(c.body["metadata"]["annotations"][m.TEMPLATE_HASH]
                        == m.template_hash(scaled, "decode") for c in made)


def test_row_rollout_surge_pods_are_not_counted_so_the_planner_never_scales_against_them(
        ) -> None:
    old = spec_for()
    new = spec_for(2, engine={"args": ["--seed", "2"]})
    surged = Observed(pods=(*steady(old).pods, pod(new, "decode"), pod(new, "prefill")))
    o = observation(new, surged, BUSY, {}, refit=False)
    assert o.rollout and (o.prefill.replicas, o.decode.replicas) == (1, 2)
    calm = Signals(decode=RoleSignals(3, 100.0, 0.0), itl_seconds=0.07)  # in the band
    assert target(new, surged, calm) == (1, 2)  # 3 decode pods, 2 desired: no change


def test_row_rollout_scale_down_keeps_the_rollouts_floor() -> None:
    old = spec_for(decode=3)
    assert target(old, steady(old), IDLE) == (1, 2)  # one step down, then the plan:
    world = World(spec_for(2, decode=2, engine={"args": ["--seed", "2"]}), steady(old))
    for _ in range(12):
        actions = world.apply()
        assert sum(p.ready for p in world.group("decode")) >= 2  # maxUnavailable 0
        if not actions:
            break
        world.progress()
    assert len(world.group("decode")) == 2


def test_row_refit_scale_up_new_engines_load_the_transactions_weights() -> None:
    spec = spec_for()
    observed = steady(spec)
    assert target(spec, observed, BUSY, refit=True) == (1, 3)  # scaling up is allowed
    during = replace(observed, pod_weights=V2)  # the transaction's choice for new pods
    (create,) = creates(plan(spec_for(2, decode=3), during), "decode")
    assert create.body["metadata"]["annotations"][m.WEIGHTS_VERSION] == V2.version


def test_row_refit_no_scale_down_while_it_runs_so_every_version_keeps_both_roles() -> None:
    spec = spec_for(decode=3)
    assert target(spec, steady(spec), IDLE, refit=True) == (1, 3)
    assert target(spec, steady(spec), IDLE, refit=False) == (1, 2)
    # and at the bottom of the bounds no decision takes a role to zero
    small = spec_for(decode=1)
    assert target(small, steady(small), IDLE) == (1, 1)


def test_row_a_role_mid_drain_is_not_scaled_down_again() -> None:
    spec = spec_for(decode=3)
    observed = steady(spec)
    (first,) = [p for p in observed.pods if p.group == "decode"][:1]
    draining = Observed(pods=tuple(replace(p, draining_since="2025-01-01T00:00:00Z")
                                   if p == first else p for p in observed.pods))
    assert target(spec, draining, IDLE) == (1, 3)


def test_row_scale_down_drains_first_never_deletes() -> None:
    before = spec_for(decode=3)
    after = spec_for(2, decode=2)
    actions = plan(after, steady(before))
    (drain,) = drains(actions, "decode")
    assert drain.reason == "ScaleDown"
    assert serving_weights(after, steady(before)) == before.weights
