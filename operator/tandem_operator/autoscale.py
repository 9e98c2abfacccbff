"""The autoscaling planner: how many prefill and decode engines a pool should run, as data.

`decide(spec, observation, history, now)` is a pure function of the pool's SLOs and bounds
(`Autoscaling`), what the engines measured over the look-back window (`Observation`) and the
planner's own recent recommendations (`History`). It returns a `Decision` per role (from, to,
the reason in words) and the history to keep, for the operator's reconcile to carry out
with the existing scale-up and drain-first scale-down (`plan.py`). Nothing here reads a
clock or a metric endpoint.

The rules, one role at a time, then the two together:

* SLO violated: TTFT over its bound (or the prefill queue over its bound) scales prefill
  up; ITL over its bound (or KV usage over its ceiling) scales decode up. Not while the
  role's last scale-up is still starting (engines desired, not ready yet): the violation
  it answers would otherwise add engine after engine (no overshoot).
* Capacity: once an engine's capacity (tokens/s within the SLO) is measured, the target is
  the demand over it, rounded up; a violated SLO is at least one engine more.
* Comfortably met: every bound under `DOWN_FRACTION` of itself lets the role shrink
  towards its demand: to the engines that serve it at `DOWN_FRACTION` of their capacity
  (so that the smaller role is not saturated at once), one engine at a time without a
  measured capacity.
* Hysteresis: between `DOWN_FRACTION` and the bound the role stays as it is.
* Stabilization, as HPA's: a scale-up takes the lowest recommendation of the last
  `scaleUpStabilizationSeconds`, a scale-down the highest of the last
  `scaleDownStabilizationSeconds` (a spike must last, a dip must last longer). A first
  decision counts the current size as a recommendation.
* Step: at most `maxStep` engines per role per decision.
* Bounds: within `minReplicas`..`maxReplicas`, at least 1 (both roles keep an engine
  while disaggregated).
* Never shrink a role with an engine draining, with queued work over the bound, or while
  a refit transaction runs (its waves need every engine, and a version must keep a
  prefill and a decode engine); scaling up is still allowed then.
* Rollouts: the targets count desired engines, not pods, so a rollout's surge pods are
  the rollout's and the planner never scales against them.
* Ratio band (optional): decode per prefill within `minDecodePerPrefill`..
  `maxDecodePerPrefill`; decode moves into the band, and where its bounds forbid that,
  prefill does.

`spec.autoscaling` parses into `Autoscaling` (spec.py). Not yet written: the metric reads,
status, Events and the reconcile that applies a `Decision` (issue 28's next steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

ROLES = ("prefill", "decode")
DOWN_FRACTION = 0.6  # an SLO under this share of its bound is comfortably met
DEFAULT_PERCENTILE = 0.9


class AutoscalingError(ValueError):
    """A bad `spec.autoscaling`: the message names the field, the limit and the fix."""


@dataclass(frozen=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 4


@dataclass(frozen=True)
class SLO:
    ttft_seconds: float
    itl_seconds: float
    percentile: float = DEFAULT_PERCENTILE
    kv_usage_ceiling: float | None = None  # 0..1 of the KV pool, decode engines
    queue_depth: float | None = None  # waiting requests per engine, either role


@dataclass(frozen=True)
class Autoscaling:
    """`spec.autoscaling`, validated by `check`."""

    slo: SLO
    prefill: Bounds = Bounds()
    decode: Bounds = Bounds()
    window_seconds: float = 60.0
    scale_up_stabilization_seconds: float = 30.0
    scale_down_stabilization_seconds: float = 300.0
    max_step: int = 1
    min_decode_per_prefill: float | None = None
    max_decode_per_prefill: float | None = None

    def bounds(self, role: str) -> Bounds:
        return self.prefill if role == "prefill" else self.decode

    def check(self) -> Autoscaling:
        """Self, or AutoscalingError naming the first bad field."""
        for role in ROLES:
            b = self.bounds(role)
            where = f"spec.autoscaling.{role}"
            if not 1 <= b.min_replicas <= b.max_replicas <= 64:
                raise AutoscalingError(
                    f"{where}: minReplicas={b.min_replicas}, maxReplicas={b.max_replicas} "
                    "must satisfy 1 <= minReplicas <= maxReplicas <= 64 (a disaggregated "
                    "pool keeps one engine of each role): raise maxReplicas or lower "
                    "minReplicas")
        slo = self.slo
        for name, value in (("ttftSeconds", slo.ttft_seconds), ("itlSeconds", slo.itl_seconds)):
            if not 0 < value <= 3600:
                raise AutoscalingError(f"spec.autoscaling.slo.{name}={value} must be in "
                                       "(0, 3600] seconds")
        if not 0.5 <= slo.percentile < 1:
            raise AutoscalingError(f"spec.autoscaling.slo.percentile={slo.percentile} must be "
                                   "in [0.5, 1), e.g. 0.9 for p90")
        if slo.kv_usage_ceiling is not None and not 0 < slo.kv_usage_ceiling <= 1:
            raise AutoscalingError(f"spec.autoscaling.slo.kvUsageCeiling="
                                   f"{slo.kv_usage_ceiling} must be in (0, 1]")
        if slo.queue_depth is not None and slo.queue_depth < 0:
            raise AutoscalingError(f"spec.autoscaling.slo.queueDepth={slo.queue_depth} must "
                                   "be >= 0")
        for name, value, low in (("window", self.window_seconds, 10),
                                 ("scaleUpStabilizationSeconds",
                                  self.scale_up_stabilization_seconds, 0),
                                 ("scaleDownStabilizationSeconds",
                                  self.scale_down_stabilization_seconds, 0)):
            if not low <= value <= 3600:
                raise AutoscalingError(f"spec.autoscaling.{name}={value} must be in "
                                       f"[{low}, 3600] seconds")
        if not 1 <= self.max_step <= 16:
            raise AutoscalingError(f"spec.autoscaling.maxStep={self.max_step} must be in "
                                   "[1, 16] engines per decision")
        low, high = self.min_decode_per_prefill, self.max_decode_per_prefill
        if (low is not None and low <= 0) or (high is not None and high <= 0) or (
                low is not None and high is not None and low > high):
            raise AutoscalingError(
                f"spec.autoscaling.ratio: minDecodePerPrefill={low}, maxDecodePerPrefill="
                f"{high} must be > 0 with min <= max")
        return self


@dataclass(frozen=True)
class RoleLoad:
    """One role over the window."""

    replicas: int  # desired engines now (spec), surge pods of a rollout not counted
    demand: float = 0.0  # tokens/s: prompt tokens for prefill, generated ones for decode
    capacity: float | None = None  # tokens/s one engine serves within its SLO, once known
    queue_depth: float = 0.0  # waiting requests per engine
    kv_usage: float = 0.0  # the fullest engine's KV pool, 0..1
    draining: int = 0  # engines of the role being drained
    starting: int = 0  # desired engines of the role not ready yet (a scale-up under way)


@dataclass(frozen=True)
class Observation:
    prefill: RoleLoad
    decode: RoleLoad
    ttft_seconds: float | None = None  # the SLO's percentile over the window
    itl_seconds: float | None = None
    refit: bool = False  # a refit transaction is running
    rollout: bool = False  # pods of another template are being replaced

    def load(self, role: str) -> RoleLoad:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class History:
    """The planner's raw recommendations, (time, replicas) per role, newest last."""

    prefill: tuple[tuple[float, int], ...] = ()
    decode: tuple[tuple[float, int], ...] = ()

    def of(self, role: str) -> tuple[tuple[float, int], ...]:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    target: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.target != self.current


