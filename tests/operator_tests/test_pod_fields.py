"""What every pool pod gets around its container, as pure manifests: a restricted security
context (non-root, no capabilities unless RDMA asks for IPC_LOCK, read-only root with a /tmp
emptyDir), a startup probe sized by spec.engine.startupTimeoutSeconds, and the pod-level
fields of spec.pod and spec.router's placement, each checked against Kubernetes' schema."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from tandem_operator import manifests as m
from tandem_operator.spec import (
    DEFAULT_STARTUP_TIMEOUT_S,
    RESERVED_ANNOTATIONS,
    RESERVED_LABELS,
    SpecError,
)
from test_crd import schema_node
from test_operator_manifests import CRD, TMP_ENV, TMP_MOUNT, TMP_VOLUME, container, parse

GROUPS = ("prefill", "decode", "router")
SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
          "whenUnsatisfiable": "DoNotSchedule"}
EVERYTHING: dict[str, Any] = {
    "engine": {"startupTimeoutSeconds": 600, "rdma": {"ipcLock": True},
               "kvCache": {"blockSize": 32},
               "volumes": [{"name": "models", "emptyDir": {}}],
               "volumeMounts": [{"name": "models", "mountPath": "/models"}],
               "initContainers": [{"name": "pull", "command": ["tandem", "models", "pull"],
                                   "volumeMounts": [{"name": "models",
                                                     "mountPath": "/models"}]}]},
    "prefill": {"nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    "router": {"nodeSelector": {"pool": "cpu"},
               "tolerations": [{"key": "cpu", "operator": "Equal", "value": "yes",
                                "effect": "NoSchedule"}],
               "affinity": {"podAntiAffinity": {
                   "preferredDuringSchedulingIgnoredDuringExecution": [{
                       "weight": 1, "podAffinityTerm": {
                           "topologyKey": "kubernetes.io/hostname",
                           "labelSelector": {"matchLabels": {"tandem.dev/role": "router"}}}}]}}},
    "pod": {"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror.creds"}],
            "labels": {"team": "ml", "app.kubernetes.io/version": "1.2"},
            "annotations": {"example.com/owner": "ml team"},
            "priorityClassName": "inference-high", "runtimeClassName": "nvidia",
            "topologySpreadConstraints": [
                SPREAD,
                {**SPREAD, "topologyKey": "kubernetes.io/hostname",
                 "whenUnsatisfiable": "ScheduleAnyway", "matchLabelKeys": ["pod-template-hash"],
                 "labelSelector": {"matchLabels": {"tandem.dev/pool": "pool"}}}]},
}


@pytest.mark.parametrize("variant", [{}, EVERYTHING], ids=["default", "everything"])
def test_every_pod_passes_the_kubernetes_1_32_schema(variant: dict[str, Any]) -> None:
    s = parse(**variant)
    for group in GROUPS:
        kubernetes_validate.validate(m.pod(s, group, s.weights), "1.32", strict=True)


def test_every_pod_runs_restricted() -> None:
    """The Pod Security Standard `restricted`, plus a read-only root filesystem: /tmp is an
    emptyDir and HOME points there (the native kernel's build cache, pulled models)."""
    s = parse(**EVERYTHING)
    plain = parse()
    for group in GROUPS:
        for spec in (s, plain):
            pod = m.pod(spec, group, spec.weights)["spec"]
            assert pod["securityContext"] == {
                "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"}}
            assert pod["volumes"][0] == TMP_VOLUME
            for c in [*pod["containers"], *pod.get("initContainers", [])]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["readOnlyRootFilesystem"] is True
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert c["volumeMounts"][0] == TMP_MOUNT
                assert [e for e in c["env"] if e["name"] in ("HOME", "TMPDIR")] == TMP_ENV


def test_ipc_lock_is_an_explicit_opt_in_for_engines_only() -> None:
    assert "add" not in container(m.pod(parse(), "decode", parse().weights))[
        "securityContext"]["capabilities"]
    s = parse(engine={"rdma": {"ipcLock": True}})
    for group in ("prefill", "decode"):
        caps = container(m.pod(s, group, s.weights))["securityContext"]["capabilities"]
        assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert "add" not in container(m.pod(s, "router", s.weights))["securityContext"][
        "capabilities"]


