"""spec.pod.overrides: the strategic merge (a pure function, Kubernetes' semantics for the
lists that matter), what the operator refuses of a patch, and the pods it renders with one:
valid against Kubernetes' schema, the operator's parts untouched, a change a new template."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from tandem_operator import manifests as m
from tandem_operator.pod_overrides import apply_overrides, strategic_merge
from tandem_operator.spec import SpecError
from test_operator_manifests import parse

GROUPS = ("prefill", "decode", "router")


# ---- the merge ----------------------------------------------------------------------------------


def test_objects_merge_key_by_key_and_null_deletes() -> None:
    base = {"securityContext": {"runAsUser": 1, "fsGroup": 2}, "hostname": "a"}
    patch = {"securityContext": {"fsGroup": 3, "runAsUser": None}, "subdomain": "s"}
    assert strategic_merge(base, patch) == {"securityContext": {"fsGroup": 3},
                                            "hostname": "a", "subdomain": "s"}
    assert base == {"securityContext": {"runAsUser": 1, "fsGroup": 2}, "hostname": "a"}


def test_keyed_lists_merge_entry_by_entry_and_add_new_ones() -> None:
    base = {"containers": [{"name": "engine", "image": "e",
                            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "imagePullSecrets": [{"name": "one"}]}
    patch = {"containers": [{"name": "engine",
                             "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
                             "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
                            {"name": "shipper", "image": "s"}],
             "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}],
             "imagePullSecrets": [{"name": "two"}]}
    merged = strategic_merge(base, patch)
    engine, shipper = merged["containers"]
    assert engine == {"name": "engine", "image": "e",
                      "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "3"},
                              {"name": "C", "value": "4"}],
                      "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                                       {"name": "scratch", "mountPath": "/scratch"}]}
    assert shipper == {"name": "shipper", "image": "s"}
    assert [v["name"] for v in merged["volumes"]] == ["tmp", "scratch"]
    assert [s["name"] for s in merged["imagePullSecrets"]] == ["one", "two"]


def test_tolerations_are_appended_other_lists_replaced() -> None:
    base = {"tolerations": [{"key": "gpu", "operator": "Exists"}],
            "containers": [{"name": "engine", "envFrom": [{"configMapRef": {"name": "a"}}]}]}
    patch = {"tolerations": [{"key": "spot", "operator": "Exists"}],
             "containers": [{"name": "engine", "envFrom": [{"secretRef": {"name": "b"}}]}]}
    merged = strategic_merge(base, patch)
    assert merged["tolerations"] == [{"key": "gpu", "operator": "Exists"},
                                     {"key": "spot", "operator": "Exists"}]
    assert merged["containers"][0]["envFrom"] == [{"secretRef": {"name": "b"}}]


def test_an_entry_named_for_the_other_groups_container_is_left_out() -> None:
    patch = {"containers": [{"name": "engine", "env": [{"name": "X", "value": "e"}]},
                            {"name": "router", "env": [{"name": "X", "value": "r"}]}]}
    engine = apply_overrides({"containers": [{"name": "engine"}]}, patch, "engine")
    router = apply_overrides({"containers": [{"name": "router"}]}, patch, "router")
    assert engine == {"containers": [{"name": "engine", "env": [{"name": "X", "value": "e"}]}]}
    assert router == {"containers": [{"name": "router", "env": [{"name": "X", "value": "r"}]}]}
    assert apply_overrides({"a": 1}, None, "engine") == {"a": 1}


# ---- the rendered pods --------------------------------------------------------------------------

OVERRIDES: dict[str, Any] = {
    "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
    "shareProcessNamespace": True,
    "securityContext": {"fsGroup": 65532},
    "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
    "containers": [
        {"name": "engine", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
         "resources": {"limits": {"memory": "8Gi"}},
         "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
        {"name": "router", "env": [{"name": "LOG_FORMAT", "value": "json"}]},
        {"name": "shipper", "image": "fluent/fluent-bit:3",
         "securityContext": {"allowPrivilegeEscalation": False},
         "volumeMounts": [{"name": "scratch", "mountPath": "/logs", "readOnly": True}]}],
    "volumes": [{"name": "scratch", "emptyDir": {}}],
}


def test_overrides_reach_every_pod_last_and_leave_the_operators_parts() -> None:
    plain = parse(prefill={"tolerations": [{"key": "gpu", "operator": "Exists"}]})
    s = parse(prefill={"tolerations": [{"key": "gpu", "operator": "Exists"}]},
              pod={"overrides": OVERRIDES})
    for group in GROUPS:
        pod, before = m.pod(s, group, s.weights)["spec"], m.pod(plain, group, plain.weights)["spec"]
        kubernetes_validate.validate(m.pod(s, group, s.weights), "1.32", strict=True)
        main, shipper = pod["containers"]
        name = "router" if group == "router" else "engine"
        assert main["name"] == name and shipper["name"] == "shipper"
        assert pod["dnsConfig"] == OVERRIDES["dnsConfig"] and pod["shareProcessNamespace"]
        assert pod["securityContext"] == {**before["securityContext"], "fsGroup": 65532}
        assert pod["tolerations"][-1]["key"] == "spot"
        assert pod["tolerations"][:-1] == before.get("tolerations", [])
        assert [v["name"] for v in pod["volumes"]] == [
            *(v["name"] for v in before["volumes"]), "scratch"]
        # the operator's parts are as they were
        old = before["containers"][0]
        for key in ("command", "args", "image", "ports", "startupProbe", "readinessProbe",
                    "livenessProbe", "securityContext"):
            assert main[key] == old[key], key
        assert main["env"][:len(old["env"])] == old["env"]
        extra = {e["name"] for e in main["env"][len(old["env"]):]}
        assert extra == ({"LOG_FORMAT"} if group == "router" else {"NCCL_DEBUG"})
        if group != "router":
            assert main["resources"] == {"limits": {"memory": "8Gi"}}
            assert main["volumeMounts"][-1] == {"name": "scratch", "mountPath": "/scratch"}
        else:  # the router's defaults stand; only the engine entry asked for memory
            assert main["resources"] == old["resources"]


def test_a_change_of_overrides_rolls_the_pods() -> None:
    one, two = (parse(pod={"overrides": {"containers": [
        {"name": "engine", "env": [{"name": "X", "value": value}]}]}}) for value in "12")
    plain = parse()
    for group in GROUPS:
        hashes = {m.template_hash(spec, group) for spec in (one, two, plain)}
        # an engine entry rolls engine pods only; routers keep their template
        assert len(hashes) == (1 if group == "router" else 3), group


@pytest.mark.parametrize(("overrides", "message"), [
    ({"containers": [{"name": "engine", "args": ["--port", "1"]}]},
     r"spec\.pod\.overrides\.containers\[0\]\.args: the engine container's args is not "
     r"overridden: the operator's: engine flags are spec\.engine's fields"),
    ({"containers": [{"name": "router", "image": "x"}]},
     r"containers\[0\]\.image: .*: spec\.engine\.image"),
    ({"containers": [{"name": "engine", "ports": []}]}, r"containers\[0\]\.ports"),
    ({"containers": [{"name": "engine", "startupProbe": {}}]},
     r"spec\.engine\.startupTimeoutSeconds"),
    ({"containers": [{"name": "engine", "env": [{"name": "POD_IP", "value": "1.2.3.4"}]}]},
     r"containers\[0\]\.env\[0\]\.name 'POD_IP' is set by the operator"),
    ({"containers": [{"name": "engine", "volumeMounts": [
        {"name": "x", "mountPath": "/weights/pvc/models"}]}]},
     r"volumeMounts\[0\] at /weights/pvc/models: /tmp, /weights and the tandem-\* volumes "
     r"are the operator's"),
    ({"containers": [{"name": "sidecar"}]}, r"\('sidecar'\) is a sidecar .* needs an image"),
    ({"initContainers": [{"name": "tandem-weights", "image": "x"}]},
     r"initContainers\[0\]\.name 'tandem-weights': init containers named tandem-\*"),
    ({"volumes": [{"name": "tandem-tmp", "emptyDir": {"medium": "Memory"}}]},
     r"volumes\[0\]\.name 'tandem-tmp': volumes named tandem-\* are the operator's"),
    ({"serviceAccountName": "mine"}, r"overrides\.serviceAccountName is the operator's"),
    ({"terminationGracePeriodSeconds": 1},
     r"terminationGracePeriodSeconds is the operator's to set: use "
     r"spec\.refit\.drainTimeoutSeconds"),
    ({"spec": {"dnsPolicy": "None"}}, r"a patch of the pod's spec: write its fields"),
    ({"containers": [{"name": "engine", "$patch": "delete"}]},
     r"containers\[0\]\.\$patch: strategic-merge directives are not supported"),
    ({"containers": {"name": "engine"}}, r"containers must be a list of objects, each with "
                                         r"its name"),
    ({"volumes": [{"name": "x", "hostPath": {"path": "/" + "a" * 40000}}]},
     r"overrides is over 32768 bytes"),
    ("dnsPolicy: None", r"overrides must be an object"),
])
def test_what_the_operator_owns_is_refused_naming_the_path(overrides: Any,
                                                           message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(pod={"overrides": overrides})


def test_spec_engines_own_volumes_and_mounts_are_edited_there() -> None:
    engine = {"volumes": [{"name": "models", "emptyDir": {}}],
              "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
    with pytest.raises(SpecError, match=r"volumes\[0\]\.name 'models': a volume of "
                                        r"spec\.engine\.volumes: edit it there"):
        parse(engine=engine, pod={"overrides": {"volumes": [{"name": "models",
                                                            "hostPath": {"path": "/m"}}]}})
    with pytest.raises(SpecError, match=r"volumeMounts\[0\] at /models is a mount of "
                                        r"spec\.engine\.volumeMounts"):
        parse(engine=engine, pod={"overrides": {"containers": [{
            "name": "engine", "volumeMounts": [{"name": "models", "mountPath": "/models/"}]}]}})
    # a sidecar may mount them: its mounts are its own
    parse(engine=engine, pod={"overrides": {"containers": [{
        "name": "shipper", "image": "x", "volumeMounts": [{"name": "models",
                                                           "mountPath": "/models"}]}]}})
