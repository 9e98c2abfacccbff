"""Rollouts that roll back (issue 28): the revision history of a pool's pod templates, the
progress deadline, Rollback and Halt, and maxSurge/maxUnavailable as percentages.

The rules are pure (`spec.Rollout.budget`, `rollout.effective_spec`, `rollout.history`,
`rollout.progress`, `rollout.step`) and tested here without a server; the last tests run
the real operator against the test API server, playing kubelet as test_operator_cluster.py
does: a changed template whose pods never become ready is rolled back, and the pods that
served before it are never taken.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from tandem_engine.fleet.transaction import Transaction
from tandem_engine.refit_policy import OnFailure
from tandem_operator import manifests as m
from tandem_operator import rollout
from tandem_operator.plan import CreatePod, Observed, PodView, plan, status, updated_ready
from tandem_operator.refit import configure
from tandem_operator.rollout import CURRENT_FIELDS, Revision, effective_spec, pool_template_hash
from tandem_operator.spec import GROUPS, PoolSpec, Rollout
from test_operator_cluster import (  # noqa: F401  (fixtures)
    Operator,
    by_group,
    cluster,
    condition,
    events,
    get_json,
    is_ready,
    operators,
    patch_spec,
    pods,
    pool,
    pool_manifest,
    wait_for,
    wait_serving,
    weights,
)
from test_operator_plan import World, all_objects, creates, drains, steady

T0 = "2025-06-01T12:00:00Z"


def at(seconds: int) -> str:
    """T0 plus `seconds`, as Kubernetes writes times."""
    minutes, secs = divmod(seconds, 60)
    return f"2025-06-01T12:{minutes:02d}:{secs:02d}Z"


def raw_spec(**fields: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "llama", "weights": {
        "uri": "file:///models/llama", "version": "v1"}}}
    spec.update(fields)
    return spec


def body(spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": "pool", "namespace": "ns", "uid": "u",
                         "generation": generation}, "spec": spec}


def parse(spec: dict[str, Any], generation: int = 1) -> PoolSpec:
    return PoolSpec.from_body(body(spec, generation))


# ---- maxSurge and maxUnavailable as percentages -------------------------------------------------

BUDGETS = [
    # (maxSurge, maxUnavailable, replicas) -> (surge, unavailable), as a Deployment resolves them
    ("25%", "25%", 4, (1, 1)),
    ("10%", "10%", 3, (1, 0)),  # surge rounds up, unavailable down
    ("50%", 0, 3, (2, 0)),
    (0, "10%", 3, (0, 1)),  # both 0: one may be unavailable
    ("0%", "25%", 2, (0, 1)),
    ("25%", "25%", 0, (0, 1)),
    ("100%", "100%", 4, (4, 4)),
    (2, 1, 5, (2, 1)),  # counts are counts
    (1, 0, 64, (1, 0)),
]


@pytest.mark.parametrize(("surge", "unavailable", "replicas", "expected"), BUDGETS)
def test_percentages_resolve_like_a_deployments(surge: int | str, unavailable: int | str,
                                                replicas: int, expected: tuple[int, int]) -> None:
    assert Rollout(max_surge=surge, max_unavailable=unavailable).budget(replicas) == expected


def test_a_percentage_rolls_each_role_against_its_own_replicas() -> None:
    rollout_ = {"maxSurge": "50%", "maxUnavailable": 0}
    before = parse(raw_spec(prefill={"replicas": 4}, decode={"replicas": 2}, rollout=rollout_))
    after = parse(raw_spec(prefill={"replicas": 4}, decode={"replicas": 2}, rollout=rollout_,
                           engine={"args": ["--seed", "9"]}), generation=2)
    actions = plan(after, steady(before))
    assert (len(creates(actions, "prefill")), len(creates(actions, "decode"))) == (2, 1)
    assert drains(actions) == []  # maxUnavailable 0: nothing goes before its successor is ready
    world = World(after, steady(before))
    for _ in range(20):
        if not world.apply():
            break
        for g, replicas in (("prefill", 4), ("decode", 2)):
            group = world.group(g)
            assert len(group) <= replicas + replicas // 2
            assert sum(p.ready and not p.draining_since for p in group) >= replicas
        world.progress()
    assert {p.template_hash for p in world.group("prefill")} == {
        m.template_hash(after, "prefill")}


def test_a_percentage_reaches_the_pdb_and_the_refit() -> None:
    spec = parse(raw_spec(prefill={"replicas": 4}, decode={"replicas": 8},
                          rollout={"maxSurge": "25%", "maxUnavailable": "50%"}))
    assert m.pod_disruption_budget(spec, "decode")["spec"]["maxUnavailable"] == "50%"
    zero = parse(raw_spec(rollout={"maxSurge": "25%", "maxUnavailable": "0%"}))
    assert m.pod_disruption_budget(zero, "decode")["spec"]["maxUnavailable"] == 1
    tx = Transaction(target=spec.weights, previous=spec.weights, epoch=1)
    configure(tx, spec)
    assert tx.max_unavailable == 2  # the smaller role's budget: 50% of 4 prefill engines


# ---- the effective spec: the last good template, today's other fields ---------------------------

GOOD = raw_spec(engine={"image": "tandem/engine:1", "args": ["--seed", "1"]},
                prefill={"replicas": 1}, decode={"replicas": 1},
                autoscaling={"slo": {"ttftSeconds": "1.5", "itlSeconds": "0.1"}})
BAD = raw_spec(engine={"image": "tandem/engine:broken"},
               model={"name": "llama", "weights": {"uri": "file:///models/llama-2",
                                                   "version": "v2"}},
               prefill={"replicas": 2}, decode={"replicas": 3},
               router={"replicas": 2, "service": {"type": "NodePort", "port": 9000}},
               rollout={"maxSurge": "50%", "progressDeadlineSeconds": 30},
               refit={"drainTimeoutSeconds": 30}, networkPolicy={"enabled": True})


def test_the_effective_spec_is_the_good_template_with_todays_other_fields() -> None:
    merged = effective_spec(GOOD, BAD)
    assert merged["engine"] == GOOD["engine"]  # the template: the last good one's
    assert merged["model"] == {"name": "llama", "weights": BAD["model"]["weights"]}
    for key in ("prefill", "decode", "rollout", "refit", "networkPolicy"):
        assert merged[key] == BAD[key], key
    assert merged["router"] == BAD["router"]
    assert "autoscaling" not in merged  # left out today: left out (the schema's default)
    assert GOOD["prefill"] == {"replicas": 1}  # pure: nothing edited in place
    spec = parse(merged)
    for group in GROUPS:
        assert m.template_hash(spec, group) == m.template_hash(parse(GOOD), group)
    assert pool_template_hash(spec) == pool_template_hash(parse(GOOD))
    assert (spec.weights.version, spec.replicas("decode")) == ("v2", 3)


@pytest.mark.parametrize("path", CURRENT_FIELDS, ids=".".join)
def test_the_overlaid_fields_are_not_the_pod_template(path: tuple[str, ...]) -> None:
    """Each field a rollback takes from today's spec leaves every pod template as it was (the
    replicas may not cross 0 prefill engines, which turns decode engines mixed)."""
    value: Any = {"weights": {"uri": "file:///models/v9", "version": "v9"},
                  "replicas": 3, "service": {"type": "NodePort", "port": 81},
                  "autoscaling": {"slo": {"ttftSeconds": "2", "itlSeconds": "0.2"},
                                  "prefill": {"maxReplicas": 8},
                                  "decode": {"maxReplicas": 8}},
                  "rollout": {"maxSurge": "10%", "onFailure": "Halt"},
                  "refit": {"drainTimeoutSeconds": 5, "strategy": "AllAtOnce"},
                  "networkPolicy": {"enabled": True},
                  "monitoring": {"podMonitor": {"enabled": True}}}[path[-1]]
    changed = json.loads(json.dumps(GOOD))
    target = changed
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    assert pool_template_hash(parse(changed)) == pool_template_hash(parse(GOOD))
    assert parse(effective_spec(GOOD, changed)) == parse(changed)


# ---- the revision history -----------------------------------------------------------------------


def revisions_of(*specs: dict[str, Any]) -> list[Revision]:
    out = []
    for number, raw in enumerate(specs, 1):
        parsed = parse(raw)
        made = Revision.from_body(rollout.revision_body(parsed, raw, pool_template_hash(parsed),
                                                        number))
        assert made is not None
        out.append(made)
    return out


def test_the_first_look_records_the_spec_as_revision_1() -> None:
    spec = parse(GOOD)
    kept = rollout.history(spec, GOOD, [])
    template = pool_template_hash(spec)
    assert kept.numbers == {template: 1} and kept.renumber is None and kept.trim == ()
    made = kept.create
    assert made is not None
    assert (made["apiVersion"], made["kind"], made["revision"]) == ("apps/v1",
                                                                     "ControllerRevision", 1)
    assert made["metadata"]["name"] == f"pool-{template}"
    assert made["metadata"]["labels"][m.POOL_LABEL] == "pool"
    assert made["metadata"]["labels"][m.TEMPLATE_HASH] == template
    assert made["metadata"]["ownerReferences"] == [m.owner_reference(spec)]
    assert made["data"] == {"spec": GOOD}
    assert rollout.history(spec, GOOD, revisions_of(GOOD)) == rollout.History({template: 1})


def test_a_template_applied_again_becomes_the_newest_revision() -> None:
    history = revisions_of(GOOD, BAD)
    kept = rollout.history(parse(GOOD), GOOD, history)
    assert kept.create is None
    assert kept.renumber == (history[0].name, 3)
    assert kept.numbers[pool_template_hash(parse(GOOD))] == 3


def test_old_revisions_past_the_limit_go_oldest_first_never_the_live_ones() -> None:
    olds = [raw_spec(engine={"args": ["--seed", str(i)]}) for i in range(12)]
    current = raw_spec(engine={"args": ["--seed", "99"]}, rollout={"revisionHistoryLimit": 3})
    history = revisions_of(*olds)
    good = history[1].template_hash  # an old one, still the last good
    kept = rollout.history(parse(current), current, history, frozenset({good}))
    assert kept.create is not None and kept.create["revision"] == 13
    # the newest three old ones stay, and the last good one: every other goes
    assert set(kept.trim) == {r.name for r in history[:9]} - {history[1].name}
    nothing_old = raw_spec(engine={"args": ["--seed", "99"]},
                           rollout={"revisionHistoryLimit": 0})
    kept = rollout.history(parse(nothing_old), nothing_old, history, frozenset({good}))
    assert set(kept.trim) == {r.name for r in history} - {history[1].name}


def test_bodies_the_operator_did_not_write_are_not_revisions() -> None:
    assert Revision.from_body({"metadata": {"name": "x"}, "data": {}, "revision": 1}) is None
    assert Revision.from_body({"metadata": {"name": "x", "labels": {m.TEMPLATE_HASH: "h"}},
                               "data": {"spec": {}}, "revision": "1"}) is None


# ---- the deadline -------------------------------------------------------------------------------

ONE_EACH = {"prefill": 1, "decode": 1, "router": 1}


def record_of(clock: rollout.Progress) -> dict[str, Any]:
    """What status.rollout keeps of a clock, through JSON as the API server stores it."""
    out: dict[str, Any] = {"templateHash": clock.template_hash, "progressTime": clock.since,
                           "progress": dict(clock.high),
                           "progressDeadlineExceeded": clock.exceeded}
    if clock.good:
        out["lastGoodTemplateHash"] = clock.good
    return json.loads(json.dumps(out))


def counts(prefill: int, decode: int, router: int = 1) -> dict[str, int]:
    return {"prefill": prefill, "decode": decode, "router": router}


def test_no_progress_past_the_deadline_fails_the_rollout() -> None:
    good = {"templateHash": "A", "lastGoodTemplateHash": "A", "progressTime": T0,
            "progress": ONE_EACH}
    clock = rollout.progress(good, "B", counts(0, 0), ONE_EACH, 10, at(5))
    assert (clock.since, clock.exceeded, clock.good) == (at(5), False, "A")  # a new rollout
    clock = rollout.progress(record_of(clock), "B", counts(0, 0), ONE_EACH, 10, at(15))
    assert not clock.exceeded  # exactly the deadline: not yet past it
    clock = rollout.progress(record_of(clock), "B", counts(0, 0), ONE_EACH, 10, at(16))
    assert clock.exceeded and clock.since == at(5) and clock.good == "A"
    # it stays failed while the template stays, whatever the clock says
    assert rollout.progress(record_of(clock), "B", counts(0, 0), ONE_EACH, 10, at(17)).exceeded
    # a new template starts a new rollout
    fresh = rollout.progress(record_of(clock), "C", counts(0, 0), ONE_EACH, 10, at(18))
    assert (fresh.exceeded, fresh.since, fresh.good) == (False, at(18), "A")


def test_progress_resets_the_clock_and_a_flapping_pod_does_not() -> None:
    start = {"templateHash": "B", "lastGoodTemplateHash": "A", "progressTime": T0,
             "progress": counts(0, 0)}
    clock = rollout.progress(start, "B", counts(1, 0), counts(2, 2), 10, at(8))
    assert clock.since == at(8) and clock.high == counts(1, 0)
    clock = rollout.progress(record_of(clock), "B", counts(0, 0), counts(2, 2), 10, at(12))
    clock = rollout.progress(record_of(clock), "B", counts(1, 0), counts(2, 2), 10, at(14))
    assert clock.since == at(8)  # back to where it was: no progress
    clock = rollout.progress(record_of(clock), "B", counts(1, 0), counts(2, 2), 10, at(19))
    assert clock.exceeded
    # a role that completes makes the template the last good one
    done = rollout.progress(start, "B", counts(2, 2), counts(2, 2), 10, at(9))
    assert (done.good, done.exceeded) == ("B", False)


def test_the_clock_lives_in_status_so_a_restart_keeps_it() -> None:
    """Each decision reads only the record status kept: replaying the same observations from
    the stored records gives the same answers as one process keeping them in memory."""
    looks = [(counts(0, 0), at(1)), (counts(1, 0), at(4)), (counts(1, 0), at(9)),
             (counts(1, 1), at(12)), (counts(1, 1), at(30))]
    kept: dict[str, Any] = {"templateHash": "A", "lastGoodTemplateHash": "A",
                            "progressTime": T0, "progress": ONE_EACH}
    answers = []
    for seen, when in looks:
        clock = rollout.progress(kept, "B", seen, counts(2, 2), 10, when)
        kept = record_of(clock)  # written to status, read back by the next (new) process
        answers.append((clock.since, clock.exceeded))
    assert answers == [(at(1), False), (at(4), False), (at(4), False), (at(12), False),
                       (at(12), True)]


def test_a_clock_it_cannot_read_starts_over_and_none_is_judged_without_a_deadline() -> None:
    odd = {"templateHash": "B", "lastGoodTemplateHash": "A", "progressTime": "yesterday",
           "progress": counts(0, 0)}
    clock = rollout.progress(odd, "B", counts(0, 0), ONE_EACH, 10, at(50))
    assert (clock.since, clock.exceeded) == (at(50), False)
    late = {**odd, "progressTime": T0}
    assert not rollout.progress(late, "B", counts(0, 0), ONE_EACH, None, at(50)).exceeded


def test_a_pool_waiting_for_its_weights_writes_no_revision_and_misses_no_deadline() -> None:
    spec = parse(GOOD_SPEC)
    observed = Observed(weights_error="weights v1 at file:///models/llama: no config.json",
                        previous={"rollout": {"templateHash": pool_template_hash(spec),
                                              "progressTime": T0}})
    decided = rollout.step(spec, body(GOOD_SPEC), observed, at(59))
    assert decided.history == rollout.History({pool_template_hash(spec): 1})
    assert decided.event is None and decided.report.progressing is None


def test_a_rolled_back_failure_stands_and_a_halted_one_clears_once_complete() -> None:
    failed = {"templateHash": "B", "lastGoodTemplateHash": "A", "progressTime": T0,
              "progress": counts(0, 0), "progressDeadlineExceeded": True}
    assert rollout.progress(failed, "B", counts(1, 1), ONE_EACH, 10, at(40),
                            sticky=True).exceeded
    late = rollout.progress(failed, "B", counts(1, 1), ONE_EACH, 10, at(40))
    assert (late.exceeded, late.good) == (False, "B")


# ---- one pass: Rollback and Halt ----------------------------------------------------------------

ROLL = {"maxSurge": 1, "maxUnavailable": 0, "progressDeadlineSeconds": 10}
GOOD_SPEC = raw_spec(rollout=ROLL)
BAD_SPEC = raw_spec(rollout=ROLL, engine={"image": "tandem/engine:broken"})


def mid_rollout(bad: dict[str, Any]) -> tuple[PoolSpec, Observed]:
    """The pool after BAD_SPEC was applied over a serving GOOD_SPEC: the old pods ready, one
    new pod per group surged and never ready; status says the rollout started at T0."""
    good, new = parse(GOOD_SPEC), parse(bad, generation=2)
    old_pods = steady(good).pods
    surged = tuple(PodView(name=f"pool-{g}-new", group=g, role=p.role,
                           template_hash=m.template_hash(new, g), weights=new.weights,
                           phase="Pending", ready=False, created="2025-06-01T12:00:01Z",
                           uid=f"new-{g}") for g, p in zip(GROUPS, old_pods, strict=True))
    previous = {"rollout": {"revision": 2, "templateHash": pool_template_hash(new),
                            "lastGoodRevision": 1,
                            "lastGoodTemplateHash": pool_template_hash(good),
                            "progressTime": T0, "progress": counts(0, 0, 0),
                            "progressDeadlineExceeded": False, "rolledBack": False}}
    bodies = tuple(rollout.revision_body(s, raw, pool_template_hash(s), n)
                   for n, (s, raw) in enumerate(((good, GOOD_SPEC), (new, bad)), 1))
    return new, Observed(pods=old_pods + surged, objects=all_objects(new), previous=previous,
                         revisions=bodies)


def test_a_rollout_past_its_deadline_rolls_back_to_the_last_good_template() -> None:
    spec, observed = mid_rollout(BAD_SPEC)
    assert rollout.step(spec, body(BAD_SPEC, 2), observed, at(10)).event is None  # in time
    decided = rollout.step(spec, body(BAD_SPEC, 2), observed, at(11))
    good = parse(GOOD_SPEC)
    assert pool_template_hash(decided.effective) == pool_template_hash(good)
    assert decided.effective.generation == 2  # the pool's identity stays today's
    reason, message = decided.event or ("", "")
    assert reason == "RolledBack"
    assert message.startswith(f"rolled back to revision 1 (template {pool_template_hash(good)}"
                              f"); the spec's template (revision 2, ")
    assert "made no progress in 10s (pods updated and ready: prefill 0/1, decode 0/1, " \
           "router 0/1): fix it and apply again" in message
    assert decided.report.record["rolledBack"] is True
    assert decided.report.record["lastGoodRevision"] == 1
    assert decided.report.progressing == (False, "ProgressDeadlineExceeded", message)
    assert decided.history.create is None and decided.history.trim == ()

    # the pods: the never-ready new ones drain away, the old ones stay, none is created
    actions = plan(decided.effective, observed)
    assert {a.pod.name for a in drains(actions)} == {"pool-prefill-new", "pool-decode-new",
                                                     "pool-router-new"}
    assert {a.reason for a in drains(actions)} == {"RollingUpdate"}
    assert creates(actions) == []
    st = status(decided.effective, observed, now=at(11), rollout=decided.report)
    progressing = next(c for c in st["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False",
                                                              "ProgressDeadlineExceeded")
    assert progressing["message"] == message
    assert st["rollout"]["revision"] == 2 and st["rollout"]["progressDeadlineExceeded"]

    # the next pass (status as written) keeps rolling back, without a second Event
    again = rollout.step(spec, body(BAD_SPEC, 2), replace(
        observed, previous={"rollout": decided.report.record}), at(30))
    assert again.event is None and again.report == decided.report
    assert again.effective == decided.effective


def test_the_rollback_converges_on_the_old_template_without_taking_a_serving_pod() -> None:
    spec, observed = mid_rollout(BAD_SPEC)
    effective = rollout.step(spec, body(BAD_SPEC, 2), observed, at(11)).effective
    serving = {p.name for p in observed.pods if p.ready}
    world = World(effective, observed)
    for _ in range(10):
        actions = world.apply()
        assert not any(a.pod.name in serving for a in drains(actions))
        if not actions:
            break
        world.progress()
    assert {p.name for p in world.pods} == serving
    assert updated_ready(effective, world.observed()) == ONE_EACH


def test_a_rollback_after_the_replicas_changed_keeps_todays_replicas() -> None:
    bad = raw_spec(rollout=ROLL, engine={"image": "tandem/engine:broken"},
                   decode={"replicas": 2})
    spec, observed = mid_rollout(bad)
    effective = rollout.step(spec, body(bad, 2), observed, at(11)).effective
    assert effective.replicas("decode") == 2
    decode = [a for a in plan(effective, observed) if isinstance(a, CreatePod)]
    assert [a.group for a in decode] == ["decode"]  # the second decode pod, on the old template
    assert decode[0].body["metadata"]["annotations"][m.TEMPLATE_HASH] == m.template_hash(
        parse(GOOD_SPEC), "decode")


def test_halt_keeps_the_pods_as_they_are_and_says_so() -> None:
    bad = raw_spec(rollout={**ROLL, "onFailure": "Halt"},
                   engine={"image": "tandem/engine:broken"})
    spec, observed = mid_rollout(bad)
    assert spec.rollout.on_failure is OnFailure.HALT
    decided = rollout.step(spec, body(bad, 2), observed, at(11))
    assert decided.effective is spec
    assert plan(decided.effective, observed) == plan(spec, observed)
    assert drains(plan(spec, observed)) == [] and creates(plan(spec, observed)) == []
    reason, message = decided.event or ("", "")
    assert reason == "ProgressDeadlineExceeded"
    assert "onFailure Halt keeps the pods as they are: fix it and apply again" in message
    assert decided.report.record["rolledBack"] is False


def test_a_first_rollout_that_fails_has_nothing_to_roll_back_to() -> None:
    spec = parse(GOOD_SPEC)
    observed = Observed(pods=tuple(replace(p, ready=False, phase="Pending")
                                   for p in steady(spec).pods),
                        previous={"rollout": {"templateHash": pool_template_hash(spec),
                                              "progressTime": T0, "progress": counts(0, 0, 0)}})
    decided = rollout.step(spec, body(GOOD_SPEC), observed, at(11))
    assert decided.effective is spec
    assert decided.report.progressing is not None
    assert "none to roll back to" in decided.report.progressing[2]


# ---- on the test cluster, with the real operator ------------------------------------------------


def engine_hashes(items: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["annotations"][m.TEMPLATE_HASH] for p in items}


def test_a_template_that_never_gets_ready_is_rolled_back(
        cluster: TestCluster, operators: Callable[..., Operator],  # noqa: F811
        weights: Path) -> None:  # noqa: F811
    operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights, rollout={
        "maxSurge": 1, "maxUnavailable": 0, "progressDeadlineSeconds": 3}))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    serving = {p["metadata"]["name"] for p in pods(cluster)}
    old_hashes = engine_hashes(pods(cluster))
    patch_spec(cluster, {"engine": {"image": "tandem/engine:broken"}})  # never gets ready

    def rolled_back() -> bool:
        items = pods(cluster)
        have = {p["metadata"]["name"] for p in items}
        assert serving <= have, f"a serving pod was taken: {serving - have}"
        for p in items:
            if p["metadata"]["name"] in serving:
                assert is_ready(p) and m.DRAINING_SINCE not in p["metadata"]["annotations"]
        c = condition(pool(cluster), "Progressing")
        return (c.get("reason") == "ProgressDeadlineExceeded" and have == serving)
    wait_for("the rollback", rolled_back, timeout=40, every=0.2)

    body_ = pool(cluster)
    assert body_["spec"]["engine"]["image"] == "tandem/engine:broken"  # the spec stays
    c = condition(body_, "Progressing")
    assert c["status"] == "False"
    assert c["message"].startswith("rolled back to revision 1 (template ")
    assert "the spec's template (revision 2, " in c["message"]
    assert "made no progress in 3s" in c["message"] and "fix it and apply again" in c["message"]
    assert body_["status"]["rollout"]["rolledBack"] is True
    assert (body_["status"]["rollout"]["revision"],
            body_["status"]["rollout"]["lastGoodRevision"]) == (2, 1)
    assert engine_hashes(pods(cluster)) == old_hashes
    rolled = [msg for reason, msg in events(cluster) if reason == "RolledBack"]
    assert len(rolled) == 1 and rolled[0] == c["message"]
    assert "Warning" in cluster.kubectl("describe", "ipool", "demo").stdout

    table = cluster.kubectl("get", "controllerrevisions", "-l", "tandem.dev/pool=demo"
                            ).stdout.splitlines()
    assert table[0].split() == ["NAME", "CONTROLLER", "REVISION", "AGE"]
    rows = sorted((line.split()[:3] for line in table[1:]), key=lambda r: int(r[2]))
    template = body_["status"]["rollout"]["lastGoodTemplateHash"]
    assert [r[2] for r in rows] == ["1", "2"]
    assert {r[1] for r in rows} == {"inferencepool.tandem.dev/demo"}
    assert f"demo-{template}" in {r[0] for r in rows}
    revision = get_json(cluster, "controllerrevision", f"demo-{template}")
    assert revision["data"]["spec"]["rollout"]["progressDeadlineSeconds"] == 3
    assert revision["metadata"]["ownerReferences"][0]["uid"] == body_["metadata"]["uid"]

    # Applying the good template again is a new rollout (revision 3), done at once.
    patch_spec(cluster, {"engine": {"image": by_group(pods(cluster), "decode")[0][
        "spec"]["containers"][0]["image"]}})

    def complete() -> bool:
        st = pool(cluster).get("status") or {}
        return (condition(pool(cluster), "Progressing").get("reason") == "Complete"
                and (st.get("rollout") or {}).get("revision") == 3)
    wait_for("the good template again", complete, timeout=20)
    assert {p["metadata"]["name"] for p in pods(cluster)} == serving
    assert get_json(cluster, "controllerrevision", f"demo-{template}")["revision"] == 3


def test_percentages_are_accepted_and_a_bad_budget_refused(
        cluster: TestCluster, weights: Path) -> None:  # noqa: F811
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(
        weights, rollout={"maxSurge": "50%", "maxUnavailable": "25%"}))
    assert pool(cluster)["spec"]["rollout"]["maxSurge"] == "50%"
    assert pool(cluster)["spec"]["rollout"]["onFailure"] == "Rollback"  # defaulted
    for budget, reason in (
            ({"maxSurge": "150x"}, 'spec.rollout.maxSurge: Invalid value: "150x"'),
            ({"maxSurge": "0%", "maxUnavailable": 0},
             "rollout.maxSurge and rollout.maxUnavailable must not both be 0")):
        done = cluster.kubectl("apply", "-f", "-", check=False, input=pool_manifest(
            weights, name="other", rollout=budget))
        assert done.returncode != 0
        assert reason in done.stderr, done.stderr
    assert cluster.kubectl("get", "ipool", "other", check=False).returncode != 0
