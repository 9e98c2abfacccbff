"""The chart's alerts: its PrometheusRule rendered by the real helm, its rules evaluated by a
real Prometheus.

Rendering: only where the cluster serves the kind (`--api-versions
monitoring.coreos.com/v1/PrometheusRule`) and alerts.enabled, four alerts with the values'
`for` and severity, and nothing else of the chart changes (no RBAC: the rule is the chart's
object, not the operator's). Evaluation: the rule's groups, their `for` shortened through the
values, are loaded into Debian's Prometheus (2.42, `make test-tools`), which scrapes every
second a process serving the operator's own metrics module with the gauges a reconcile sets
for three pools: each alert fires for the pool it should, with the pool's labels and
annotations that name it, and none for the healthy pool.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from test_chart import CHART, COMMON_LABELS, NAMESPACE, by_kind, one, render, run_helm
from test_chart import helm as helm
from test_dashboard_prometheus import Prometheus
from test_operator_cluster import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
RULE_API = ["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]
# alert -> its block under `alerts:` in values.yaml
ALERTS = {"TandemSLOViolated": "sloViolated", "TandemRefitStuck": "refitStuck",
          "TandemRolloutStuck": "rolloutStuck", "TandemEnginesUnavailable": "enginesUnavailable"}
POOL = "{{ $labels.namespace }}/{{ $labels.pool }}"  # how every annotation names the pool


def alert_rules(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """alert -> rule of the one PrometheusRule's one group."""
    [group] = one(objects, "PrometheusRule")["spec"]["groups"]
    assert group["name"] == "tandem"
    return {rule["alert"]: rule for rule in group["rules"]}


# ---- rendering ----------------------------------------------------------------------------------