@dataclass(frozen=True)
class Decision:
    prefill: RoleDecision
    decode: RoleDecision
    history: History = field(default_factory=History)

    def of(self, role: str) -> RoleDecision:
        return self.prefill if role == "prefill" else self.decode


def _violations(spec: Autoscaling, obs: Observation, role: str) -> list[str]:
    slo, load = spec.slo, obs.load(role)
    out = []
    pct = f"p{round(slo.percentile * 100)}"
    if role == "prefill" and obs.ttft_seconds is not None and obs.ttft_seconds > slo.ttft_seconds:
        out.append(f"{pct} TTFT {obs.ttft_seconds:.3f} s > {slo.ttft_seconds:g} s")
    if role == "decode" and obs.itl_seconds is not None and obs.itl_seconds > slo.itl_seconds:
        out.append(f"{pct} ITL {obs.itl_seconds:.3f} s > {slo.itl_seconds:g} s")
    if role == "decode" and slo.kv_usage_ceiling is not None and \
            load.kv_usage > slo.kv_usage_ceiling:
        out.append(f"KV usage {load.kv_usage:.0%} > {slo.kv_usage_ceiling:.0%}")
    if slo.queue_depth is not None and load.queue_depth > slo.queue_depth:
        out.append(f"queue depth {load.queue_depth:g} > {slo.queue_depth:g} per engine")
    return out


