"""Rollouts that roll back: the pool's pod-template revisions, the progress deadline, and the
spec its pods are planned from — as data, without I/O (reconcile writes what `step` decides).

A revision is one pod template of the pool, kept as a ControllerRevision (apps/v1, as a
StatefulSet or a DaemonSet keeps its history) named `<pool>-<template hash>`, owned by the pool
and labelled with it: `revision` is its number, `data.spec` the pool's spec as it was applied.
The template hash covers the three groups' pod templates together (`pool_template_hash`). The
spec's template gets the next number when first seen, and again when an older template is
applied anew (as a Deployment renumbers a rollback); revisions beyond
`spec.rollout.revisionHistoryLimit` go oldest first, never the spec's own nor the last good one.

Progress is measured as a Deployment's is. While the spec's template is not the last good one,
a rollout progresses when some role has more updated-and-ready pods (`plan.updated_ready`) than
it ever had in this rollout (a pod that flaps does not count twice); `status.rollout` keeps
those high-water marks and `progressTime`, so an operator restart neither resets the clock nor
forgets it. A rollout whose every role has its replicas updated and ready is complete: its
template becomes the last good one. One that gains nothing for `progressDeadlineSeconds` has
failed (Progressing=False, reason ProgressDeadlineExceeded, and a Warning Event) and stays
failed until the spec's template changes. Then `onFailure`:

* Rollback: the pods are planned from `effective_spec` (the last good revision's spec with
  the current spec's fields that are not the pod template laid over it, `CURRENT_FIELDS`),
  so plan rolls them back within maxSurge/maxUnavailable through the usual drains; the user's
  spec is never edited.
* Halt: only the condition changes (a Deployment's behaviour): the pods stay as the rollout
  left them, within its budget.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem_engine.refit_policy import OnFailure
from tandem_engine.weights import WeightsURIError, weights_source

from tandem_operator import manifests as m
from tandem_operator.fields import SpecError
from tandem_operator.kube import parse_time
from tandem_operator.plan import Condition, Observed, RolloutReport, updated_ready
from tandem_operator.spec import GROUPS, PoolSpec

REVISION_API_VERSION = "apps/v1"
REVISION_KIND = "ControllerRevision"
DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
ROLLED_BACK = "RolledBack"  # the Warning Event of a rollback

# The spec's fields that are not the pods' template: a rollback keeps them as they are now.
# The weights (and their draft checkpoint) are the refit's, the replicas the scalers' (kubectl
# scale, HPA, the planner); the rest configures the rollout itself or objects other than pods.
CURRENT_FIELDS: tuple[tuple[str, ...], ...] = (
    ("model", "weights"),
    ("prefill", "replicas"), ("decode", "replicas"), ("router", "replicas"),
    ("router", "service"),
    ("autoscaling",), ("rollout",), ("refit",), ("networkPolicy",), ("monitoring",))


def pool_template_hash(spec: PoolSpec) -> str:
    """The pool's pod templates as one name: its three groups' template hashes together."""
    groups = {g: m.template_hash(spec, g) for g in GROUPS}
    canonical = json.dumps(groups, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def _plain(value: Mapping[str, Any]) -> dict[str, Any]:
    """A deep, JSON-only copy (bodies may come from kopf as its own mapping types)."""
    return json.loads(json.dumps(value))


def effective_spec(good: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The spec a rolled-back pool's pods are planned from: the last good revision's spec
    (`good`, its pod template) with the current spec's `CURRENT_FIELDS` laid over it (a field
    the current spec leaves out is left out: the schema's default applies). The weights are
    the current ones only where they come from the good revision's volume: weights on
    another claim or model image are part of the template that failed."""
    out = _plain(good)
    now = _plain(current)
    fields = CURRENT_FIELDS
    if _weights_volume(out) != _weights_volume(now):
        fields = tuple(f for f in fields if f != ("model", "weights"))
    for *parents, leaf in fields:
        source: Any = now
        target = out
        for key in parents:
            source = source.get(key) if isinstance(source, dict) else None
            if not isinstance(target.get(key), dict):
                target[key] = {}
            target = target[key]
        if isinstance(source, dict) and leaf in source:
            target[leaf] = source[leaf]
        else:
            target.pop(leaf, None)
    return out


def _weights_volume(spec: Mapping[str, Any]) -> str | None:
    uri = ((spec.get("model") or {}).get("weights") or {}).get("uri")
    try:
        return weights_source(str(uri)).volume if uri else None
    except WeightsURIError:
        return None


