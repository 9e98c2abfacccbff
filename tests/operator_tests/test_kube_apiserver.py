"""API semantics of the test cluster's API server, checked with real kubectl and clients.

Each test names the Kubernetes behaviour it pins down; the operator, router and kubelet tests
rely on every one of them (see tests/kcluster/ for why each exists).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes.client as k8s
import pytest
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:  # noqa: F811
    """The shared per-test cluster (kcluster.fixtures), under a shorter name."""
    return test_cluster
WIDGETS = ("tandem.test", "v1", "widgets")

# A small CRD exercising what the project's CRD uses: status subresource, printer columns,
# defaults (nested), int-or-string, preserve-unknown-fields and CEL (with a transition rule).
WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.tandem.test"},
    "spec": {
        "group": "tandem.test", "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget",
                  "shortNames": ["wd"], "categories": ["gadgets"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
            "additionalPrinterColumns": [
                {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                {"name": "Ready", "type": "string",
                 "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "default": {}, "properties": {
                    "size": {"type": "integer", "minimum": 1, "maximum": 10, "default": 1,
                             "x-kubernetes-validations": [
                                 {"rule": "self >= oldSelf", "message": "size may only grow"}]},
                    "color": {"type": "string", "enum": ["Red", "Blue"], "default": "Red"},
                    "limits": {"type": "object", "default": {}, "properties": {
                        "cpu": {"x-kubernetes-int-or-string": True, "default": 1}}},
                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
                    "x-kubernetes-validations": [
                        {"rule": "self.color != 'Blue' || self.size > 2",
                         "message": "blue widgets need size > 2"}]},
                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            }}},
        }],
    },
}


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tandem.test/v1", "kind": "Widget", "metadata": {"name": name},
            "spec": spec}


def pod(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}, **meta},
            "spec": {"containers": [{"name": "main", "image": "busybox:1"}]}}


def http(cluster: TestCluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, timeout=10)


def watch(cluster: TestCluster, path: str, **params: Any) -> list[dict[str, Any]]:
    """The events of a watch that ends by itself, by default after 0.3 s.

    (The real server takes whole seconds only; the test server also takes fractions.)
    """
    params = {"watch": "1", "timeoutSeconds": "0.3", **params}
    with http(cluster) as client, client.stream("GET", path, params=params) as response:
        assert response.status_code == 200
        return [json.loads(line) for line in response.iter_lines() if line]


def names(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"].get("name", "")) for e in events]


# -- startup, discovery ------------------------------------------------------------------------

def test_cluster_starts_in_well_under_half_a_second() -> None:
    started = time.monotonic()
    with TestCluster() as cluster:
        assert cluster.kubeconfig.is_file()
        assert cluster.url.startswith("http://127.0.0.1:")
    assert time.monotonic() - started < 0.5


def test_discovery_serves_core_builtin_and_crd_groups(cluster: TestCluster) -> None:
    cluster.install_crds(REPO / "crds")
    with http(cluster) as client:
        core = client.get("/api/v1").json()
        groups = {g["name"]: g["preferredVersion"]["groupVersion"]
                  for g in client.get("/apis").json()["groups"]}
    assert core["groupVersion"] == "v1"
    entries = {r["name"]: r for r in core["resources"]}
    assert entries["pods"]["shortNames"] == ["po"] and entries["pods"]["namespaced"] is True
    assert "shortNames" not in entries["pods/status"]
    assert entries["namespaces"]["namespaced"] is False
    for group_version in ("apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1",
                          "coordination.k8s.io/v1", "apiextensions.k8s.io/v1",
                          "events.k8s.io/v1", "tandem.dev/v1alpha1", "kopf.dev/v1"):
        assert groups[group_version.split("/")[0]] == group_version

    table = cluster.kubectl("api-resources", "--no-headers").stdout
    rows = {line.split()[0] + "@" + line.split()[-3]: line.split() for line in table.splitlines()}
    assert rows["pods@v1"] == ["pods", "po", "v1", "true", "Pod"]
    assert rows["inferencepools@tandem.dev/v1alpha1"][1:] == [
        "ipool", "tandem.dev/v1alpha1", "true", "InferencePool"]
    assert rows["clusterkopfpeerings@kopf.dev/v1"][-2] == "false"
    versions = k8s.CoreApi(cluster.client()).get_api_versions()
    assert versions.versions == ["v1"]


# -- object metadata, errors, optimistic concurrency -------------------------------------------

def test_create_stamps_metadata_and_answers_201(cluster: TestCluster) -> None:
    with http(cluster) as client:
        created = client.post("/api/v1/namespaces/default/configmaps",
                              json={"metadata": {"name": "a"}, "data": {"k": "v"}})
        again = client.post("/api/v1/namespaces/default/configmaps",
                            json={"metadata": {"name": "a"}})
        generated = client.post("/api/v1/namespaces/default/configmaps",
                                json={"metadata": {"generateName": "cfg-"}}).json()
        listing = client.get("/api/v1/namespaces/default/configmaps").json()
        missing = client.get("/api/v1/namespaces/default/configmaps/nope")
    assert created.status_code == 201
    meta = created.json()["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    assert int(generated["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert generated["metadata"]["name"].startswith("cfg-")
    assert len(generated["metadata"]["name"]) == len("cfg-") + 5
    assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"
    assert missing.status_code == 404 and missing.json()["reason"] == "NotFound"
    assert listing["kind"] == "ConfigMapList" and listing["apiVersion"] == "v1"
    assert listing["metadata"]["resourceVersion"] == generated["metadata"]["resourceVersion"]

    # The kubernetes client deserialises 201s (with 200 it returned None for custom objects).
    cluster.create(WIDGET_CRD)
    custom = k8s.CustomObjectsApi(cluster.client())
    body = custom.create_namespaced_custom_object(*WIDGETS[:2], "default", WIDGETS[2],
                                                  widget("w1", size=2))
    assert body["metadata"]["name"] == "w1" and body["spec"]["size"] == 2

    failed = cluster.kubectl("get", "pod", "nope", check=False)
    assert failed.stderr.strip() == 'Error from server (NotFound): pods "nope" not found'
    cluster.kubectl("create", "configmap", "b")
    failed = cluster.kubectl("create", "configmap", "b", check=False)
    assert failed.stderr == 'error: failed to create configmap: configmaps "b" already exists\n'


def test_stale_resource_versions_conflict(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())
    first = v1.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
    stale = first.metadata.resource_version
    first.data = {"a": "1"}
    fresh = v1.replace_namespaced_config_map("c", "default", first).metadata.resource_version
    assert int(fresh) > int(stale)

    first.metadata.resource_version = stale
    with pytest.raises(ApiException) as update:
        v1.replace_namespaced_config_map("c", "default", first)
    with pytest.raises(ApiException) as merge:
        v1.patch_namespaced_config_map("c", "default", {"metadata": {"resourceVersion": stale}})
    assert update.value.status == merge.value.status == 409
    assert json.loads(update.value.body)["reason"] == "Conflict"

    # kopf's finalizer patches: a JSON patch guarded by a `test` of the resourceVersion.
    path = "/api/v1/namespaces/default/configmaps/c"
    headers = {"Content-Type": "application/json-patch+json"}
    with http(cluster) as client:
        ok = client.patch(path, headers=headers, content=json.dumps([
            {"op": "test", "path": "/metadata/resourceVersion", "value": fresh},
            {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]}]))
        late = client.patch(path, headers=headers, content=json.dumps([
            {"op": "test", "path": "/metadata/resourceVersion", "value": fresh},
            {"op": "remove", "path": "/metadata/finalizers"}]))
    assert ok.status_code == 200 and ok.json()["metadata"]["finalizers"] == ["x/y"]
    assert late.status_code == 422


def test_generation_moves_with_spec_and_status_is_a_subresource(cluster: TestCluster,
                                                                ) -> None:
    cluster.create(WIDGET_CRD)
    custom = k8s.CustomObjectsApi(cluster.client())
    args = (*WIDGETS[:2], "default", WIDGETS[2], "w")
    created = custom.create_namespaced_custom_object(
        *args[:4], {**widget("w", size=2), "status": {"ignored": True}})
    assert "status" not in created and created["metadata"]["generation"] == 1

    status = custom.patch_namespaced_custom_object_status(*args, {"status": {"phase": "Up"}})
    labeled = custom.patch_namespaced_custom_object(*args, {"metadata": {"labels": {"a": "b"}}})
    sneaky = custom.patch_namespaced_custom_object(*args, {"status": {"phase": "Down"}})
    resized = custom.patch_namespaced_custom_object(*args, {"spec": {"size": 3}})
    assert status["status"] == {"phase": "Up"} and status["metadata"]["generation"] == 1
    assert labeled["metadata"]["generation"] == 1
    assert sneaky["status"] == {"phase": "Up"}
    assert resized["metadata"]["generation"] == 2 and resized["status"] == {"phase": "Up"}

    whole = {**resized, "spec": {"size": 9}, "status": {"phase": "Gone"}}
    via_status = custom.replace_namespaced_custom_object_status(*args, whole)
    assert via_status["spec"]["size"] == 3 and via_status["status"] == {"phase": "Gone"}

    v1 = k8s.CoreV1Api(cluster.client())
    v1.create_namespaced_pod("default", pod("p"))
    v1.patch_namespaced_pod("p", "default", {"status": {"phase": "Running"}})
    assert v1.read_namespaced_pod("p", "default").status.phase == "Pending"
    v1.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running",
                                                               "podIP": "127.0.0.9"}})
    running = v1.read_namespaced_pod_status("p", "default")
    assert (running.status.phase, running.status.pod_ip) == ("Running", "127.0.0.9")


# -- selectors ---------------------------------------------------------------------------------

def test_label_and_field_selectors_on_list_and_watch(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())
    for name, labels in (("a", {"app": "x", "tier": "1"}), ("b", {"app": "y"}),
                         ("c", {"app": "z", "tier": "2"})):
        v1.create_namespaced_pod("default", pod(name, labels))
    v1.patch_namespaced_pod_status("c", "default", {"status": {"phase": "Running"}})
    cluster.kubectl("create", "namespace", "other")
    v1.create_namespaced_pod("other", pod("a", {"app": "x"}))

    def listed(label: str = "", field: str = "", namespace: str = "default") -> list[str]:
        items = v1.list_namespaced_pod(namespace, label_selector=label,
                                       field_selector=field).items
        return sorted(p.metadata.name for p in items)

    assert listed("app=x") == listed("app==x") == ["a"]
    assert listed("app!=x") == ["b", "c"]
    assert listed("app in (x,z)") == ["a", "c"]
    assert listed("app notin (x, z)") == ["b"]
    assert listed("tier") == ["a", "c"] and listed("!tier") == ["b"]
    assert listed("app in (x,z),tier=2") == ["c"]
    assert listed(field="metadata.name=b") == ["b"]
    assert listed(field="status.phase=Running") == ["c"]
    assert listed(field="status.phase!=Running,metadata.name!=a") == ["b"]
    everywhere = v1.list_pod_for_all_namespaces(field_selector="metadata.namespace=other")
    assert [p.metadata.name for p in everywhere.items] == ["a"]
    assert cluster.kubectl("get", "pods", "-l", "tier", "-o", "name").stdout.split() == [
        "pod/a", "pod/c"]

    since = v1.list_namespaced_pod("default").metadata.resource_version
    v1.patch_namespaced_pod("b", "default", {"metadata": {"labels": {"tier": "3"}}})
    v1.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"tier": None}}})
    v1.delete_namespaced_pod("c", "default")
    events = watch(cluster, "/api/v1/namespaces/default/pods", labelSelector="tier",
                   resourceVersion=since)
    # b moves into the selection (ADDED), a moves out (DELETED), c is deleted.
    assert names(events) == [("ADDED", "b"), ("DELETED", "a"), ("DELETED", "c")]
    events = watch(cluster, "/api/v1/namespaces/default/pods",
                   fieldSelector="metadata.name=b")
    assert names(events) == [("ADDED", "b")]


# -- patches -----------------------------------------------------------------------------------

POD_YAML = """
apiVersion: v1
kind: Pod
metadata: {name: web, labels: {app: web}}
spec:
  containers:
  - name: main
    image: nginx:1
    env: [{name: A, value: "1"}, {name: B, value: "2"}]
    ports: [{containerPort: 80}]
