"""A pool's closed network surface: its NetworkPolicies and its credentials, checked offline.

The NetworkPolicies `manifests.network_policies` renders are validated against the
Kubernetes 1.32 OpenAPI schema (kubernetes-validate, offline), and their selectors are
checked against the pods the operator renders (and the operator's own pod as the Helm chart
renders it) by `admits`, a small evaluator of NetworkPolicy ingress semantics: which
(source pod, destination pod, port) connections a CNI that enforces policies lets through.
The test API server enforces no network policy at all, so this evaluator is the only check
of what the policies mean; the end-to-end test at the bottom checks only that the operator
creates, completes and deletes the objects.

Also here: the ZMQ CURVE keys in the pool's credentials Secret, the env that hands them (and
the router's API keys) to the pods, and the engines' metrics port and weights roots.
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import json
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
import zmq
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from kcluster.helm import helm_binary
from tandem_engine.weights import WeightsRef
from tandem_operator import manifests as m
from tandem_operator.plan import AddCurveKeys, DeleteObject, Observed, PatchObject, plan
from tandem_operator.reconcile import curve_keys
from tandem_operator.spec import PoolSpec, SpecError
from test_operator_cluster import Operator, pool_manifest, wait_for

ROOT = Path(__file__).resolve().parents[2]
KUBE_VERSION = "1.32"
NS = "serving"


def parse(**spec: Any) -> PoolSpec:
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": NS, "uid": "uid-1"},
            "spec": {"model": {"name": "llama", "weights": {"uri": "file:///models/llama",
                                                            "version": "v1"}},
                     "networkPolicy": {"enabled": True}, **spec}}
    return PoolSpec.from_body(body)


# ---- a NetworkPolicy evaluator ------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """A pod as NetworkPolicies see it: labels, namespace (and its labels), IP, named ports."""

    labels: Mapping[str, str]
    namespace: str
    ip: str = "10.0.0.1"
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # container port name -> number

    @property
    def ns_labels(self) -> Mapping[str, str]:
        # The API server labels every namespace with its name.
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics; an empty selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or ()
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_admits(peer: Mapping[str, Any], policy_ns: str, src: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(src.ip)
        return (ip in ipaddress.ip_network(block["cidr"])
                and not any(ip in ipaddress.ip_network(e) for e in block.get("except") or ()))
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], src.ns_labels):
            return False
    elif src.namespace != policy_ns:  # a podSelector alone means the policy's namespace
        return False
    return selects(peer.get("podSelector"), src.labels)


def port_admits(ports: list[Mapping[str, Any]] | None, dst: Endpoint, port: int,
                protocol: str) -> bool:
    if not ports:
        return True  # no ports: every port
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            want = dst.ports.get(want)
        if want is not None and want <= port <= p.get("endPort", want):
            return True
    return False


def admits(policies: list[Mapping[str, Any]], src: Endpoint, dst: Endpoint, port: int,
           protocol: str = "TCP") -> bool:
    """Whether an ingress connection src -> dst:port is let through. A pod no Ingress policy
    selects is not isolated; an isolated one takes what any rule of its policies allows."""
    mine = [p for p in policies if p["metadata"]["namespace"] == dst.namespace
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
            and selects(p["spec"]["podSelector"], dst.labels)]
    if not mine:
        return True
    return any(port_admits(rule.get("ports"), dst, port, protocol)
               and (not rule.get("from") or any(peer_admits(peer, p["metadata"]["namespace"],
                                                            src) for peer in rule["from"]))
               for p in mine for rule in p["spec"].get("ingress") or ())


def test_the_evaluator_follows_kubernetes_semantics() -> None:
    pod = Endpoint({"app": "a", "tier": "x"}, "ns", ports={"web": 80})
    assert selects({}, pod.labels) and not selects({"matchLabels": {"app": "b"}}, pod.labels)
    assert selects({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["x"]},
                                         {"key": "gone", "operator": "DoesNotExist"}]},
                   pod.labels)
    assert not selects({"matchExpressions": [{"key": "app", "operator": "NotIn",
                                              "values": ["a"]}]}, pod.labels)
    policy = {"metadata": {"namespace": "ns"},
              "spec": {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "c"}}}],
                                    "ports": [{"port": "web"}]}]}}
    same_ns_c, other_ns_c = Endpoint({"app": "c"}, "ns"), Endpoint({"app": "c"}, "other")
    assert admits([policy], same_ns_c, pod, 80)
    assert not admits([policy], same_ns_c, pod, 81)
    assert not admits([policy], other_ns_c, pod, 80)  # podSelector alone: policy's namespace
    assert admits([policy], other_ns_c, Endpoint({"app": "b"}, "ns"), 81)  # not isolated


# ---- the pool's pods and its neighbours ---------------------------------------------------------


def pod_endpoint(spec: PoolSpec, group: str, ip: str) -> Endpoint:
    body = m.pod(spec, group, spec.weights)  # type: ignore[arg-type]
    ports = {p["name"]: p["containerPort"] for p in body["spec"]["containers"][0]["ports"]}
    return Endpoint(body["metadata"]["labels"], body["metadata"]["namespace"], ip, ports=ports)


@pytest.fixture(scope="module")
def operator_pod() -> Endpoint:
    """The operator's pod, labelled as the Helm chart's Deployment labels it."""
    done = subprocess.run([str(helm_binary()), "template", "tandem", str(ROOT / "charts/tandem"),
                           "--namespace", "tandem-system",
                           "--show-only", "templates/deployment.yaml"],
                          capture_output=True, text=True, timeout=60, check=True)
    deployment = yaml.safe_load(done.stdout)
    return Endpoint(deployment["spec"]["template"]["metadata"]["labels"], "tandem-system",
                    "10.9.0.2")


def neighbours(spec: PoolSpec) -> dict[str, Endpoint]:
    other = dataclasses.replace(parse(), name="other")
    return {
        "router": pod_endpoint(spec, "router", "10.0.0.10"),
        "prefill": pod_endpoint(spec, "prefill", "10.0.0.11"),
        "decode": pod_endpoint(spec, "decode", "10.0.0.12"),
        "other-router": pod_endpoint(other, "router", "10.0.1.10"),
        "other-engine": pod_endpoint(other, "decode", "10.0.1.11"),
        "random": Endpoint({"app": "curl"}, NS, "10.0.2.1"),
        "prometheus": Endpoint({"app": "prometheus"}, "monitoring", "10.0.3.1"),
        "client": Endpoint({"app": "web"}, "apps", "10.1.2.3",
                           namespace_labels={"team": "web"}),
        "outside": Endpoint({}, "elsewhere", "192.168.7.7"),
    }


ZMQ, ADMIN, METRICS, HTTP = (m.ENGINE_ZMQ_PORT, m.ENGINE_ADMIN_PORT, m.ENGINE_METRICS_PORT,
                             m.ROUTER_HTTP_PORT)
UCX_EPHEMERAL = 41234  # NIXL's UCX listens on an ephemeral TCP port


def test_default_policies_admit_exactly_what_the_pool_needs(operator_pod: Endpoint) -> None:
    spec = parse()
    policies = m.network_policies(spec)
    pods = {**neighbours(spec), "operator": operator_pod}

    def ok(src: str, dst: str, port: int, protocol: str = "TCP") -> bool:
        return admits(policies, pods[src], pods[dst], port, protocol)

    for engine in ("prefill", "decode"):
        assert ok("router", engine, ZMQ) and ok("router", engine, ADMIN)
        assert ok("operator", engine, ADMIN)
        assert ok("operator", engine, METRICS)  # the autoscaler reads the engines' metrics
        assert not ok("operator", engine, ZMQ)
        for nixl in (UCX_EPHEMERAL, ZMQ, ADMIN):  # every TCP port between the pool's engines
            assert ok("prefill", engine, nixl) and ok("decode", engine, nixl)
        assert not ok("prefill", engine, UCX_EPHEMERAL, "UDP")
        for stranger in ("random", "other-router", "other-engine", "client", "prometheus",
                         "outside"):
            for port in (ZMQ, ADMIN, UCX_EPHEMERAL):
                assert not ok(stranger, engine, port), (stranger, engine, port)
        assert not ok("router", engine, UCX_EPHEMERAL)
        # metrics: any pod of the pool's namespace by default, nobody from elsewhere
        assert ok("random", engine, METRICS) and ok("router", engine, METRICS)
        assert not ok("prometheus", engine, METRICS) and not ok("outside", engine, METRICS)
    # The router's API from anywhere by default, and only its HTTP port.
    for src in ("client", "outside", "random", "prometheus"):
        assert ok(src, "router", HTTP)
        assert not ok(src, "router", ADMIN)


def test_api_from_and_metrics_from_narrow_the_sources(operator_pod: Endpoint) -> None:
    spec = parse(networkPolicy={
        "enabled": True,
        "apiFrom": [{"namespaceSelector": {"matchLabels": {"team": "web"}},
                     "podSelector": {"matchExpressions": [
                         {"key": "app", "operator": "In", "values": ["web"]}]}},
                    {"ipBlock": {"cidr": "192.168.0.0/16", "except": ["192.168.9.0/24"]}}],
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app": "prometheus"}}}]})
    policies = m.network_policies(spec)
    pods = neighbours(spec)
    router, decode = pods["router"], pods["decode"]
    assert admits(policies, pods["client"], router, HTTP)
    assert admits(policies, pods["outside"], router, HTTP)  # in the ipBlock
    assert not admits(policies, Endpoint({}, "x", "192.168.9.1"), router, HTTP)  # except
    assert not admits(policies, pods["random"], router, HTTP)
    assert not admits(policies, pods["prometheus"], router, HTTP)
    assert admits(policies, pods["prometheus"], decode, METRICS)
    assert not admits(policies, pods["random"], decode, METRICS)
    assert admits(policies, pods["router"], decode, ZMQ)  # the rest as before
    assert admits(policies, operator_pod, decode, ADMIN)
    # An empty list is Kubernetes' "from anywhere".
    anywhere = m.network_policies(parse(networkPolicy={"enabled": True, "metricsFrom": []}))
    assert admits(anywhere, pods["prometheus"], decode, METRICS)


def test_policies_validate_against_the_kubernetes_schema() -> None:
    specs = [parse(), parse(networkPolicy={
        "enabled": True,
        "apiFrom": [{"namespaceSelector": {"matchExpressions": [
            {"key": "team", "operator": "Exists"}]}},
            {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
        "metricsFrom": [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]})]
    for spec in specs:
        policies = m.network_policies(spec)
        assert [p["metadata"]["name"] for p in policies] == ["pool-engines", "pool-router"]
        for policy in policies:
            kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
            assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
            assert policy["metadata"]["labels"]["tandem.dev/pool"] == "pool"
            assert m.drift_patch(policy, json.loads(json.dumps(policy))) is None
    # The schema check has teeth: a misspelt field, a port that is no port.
    for path, value in ((("spec", "ingress", 0, "sources"), []),
                        (("spec", "ingress", 0, "ports", 0, "port"), [5555])):
        broken = m.network_policies(parse())[0]
        node: Any = broken
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_policies_are_on_unless_disabled_and_peers_are_checked() -> None:
    """On by default (inert where the CNI enforces none), as the CRD states it."""
    assert parse(networkPolicy={}).network_policy.enabled
    assert len(m.network_policies(PoolSpec.from_body(
        {"metadata": {"name": "p"}, "spec": {"model": {
            "name": "m", "weights": {"uri": "file:///m", "version": "v"}}}}))) == 2
    spec = parse(networkPolicy={"enabled": False})
    assert not spec.network_policy.enabled and m.network_policies(spec) == []
    assert all(o["kind"] != "NetworkPolicy" for o in m.support_objects(spec))
    with pytest.raises(SpecError, match=r"apiFrom\[0\]: ipBlock cannot be combined"):
        parse(networkPolicy={"apiFrom": [{"ipBlock": {"cidr": "1.2.3.0/24"},
                                          "podSelector": {}}]})
    with pytest.raises(SpecError, match=r"metricsFrom\[0\] must be a NetworkPolicyPeer"):
        parse(networkPolicy={"metricsFrom": [{"pods": "all"}]})


# ---- credentials, env, ports, weights roots -----------------------------------------------------


def env_of(spec: PoolSpec, group: str) -> dict[str, Any]:
    body = m.pod(spec, group, spec.weights)  # type: ignore[arg-type]
    return {e["name"]: e.get("valueFrom", e.get("value"))
            for e in body["spec"]["containers"][0]["env"]}


def test_the_credentials_secret_holds_the_curve_keys() -> None:
    keys = curve_keys(tuple(m.CURVE_KEYS))
    assert set(keys) == {"zmq-server-public", "zmq-server-secret", "zmq-client-public",
                         "zmq-client-secret"}
    for public, secret in m.CURVE_KEYS.values():
        assert len(keys[public]) == len(keys[secret]) == 40  # Z85 of 32 bytes
        assert zmq.curve_public(keys[secret].encode()).decode() == keys[public]
    secret = m.admin_secret(parse(), "tok", keys)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {"token": "tok", **keys}
    assert m.missing_curve_pairs(secret) == ()
    assert m.missing_curve_pairs(m.admin_secret(parse(), "tok")) == ("server", "client")
    assert m.missing_curve_pairs({"data": {"zmq-server-public": "x", "zmq-server-secret": "y"},
                                  "stringData": {"zmq-client-public": "z"}}) == ("client",)


def test_pods_get_the_keys_they_need_and_no_other() -> None:
    spec = parse()
    ref = {"secretKeyRef": {"name": "pool-admin-token", "key": ""}}

    def key(k: str) -> dict[str, Any]:
        return {"secretKeyRef": {**ref["secretKeyRef"], "key": k}}

    for engine in ("prefill", "decode"):
        env = env_of(spec, engine)
        assert env["TANDEM_ZMQ_SERVER_SECRET_KEY"] == key("zmq-server-secret")
        assert env["TANDEM_ZMQ_CLIENT_PUBLIC_KEY"] == key("zmq-client-public")
        assert env["TANDEM_ADMIN_TOKEN"] == key("token")
        assert "TANDEM_ZMQ_CLIENT_SECRET_KEY" not in env and "TANDEM_API_KEY" not in env
    router = env_of(spec, "router")
    assert router["TANDEM_ZMQ_SERVER_PUBLIC_KEY"] == key("zmq-server-public")
    assert router["TANDEM_ZMQ_CLIENT_SECRET_KEY"] == key("zmq-client-secret")
    assert "TANDEM_ZMQ_SERVER_SECRET_KEY" not in router and "TANDEM_ADMIN_TOKEN" not in router
    assert "TANDEM_API_KEY" not in router
    keyed = parse(router={"apiKeySecret": {"name": "api-keys.v1"}})
    assert env_of(keyed, "router")["TANDEM_API_KEY"] == {
        "secretKeyRef": {"name": "api-keys.v1", "key": "api-keys"}}
    custom = parse(router={"apiKeySecret": {"name": "s", "key": "clients_1"}})
    assert env_of(custom, "router")["TANDEM_API_KEY"]["secretKeyRef"]["key"] == "clients_1"
    with pytest.raises(SpecError, match="is not a Secret name"):
        parse(router={"apiKeySecret": {"name": "Not_A_Name"}})
    for group in ("router", "prefill"):
        kubernetes_validate.validate(m.pod(keyed, group, keyed.weights), KUBE_VERSION,
                                     strict=True)


def roots(body: dict[str, Any]) -> list[str]:
    args = body["spec"]["containers"][0]["args"]
    return [args[i + 1] for i, a in enumerate(args) if a == "--weights-root"]


def test_engines_serve_metrics_and_refit_only_from_the_mounts_holding_weights() -> None:
    spec = parse(engine={"volumes": [{"name": "models", "emptyDir": {}},
                                     {"name": "scratch", "emptyDir": {}},
                                     {"name": "more", "emptyDir": {}}],
                         "volumeMounts": [{"name": "models", "mountPath": "/models"},
                                          {"name": "scratch", "mountPath": "/scratch"},
                                          {"name": "more", "mountPath": "/models/llama"}]})
    body = m.pod(spec, "decode", spec.weights)  # file:///models/llama
    c = body["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--metrics-port") + 1] == "9100"
    assert roots(body) == ["/models", "/models/llama"]
    elsewhere = WeightsRef(uri="file:///opt/ckpt/llama", version="v2")
    assert roots(m.pod(spec, "decode", elsewhere)) == []  # the engine's default
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert c["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert body["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    assert roots(m.pod(parse(), "decode", spec.weights)) == []  # no volumes: the image's


# ---- planning -----------------------------------------------------------------------------------


def objects_of(spec: PoolSpec, secret: dict[str, Any]) -> dict[tuple[str, str], Any]:
    objects = {(o["kind"], o["metadata"]["name"]): o for o in m.support_objects(spec)}
    objects[("Secret", secret["metadata"]["name"])] = secret
    return objects


def object_steps(spec: PoolSpec, objects: dict[tuple[str, str], Any]) -> list[Any]:
    return [a for a in plan(spec, Observed(objects=objects))
            if isinstance(a, AddCurveKeys | DeleteObject | PatchObject)]


def test_plan_completes_old_secrets_and_follows_the_enabled_flag() -> None:
    spec = parse()
    full = m.admin_secret(spec, "t", curve_keys(tuple(m.CURVE_KEYS)))
    assert object_steps(spec, objects_of(spec, full)) == []
    old = m.admin_secret(spec, "t")
    assert object_steps(spec, objects_of(spec, old)) == [
        AddCurveKeys("pool-admin-token", ("server", "client"))]
    off = parse(networkPolicy={"enabled": False})
    assert object_steps(off, objects_of(spec, full)) == [
        DeleteObject("NetworkPolicy", "pool-engines"), DeleteObject("NetworkPolicy",
                                                                    "pool-router")]
    narrowed = parse(networkPolicy={"enabled": True, "apiFrom": [{"podSelector": {}}]})
    [patch] = object_steps(narrowed, objects_of(spec, full))
    assert patch.name == "pool-router" and patch.patch["spec"]["ingress"][0]["from"] == [
        {"podSelector": {}}]


# ---- the operator on the test API server --------------------------------------------------------


@pytest.fixture
def operator_cluster(test_cluster: TestCluster, tmp_path: Path  # noqa: F811
                     ) -> Iterator[tuple[TestCluster, Path]]:
    """The test cluster with the CRD, a `tandem-operator` process, and a weights folder."""
    test_cluster.install_crds(ROOT / "crds")
    folder = tmp_path / "models" / "demo"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    log = tmp_path / "operator.log"
    operator = Operator(test_cluster, log, "--standalone", "--metrics-port", "0",
                        "--liveness-port", "0")
    try:
        yield test_cluster, folder
    finally:
        operator.stop()
        print(f"---- operator log (tail) ----\n{log.read_text()[-6000:]}")


def test_the_operator_creates_completes_and_removes_the_objects(
        operator_cluster: tuple[TestCluster, Path]) -> None:
    """No network enforcement here (the test API server has none): objects only."""
    cluster, weights = operator_cluster
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))

    def get(kind: str, name: str) -> dict[str, Any] | None:
        done = cluster.kubectl("get", kind, name, "-o", "json", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def secret_data() -> dict[str, str]:
        return (get("secret", "demo-admin-token") or {}).get("data") or {}

    keys = {"token", *(k for pair in m.CURVE_KEYS.values() for k in pair)}
    wait_for("the NetworkPolicies and the keys", lambda: get("networkpolicy", "demo-engines")
             and get("networkpolicy", "demo-router") and set(secret_data()) == keys)
    engines = get("networkpolicy", "demo-engines")
    assert engines and engines["spec"]["podSelector"]["matchLabels"] == {
        "tandem.dev/pool": "demo", "tandem.dev/engine": "true"}
    before = secret_data()

    # A Secret from before the keys (an upgraded operator) is completed, the token kept.
    cluster.kubectl("patch", "secret", "demo-admin-token", "--type", "merge", "-p",
                    json.dumps({"data": {"zmq-client-public": None,
                                         "zmq-client-secret": None}}))
    wait_for("the client keys again", lambda: set(secret_data()) == keys)
    after = secret_data()
    assert after["token"] == before["token"]
    assert after["zmq-server-public"] == before["zmq-server-public"]
    assert after["zmq-client-public"] != before["zmq-client-public"]

    cluster.kubectl("patch", "ipool", "demo", "--type", "merge", "-p",
                    json.dumps({"spec": {"networkPolicy": {"enabled": False}}}))
    wait_for("the NetworkPolicies gone", lambda: get("networkpolicy", "demo-engines") is None
             and get("networkpolicy", "demo-router") is None)
