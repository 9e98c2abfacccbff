"""examples/httproute.yaml, Tandem behind a Gateway (docs/gateway.md).

The route must send the OpenAI API to the Service the operator renders for the example pool
(`manifests.router_service`: its name and port, in the pool's namespace), and it must be an
HTTPRoute the Gateway API accepts. The Gateway API CRDs are in no package of the registries
this project reaches, so the test API server cannot validate it against them; it is checked
against the Gateway API's JSON schemas from npm instead (`kcluster.gateway_api`: types,
required fields, bounds, enums; not the CRDs' CEL rules, so the Service port that a CEL rule
requires is checked here, from the rendered Service).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kcluster import gateway_api
from tandem_operator import manifests as m
from tandem_operator.spec import PoolSpec

ROOT = Path(__file__).resolve().parents[2]
ROUTE = ROOT / "examples" / "httproute.yaml"
POOL = ROOT / "examples" / "inferencepool.yaml"


@pytest.fixture(scope="module")
def route() -> dict[str, Any]:
    return yaml.safe_load(ROUTE.read_text())


def router_service() -> dict[str, Any]:
    pool = yaml.safe_load(POOL.read_text())
    pool["metadata"]["namespace"] = "default"
    return m.router_service(PoolSpec.from_body(pool))


def test_the_route_sends_the_api_to_the_pools_router_service(route: dict[str, Any]):
    service = router_service()
    [port] = service["spec"]["ports"]
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    # Same namespace as the pool (none written: `kubectl apply -n` puts both in one), so no
    # ReferenceGrant is needed to reach the Service.
    assert "namespace" not in route["metadata"]
    assert route["metadata"]["labels"] == {m.POOL_LABEL: service["metadata"]["name"]}
    assert route["spec"]["parentRefs"]
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "", "kind": "Service",
                                    "name": service["metadata"]["name"],
                                    "port": port["port"]}]
    assert (port["port"], port["targetPort"]) == (8000, "http")  # the router's HTTP port
    # The OpenAI API is under /v1 (chat/completions, completions, models).
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]


def broken(route: dict[str, Any], change: str) -> dict[str, Any]:
    doc = copy.deepcopy(route)
    backend = doc["spec"]["rules"][0]["backendRefs"][0]
    if change == "port-out-of-range":
        backend["port"] = 80000
    elif change == "port-as-text":
        backend["port"] = "8000"
    elif change == "no-backend-name":
        del backend["name"]
    elif change == "no-parent-name":
        del doc["spec"]["parentRefs"][0]["name"]
    elif change == "wrong-path-type":
        doc["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"
    elif change == "wrong-kind":
        doc["kind"] = "HTTPRoutes"
    return doc


REFUSALS = {
    "port-out-of-range": "/spec/rules/0/backendRefs/0/port must be <= 65535",
    "port-as-text": "/spec/rules/0/backendRefs/0/port must be integer",
    "no-backend-name": "/spec/rules/0/backendRefs/0 must have required property name",
    "no-parent-name": "/spec/parentRefs/0 must have required property name",
    "wrong-path-type": "/spec/rules/0/matches/0/path/type must be equal to one of the allowed "
                       "values",
    "wrong-kind": "gateway.networking.k8s.io/v1/HTTPRoutes.js'",  # no such model
}


def test_the_route_is_valid_for_the_gateway_api_and_a_broken_one_is_not(
        route: dict[str, Any]):
    answers = gateway_api.validate([route, *(broken(route, c) for c in REFUSALS)])
    assert answers[0] is None, answers[0]
    for (change, expected), answer in zip(REFUSALS.items(), answers[1:], strict=True):
        assert answer is not None, f"{change} was accepted"
        assert expected in answer, (change, answer)