def test_the_rule_renders_only_where_its_kind_is_served(helm: Path) -> None:
    assert by_kind(render(helm), "PrometheusRule") == []
    assert by_kind(render(helm, *RULE_API, "--set", "alerts.enabled=false"),
                   "PrometheusRule") == []
    objects = render(helm, *RULE_API)
    rule = one(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert (rule["metadata"]["name"], rule["metadata"]["namespace"]) == ("tandem-alerts",
                                                                         NAMESPACE)
    assert rule["metadata"]["labels"].items() >= COMMON_LABELS.items()
    # The rule is the chart's object: the operator's RBAC and everything else stay as they are.
    assert [obj for obj in objects if obj["kind"] != "PrometheusRule"] == render(helm)


def test_the_four_alerts_with_their_default_durations(helm: Path) -> None:
    rules = alert_rules(render(helm, *RULE_API))
    assert {alert: rule["for"] for alert, rule in rules.items()} == {
        "TandemSLOViolated": "5m", "TandemRefitStuck": "30m", "TandemRolloutStuck": "1m",
        "TandemEnginesUnavailable": "10m"}
    for alert, rule in rules.items():
        assert rule["labels"] == {"severity": "warning"}, alert
        assert set(rule["annotations"]) == {"summary", "description"}, alert
        # Prometheus' templates reach Prometheus untouched by helm.
        assert POOL in rule["annotations"]["summary"], alert
        assert "kubectl" in rule["annotations"]["description"], alert  # what to do
    assert rules["TandemSLOViolated"]["expr"] == (
        "tandem_operator_autoscaling_observed > on(namespace, pool, role, metric) "
        "tandem_operator_autoscaling_slo")


def test_the_alerts_follow_the_values(helm: Path) -> None:
    objects = render(helm, *RULE_API, "--set", "alerts.sloViolated.for=15m",
                     "--set", "alerts.enginesUnavailable.severity=critical",
                     "--set", "alerts.refitStuck.for=1h30m",
                     "--set", "alerts.labels.release=kube-prometheus-stack")
    assert one(objects, "PrometheusRule")["metadata"]["labels"]["release"] == \
        "kube-prometheus-stack"  # for the Prometheus' ruleSelector
    rules = alert_rules(objects)
    assert rules["TandemSLOViolated"]["for"] == "15m"
    assert "for more than 15m" in rules["TandemSLOViolated"]["annotations"]["description"]
    assert rules["TandemRefitStuck"]["for"] == "1h30m"
    assert rules["TandemEnginesUnavailable"]["labels"] == {"severity": "critical"}
    assert rules["TandemRolloutStuck"]["labels"] == {"severity": "warning"}


@pytest.mark.parametrize(("values", "expected"), [
    (["--set", "alerts.refitStuck.for=soon"], "/alerts/refitStuck/for"),
    (["--set", "alerts.rolloutStuck.for=5"], "/alerts/rolloutStuck/for"),  # no unit
    (["--set", "alerts.sloViolated.severity=page"], "/alerts/sloViolated/severity"),
    (["--set", "alerts.enable=true"], "enable"),  # a typo of enabled is not ignored
    (["--set", "alerts.refitStuck.forr=1m"], "forr"),
])
def test_the_alert_values_are_checked(helm: Path, values: list[str], expected: str) -> None:
    done = run_helm(helm, "template", "t", str(CHART), *values)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert expected in done.stderr, done.stderr


# ---- evaluation by a real Prometheus ------------------------------------------------------------

# The operator's metrics module with the gauges its reconciles set (metrics.record_*), for
# three pools in namespace "serving", served on argv[1] until the test ends it.
EXPORTER = """
import sys
import threading

from tandem_operator import metrics

# demo: prefill TTFT over its SLO (decode ITL under it), past its progress deadline, a refit
# under way, one of two decode engines ready (on the old version).
metrics.record_autoscaling(
    "serving", "demo",
    slo={("prefill", "ttft_seconds"): 0.5, ("decode", "itl_seconds"): 0.05},
    observed={("prefill", "ttft_seconds"): 2.0, ("decode", "itl_seconds"): 0.01})
metrics.record_conditions("serving", "demo", [
    {"type": "Ready", "status": "True", "reason": "Serving"},
    {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"},
    {"type": "Degraded", "status": "False", "reason": "AsExpected"},
    {"type": "Refitting", "status": "True", "reason": "Rolling"}])
metrics.record_pool_engines("serving", "demo", {
    ("prefill", "v2", "desired"): 1, ("prefill", "v2", "ready"): 1,
    ("decode", "v2", "desired"): 2, ("decode", "v2", "ready"): 0,
    ("decode", "v1", "ready"): 1})
# calm: under its SLO, settled, every engine ready though split over two versions.
metrics.record_autoscaling(
    "serving", "calm",
    slo={("prefill", "ttft_seconds"): 0.5, ("decode", "kv_usage"): 0.9},
    observed={("prefill", "ttft_seconds"): 0.3, ("decode", "kv_usage"): 0.5})
metrics.record_conditions("serving", "calm", [
    {"type": "Ready", "status": "True", "reason": "Serving"},
    {"type": "Progressing", "status": "False", "reason": "Complete"},
    {"type": "Degraded", "status": "False", "reason": "AsExpected"},
    {"type": "Refitting", "status": "False", "reason": "WeightsCurrent"}])
metrics.record_pool_engines("serving", "calm", {
    ("mixed", "v2", "desired"): 2, ("mixed", "v2", "ready"): 1, ("mixed", "v1", "ready"): 1})
# cold: a desired role without any ready series (the alert's `or`).
metrics.record_pool_engines("serving", "cold", {("prefill", "v1", "desired"): 1})

metrics.serve(int(sys.argv[1]), "127.0.0.1")
threading.Event().wait()
"""
# (alert, pool, role) of every alert that must fire, and nothing else may.
FIRING = {
    ("TandemSLOViolated", "demo", "prefill"),
    ("TandemRefitStuck", "demo", ""),
    ("TandemRolloutStuck", "demo", ""),
    ("TandemEnginesUnavailable", "demo", "decode"),
    ("TandemEnginesUnavailable", "cold", "prefill"),
}
# Short enough for a test: rules are evaluated every second.
QUICK = [arg for key in ALERTS.values() for arg in ("--set", f"alerts.{key}.for=2s")]


def alert_key(alert: dict[str, Any]) -> tuple[str, str, str]:
    labels = alert["labels"]
    return labels["alertname"], labels["pool"], labels.get("role", "")


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[int]:
    """The port of a process serving tandem_operator.metrics with EXPORTER's pools."""
    port, log = free_port(), tmp_path / "exporter.log"
    path = [str(ROOT / "operator"), str(ROOT / "engine_image"), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.Popen([sys.executable, "-c", EXPORTER, str(port)],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the exporter exited: {log.read_text()}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("the exporter's /metrics", answers, timeout=20)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_rules(rules: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no promtool binary: `make test-tools` (apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_the_alerts_fire_in_a_real_prometheus_for_the_pools_they_name(
        helm: Path, exporter: int, tmp_path: Path) -> None:
    rule = one(render(helm, *RULE_API, *QUICK), "PrometheusRule")
    rules = tmp_path / "tandem.rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))

    check_rules(rules)
    prometheus = Prometheus(tmp_path, {"operator": [f"127.0.0.1:{exporter}"]}, rules=(rules,))
    alerts: list[dict[str, Any]] = []
    try:
        prometheus.wait_all_up()
        assert [g["name"] for g in prometheus.api("rules")["groups"]] == ["tandem"]

        def firing() -> bool:
            alerts[:] = prometheus.api("alerts")["alerts"]
            return {alert_key(a) for a in alerts if a["state"] == "firing"} >= FIRING
        wait_for("the alerts to fire", firing, timeout=30)

        assert {alert_key(a) for a in alerts} == FIRING  # none pending besides
        assert not [a for a in alerts if a["labels"]["pool"] == "calm"]
        by_key = {alert_key(a): a for a in alerts}
        for (alert, pool, _), found in by_key.items():
            assert found["labels"]["namespace"] == "serving"
            assert found["labels"]["severity"] == "warning"
            assert f"serving/{pool}" in found["annotations"]["summary"], found
            assert f"serving/{pool}" in found["annotations"]["description"], found
            assert "{{" not in found["annotations"]["description"], alert
        slo = by_key[("TandemSLOViolated", "demo", "prefill")]
        assert slo["labels"]["metric"] == "ttft_seconds"
        assert float(slo["value"]) == 2.0  # what was observed, beside its bound of 0.5
        assert "ttft_seconds = 2 " in slo["annotations"]["description"]
        assert by_key[("TandemRolloutStuck", "demo", "")]["labels"]["reason"] == \
            "ProgressDeadlineExceeded"
        assert by_key[("TandemRefitStuck", "demo", "")]["labels"]["reason"] == "Rolling"
        engines = by_key[("TandemEnginesUnavailable", "demo", "decode")]
        assert "wants 2 decode engines" in engines["annotations"]["description"]
        assert "weights_version" not in engines["labels"]  # summed over versions
    finally:
        prometheus.stop()
        print(f"---- alerts ----\n{yaml.safe_dump(alerts)}")
        print(f"---- prometheus (tail) ----\n{prometheus.log.read_text()[-3000:]}")
