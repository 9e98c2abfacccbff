"""Monitoring objects, checked offline: the pool's PodMonitor and the pods' scrape annotations
(pure manifest builders and the plan), spec.monitoring in the CRD, and what the chart renders
for Prometheus and Grafana (the operator's ServiceMonitor, the dashboard ConfigMap).

No prometheus-operator schema is available offline, so the PodMonitor is checked against the
pods it must reach (selector, named ports); the built-in objects are validated strictly with
kubernetes-validate. The dashboard's queries are run against a real Prometheus in
test_dashboard_prometheus.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tandem_operator import manifests as m
from tandem_operator.plan import CreateObject, DeleteObject, Observed, PatchObject, plan
from tandem_operator.spec import PoolSpec, SpecError
from test_chart import CHART, KUBE_VERSION, by_kind, one, render, run_helm
from test_chart import helm as helm
from test_crd import minimal_pool, validate

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = CHART / "dashboards" / "tandem.json"
SERVICE_MONITOR_API = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]


def parse(**spec: Any) -> PoolSpec:
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": "serving", "uid": "uid-1"},
            "spec": {"model": {"name": "llama", "weights": {"uri": "file:///models/llama",
                                                            "version": "v1"}}, **spec}}
    return PoolSpec.from_body(body)


MONITORED = {"monitoring": {"podMonitor": {"enabled": True, "interval": "15s",
                                           "labels": {"release": "kube-prometheus-stack"}}}}


def container_ports(pod: dict[str, Any]) -> dict[str, int]:
    [container] = pod["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# ---- pods: Prometheus' annotations --------------------------------------------------------------


@pytest.mark.parametrize(("group", "port"), [("prefill", 9100), ("decode", 9100),
                                              ("router", 8000)])
def test_pods_carry_scrape_annotations_on_a_port_they_serve(group: str, port: int) -> None:
    spec = parse(prefill={"replicas": 1})
    pod = m.pod(spec, group, spec.weights)  # type: ignore[arg-type]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port
    assert port in container_ports(pod).values()
    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)


# ---- the PodMonitor -----------------------------------------------------------------------------


def test_the_pod_monitor_is_off_unless_asked_for() -> None:
    assert m.monitoring_objects(parse()) == []
    assert m.monitoring_objects(parse(monitoring={"podMonitor": {}})) == []
    assert parse().pod_monitor.interval == "30s"


def test_the_pod_monitor_reaches_engines_and_routers_on_their_metrics_ports() -> None:
    spec = parse(prefill={"replicas": 1}, **MONITORED)
    [monitor] = m.monitoring_objects(spec)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    meta = monitor["metadata"]
    assert (meta["name"], meta["namespace"]) == ("pool", "serving")
    assert meta["ownerReferences"] == [m.owner_reference(spec)]
    assert meta["labels"]["release"] == "kube-prometheus-stack"  # for podMonitorSelector
    assert meta["labels"][m.POOL_LABEL] == "pool"
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert all(e["interval"] == "15s" and e["path"] == "/metrics" for e in endpoints)
    scraped: dict[str, int] = {}
    for group in ("prefill", "decode", "router"):
        pod = m.pod(spec, group, spec.weights)  # type: ignore[arg-type]
        assert selector.items() <= pod["metadata"]["labels"].items(), group
        ports = container_ports(pod)
        [port] = [ports[e["port"]] for e in endpoints if e["port"] in ports]
        scraped[group] = port
    assert scraped == {"prefill": m.ENGINE_METRICS_PORT, "decode": m.ENGINE_METRICS_PORT,
                       "router": m.ROUTER_HTTP_PORT}
    # The engines' admin port (token-protected) is never a scrape target.
    assert m.ENGINE_ADMIN_PORT not in scraped.values()
    # Every series gets the pool's name as `pool`, the dashboard's filter.
    for endpoint in endpoints:
        assert endpoint["relabelings"] == [{
            "sourceLabels": ["__meta_kubernetes_pod_label_tandem_dev_pool"],
            "targetLabel": "pool", "action": "replace"}]


def test_the_pod_monitor_is_planned_only_where_the_cluster_serves_it() -> None:
    spec = parse(**MONITORED)
    key = ("PodMonitor", "pool")

    def monitor_actions(observed: Observed) -> list[Any]:
        return [a for a in plan(spec, observed)
                if (isinstance(a, CreateObject) and a.body["kind"] == "PodMonitor")
                or (isinstance(a, DeleteObject | PatchObject) and a.kind == "PodMonitor")]

    assert monitor_actions(Observed()) == []  # no prometheus-operator: nothing to create
    [create] = monitor_actions(Observed(monitoring_served=True))
    assert create == CreateObject(m.pod_monitor(spec))
    have = m.pod_monitor(spec)
    assert monitor_actions(Observed(objects={key: have}, monitoring_served=True)) == []
    # Labels others add stay; ours and the endpoints are put back.
    drifted = json.loads(json.dumps(have))
    drifted["metadata"]["labels"]["team"] = "ml"
    drifted["spec"]["podMetricsEndpoints"][0]["interval"] = "5m"
    [patch] = monitor_actions(Observed(objects={key: drifted}, monitoring_served=True))
    assert patch == PatchObject("PodMonitor", "pool", {
        "spec": {"podMetricsEndpoints": have["spec"]["podMetricsEndpoints"]}})
    # Disabled: the one it made goes.
    off = parse(monitoring={"podMonitor": {"enabled": False}})
    actions = plan(off, Observed(objects={key: have}, monitoring_served=True))
    assert DeleteObject("PodMonitor", "pool") in actions


@pytest.mark.parametrize(("monitoring", "message"), [
    ({"podMonitor": {"interval": "30"}}, "is not a Prometheus duration"),
    ({"podMonitor": {"enabled": "yes"}}, "must be true or false"),
    ({"podMonitor": {"labels": {"release": "kube prometheus"}}}, "must be a label value"),
    ({"podMonitor": []}, "must be an object"),
])
def test_the_operator_refuses_a_bad_monitoring_spec(monitoring: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(monitoring=monitoring)


def test_the_crd_takes_spec_monitoring() -> None:
    assert validate(minimal_pool(**MONITORED)) == []
    errors = validate(minimal_pool(monitoring={"podMonitor": {"interval": "soon"}}))
    assert [f for f, _ in errors] == ["spec.monitoring.podMonitor.interval"]
    errors = validate(minimal_pool(monitoring={"serviceMonitor": {}}))
    assert errors and errors[0][0] == "spec.monitoring"


# ---- the chart ----------------------------------------------------------------------------------


def test_the_chart_renders_no_monitoring_objects_by_default(helm: Path) -> None:
    kinds = {o["kind"] for o in render(helm, *SERVICE_MONITOR_API)}
    assert "ServiceMonitor" not in kinds and "ConfigMap" not in kinds


def test_the_service_monitor_needs_its_crd_in_the_cluster(helm: Path) -> None:
    enabled = ["--set", "metrics.serviceMonitor.enabled=true"]
    assert by_kind(render(helm, *enabled), "ServiceMonitor") == []
    objects = render(helm, *enabled, *SERVICE_MONITOR_API,
                     "--set", "metrics.serviceMonitor.labels.release=kps",
                     "--set", "metrics.serviceMonitor.interval=10s")
    monitor, service = one(objects, "ServiceMonitor"), one(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {
        "matchNames": [service["metadata"]["namespace"]]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "10s")
    # The operator's namespace and pool labels are the pools', not the target's.
    assert endpoint["honorLabels"] is True


def test_the_service_monitor_without_its_service_is_refused(helm: Path) -> None:
    done = run_helm(helm, "template", "t", str(CHART), *SERVICE_MONITOR_API,
                    "--set", "metrics.serviceMonitor.enabled=true",
                    "--set", "metrics.service.enabled=false")
    assert done.returncode != 0
    assert "set metrics.service.enabled=true as well" in done.stderr


def test_the_dashboard_ships_in_a_grafana_config_map(helm: Path) -> None:
    objects = render(helm, "--set", "dashboard.enabled=true",
                     "--set", "dashboard.namespace=monitoring",
                     "--set", "dashboard.annotations.grafana_folder=Tandem")
    config_map = one(objects, "ConfigMap")
    kubernetes_validate.validate(config_map, KUBE_VERSION, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Tandem"}
    assert json.loads(config_map["data"]["tandem.json"]) == json.loads(DASHBOARD.read_text())
    done = run_helm(helm, "lint", "--strict", str(CHART), "--set", "dashboard.enabled=true",
                    "--set", "metrics.serviceMonitor.enabled=true")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("values", "expected"), [
    (["--set", "metrics.serviceMonitor.interval=often"], "/metrics/serviceMonitor/interval"),
    (["--set", "metrics.serviceMonitor.enable=true"], "enable"),
    (["--set", "dashboard.namespace=Monitoring"], "/dashboard/namespace"),
    (["--set", "dashboard.label=x"], "label"),
])
def test_the_monitoring_values_are_checked(helm: Path, values: list[str],
                                           expected: str) -> None:
    done = run_helm(helm, "template", "t", str(CHART), *values)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert expected in done.stderr, done.stderr


# ---- the dashboard's own shape ------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_model_on_a_prometheus_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"pool", "model_name"} <= variables.keys()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["title"] and p["description"], p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    cells = set()  # no two panels overlap on the 24-column grid
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, p["title"]
        cells |= area
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("requests", "tokens", "first token", "inter-token", "end-to-end", "queue",
                  "kv cache", "prefix", "handoff bytes", "handoff latency", "handoff failures",
                  "lifecycle", "weights version", "refit", "reconcile"):
        assert topic in titles, topic


def test_the_crd_folder_is_still_the_charts() -> None:
    # spec.monitoring lives in crds/ only; the chart's crds/ is a link to it.
    assert (CHART / "crds").resolve() == (ROOT / "crds").resolve()
    crd = yaml.safe_load((ROOT / "crds" / "inferencepools.tandem.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "podMonitor" in spec["properties"]["monitoring"]["properties"]