def _comfortable(spec: Autoscaling, obs: Observation, role: str) -> bool:
    """Every bound of the role met with room to spare (the hysteresis band's low side)."""
    slo, load = spec.slo, obs.load(role)
    latency, bound = ((obs.ttft_seconds, slo.ttft_seconds) if role == "prefill"
                      else (obs.itl_seconds, slo.itl_seconds))
    if latency is not None and latency > DOWN_FRACTION * bound:
        return False
    if role == "decode" and slo.kv_usage_ceiling is not None and \
            load.kv_usage > DOWN_FRACTION * slo.kv_usage_ceiling:
        return False
    return not (slo.queue_depth is not None and load.queue_depth > 0)


def _raw(spec: Autoscaling, obs: Observation, role: str) -> tuple[int, str]:
    """This window's recommendation for `role`, before stabilization, step and bounds."""
    load = obs.load(role)
    needed = (math.ceil(load.demand / load.capacity)
              if load.capacity and load.capacity > 0 else None)
    violated = _violations(spec, obs, role)
    if violated:
        if load.starting:  # the last step has not landed yet: wait for it, don't overshoot
            return max(load.replicas, needed or 0), (
                f"{'; '.join(violated)}; waiting for {load.starting} starting engine(s)")
        want = max(load.replicas + 1, needed or 0)
        return want, "; ".join(violated)
    seen = _seen(spec, obs, role)
    if _comfortable(spec, obs, role):
        if load.capacity and load.capacity > 0:
            keep = math.ceil(load.demand / (DOWN_FRACTION * load.capacity) - 1e-9)
            if keep < load.replicas:
                return keep, (f"SLO met with room ({seen}); demand {load.demand:.0f} tok/s "
                              f"fits {keep} at {DOWN_FRACTION:.0%} of {load.capacity:.0f} "
                              "tok/s each")
            return load.replicas, (f"SLO met ({seen}); demand {load.demand:.0f} tok/s needs "
                                   f"{keep} engine(s) at {DOWN_FRACTION:.0%} of "
                                   f"{load.capacity:.0f} tok/s each")
        return load.replicas - 1, f"SLO met with room ({seen})"
    return load.replicas, f"SLO met, within the hysteresis band ({seen})"


def _seen(spec: Autoscaling, obs: Observation, role: str) -> str:
    """What the role's SLO was judged on, in words."""
    slo, load = spec.slo, obs.load(role)
    pct = f"p{round(slo.percentile * 100)}"
    name, latency = (("TTFT", obs.ttft_seconds) if role == "prefill"
                     else ("ITL", obs.itl_seconds))
    words = [f"no {name} observed" if latency is None else f"{pct} {name} {latency:.3f} s"]
    if role == "decode" and slo.kv_usage_ceiling is not None:
        words.append(f"KV usage {load.kv_usage:.0%}")
    if slo.queue_depth is not None:
        words.append(f"queue depth {load.queue_depth:g}")
    return ", ".join(words)