# ---- revisions ----------------------------------------------------------------------------------


def revision_name(pool: str, template_hash: str) -> str:
    return f"{pool}-{template_hash}"


@dataclass(frozen=True)
class Revision:
    """One of the pool's ControllerRevisions."""

    name: str
    number: int
    template_hash: str
    spec: Mapping[str, Any]  # the pool's spec as it was applied

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Revision | None:
        """None for a ControllerRevision the operator did not write."""
        meta = body.get("metadata") or {}
        template = (meta.get("labels") or {}).get(m.TEMPLATE_HASH)
        data, number = body.get("data"), body.get("revision")
        if (not template or not isinstance(data, Mapping) or not isinstance(
                data.get("spec"), Mapping) or isinstance(number, bool)
                or not isinstance(number, int)):
            return None
        return cls(str(meta.get("name") or ""), number, template, data["spec"])


def revision_body(spec: PoolSpec, raw_spec: Mapping[str, Any], template_hash: str,
                  number: int) -> dict[str, Any]:
    """The ControllerRevision of the spec's template: the pool's spec as applied."""
    return {"apiVersion": REVISION_API_VERSION, "kind": REVISION_KIND,
            "metadata": {"name": revision_name(spec.name, template_hash),
                         "namespace": spec.namespace,
                         "labels": {**m.common_labels(spec), m.TEMPLATE_HASH: template_hash},
                         "ownerReferences": [m.owner_reference(spec)]},
            "data": {"spec": _plain(raw_spec)}, "revision": number}


@dataclass(frozen=True)
class History:
    """What keeps the revisions in step with the spec, and their numbers once written."""

    numbers: Mapping[str, int]  # template hash -> revision number
    create: Mapping[str, Any] | None = None  # the spec's template, first seen
    renumber: tuple[str, int] | None = None  # (name, number): an older template applied anew
    trim: tuple[str, ...] = ()  # names past the history limit


def history(spec: PoolSpec, raw_spec: Mapping[str, Any], revisions: Sequence[Revision],
            keep: frozenset[str] = frozenset()) -> History:
    """The spec's template as the newest revision, and the old revisions past
    `revisionHistoryLimit` to delete (oldest first; never the spec's nor those in `keep`)."""
    template = pool_template_hash(spec)
    numbers = {r.template_hash: r.number for r in revisions}
    top = max(numbers.values(), default=0)
    mine = next((r for r in revisions if r.template_hash == template), None)
    create = renumber = None
    if mine is None:
        numbers[template] = top + 1
        create = revision_body(spec, raw_spec, template, top + 1)
    elif sum(r.number >= mine.number for r in revisions) > 1:  # not alone at the top
        numbers[template] = top + 1
        renumber = (mine.name, top + 1)
    old = sorted((r for r in revisions if r.template_hash not in keep | {template}),
                 key=lambda r: (-r.number, r.name))
    trim = tuple(r.name for r in old[spec.rollout.revision_history_limit:])
    return History(numbers, create, renumber, trim)


# ---- progress and its deadline ------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """The spec's template's rollout clock (kept in status.rollout)."""

    template_hash: str
    good: str | None  # the last template whose rollout completed
    since: str  # when the rollout started or last progressed
    high: Mapping[str, int] = field(default_factory=dict)  # most updated-and-ready per group
    exceeded: bool = False  # no progress within the deadline: failed


def _valid_time(stamp: Any) -> bool:
    try:
        parse_time(str(stamp))
    except ValueError:
        return False
    return True


def progress(previous: Mapping[str, Any], template_hash: str, counts: Mapping[str, int],
             replicas: Mapping[str, int], deadline_seconds: int | None, now: str,
             sticky: bool = False) -> Progress:
    """The deadline decision for one observation: `previous` is status.rollout as last
    written, `counts` the updated-and-ready pods per group, `replicas` the spec's; no
    `deadline_seconds`: not judged now. A failure that is `sticky` (being rolled back)
    stands even if the pods complete later."""
    good = previous.get("lastGoodTemplateHash") or None
    if previous.get("templateHash") != template_hash:  # a new template (or a first look)
        since, high, exceeded = now, dict(counts), False
    else:
        stamp = previous.get("progressTime")
        since = str(stamp) if _valid_time(stamp) else now  # not ours: the clock starts over
        before = previous.get("progress") or {}
        high = {g: int(before.get(g) or 0) for g in GROUPS}
        exceeded = bool(previous.get("progressDeadlineExceeded"))
        if any(counts[g] > high[g] for g in GROUPS):
            since = now
        high = {g: max(counts[g], high[g]) for g in GROUPS}
    if good != template_hash:
        if all(counts[g] >= replicas[g] for g in GROUPS) and not (exceeded and sticky):
            good, exceeded = template_hash, False
        elif (not exceeded and deadline_seconds is not None
              and (parse_time(now) - parse_time(since)).total_seconds() > deadline_seconds):
            exceeded = True
    return Progress(template_hash, good, since, high, exceeded)


