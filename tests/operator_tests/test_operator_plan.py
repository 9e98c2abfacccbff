"""The operator's decisions, without an API server: what `plan` does next for every shape of
observed pool (create, scale, replace, roll, drain, wait), and what `status` reports.

Rollouts run in a small simulated world (pods start not ready and become ready a step later,
drains finish a step later) over a matrix of replicas, maxSurge and maxUnavailable, checking
at every step that no role drops below its availability floor or above its surge ceiling and
that every rollout converges."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pytest
from tandem_engine.weights import WeightsRef
from tandem_operator import manifests as m
from tandem_operator.kube import parse_time
from tandem_operator.plan import (
    CreateAdminSecret,
    CreateObject,
    CreatePod,
    DeletePod,
    DrainPod,
    Observed,
    PatchObject,
    PodView,
    RefitReport,
    deletion_deadline,
    deletion_drains,
    invalid_status,
    plan,
    scale_down_order,
    serving_weights,
    status,
)
from tandem_operator.spec import GROUPS, PoolSpec

V1 = WeightsRef("file:///models/llama", "v1")
V2 = WeightsRef("file:///models/llama-2", "v2")
NOW = "2025-06-01T12:00:00Z"


def make_spec(generation: int = 1, **spec: Any) -> PoolSpec:
    full: dict[str, Any] = {"model": {"name": "llama",
                                      "weights": {"uri": V1.uri, "version": V1.version}}}
    full.update(spec)
    return PoolSpec.from_body({"metadata": {"name": "pool", "namespace": "ns", "uid": "u",
                                            "generation": generation}, "spec": full})


_serial = itertools.count(1)


def pod(spec: PoolSpec, group: str, *, name: str | None = None, ready: bool = True,
        phase: str | None = None, template: str | None = None, weights: WeightsRef | None = None,
        created: str | None = None, draining: str | None = None, deleting: bool = False
        ) -> PodView:
    n = next(_serial)
    return PodView(
        name=name or f"pool-{group}-{n:05d}", group=group,  # type: ignore[arg-type]
        role="router" if group == "router" else spec.engine_role(group),  # type: ignore[arg-type]
        template_hash=template or m.template_hash(spec, group),  # type: ignore[arg-type]
        weights=weights or spec.weights, phase=phase or ("Running" if ready else "Pending"),
        ready=ready, deleting=deleting, draining_since=draining,
        created=created or f"2025-01-01T00:{n // 60 % 60:02d}:{n % 60:02d}Z", ip="10.0.0.1",
        uid=f"uid-{n}")


def all_objects(spec: PoolSpec) -> dict[tuple[str, str], dict[str, Any]]:
    objects = {(o["kind"], o["metadata"]["name"]): o for o in m.support_objects(spec)}
    curve = {key: "k" * 40 for pair in m.CURVE_KEYS.values() for key in pair}
    objects[("Secret", m.admin_secret_name(spec.name))] = m.admin_secret(spec, "t", curve)
    return objects


def steady(spec: PoolSpec, **kw: Any) -> Observed:
    pods = tuple(pod(spec, g) for g in GROUPS for _ in range(spec.replicas(g)))
    return Observed(pods=pods, objects=all_objects(spec), **kw)


def of(actions: Iterable[object], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def creates(actions: Iterable[object], group: str | None = None) -> list[CreatePod]:
    return [a for a in of(actions, CreatePod) if group is None or a.group == group]


def drains(actions: Iterable[object], group: str | None = None) -> list[DrainPod]:
    return [a for a in of(actions, DrainPod) if group is None or a.pod.group == group]


# ---- from nothing to a pool ---------------------------------------------------------------------


def test_an_empty_pool_gets_every_object_and_pod() -> None:
    spec = make_spec(prefill={"replicas": 2}, decode={"replicas": 3}, router={"replicas": 2})
    actions = plan(spec, Observed())
    assert of(actions, CreateAdminSecret) == [CreateAdminSecret("pool-admin-token")]
    assert sorted((a.kind, a.name) for a in of(actions, CreateObject)) == sorted([
        ("ServiceAccount", "pool-router"), ("Role", "pool-router"),
        ("RoleBinding", "pool-router"), ("Service", "pool"), ("Service", "pool-engines"),
        ("PodDisruptionBudget", "pool-prefill"), ("PodDisruptionBudget", "pool-decode"),
        ("NetworkPolicy", "pool-engines"), ("NetworkPolicy", "pool-router")])
    assert [len(creates(actions, g)) for g in GROUPS] == [2, 3, 2]
    assert {a.reason for a in creates(actions)} == {"ScaleUp"}
    assert creates(actions, "decode")[0].body == m.pod(spec, "decode", V1)
    # objects come before pods in the plan (pods need the Secret and the ServiceAccount)
    kinds = [type(a).__name__ for a in actions]
    assert kinds.index("CreatePod") > max(i for i, k in enumerate(kinds) if k != "CreatePod")


def test_a_steady_pool_needs_nothing_and_plans_are_repeatable() -> None:
    spec = make_spec()
    assert plan(spec, steady(spec)) == []
    empty = Observed()
    assert plan(spec, empty) == plan(spec, empty)


def test_unreachable_weights_create_nothing_at_all() -> None:
    spec = make_spec()
    assert plan(spec, Observed(weights_error="no config.json")) == []


def test_missing_objects_are_recreated_and_drifted_ones_patched() -> None:
    spec = make_spec(router={"service": {"port": 9000}})
    observed = steady(spec)
    objects = dict(observed.objects)
    del objects[("Service", "pool-engines")]
    stale = make_spec()
    objects[("Service", "pool")] = m.router_service(stale)
    actions = plan(spec, replace(observed, objects=objects))
    assert [(a.kind, a.name) for a in of(actions, CreateObject)] == [("Service", "pool-engines")]
    (patch,) = of(actions, PatchObject)
    assert (patch.kind, patch.name) == ("Service", "pool")
    assert patch.patch["spec"]["ports"][0]["port"] == 9000
    assert not creates(actions) and not drains(actions)


# ---- scaling ------------------------------------------------------------------------------------


def test_scale_up_creates_the_difference() -> None:
    before = make_spec()
    after = make_spec(generation=2, prefill={"replicas": 3}, router={"replicas": 2})
    actions = plan(after, steady(before))
    assert [len(creates(actions, g)) for g in GROUPS] == [2, 0, 1]
    assert {a.reason for a in creates(actions)} == {"ScaleUp"}


def test_scale_down_drains_not_ready_first_then_newest() -> None:
    spec = make_spec(decode={"replicas": 1})
    old = pod(spec, "decode", name="a", created="2025-01-01T00:00:01Z")
    newest = pod(spec, "decode", name="b", created="2025-01-01T00:00:09Z")
    middle = pod(spec, "decode", name="c", created="2025-01-01T00:00:05Z")
    starting = pod(spec, "decode", name="d", ready=False, created="2025-01-01T00:00:00Z")
    observed = Observed(pods=(old, newest, middle, starting,
                              pod(spec, "prefill"), pod(spec, "router")),
                        objects=all_objects(spec))
    actions = plan(spec, observed)
    assert [(a.pod.name, a.reason) for a in drains(actions)] == [
        ("d", "ScaleDown"), ("b", "ScaleDown"), ("c", "ScaleDown")]
    assert not creates(actions)
    assert [p.name for p in scale_down_order([old, newest, middle, starting])] == [
        "d", "b", "c", "a"]


def test_scale_down_takes_an_engine_a_refit_has_out_of_service_last() -> None:
    """A paused-for-refit engine is not ready for a moment; draining it instead of a
    serving one would keep its requests waiting for the drain timeout."""
    spec = make_spec(decode={"replicas": 1})
    serving = pod(spec, "decode", name="a", created="2025-01-01T00:00:01Z")
    refitted = pod(spec, "decode", name="b", ready=False, created="2025-01-01T00:00:09Z")
    previous = {"refit": {"phase": "Progressing", "engines": {
        "b": {"step": "suspend", "verified": False}, "x": {"verified": True}}}}
    observed = Observed(pods=(serving, refitted, pod(spec, "prefill"), pod(spec, "router")),
                        objects=all_objects(spec), previous=previous)
    assert [a.pod.name for a in drains(plan(spec, observed))] == ["a"]
    done = replace(observed, previous={"refit": {**previous["refit"], "phase": "Succeeded"}})
    assert [a.pod.name for a in drains(plan(spec, done))] == ["b"]


def test_draining_pods_continue_and_do_not_count_as_replicas() -> None:
    spec = make_spec()
    leaving = pod(spec, "decode", draining=NOW)
    observed = replace(steady(spec), pods=(*steady(spec).pods, leaving))
    actions = plan(spec, observed)
    assert [(a.pod.name, a.reason) for a in drains(actions)] == [(leaving.name, "Draining")]
    assert not creates(actions)
    # scaled up while a pod drains: the draining one is not counted as one of the replicas
    more = make_spec(decode={"replicas": 2})
    assert len(creates(plan(more, observed), "decode")) == 1


def test_terminating_pods_are_ignored() -> None:
    spec = make_spec()
    pods = [p for p in steady(spec).pods if p.group != "prefill"]
    gone = pod(spec, "prefill", deleting=True)
    actions = plan(spec, Observed(pods=(*pods, gone), objects=all_objects(spec)))
    assert len(creates(actions, "prefill")) == 1
    assert not drains(actions) and not of(actions, DeletePod)


# ---- replacing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_a_failed_pod_is_deleted_and_replaced(phase: str) -> None:
    spec = make_spec()
    broken = pod(spec, "prefill", ready=False, phase=phase)
    pods = [p for p in steady(spec).pods if p.group != "prefill"]
    actions = plan(spec, Observed(pods=(*pods, broken), objects=all_objects(spec)))
    assert of(actions, DeletePod) == [DeletePod(broken, "Failed")]
    (create,) = creates(actions)
    assert (create.group, create.reason) == ("prefill", "Replace")


def test_a_pod_deleted_out_from_under_the_pool_is_replaced() -> None:
    spec = make_spec()
    previous = status(spec, steady(spec), now=NOW)
    pods = [p for p in steady(spec).pods if p.group != "decode"]
    actions = plan(spec, Observed(pods=tuple(pods), objects=all_objects(spec),
                                  previous=previous))
    (create,) = creates(actions)
    assert (create.group, create.reason) == ("decode", "Replace")
    # the same shortfall after a spec change is a scale-up
    bigger = make_spec(generation=2, decode={"replicas": 2})
    assert {a.reason for a in creates(plan(bigger, Observed(
        pods=tuple(pods), objects=all_objects(spec), previous=previous)))} == {"ScaleUp"}


# ---- weights of new pods ------------------------------------------------------------------------


def test_new_pods_load_the_weights_the_engines_serve() -> None:
    on_v1 = make_spec()
    wants_v2 = make_spec(generation=2, model={"name": "llama", "weights": {
        "uri": V2.uri, "version": V2.version}}, decode={"replicas": 2})
    observed = steady(on_v1)
    assert serving_weights(wants_v2, observed) == V1
    (create,) = creates(plan(wants_v2, observed))
    assert create.body["metadata"]["annotations"]["tandem.dev/weights-version"] == "v1"
    assert "/models/llama" in create.body["spec"]["containers"][0]["args"]
    # a fresh pool (or one whose engines are all gone) starts on the spec's weights
    assert serving_weights(wants_v2, Observed()) == V2
    # a tie between versions goes to the spec's
    tie = Observed(pods=(pod(wants_v2, "prefill", weights=V1), pod(wants_v2, "decode",
                                                                     weights=V2)))
    assert serving_weights(wants_v2, tie) == V2
    most = Observed(pods=(pod(on_v1, "prefill", weights=V2), pod(on_v1, "decode", weights=V2),
                          pod(on_v1, "decode", weights=V1)))
    assert serving_weights(on_v1, most) == V2


def test_new_pods_carry_the_epoch_of_their_weights() -> None:
    spec = make_spec(decode={"replicas": 2})
    observed = Observed(pods=(replace(pod(spec, "prefill", weights=V2), epoch=4),
                              replace(pod(spec, "decode", weights=V1), epoch=1)),
                        previous={"weights": {"epoch": 6}})
    (create,) = creates(plan(spec, observed), "decode")
    args = create.body["spec"]["containers"][0]["args"]
    assert args[args.index("--weight-epoch") + 1] == "1"  # on the spec's v1, like its engine
    assert create.body["metadata"]["annotations"]["tandem.dev/weights-epoch"] == "1"
    # A refit transaction decides the weights instead; their engines' epoch comes along.
    (create,) = creates(plan(spec, replace(observed, pod_weights=V2)), "decode")
    annotations = create.body["metadata"]["annotations"]
    assert (annotations["tandem.dev/weights-version"], annotations["tandem.dev/weights-epoch"]
            ) == ("v2", "4")
    # No engine on those weights: the pool-wide epoch in status.
    lone = Observed(previous={"weights": {"epoch": 6}})
    assert {a.body["metadata"]["annotations"].get("tandem.dev/weights-epoch")
            for a in creates(plan(spec, lone))} == {"6", None}  # routers carry none
    body = m.pod(spec, "decode", V2, epoch=4)
    body["metadata"].update(name="pool-decode-x", uid="u1")
    view = PodView.from_body(body)
    assert view is not None and (view.weights, view.epoch) == (V2, 4)


def test_the_weights_change_alone_rolls_nothing() -> None:
    on_v1 = make_spec()
    wants_v2 = make_spec(generation=2, model={"name": "llama", "weights": {
        "uri": V2.uri, "version": V2.version}})
    assert plan(wants_v2, steady(on_v1)) == []


# ---- rollouts -----------------------------------------------------------------------------------


class World:
    """A pool's pods over time: plans are applied, new pods become ready a step later and
    drains finish a step later (unless told otherwise)."""

    def __init__(self, spec: PoolSpec, observed: Observed) -> None:
        self.spec, self.pods = spec, list(observed.pods)
        self.objects = dict(observed.objects)
        self.clock = itertools.count(100)

    def observed(self) -> Observed:
        return Observed(pods=tuple(self.pods), objects=self.objects)

    def apply(self) -> list[Any]:
        actions = plan(self.spec, self.observed())
        for a in actions:
            if isinstance(a, CreatePod):
                ann = a.body["metadata"]["annotations"]
                t = next(self.clock)
                self.pods.append(PodView(
                    name=f"pool-{a.group}-n{t}", group=a.group,
                    role=a.body["metadata"]["labels"]["tandem.dev/role"],
                    template_hash=ann[m.TEMPLATE_HASH],
                    weights=WeightsRef(ann[m.WEIGHTS_URI], ann[m.WEIGHTS_VERSION]),
                    created=f"2025-01-02T00:{t // 60 % 60:02d}:{t % 60:02d}Z", uid=f"n{t}"))
            elif isinstance(a, DrainPod):
                self.pods = [replace(p, draining_since=NOW, ready=False) if p == a.pod else p
                             for p in self.pods]
            elif isinstance(a, DeletePod):
                self.pods.remove(a.pod)
        return actions

    def progress(self, *, ready: bool = True, drains_finish: bool = True) -> None:
        if drains_finish:
            self.pods = [p for p in self.pods if not p.draining_since]
        if ready:
            self.pods = [replace(p, ready=True, phase="Running")
                         if not p.draining_since and not p.failed else p for p in self.pods]

    def group(self, group: str) -> list[PodView]:
        return [p for p in self.pods if p.group == group]


def _available(pods: list[PodView]) -> int:
    return sum(p.ready and not p.draining_since for p in pods)


ROLLOUT_CASES = [(r, s, u) for r in (1, 2, 3, 5)
                 for s, u in ((1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (3, 3))]


@pytest.mark.parametrize(("replicas", "surge", "unavailable"), ROLLOUT_CASES,
                         ids=[f"r{r}-s{s}-u{u}" for r, s, u in ROLLOUT_CASES])
def test_a_template_change_rolls_both_roles_within_the_budget(replicas: int, surge: int,
                                                               unavailable: int) -> None:
    roles = {"prefill": {"replicas": replicas}, "decode": {"replicas": replicas}}
    rollout = {"maxSurge": surge, "maxUnavailable": unavailable}
    before = make_spec(rollout=rollout, **roles)
    after = make_spec(generation=2, rollout=rollout, engine={"args": ["--seed", "9"]}, **roles)
    world = World(after, steady(before))
    floor = max(replicas - unavailable, 1)
    ceiling = replicas + max(surge, 1 if replicas <= unavailable else 0)
    for step in range(4 * replicas + 6):
        actions = world.apply()
        if step == 0:  # prefill and decode start in the same step
            for g in ("prefill", "decode"):
                assert creates(actions, g) or drains(actions, g), (g, actions)
        for g in ("prefill", "decode"):
            pods = world.group(g)
            assert _available(pods) >= floor, (step, g, pods)
            assert len(pods) <= ceiling, (step, g, pods)
        if not actions:
            break
        world.progress()
    else:
        pytest.fail(f"the rollout did not converge: {world.pods}")
    for g in ("prefill", "decode"):
        pods = world.group(g)
        assert len(pods) == replicas
        assert {p.template_hash for p in pods} == {m.template_hash(after, g)}
        assert all(p.ready for p in pods)
    assert len(world.group("router")) == 1  # the router's template did not change


def test_a_rollout_waits_for_new_pods_to_be_ready() -> None:
    rollout = {"maxSurge": 1, "maxUnavailable": 0}
    before = make_spec(rollout=rollout, decode={"replicas": 2})
    after = make_spec(generation=2, rollout=rollout, decode={"replicas": 2},
                      engine={"image": "tandem/engine:0.2.0"})
    world = World(after, steady(before))
    first = world.apply()
    assert [len(creates(first, g)) for g in GROUPS] == [1, 1, 1]
    assert not drains(first)
    for _ in range(3):  # the new pods never become ready: nothing more happens
        world.progress(ready=False)
        assert world.apply() == []
    world.progress()
    second = world.apply()
    assert [len(drains(second, g)) for g in GROUPS] == [1, 1, 1]
    assert {a.reason for a in drains(second)} == {"RollingUpdate"}


def test_the_last_ready_pod_of_a_role_is_never_taken() -> None:
    rollout = {"maxSurge": 0, "maxUnavailable": 1}
    before = make_spec(rollout=rollout)
    after = make_spec(generation=2, rollout=rollout, engine={"args": ["--seed", "2"]})
    world = World(after, steady(before))
    actions = world.apply()
    # maxUnavailable would allow taking it, but it is the only ready one: surge one instead
    assert [len(creates(actions, g)) for g in ("prefill", "decode")] == [1, 1]
    assert not drains(actions, "prefill") and not drains(actions, "decode")


def test_not_ready_outdated_pods_go_first_and_freely() -> None:
    rollout = {"maxSurge": 1, "maxUnavailable": 0}
    before = make_spec(rollout=rollout, decode={"replicas": 2})
    after = make_spec(generation=2, rollout=rollout, decode={"replicas": 2},
                      engine={"args": ["--seed", "2"]})
    crashing = pod(before, "decode", ready=False)
    fine = pod(before, "decode")
    observed = Observed(pods=(crashing, fine, pod(before, "prefill"), pod(before, "router")),
                        objects=all_objects(before))
    actions = plan(after, observed)
    assert [a.pod for a in drains(actions, "decode")] == [crashing]
    assert len(creates(actions, "decode")) == 1


def test_scaling_down_during_a_rollout_keeps_the_floor() -> None:
    rollout = {"maxSurge": 1, "maxUnavailable": 0}
    before = make_spec(rollout=rollout, decode={"replicas": 3})
    after = make_spec(generation=2, rollout=rollout, decode={"replicas": 1},
                      engine={"args": ["--seed", "2"]})
    world = World(after, steady(before))
    for _ in range(10):
        actions = world.apply()
        assert _available(world.group("decode")) >= 1
        if not actions:
            break
        world.progress()
    assert len(world.group("decode")) == 1
    assert world.group("decode")[0].template_hash == m.template_hash(after, "decode")


def test_from_mixed_to_disaggregated_decode_waits_for_a_ready_prefill() -> None:
    mixed = make_spec(prefill={"replicas": 0}, decode={"replicas": 1})
    disagg = make_spec(generation=2, prefill={"replicas": 1}, decode={"replicas": 1})
    world = World(disagg, steady(mixed))
    first = world.apply()
    assert len(creates(first, "prefill")) == 1 and len(creates(first, "decode")) == 1
    world.progress(ready=False)
    # the new decode engine is ready but no prefill engine is: the mixed one keeps serving
    world.pods = [replace(p, ready=True, phase="Running") if p.group == "decode" else p
                  for p in world.pods]
    assert not drains(world.apply(), "decode")
    world.progress()
    assert [a.pod.role for a in drains(world.apply(), "decode")] == ["mixed"]


def test_from_disaggregated_to_mixed_prefill_leaves_after_decode_runs_mixed() -> None:
    disagg = make_spec(prefill={"replicas": 1}, decode={"replicas": 1})
    mixed = make_spec(generation=2, prefill={"replicas": 0}, decode={"replicas": 1})
    world = World(mixed, steady(disagg))
    first = world.apply()
    assert not drains(first, "prefill")  # no mixed engine yet
    assert len(creates(first, "decode")) == 1
    for _ in range(6):
        world.progress()
        decode_before = [p for p in world.group("decode") if p.live]
        actions = world.apply()
        if drains(actions, "prefill"):  # only once every decode engine runs mixed and ready
            assert decode_before and all(p.role == "mixed" and p.ready for p in decode_before)
        if not actions:
            break
    assert world.group("prefill") == []
    assert [p.role for p in world.group("decode")] == ["mixed"]


# ---- PodView ------------------------------------------------------------------------------------


def test_pod_view_from_a_pod_body() -> None:
    spec = make_spec()
    body = m.pod(spec, "decode", V1)
    body["metadata"].update(name="pool-decode-abcde", uid="u9",
                            creationTimestamp="2025-01-01T00:00:00Z")
    body["status"] = {"phase": "Running", "podIP": "10.1.2.3",
                      "conditions": [{"type": "Ready", "status": "True"}]}
    view = PodView.from_body(body)
    assert view == PodView(name="pool-decode-abcde", group="decode", role="decode",
                           template_hash=m.template_hash(spec, "decode"), weights=V1,
                           epoch=0, phase="Running", ready=True,
                           created="2025-01-01T00:00:00Z",
                           ip="10.1.2.3", uid="u9")
    body["status"]["phase"] = "Pending"  # a Ready condition left over is not readiness
    assert PodView.from_body(body).ready is False  # type: ignore[union-attr]
    body["metadata"]["annotations"][m.DRAINING_SINCE] = NOW
    body["metadata"]["deletionTimestamp"] = NOW
    view = PodView.from_body(body)
    assert view is not None and view.draining_since == NOW and view.deleting
    assert not view.live
    assert PodView.from_body({"metadata": {"name": "x", "labels": {}}}) is None


# ---- status -------------------------------------------------------------------------------------


def conditions(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in st["conditions"]}


def test_status_of_a_serving_pool() -> None:
    spec = make_spec(generation=4, decode={"replicas": 2})
    st = status(spec, steady(spec), now=NOW)
    assert st["observedGeneration"] == 4
    assert st["prefill"] == {"replicas": 1, "ready": 1, "updated": 1}
    assert st["decode"] == {"replicas": 2, "ready": 2, "updated": 2}
    assert st["router"] == {"replicas": 1, "ready": 1, "updated": 1}
    assert st["weights"] == {"current": "v1", "target": "v1", "epoch": 0}
    assert st["routerEndpoint"] == "http://pool.ns.svc:8000/v1"
    # what the scale subresource reports as its selector: the decode engines
    assert st["selector"] == "tandem.dev/pool=pool,app.kubernetes.io/component=decode"
    c = conditions(st)
    assert [x["type"] for x in st["conditions"]] == ["Ready", "Progressing", "Degraded",
                                                     "Refitting"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "Serving")
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "Complete")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("False", "AsExpected")
    assert (c["Refitting"]["status"], c["Refitting"]["reason"]) == ("False", "WeightsCurrent")
    for cond in st["conditions"]:
        assert cond["observedGeneration"] == 4 and cond["lastTransitionTime"] == NOW
        assert cond["message"]


def test_last_transition_time_moves_only_with_the_status() -> None:
    spec = make_spec()
    first = status(spec, steady(spec), now=NOW)
    later = "2025-06-01T13:00:00Z"
    again = status(spec, steady(spec, previous=first), now=later)
    assert again == first  # nothing changed: an identical status, so no write
    pods = tuple(replace(p, ready=False) if p.group == "decode" else p
                 for p in steady(spec).pods)
    changed = conditions(status(spec, Observed(pods=pods, previous=first), now=later))
    assert changed["Ready"]["lastTransitionTime"] == later
    assert changed["Ready"]["reason"] == "DecodeNotReady"
    assert changed["Degraded"]["lastTransitionTime"] == NOW  # still False


def test_status_while_starting_rolling_and_scaling() -> None:
    spec = make_spec(decode={"replicas": 2})
    assert conditions(status(spec, Observed(), now=NOW))["Progressing"]["reason"] == "ScalingUp"
    starting = Observed(pods=tuple(replace(p, ready=False) for p in steady(spec).pods))
    c = conditions(status(spec, starting, now=NOW))
    assert (c["Progressing"]["reason"], c["Ready"]["reason"]) == ("PodsStarting",
                                                                  "PrefillNotReady")
    assert "prefill or decode or router" in c["Ready"]["message"]
    newer = make_spec(generation=2, decode={"replicas": 2}, engine={"args": ["--x"]})
    st = status(newer, steady(spec), now=NOW)
    assert conditions(st)["Progressing"]["reason"] == "RollingUpdate"
    assert st["decode"] == {"replicas": 2, "ready": 2, "updated": 0}
    assert st["router"]["updated"] == 1
    fewer = make_spec(generation=2, decode={"replicas": 1})
    assert conditions(status(fewer, steady(spec), now=NOW))["Progressing"]["reason"] == \
        "ScalingDown"
    leaving = (*steady(fewer).pods, pod(fewer, "decode", ready=False, draining=NOW))
    st = status(fewer, Observed(pods=leaving), now=NOW)
    assert conditions(st)["Progressing"]["reason"] == "ScalingDown"
    assert st["decode"]["replicas"] == 2


def test_status_degraded_reasons() -> None:
    spec = make_spec()
    unreachable = status(spec, Observed(weights_error="no /models/llama/config.json"), now=NOW)
    c = conditions(unreachable)
    for t in ("Ready", "Progressing"):
        assert (c[t]["status"], c[t]["reason"]) == ("False", "WeightsUnreachable")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "WeightsUnreachable")
    assert "config.json" in c["Degraded"]["message"]
    failed = (*steady(spec).pods, pod(spec, "decode", name="pool-decode-dead", ready=False,
                                      phase="Failed"))
    c = conditions(status(spec, Observed(pods=failed), now=NOW))
    assert (c["Degraded"]["reason"], c["Progressing"]["reason"]) == ("PodFailed", "Replacing")
    assert "pool-decode-dead" in c["Degraded"]["message"]
    c = conditions(status(spec, steady(spec), now=NOW, errors=("create Pod: 403 Forbidden",)))
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ApplyFailed")
    assert "403" in c["Degraded"]["message"]


def test_status_weights_and_refitting() -> None:
    spec = make_spec()
    wants_v2 = make_spec(generation=2, model={"name": "llama", "weights": {
        "uri": V2.uri, "version": V2.version}})
    st = status(wants_v2, steady(spec, previous={"weights": {"epoch": 3}}), now=NOW)
    assert st["weights"] == {"current": "v1", "target": "v2", "epoch": 3}
    assert conditions(st)["Refitting"]["reason"] == "RefitPending"
    split = Observed(pods=(pod(spec, "prefill", weights=V1), pod(spec, "decode", weights=V2)))
    assert status(spec, split, now=NOW)["weights"]["current"] == ""
    st = status(spec, Observed(), now=NOW)
    assert st["weights"]["current"] == ""
    assert conditions(st)["Refitting"]["reason"] == "NoEngines"


def test_status_from_a_refit_report() -> None:
    spec = make_spec(generation=2, model={"name": "llama", "weights": {
        "uri": V2.uri, "version": V2.version}})
    split = Observed(pods=(pod(spec, "prefill", weights=V1),
                           replace(pod(spec, "decode", weights=V2, ready=False), epoch=4),
                           pod(spec, "router")),
                     previous={"weights": {"epoch": 3}, "refit": {"phase": "Progressing"}})
    running = RefitReport(record={"phase": "Progressing", "epoch": 4},
                          refitting=(True, "Rolling", "refit v1 → v2: wave 1"))
    st = status(spec, split, now=NOW, refit=running)
    c = conditions(st)
    assert (c["Refitting"]["status"], c["Refitting"]["reason"]) == ("True", "Rolling")
    assert c["Progressing"]["reason"] == "Refitting"
    assert c["Degraded"]["status"] == "False"
    # the epoch new pods get: that of the v2 engine (a tie goes to the spec's weights)
    assert st["weights"] == {"current": "", "target": "v2", "epoch": 4}
    assert st["refit"] == {"phase": "Progressing", "epoch": 4}
    failed = RefitReport(record={"phase": "RolledBack"},
                         refitting=(False, "RefitRolledBack", "rolled back"),
                         degraded=(True, "RefitRolledBack", "engine e failed at refit: 422"),
                         current="v1")
    st = status(spec, replace(split, pod_weights=V1), now=NOW, refit=failed)
    c = conditions(st)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "RefitRolledBack")
    # v1's engine carries no epoch annotation (created before they existed): status's
    assert st["weights"] == {"current": "v1", "target": "v2", "epoch": 3}
    # An apply error still comes first; without a report the record stays as it was.
    c = conditions(status(spec, split, now=NOW, errors=("boom",), refit=failed))
    assert c["Degraded"]["reason"] == "ApplyFailed"
    assert status(spec, split, now=NOW)["refit"] == {"phase": "Progressing"}


def test_invalid_status_keeps_what_was_observed() -> None:
    spec = make_spec()
    previous = status(spec, steady(spec), now=NOW)
    st = invalid_status(previous, 7, "spec.engine.threads = 0 is outside 1..256", NOW)
    assert st["observedGeneration"] == 7 and st["prefill"] == previous["prefill"]
    c = conditions(st)
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "InvalidSpec")
    assert "threads" in c["Degraded"]["message"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "InvalidSpec")


# ---- a deleted pool's drain ---------------------------------------------------------------------


def test_a_deleted_pools_engines_drain_prefill_first_then_decode() -> None:
    """A draining engine refuses a decode engine's pull, so the engines that hand requests
    on go first and the decode engines, which hand nothing on, last; routers and engines
    that run nothing have nothing to drain."""
    spec = make_spec(prefill={"replicas": 2}, decode={"replicas": 2})
    prefill = [pod(spec, "prefill", name=f"p{i}") for i in range(2)]
    decode = [pod(spec, "decode", name=f"d{i}") for i in range(2)]
    idle = [pod(spec, "router"), pod(spec, "decode", ready=False), pod(spec, "prefill",
                                                                        deleting=True)]
    stages = deletion_drains([*decode, *idle, *prefill])
    assert [[p.name for p in stage] for stage in stages] == [["p0", "p1"], ["d0", "d1"]]
    # Mixed engines only (no prefill pool): the last one serves until the others are idle.
    mixed = make_spec(prefill={"replicas": 0}, decode={"replicas": 3})
    engines = [pod(mixed, "decode", name=f"m{i}") for i in (2, 0, 1)]
    assert [[p.name for p in s] for s in deletion_drains(engines)] == [["m0", "m1"], ["m2"]]
    assert [[p.name for p in s] for s in deletion_drains(engines[:1])] == [["m2"]]
    assert deletion_drains(idle) == []


def test_a_deleted_pools_grace_period_counts_from_the_deletion() -> None:
    """An operator restarted mid-drain does not start the drain timeout over."""
    at = 1748779200.0  # NOW
    assert deletion_deadline(NOW, 30, now=at + 100) == at + 30
    assert deletion_deadline(None, 30, now=at) == at + 30
    assert deletion_deadline("yesterday", 30, now=at) == at + 30


def test_a_new_pod_counts_for_the_rollout_only_once_ready_for_min_ready_seconds() -> None:
    """Routers need a moment to connect to a new engine: its old peer leaves only once it has
    been Ready for spec.rollout.minReadySeconds (5 by default)."""
    before = make_spec(decode={"replicas": 1})
    after = make_spec(generation=2, decode={"replicas": 1}, engine={"args": ["--seed", "2"]})
    assert after.rollout.min_ready_seconds == 5
    old = list(steady(before).pods)
    fresh = replace(pod(after, "decode"), ready_since="2025-06-01T12:00:00Z")
    turned_ready = parse_time("2025-06-01T12:00:00Z").timestamp()
    observed = Observed(pods=(*old, fresh), objects=all_objects(after))

    def leaving(now: float) -> list[str]:
        return [d.pod.name for d in drains(plan(after, replace(observed, now=now)), "decode")
                if d.reason == "RollingUpdate"]

    assert leaving(turned_ready + 2) == []
    (gone,) = leaving(turned_ready + 5)
    assert gone in {p.name for p in old if p.group == "decode"}
    assert leaving(turned_ready + 2) != leaving(turned_ready + 5)
    no_wait = make_spec(generation=2, decode={"replicas": 1}, engine={"args": ["--seed", "2"]},
                        rollout={"minReadySeconds": 0})
    assert drains(plan(no_wait, replace(observed, now=turned_ready)), "decode")