def _stabilized(spec: Autoscaling, current: int, raw: int,
                past: tuple[tuple[float, int], ...], now: float) -> int:
    """`raw` held back by the earlier recommendations inside each window (a window of 0:
    this one alone)."""
    up = [raw] + [r for t, r in past if now - t < spec.scale_up_stabilization_seconds]
    down = [raw] + [r for t, r in past if now - t < spec.scale_down_stabilization_seconds]
    low, high = min(up), max(down)
    if low > current:
        return low
    if high < current:
        return high
    return current


def decide(spec: Autoscaling, obs: Observation, history: History, now: float) -> Decision:
    """The targets for both roles (see the module's table)."""
    keep = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
    kept: dict[str, tuple[tuple[float, int], ...]] = {}
    decisions: dict[str, RoleDecision] = {}
    for role in ROLES:
        load, bounds = obs.load(role), spec.bounds(role)
        raw, reason = _raw(spec, obs, role)
        # A first decision (a new pool, a restarted operator) counts the current size as
        # a recommendation too: one window of data never moves a role on its own.
        past = tuple((t, r) for t, r in history.of(role) or ((now, load.replicas),)
                     if now - t < keep)
        kept[role] = (*past, (now, raw))
        target = _stabilized(spec, load.replicas, raw, past, now)
        if target != raw:
            reason += f"; stabilized at {target}"
        target = max(load.replicas - spec.max_step,
                     min(load.replicas + spec.max_step, target))
        if target < load.replicas:
            held = _hold_reason(spec, obs, role)
            if held:
                target, reason = load.replicas, f"{reason}; not scaling down: {held}"
        target = max(bounds.min_replicas, min(bounds.max_replicas, target))
        decisions[role] = RoleDecision(role, load.replicas, target, reason)
    decisions = _ratio(spec, decisions)
    return Decision(decisions["prefill"], decisions["decode"],
                    History(kept["prefill"], kept["decode"]))


def _hold_reason(spec: Autoscaling, obs: Observation, role: str) -> str | None:
    load = obs.load(role)
    if load.draining:
        return f"{load.draining} {role} engine(s) still draining"
    if spec.slo.queue_depth is not None and load.queue_depth > spec.slo.queue_depth:
        return f"queued work ({load.queue_depth:g} per engine)"
    if obs.refit:
        return "a refit is running (its waves need every engine)"
    return None


def _ratio(spec: Autoscaling, decisions: dict[str, RoleDecision]) -> dict[str, RoleDecision]:
    """Hold decode per prefill within the band: move decode, else prefill."""
    low, high = spec.min_decode_per_prefill, spec.max_decode_per_prefill
    if low is None and high is None:
        return decisions
    pre, dec = decisions["prefill"], decisions["decode"]
    p, d = pre.target, dec.target
    lo_b, hi_b = spec.decode.min_replicas, spec.decode.max_replicas
    want_min = math.ceil(low * p - 1e-9) if low is not None else lo_b
    want_max = math.floor(high * p + 1e-9) if high is not None else hi_b
    d2 = max(want_min, min(want_max, d))
    d2 = max(lo_b, min(hi_b, d2))
    notes = []
    if d2 != d:
        notes.append(f"decode {d} -> {d2} to hold the ratio band")
        d = d2
    # decode's bounds forbid the band: move prefill instead
    if low is not None and d < low * p - 1e-9:
        p2 = max(spec.prefill.min_replicas, math.floor(d / low + 1e-9))
        notes.append(f"prefill {p} -> {p2}: decode is at maxReplicas {hi_b}")
        p = p2
    if high is not None and d > high * p + 1e-9:
        p2 = min(spec.prefill.max_replicas, math.ceil(d / high - 1e-9))
        notes.append(f"prefill {p} -> {p2}: decode is at minReplicas {lo_b}")
        p = p2
    if not notes:
        return decisions
    note = "; ".join(notes)
    return {"prefill": replace(pre, target=p, reason=f"{pre.reason}; {note}"),
            "decode": replace(dec, target=d, reason=f"{dec.reason}; {note}")}