"""


def test_patch_types_merge_lists_by_their_keys(cluster: TestCluster) -> None:
    cluster.kubectl("apply", "-f", "-", input=POD_YAML)
    cluster.kubectl("apply", "-f", "-", input=POD_YAML.replace('value: "2"', 'value: "3"'))
    cluster.kubectl("patch", "pod", "web", "-p", json.dumps({"spec": {"containers": [
        {"name": "side", "image": "busybox:1"},
        {"name": "main", "ports": [{"containerPort": 81}], "env": [{"name": "C", "value": "4"}]},
    ]}}))
    cluster.kubectl("patch", "pod", "web", "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/metadata/labels/tier", "value": "front"},
        {"op": "replace", "path": "/spec/containers/0/image", "value": "nginx:2"}]))
    cluster.kubectl("patch", "pod", "web", "--type=merge", "-p",
                         '{"metadata": {"labels": {"app": null}}}')
    cluster.kubectl("patch", "pod", "web", "--subresource=status", "-p", json.dumps(
        {"status": {"conditions": [{"type": "Ready", "status": "False"},
                                   {"type": "PodScheduled", "status": "True"}]}}))
    cluster.kubectl("patch", "pod", "web", "--subresource=status", "-p", json.dumps(
        {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}))
    web = json.loads(cluster.kubectl("get", "pod", "web", "-o", "json").stdout)
    main, side = web["spec"]["containers"]
    assert (main["name"], main["image"], side["name"]) == ("main", "nginx:2", "side")
    assert main["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "3"},
                           {"name": "C", "value": "4"}]
    assert [p["containerPort"] for p in main["ports"]] == [80, 81]
    assert web["metadata"]["labels"] == {"tier": "front"}
    assert {c["type"]: c["status"] for c in web["status"]["conditions"]} == {
        "Ready": "True", "PodScheduled": "True"}

    # Custom resources take merge and JSON patches; strategic merge is refused as upstream.
    cluster.create(WIDGET_CRD)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(widget("w", size=2)))
    cluster.kubectl("patch", "widget", "w", "--type=merge", "-p", '{"spec":{"size":4}}')
    refused = cluster.kubectl("patch", "widget", "w", "--type=strategic", "-p", "{}",
                                   check=False)
    assert refused.returncode != 0 and "is not supported by tandem.test/v1" in refused.stderr
    assert cluster.kubectl("get", "wd", "w", "-o", "jsonpath={.spec.size}").stdout == "4"


def test_server_side_apply_creates_updates_and_drops_fields(cluster: TestCluster) -> None:
    path = "/api/v1/namespaces/default/configmaps/ssa"
    headers = {"Content-Type": "application/apply-patch+yaml"}
    params = {"fieldManager": "helm"}
    with http(cluster) as client:
        created = client.patch(path, params=params, headers=headers, content=(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: ssa}\ndata: {a: '1', b: '2'}\n"))
        client.patch(path, headers={"Content-Type": "application/merge-patch+json"},
                     content='{"data": {"other": "kept"}}')
        updated = client.patch(path, params=params, headers=headers, content=(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: ssa}\ndata: {a: '9'}\n"))
    assert created.status_code == 201 and updated.status_code == 200
    assert updated.json()["data"] == {"a": "9", "other": "kept"}
    cluster.kubectl("apply", "--server-side", "-f", "-", input=POD_YAML)
    assert cluster.kubectl("get", "pod", "web", "-o", "name").stdout.strip() == "pod/web"


# -- deletion ----------------------------------------------------------------------------------

def test_finalizers_hold_deletion_until_removed(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())
    v1.create_namespaced_config_map("default", {"metadata": {"name": "f",
                                                             "finalizers": ["tandem.dev/x"]}})
    since = v1.read_namespaced_config_map("f", "default").metadata.resource_version
    with http(cluster) as client:
        pending = client.delete("/api/v1/namespaces/default/configmaps/f")
    assert pending.status_code == 202
    held = v1.read_namespaced_config_map("f", "default")
    assert held.metadata.deletion_timestamp is not None
    v1.patch_namespaced_config_map("f", "default", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as gone:
        v1.read_namespaced_config_map("f", "default")
    assert gone.value.status == 404
    events = watch(cluster, "/api/v1/namespaces/default/configmaps", resourceVersion=since)
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED", "DELETED"]


def test_owner_references_are_garbage_collected(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())

    def owner(name: str) -> dict[str, Any]:
        uid = v1.create_namespaced_config_map("default", {"metadata": {"name": name}}).metadata.uid
        return {"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": uid,
                "controller": True, "blockOwnerDeletion": True}

    def dependent(name: str, *owners: dict[str, Any], finalizers: Any = None) -> None:
        meta = {"name": name, "ownerReferences": list(owners), "finalizers": finalizers}
        v1.create_namespaced_config_map("default", {"metadata": meta})

    def existing() -> set[str]:
        return {c.metadata.name for c in v1.list_namespaced_config_map("default").items}

    background, second = owner("bg"), owner("second")
    dependent("bg-1", background)
    dependent("bg-2", background, second)
    v1.create_namespaced_pod("default", {**pod("bg-pod"), "metadata": {
        "name": "bg-pod", "ownerReferences": [background]}})
    v1.delete_namespaced_config_map("bg", "default")
    assert existing() == {"second", "bg-2"}
    assert v1.list_namespaced_pod("default").items == []
    refs = v1.read_namespaced_config_map("bg-2", "default").metadata.owner_references
    assert [r.name for r in refs] == ["second"]

    foreground = owner("fg")
    dependent("fg-1", foreground, finalizers=["tandem.dev/hold"])
    v1.delete_namespaced_config_map("fg", "default", propagation_policy="Foreground")
    held = v1.read_namespaced_config_map("fg", "default").metadata
    assert held.deletion_timestamp and held.finalizers == ["foregroundDeletion"]
    v1.patch_namespaced_config_map("fg-1", "default", {"metadata": {"finalizers": None}})
    assert not existing() & {"fg", "fg-1"}

    orphaner = owner("orphaner")
    dependent("orphan", orphaner)
    v1.delete_namespaced_config_map("orphaner", "default", propagation_policy="Orphan")
    assert "orphan" in existing() and "orphaner" not in existing()
    assert not v1.read_namespaced_config_map("orphan", "default").metadata.owner_references


def test_bound_pods_terminate_gracefully(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())
    for name in ("bound", "short", "unbound"):
        v1.create_namespaced_pod("default", pod(name))
    path = "/api/v1/namespaces/default/pods"
    with http(cluster) as client:
        for name in ("bound", "short"):
            bind = client.post(f"{path}/{name}/binding", json={
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"}})
            assert bind.status_code == 201
        again = client.post(f"{path}/bound/binding", json={"target": {"name": "node-2"}})
        assert again.status_code == 409
        since = client.get(path).json()["metadata"]["resourceVersion"]
        terminating = client.delete(f"{path}/bound")
        short = client.delete(f"{path}/short", params={"gracePeriodSeconds": "5"}).json()
        unbound = client.delete(f"{path}/unbound")
    assert terminating.status_code == 202 and unbound.status_code == 200
    meta = terminating.json()["metadata"]
    assert meta["deletionTimestamp"] and meta["deletionGracePeriodSeconds"] == 30
    assert short["metadata"]["deletionGracePeriodSeconds"] == 5
    scheduled = v1.read_namespaced_pod("bound", "default")
    assert scheduled.spec.node_name == "node-1"
    assert [c.type for c in scheduled.status.conditions] == ["PodScheduled"]
    shown = cluster.kubectl("get", "pod", "bound", "--no-headers").stdout.split()
    assert shown[2] == "Terminating"

    # What the kubelet does once the container stopped: delete again with grace 0.
    v1.delete_namespaced_pod("bound", "default", grace_period_seconds=0)
    cluster.kubectl("delete", "pod", "short", "--grace-period=0", "--force")
    assert v1.list_namespaced_pod("default").items == []
    events = names(watch(cluster, path, resourceVersion=since))
    assert events[:3] == [("MODIFIED", "bound"), ("MODIFIED", "short"), ("DELETED", "unbound")]
    assert [e for e in events[3:] if e[0] == "DELETED"] == [("DELETED", "bound"),
                                                            ("DELETED", "short")]


def test_deleting_a_namespace_deletes_its_contents(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())
    with pytest.raises(ApiException) as missing:
        v1.create_namespaced_config_map("nowhere", {"metadata": {"name": "c"}})
    assert missing.value.status == 404
    cluster.kubectl("create", "namespace", "doomed")
    v1.create_namespaced_config_map("doomed", {"metadata": {"name": "c"}})
    v1.create_namespaced_pod("doomed", {**pod("p"), "spec": {
        "nodeName": "node-1", "containers": [{"name": "main", "image": "busybox:1"}]}})
    cluster.kubectl("delete", "namespace", "doomed", "--wait=false")
    assert v1.read_namespace("doomed").status.phase == "Terminating"
    assert v1.list_namespaced_config_map("doomed").items == []
    with pytest.raises(ApiException) as closed:
        v1.create_namespaced_config_map("doomed", {"metadata": {"name": "d"}})
    assert closed.value.status == 403
    v1.delete_namespaced_pod("p", "doomed", grace_period_seconds=0)
    assert "doomed" not in cluster.kubectl("get", "namespaces", "-o", "name").stdout


# -- watches -----------------------------------------------------------------------------------

def test_watch_replays_resumes_and_expires() -> None:
    with TestCluster(history_size=4) as cluster:
        v1 = k8s.CoreV1Api(cluster.client())
        for name in ("a", "b"):
            v1.create_namespaced_config_map("default", {"metadata": {"name": name}})
        path = "/api/v1/namespaces/default/configmaps"
        since = v1.list_namespaced_config_map("default").metadata.resource_version
        v1.create_namespaced_config_map("default", {"metadata": {"name": "c"}})

        started = time.monotonic()
        initial = watch(cluster, path, timeoutSeconds="1")
        assert names(initial) == [("ADDED", "a"), ("ADDED", "b"), ("ADDED", "c")]
        assert 1 <= time.monotonic() - started < 3  # timeoutSeconds ends the stream
        assert names(watch(cluster, path, resourceVersion="0")) == names(watch(cluster, path))
        assert names(watch(cluster, path, resourceVersion=since)) == [("ADDED", "c")]
        bookmarked = watch(cluster, path, sendInitialEvents="true", allowWatchBookmarks="true",
                           resourceVersionMatch="NotOlderThan")
        assert [e["type"] for e in bookmarked[:4]] == ["ADDED"] * 3 + ["BOOKMARK"]
        assert bookmarked[3]["object"]["metadata"]["annotations"] == {
            "k8s.io/initial-events-end": "true"}

        for index in range(5):  # pushes `since` out of the 4-event history
            v1.patch_namespaced_config_map("c", "default", {"data": {"i": str(index)}})
        expired = watch(cluster, path, resourceVersion=since)
        assert expired[0]["type"] == "ERROR"
        assert (expired[0]["object"]["code"], expired[0]["object"]["reason"]) == (410, "Expired")

        # Live delivery to an open watch, via the kubernetes client's Watch.
        latest = v1.list_namespaced_config_map("default").metadata.resource_version
        later = threading.Timer(0.3, v1.create_namespaced_config_map,
                                ("default", {"metadata": {"name": "live"}}))
        later.start()
        from kubernetes import watch as k8s_watch

        watcher, seen = k8s_watch.Watch(), []
        for event in watcher.stream(v1.list_namespaced_config_map, "default",
                                    resource_version=latest, timeout_seconds=3):
            seen.append((event["type"], event["object"].metadata.name))
            watcher.stop()
        later.join()
        assert seen == [("ADDED", "live")]


# -- custom resources --------------------------------------------------------------------------

def test_crd_is_served_with_printer_columns(cluster: TestCluster) -> None:
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    assert cluster.kubectl("get", "crd", "-o", "name").stdout.split() == [
        "customresourcedefinition.apiextensions.k8s.io/clusterkopfpeerings.kopf.dev",
        "customresourcedefinition.apiextensions.k8s.io/inferencepools.tandem.dev",
        "customresourcedefinition.apiextensions.k8s.io/kopfpeerings.kopf.dev"]
    cluster.kubectl("apply", "-f", str(REPO / "examples" / "inferencepool.yaml"))
    pool = json.loads(cluster.kubectl("get", "ipool", "-o", "json").stdout)["items"][0]
    name = pool["metadata"]["name"]
    cluster.kubectl("patch", "ipool", name, "--subresource=status", "--type=merge", "-p",
                         json.dumps({"status": {
                             "conditions": [{"type": "Ready", "status": "True",
                                             "reason": "Serving", "message": "ok",
                                             "lastTransitionTime": "2026-12-01T00:00:00Z"}],
                             "prefill": {"ready": 1}, "decode": {"ready": 1},
                             "weights": {"current": "v1", "target": "v1"},
                             "refit": {"phase": "Succeeded"}, "adapterSummary": "none"}}))
    header, row = cluster.kubectl("get", "ipool").stdout.splitlines()
    crd = json.loads(cluster.kubectl("get", "crd", "inferencepools.tandem.dev",
                                          "-o", "json").stdout)
    columns = [c["name"].upper() for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]
               if not c.get("priority")]
    assert header.split() == ["NAME", *columns]
    cells = dict(zip(header.split(), row.split(), strict=True))
    assert cells["NAME"] == name and cells["READY"] == "True" and cells["WEIGHTS"] == "v1"
    assert cells["AGE"].endswith("s")
    assert crd["status"]["conditions"][-1]["type"] == "Established"
    cluster.kubectl("delete", "crd", "inferencepools.tandem.dev")
    assert cluster.kubectl("get", "ipool", check=False).returncode != 0


def test_kubectl_scale_sets_a_pool_s_decode_engines(cluster: TestCluster) -> None:
    """The scale subresource maps to spec.decode.replicas (prefill stays as set) and reports
    status.decode.replicas and the selector the operator writes, as an HPA reads them."""
    cluster.kubectl("apply", "-f", str(REPO / "crds" / "inferencepools.tandem.dev.yaml"))
    cluster.kubectl("apply", "-f", str(REPO / "examples" / "inferencepool.yaml"))
    name = cluster.kubectl("get", "ipool", "-o", "name").stdout.strip()
    before = json.loads(cluster.kubectl("get", name, "-o", "json").stdout)["spec"]
    cluster.kubectl("scale", name, "--replicas=3")
    after = json.loads(cluster.kubectl("get", name, "-o", "json").stdout)["spec"]
    assert after["decode"]["replicas"] == 3
    assert after["prefill"] == before["prefill"]
    selector = f"tandem.dev/pool={name.split('/')[-1]},app.kubernetes.io/component=decode"
    cluster.kubectl("patch", name, "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"decode": {"replicas": 2}, "selector": selector}}))
    scale = json.loads(cluster.kubectl("get", name, "--subresource=scale", "-o", "json").stdout)
    assert (scale["kind"], scale["spec"], scale["status"]) == (
        "Scale", {"replicas": 3}, {"replicas": 2, "selector": selector})
    cluster.kubectl("delete", "crd", "inferencepools.tandem.dev")


def test_crd_schema_prunes_defaults_and_validates(cluster: TestCluster) -> None:
    cluster.create(WIDGET_CRD)
    created = cluster.kubectl("apply", "-f", "-", "-o", "json", input=json.dumps(
        widget("w", size=3, unknown=1, limits={"cpu": "500m"}, extra={"free": {"form": 1}})))
    spec = json.loads(created.stdout)["spec"]
    assert spec == {"size": 3, "color": "Red", "limits": {"cpu": "500m"},
                    "extra": {"free": {"form": 1}}}
    bare = cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(
        {**widget("bare"), "spec": None}))
    assert json.loads(bare.stdout)["spec"] == {"size": 1, "color": "Red", "limits": {"cpu": 1}}

    failed = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps(
        widget("bad", size=11, color="Green", limits={"cpu": [1]})))
    assert 'The Widget "bad" is invalid:' in failed.stderr
    assert ("spec.size: Invalid value: 11: spec.size in body should be less than or equal "
            "to 10") in failed.stderr
    assert 'spec.color: Unsupported value: "Green": supported values: "Red", "Blue"' in \
        failed.stderr
    assert "spec.limits.cpu" in failed.stderr

    rule = cluster.kubectl("apply", "-f", "-", check=False,
                                input=json.dumps(widget("blue", color="Blue")))
    assert 'spec: Invalid value: "object": blue widgets need size > 2' in rule.stderr
    shrink = cluster.kubectl("patch", "widget", "w", "--type=merge", "-p",
                                  '{"spec": {"size": 2}}', check=False)
    assert 'spec.size: Invalid value: "integer": size may only grow' in shrink.stderr
    with http(cluster) as client:
        response = client.post("/apis/tandem.test/v1/namespaces/default/widgets",
                               json=widget("bad", size=0))
    status = response.json()
    assert response.status_code == 422 and status["reason"] == "Invalid"
    assert status["details"]["causes"][0]["field"] == "spec.size"


def test_project_crd_rejects_invalid_pools_with_readable_messages(cluster: TestCluster,
                                                                  ) -> None:
    cluster.install_crds(REPO / "crds")
    pool = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "bad"},
            "spec": {"model": {"name": "m", "weights": {"uri": "s3://bucket/model",
                                                        "version": "v1"}},
                     "prefill": {"replicas": 0}, "decode": {"replicas": 0}}}
    failed = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps(pool))
    assert "weights.uri must be a file://, pvc:// or oci:// URI" in failed.stderr
    assert "the pool needs at least one engine" in failed.stderr


# -- kubectl: protobuf bodies, events, workflows -----------------------------------------------

def test_kubectl_create_commands_that_send_protobuf(cluster: TestCluster) -> None:
    cluster.kubectl("create", "namespace", "n")
    cluster.kubectl("create", "secret", "generic", "s", "-n", "n", "--from-literal=a=b")
    cluster.kubectl("create", "configmap", "c", "-n", "n", "--from-literal=k=v")
    cluster.kubectl("create", "serviceaccount", "sa", "-n", "n")
    v1 = k8s.CoreV1Api(cluster.client())
    assert v1.read_namespaced_secret("s", "n").data == {"a": "Yg=="}
    assert v1.read_namespaced_config_map("c", "n").data == {"k": "v"}
    assert v1.read_namespace("n").metadata.labels == {"kubernetes.io/metadata.name": "n"}


def test_events_of_both_apis_show_in_describe(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())
    uid = v1.create_namespaced_pod("default", pod("p")).metadata.uid
    v1.create_namespaced_event("default", {
        "metadata": {"generateName": "p."}, "type": "Normal", "reason": "Reconciled",
        "message": "all engines ready", "count": 1,
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": "p", "uid": uid},
        "source": {"component": "tandem-operator"}})
    k8s.EventsV1Api(cluster.client()).create_namespaced_event("default", {
        "metadata": {"name": "e2"}, "eventTime": "2025-01-01T00:00:00.000000Z",
        "reason": "Started", "note": "from events.k8s.io", "type": "Normal", "action": "Start",
        "reportingController": "tandem", "reportingInstance": "tandem-1",
        "regarding": {"kind": "Pod", "namespace": "default", "name": "p"}})
    described = cluster.kubectl("describe", "pod", "p").stdout
    assert "Reconciled" in described and "all engines ready" in described
    listed = cluster.kubectl("get", "events.v1.events.k8s.io", "-o", "name").stdout
    assert "event.events.k8s.io/e2" in listed


def test_kubectl_scale_edit_and_delete(cluster: TestCluster) -> None:
    cluster.kubectl("create", "deployment", "d", "--image=busybox:1", "--replicas=2",
                         check=False)  # protobuf for Deployment: not decoded
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "d"}}, "template": {
            "metadata": {"labels": {"app": "d"}},
            "spec": {"containers": [{"name": "main", "image": "busybox:1"}]}}}}))
    cluster.kubectl("scale", "deployment", "d", "--replicas=5")
    cluster.kubectl("edit", "deployment", "d",
                         env={"EDITOR": "sed -i s/busybox:1/busybox:2/", "KUBE_EDITOR": ""})
    deployment = json.loads(cluster.kubectl("get", "deploy", "d", "-o", "json").stdout)
    assert deployment["spec"]["replicas"] == 5
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "busybox:2"
    assert deployment["metadata"]["generation"] == 3
    cluster.kubectl("delete", "deployment", "d")
    assert cluster.kubectl("get", "deploy", "-o", "name").stdout == ""


def test_a_thousand_pod_creates_take_seconds(cluster: TestCluster) -> None:
    v1 = k8s.CoreV1Api(cluster.client())
    started = time.monotonic()
    for index in range(1000):
        v1.create_namespaced_pod("default", pod(f"p{index}", {"group": str(index % 10)}))
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"1,000 pod creates took {elapsed:.1f}s"
    assert len(v1.list_namespaced_pod("default", label_selector="group=3").items) == 100


# -- kopf ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("peering", [None, "tandem"], ids=["standalone", "peering"])
def test_kopf_operator_handles_create_and_delete(cluster: TestCluster, peering: str | None,
                                                 ) -> None:
    import kopf

    cluster.create(WIDGET_CRD)
    if peering:
        cluster.install_crds(REPO / "crds")
        cluster.create({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                        "metadata": {"name": peering, "namespace": "default"}})
    cluster.make_default()
    registry = kopf.OperatorRegistry()
    deleted: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        return kopf.login_via_client(**kwargs)  # reads the kubeconfig make_default() set

    @kopf.on.create(*WIDGETS, registry=registry, id="grow")
    def grow(spec: Any, patch: Any, **_: Any) -> None:
        patch.status["size"] = spec["size"]

    @kopf.on.delete(*WIDGETS, registry=registry)
    def forget(name: str, **_: Any) -> None:
        deleted.append(name)

    def read() -> dict[str, Any] | None:
        return cluster.call(cluster.server.store.get, WIDGETS[::2], "default", "w")

    async def until(condition: Any) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out; the widget is {read()}")

    async def scenario() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        operator = asyncio.create_task(kopf.operator(
            registry=registry, standalone=peering is None, peering_name=peering,
            clusterwide=False, namespaces=["default"], stop_flag=stop, ready_flag=ready))
        await asyncio.wait_for(ready.wait(), 10)
        await asyncio.to_thread(cluster.kubectl, "apply", "-f", "-",
                                input=json.dumps(widget("w", size=3)))
        await until(lambda: (read() or {}).get("status", {}).get("size") == 3)
        assert read()["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        await asyncio.to_thread(cluster.kubectl, "delete", "widget", "w", "--wait=false")
        await until(lambda: read() is None)
        if peering:  # the operator announced itself in the peering object
            body = cluster.kubectl("get", "kopfpeering", peering, "-o", "json").stdout
            assert json.loads(body).get("status")
        stop.set()
        await asyncio.wait_for(operator, 10)

    asyncio.run(scenario())
    assert deleted == ["w"]