@pytest.mark.parametrize(("timeout", "tries"), [(None, DEFAULT_STARTUP_TIMEOUT_S // 2),
                                                (600, 300), (11, 6), (10, 5)])
def test_the_startup_probe_allows_startup_timeout_seconds(timeout: int | None,
                                                          tries: int) -> None:
    s = parse(engine={} if timeout is None else {"startupTimeoutSeconds": timeout})
    for group in ("prefill", "decode"):
        c = container(m.pod(s, group, s.weights))
        probe = c["startupProbe"]
        assert probe["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert probe["periodSeconds"] * probe["failureThreshold"] >= (
            timeout or DEFAULT_STARTUP_TIMEOUT_S)
        assert probe["failureThreshold"] == tries
        assert "initialDelaySeconds" not in c["livenessProbe"]  # the startup probe gates it
    router = container(m.pod(s, "router", s.weights))
    assert router["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert "initialDelaySeconds" not in router["livenessProbe"]


def test_the_block_size_reaches_the_engine() -> None:
    s = parse(engine={"kvCache": {"blockSize": 64}})
    for group in ("prefill", "decode"):
        args = container(m.pod(s, group, s.weights))["args"]
        assert args[args.index("--block-size") + 1] == "64"


def test_pod_fields_land_on_every_pod() -> None:
    s = parse(**EVERYTHING)
    for group in GROUPS:
        pod = m.pod(s, group, s.weights)
        spec, meta = pod["spec"], pod["metadata"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror.creds"}]
        assert spec["priorityClassName"] == "inference-high"
        assert spec["runtimeClassName"] == "nvidia"
        assert meta["labels"]["team"] == "ml"
        assert meta["labels"]["app.kubernetes.io/version"] == "1.2"
        assert meta["labels"]["tandem.dev/pool"] == "pool"  # the operator's stay
        assert meta["annotations"]["example.com/owner"] == "ml team"
        assert meta["annotations"]["tandem.dev/template-hash"] == m.template_hash(s, group)
        # Without a labelSelector a constraint spreads the pod's own group; one given stays.
        own, given = spec["topologySpreadConstraints"]
        assert own == {**SPREAD, "labelSelector": {"matchLabels": {
            "tandem.dev/pool": "pool", "app.kubernetes.io/component": group}}}
        assert given["labelSelector"] == {"matchLabels": {"tandem.dev/pool": "pool"}}
    for key in ("imagePullSecrets", "priorityClassName", "runtimeClassName",
                "topologySpreadConstraints"):
        assert key not in m.pod(parse(), "router", parse().weights)["spec"]


def test_routers_and_engines_are_placed_by_their_own_fields() -> None:
    s = parse(**EVERYTHING)
    router = m.pod(s, "router", s.weights)["spec"]
    assert router["nodeSelector"] == {"pool": "cpu"}
    assert router["tolerations"] == EVERYTHING["router"]["tolerations"]
    assert router["affinity"] == EVERYTHING["router"]["affinity"]
    prefill = m.pod(s, "prefill", s.weights)["spec"]
    assert prefill["nodeSelector"] == {"gpu": "h100"} and "affinity" not in prefill
    decode = m.pod(s, "decode", s.weights)["spec"]
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert key not in decode


def test_the_operator_keys_are_the_reserved_ones() -> None:
    """spec.py refuses exactly the labels and annotations manifests.py sets, and the CRD's
    CEL rules name the same keys."""
    s = parse()
    for group in GROUPS:
        meta = m.pod(s, group, s.weights)["metadata"]
        for key in meta["labels"]:
            assert key in RESERVED_LABELS or key.startswith("tandem.dev/"), key
        for key in meta["annotations"]:
            assert key in RESERVED_ANNOTATIONS or key.startswith("tandem.dev/"), key
    for field, reserved in (("labels", RESERVED_LABELS), ("annotations", RESERVED_ANNOTATIONS)):
        (rule,) = schema_node(f"spec.pod.{field}")["x-kubernetes-validations"]
        assert "'tandem.dev/'" in rule["rule"]
        assert all(f"'{key}'" in rule["rule"] for key in reserved)
    assert yaml.safe_load(CRD.read_text())  # the CRD the rules came from parses


@pytest.mark.parametrize(("spec", "message"), [
    ({"pod": {"labels": {"tandem.dev/role": "decode"}}},
     r"spec.pod.labels: 'tandem.dev/role' is the operator's own"),
    ({"pod": {"labels": {"app.kubernetes.io/component": "x"}}},
     r"spec.pod.labels: 'app.kubernetes.io/component' is the operator's own"),
    ({"pod": {"annotations": {"prometheus.io/port": "1"}}},
     r"spec.pod.annotations: 'prometheus.io/port' is the operator's own"),
    ({"pod": {"annotations": {"tandem.dev/template-hash": "x"}}},
     r"spec.pod.annotations: 'tandem.dev/template-hash' is the operator's own"),
    ({"pod": {"labels": {"team": "a b"}}}, r"spec.pod.labels\['team'\] must be a label value"),
    ({"pod": {"labels": {"bad key!": "x"}}}, r"spec.pod.labels: 'bad key!' is not a label"),
    ({"pod": {"labels": {f"k{i}": "v" for i in range(33)}}},
     "spec.pod.labels has 33 entries; at most 32"),
    ({"pod": {"imagePullSecrets": ["regcred"]}}, r"spec.pod.imagePullSecrets\[0\] must be"),
    ({"pod": {"imagePullSecrets": [{"name": "Reg"}]}},
     r"spec.pod.imagePullSecrets\[0\].name 'Reg' is not an object name"),
    ({"pod": {"priorityClassName": "High"}}, "spec.pod.priorityClassName 'High'"),
    ({"pod": {"runtimeClassName": "a_b"}}, "spec.pod.runtimeClassName 'a_b'"),
    ({"pod": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}},
     r"spec.pod.topologySpreadConstraints\[0\].whenUnsatisfiable is required"),
    ({"pod": {"topologySpreadConstraints": [{"topologyKey": "z",
                                             "whenUnsatisfiable": "DoNotSchedule"}]}},
     r"spec.pod.topologySpreadConstraints\[0\].maxSkew is required"),
    ({"pod": "yes"}, "spec.pod must be an object"),
    ({"router": {"nodeSelector": {"pool": "a b"}}},
     r"spec.router.nodeSelector\['pool'\] must be a label value"),
    ({"engine": {"startupTimeoutSeconds": 5}},
     "spec.engine.startupTimeoutSeconds = 5 is outside 10..86400"),
    ({"engine": {"rdma": {"ipcLock": "yes"}}}, "spec.engine.rdma.ipcLock must be true or false"),
    ({"engine": {"volumes": [{"name": "tandem-tmp", "emptyDir": {}}]}},
     r"spec.engine.volumes\[0\].name 'tandem-tmp' is the operator's"),
    ({"engine": {"volumes": [{"name": "t", "emptyDir": {}}],
                 "volumeMounts": [{"name": "t", "mountPath": "/tmp/"}]}},
     r"spec.engine.volumeMounts\[0\].mountPath /tmp is the pod's own"),
    ({"engine": {"volumes": [{"name": "t", "emptyDir": {}}],
                 "initContainers": [{"name": "i", "command": ["x"], "volumeMounts": [
                     {"name": "t", "mountPath": "/tmp"}]}]}},
     r"spec.engine.initContainers\[0\].volumeMounts\[0\].mountPath /tmp"),
])
def test_bad_pod_fields_name_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(**spec)


def test_router_pods_get_the_measured_resources_unless_the_spec_gives_them() -> None:
    """spec.router.resources defaults (docs/benchmarks.md, "Router resources"), each half
    apart as the CRD defaults them; engines keep theirs; a change rolls the routers only."""
    plain = parse()
    router = m.pod(plain, "router", plain.weights)["spec"]["containers"][0]
    assert router["resources"] == {"requests": {"cpu": "500m", "memory": "256Mi"},
                                   "limits": {"cpu": "2", "memory": "1Gi"}}
    assert schema_node("spec.router.resources.requests")["default"] == (
        router["resources"]["requests"])
    assert schema_node("spec.router.resources.limits")["default"] == router["resources"]["limits"]
    assert "resources" not in m.pod(plain, "decode", plain.weights)["spec"]["containers"][0]
    mine = parse(router={"resources": {"requests": {"cpu": "1"}, "limits": {}}})
    assert m.pod(mine, "router", mine.weights)["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1"}}
    limits_only = parse(router={"resources": {"limits": {"memory": "2Gi"}}})
    assert m.pod(limits_only, "router", limits_only.weights)["spec"]["containers"][0][
        "resources"] == {"requests": {"cpu": "500m", "memory": "256Mi"},
                         "limits": {"memory": "2Gi"}}
    for spec in (mine, limits_only):
        kubernetes_validate.validate(m.pod(spec, "router", spec.weights), "1.32", strict=True)
        assert m.template_hash(spec, "router") != m.template_hash(plain, "router")
        assert m.template_hash(spec, "decode") == m.template_hash(plain, "decode")
    with pytest.raises(SpecError, match=r"spec\.router\.resources\.limits must be an object"):
        parse(router={"resources": {"limits": ["cpu"]}})
