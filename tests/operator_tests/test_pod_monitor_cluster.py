"""The operator keeps a pool's PodMonitor on the test API server once prometheus-operator's
PodMonitor CRD is there: found through the group's discovery, created with the pool's other
objects, put back when edited, deleted when the spec no longer asks for it. (Without the CRD
the operator creates none and the pool still becomes Ready: test_dashboard_prometheus.py.)
The PodMonitor's contents are checked offline in test_monitoring_manifests.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from tandem_operator import manifests as m
from test_operator_cluster import (  # noqa: F401  (fixtures)
    Operator,
    cluster,
    operators,
    patch_spec,
    pool_manifest,
    wait_for,
    weights,
)

pytestmark = pytest.mark.slow

# prometheus-operator's CRD, cut down to what the API server needs to serve the kind.
POD_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"plural": "podmonitors", "singular": "podmonitor", "kind": "PodMonitor",
                       "listKind": "PodMonitorList"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {
                               "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def pod_monitors(cluster: TestCluster) -> list[dict[str, Any]]:  # noqa: F811
    return json.loads(cluster.kubectl("get", "podmonitors", "-o", "json").stdout)["items"]


def test_the_operator_keeps_the_pool_pod_monitor(
        cluster: TestCluster, operators: Callable[..., Operator],  # noqa: F811
        weights: Path) -> None:  # noqa: F811
    cluster.create(POD_MONITOR_CRD)
    operators()
    pool = yaml.safe_load(pool_manifest(weights))
    pool["spec"]["monitoring"] = {"podMonitor": {"enabled": True, "interval": "15s",
                                                 "labels": {"release": "kps"}}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pool))
    [monitor] = wait_for("the PodMonitor", lambda: pod_monitors(cluster), timeout=30)
    assert monitor["metadata"]["name"] == "demo"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["metadata"]["ownerReferences"][0]["kind"] == "InferencePool"
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e["interval"]) for e in endpoints] == [("metrics", "15s"),
                                                                ("http", "15s")]
    assert monitor["spec"]["selector"] == {"matchLabels": {m.POOL_LABEL: "demo"}}

    # An edit by hand is put back (the operator reads PodMonitors on every reconcile).
    cluster.kubectl("patch", "podmonitor", "demo", "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/podMetricsEndpoints/0/interval", "value": "5m"}]))
    wait_for("the interval put back", lambda: pod_monitors(cluster)[0]["spec"]
             ["podMetricsEndpoints"] == endpoints, timeout=30)

    patch_spec(cluster, {"monitoring": {"podMonitor": {"enabled": False}}})
    wait_for("the PodMonitor deleted", lambda: pod_monitors(cluster) == [], timeout=30)