# ---- one pass -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutStep:
    """What one pass decides: the spec to plan pods from, status, revisions to write, and an
    Event (reason, message) when a rollout just failed."""

    effective: PoolSpec
    report: RolloutReport
    history: History
    event: tuple[str, str] | None = None


def step(spec: PoolSpec, body: Mapping[str, Any], observed: Observed, now: str
         ) -> RolloutStep:
    """One pass of the rollout for the pool `body` (whose parsed spec is `spec`)."""
    raw = body.get("spec") or {}
    template = pool_template_hash(spec)
    revisions = [r for b in observed.revisions if (r := Revision.from_body(b)) is not None]
    previous = observed.previous.get("rollout") or {}
    rollback = spec.rollout.on_failure is OnFailure.ROLLBACK
    counts = updated_ready(spec, observed)
    replicas = {g: spec.replicas(g) for g in GROUPS}
    # A pool waiting for weights it can load has no pods to judge, and writes nothing.
    waiting = observed.weights_error is not None
    clock = progress(previous, template, counts, replicas,
                     None if waiting else spec.rollout.progress_deadline_seconds, now,
                     sticky=rollback and bool(previous.get("lastGoodTemplateHash")))
    kept = history(spec, raw, revisions, frozenset({clock.good} if clock.good else ()))
    if waiting:
        kept = History(kept.numbers)
    numbers = kept.numbers
    good_number = numbers.get(clock.good or "", previous.get("lastGoodRevision"))

    effective, problem = spec, None
    if clock.exceeded and rollback and clock.good is not None and clock.good != template:
        good = next((r for r in revisions if r.template_hash == clock.good), None)
        if good is None:
            problem = f"its ControllerRevision {revision_name(spec.name, clock.good)} is gone"
        else:
            try:
                effective = PoolSpec.from_body({"metadata": body.get("metadata") or {},
                                                "spec": effective_spec(good.spec, raw)})
            except SpecError as exc:
                problem = f"its spec with today's replicas and weights is invalid: {exc}"
    rolled_back = effective is not spec

    record: dict[str, Any] = {
        "revision": numbers[template], "templateHash": template,
        "progressTime": clock.since, "progress": dict(clock.high),
        "progressDeadlineExceeded": clock.exceeded, "rolledBack": rolled_back}
    if clock.good is not None and good_number is not None:
        record["lastGoodRevision"] = int(good_number)
        record["lastGoodTemplateHash"] = clock.good
    progressing: Condition | None = None
    event = None
    if clock.exceeded:
        stuck = ", ".join(f"{g} {clock.high[g]}/{replicas[g]}" for g in GROUPS)
        failed = (f"the spec's template (revision {numbers[template]}, {template}) made no "
                  f"progress in {spec.rollout.progress_deadline_seconds}s (pods updated and "
                  f"ready: {stuck})")
        if rolled_back:
            message = (f"rolled back to revision {good_number} (template {clock.good}); "
                       f"{failed}: fix it and apply again")
        elif not rollback:
            message = f"{failed}; onFailure Halt keeps the pods as they are: fix it and apply again"
        elif clock.good is None:
            message = (f"{failed}; no earlier revision ever completed, so there is none to roll "
                       "back to: fix it and apply again")
        else:
            message = (f"{failed}; cannot roll back to revision {good_number} ({problem}): "
                       "fix it and apply again")
        progressing = (False, DEADLINE_EXCEEDED, message)
        if not (previous.get("templateHash") == template
                and previous.get("progressDeadlineExceeded")):
            event = (ROLLED_BACK if rolled_back else DEADLINE_EXCEEDED, message)
    return RolloutStep(effective, RolloutReport(record, progressing), kept, event)
