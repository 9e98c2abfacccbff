"""Every request the operator makes is one the chart's RBAC grants.

The test API server enforces no RBAC, so the other cluster tests would pass with any rules.
Here `tandem-operator` runs a pool through its life (create, serve, scale up and down, a
rolling update, deletion) while the API server logs every request; each of the operator's
requests, as (API group, resource, verb), must be granted by the rules `helm template`
renders for an operator that watches the namespace: the Role there for namespaced requests,
the ClusterRole for cluster-scoped ones. Discovery (/api, /apis, /version) is open to every
authenticated user and not checked. Secrets are held to what the chart's own rule allows:
the operator never updates or deletes one (garbage collection does).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kcluster.apiserver import LoggedRequest, Route, parse_path
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from kcluster.helm import helm_binary
from test_operator_cluster import (  # noqa: F401  (fixtures)
    Operator,
    cluster,
    get_json,
    operators,
    patch_spec,
    pool_manifest,
    wait_for,
    wait_serving,
    weights,
)

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "default"  # where the operator fixture watches, and the pools live
Grants = dict[tuple[str, str], set[str]]


def rendered_rules() -> tuple[Grants, Grants]:
    """(the namespace's Role, the ClusterRole) as the chart renders them for an operator that
    watches NAMESPACE."""
    done = subprocess.run(
        [str(helm_binary()), "template", "tandem", str(ROOT / "charts" / "tandem"),
         "--namespace", "tandem-system", "--set", f"watchNamespaces={{{NAMESPACE}}}"],
        capture_output=True, text=True, timeout=60, check=True)
    objects = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    [role] = [o for o in objects if o["kind"] == "Role"]
    [cluster_role] = [o for o in objects if o["kind"] == "ClusterRole"]
    return grants(role), grants(cluster_role)


def grants(role: dict[str, Any]) -> Grants:
    out: Grants = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def verb(request: LoggedRequest, route: Route) -> str:
    if request.method == "GET":
        return "watch" if request.watch else "get" if route.name else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete" if route.name else "deletecollection"}[request.method]


def asked(requests: list[LoggedRequest]) -> dict[tuple[bool, str, str, str], int]:
    """(namespaced, group, resource, verb) -> how many requests."""
    out: dict[tuple[bool, str, str, str], int] = {}
    for request in requests:
        route = parse_path(request.path)
        if not isinstance(route, Route):
            continue  # discovery
        resource = f"{route.plural}/{route.subresource}" if route.subresource else route.plural
        key = (route.namespace is not None, route.group, resource, verb(request, route))
        out[key] = out.get(key, 0) + 1
    return out


def test_the_operator_asks_only_for_what_the_chart_grants(
        cluster: TestCluster, operators: Callable[..., Operator],  # noqa: F811
        weights: Path) -> None:  # noqa: F811
    role, cluster_role = rendered_rules()
    since = time.monotonic()
    operators()
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    patch_spec(cluster, {"decode": {"replicas": 2}})
    wait_serving(cluster, {"prefill": 1, "decode": 2, "router": 1})
    patch_spec(cluster, {"decode": {"replicas": 1}, "engine": {"args": ["--seed", "7"]}})
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    cluster.kubectl("delete", "ipool", "demo", "--wait=true", timeout=60)
    wait_for("garbage collection", lambda: not get_json(
        cluster, "pods,secrets", "-l", "tandem.dev/pool=demo")["items"])

    # kubectl is the test; every other client is the operator (kopf and its own client).
    calls = asked([r for r in cluster.requests(since)
                   if not r.user_agent.startswith("kubectl")])
    denied = {key: n for key, n in calls.items()
              if key[3] not in (role if key[0] else cluster_role).get(key[1:3], set())}
    assert not denied, f"requests the chart's RBAC refuses: {denied}"
    # The pool's life did exercise the operator's Secret and pod rights.
    secret_verbs = {key[3] for key in calls if key[1:3] == ("", "secrets")}
    assert {"create", "list", "watch"} <= secret_verbs <= role[("", "secrets")]
    assert {"create", "delete"} <= {key[3] for key in calls if key[1:3] == ("", "pods")}
