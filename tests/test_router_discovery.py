"""Router engine discovery: which pod is which engine, list/watch bookkeeping, cluster config,
the watch loop over HTTP, the router's flags, and (with the test cluster) a real router
following real engine pods."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from kcluster.fixtures import test_cluster  # noqa: F401
from tandem_engine.router import discovery as d
from tandem_engine.router.discovery import Change, EndpointTable, pod_endpoint


def pod(name: str = "p-decode-abcde", *, ip: str | None = "10.0.0.5", ready: bool = True,
        running: bool = True, role: str = "decode", pool: str = "p", port: int | None = 5555,
        deleting: bool = False, namespace: str = "ns") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {"tandem.dev/pool": pool, "tandem.dev/role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    ports = [{"name": "admin", "containerPort": 8080}]
    if port is not None:
        ports.append({"name": "zmq", "containerPort": port})
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready and running else "False"}],
        "containerStatuses": [{"name": "engine", "ready": ready and running, "state": {
            "running": {"startedAt": "2025-01-01T00:00:00Z"}} if running else {
            "waiting": {"reason": "CrashLoopBackOff"}}}]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"name": "engine", "ports": ports}]},
            "status": status}


# ---- pod -> engine ------------------------------------------------------------------------------


def test_a_ready_engine_pod_is_an_engine_at_its_ip_and_zmq_port() -> None:
    assert pod_endpoint(pod(), "p") == "10.0.0.5:5555"
    for role in ("prefill", "decode", "mixed"):
        assert pod_endpoint(pod(role=role, port=6000), "p") == "10.0.0.5:6000"
    assert pod_endpoint(pod(ip="fd00::5"), "p") == "[fd00::5]:5555"


@pytest.mark.parametrize("p", [
    pod(running=False), pod(ip=None), pod(ip=""), pod(deleting=True), pod(role="router"),
    pod(pool="other"), pod(port=None),
    {"metadata": {"name": "bare"}},  # no labels, spec or status at all
], ids=["not-running", "no-ip", "empty-ip", "deleting", "router", "other-pool",
        "no-zmq-port", "bare"])
def test_pods_that_serve_no_engine(p: dict[str, Any]) -> None:
    assert pod_endpoint(p, "p") is None


def test_a_paused_engine_is_not_ready_yet_still_an_engine() -> None:
    """Paused (drain, refit) engines answer 503 on /readyz but keep their requests."""
    assert pod_endpoint(pod(ready=False), "p") == "10.0.0.5:5555"


def test_a_pending_pod_is_not_an_engine() -> None:
    p = pod()
    p["status"]["phase"] = "Pending"
    assert pod_endpoint(p, "p") is None


# ---- list and events -> changes -----------------------------------------------------------------


def test_events_add_and_remove_engines() -> None:
    t = EndpointTable("p")
    assert t.reset([pod("a", ip="10.0.0.1"), pod("b", ip="10.0.0.2", running=False),
                    pod("r", ip="10.0.0.9", role="router")]) == Change(
        added=frozenset({"10.0.0.1:5555"}))
    # b's container starts; a replayed ADDED of a changes nothing.
    assert t.apply("MODIFIED", pod("b", ip="10.0.0.2")) == Change(
        added=frozenset({"10.0.0.2:5555"}))
    assert not t.apply("ADDED", pod("a", ip="10.0.0.1"))
    # a's container stops (crash), then comes back on another IP.
    assert t.apply("MODIFIED", pod("a", ip="10.0.0.1", running=False)) == Change(
        removed=frozenset({"10.0.0.1:5555"}))
    assert t.apply("MODIFIED", pod("a", ip="10.0.0.3")) == Change(
        added=frozenset({"10.0.0.3:5555"}))
    assert t.apply("MODIFIED", pod("a", ip="10.0.0.4")) == Change(
        added=frozenset({"10.0.0.4:5555"}), removed=frozenset({"10.0.0.3:5555"}))
    # Graceful deletion removes at once (deletionTimestamp), the DELETED event changes nothing.
    assert t.apply("MODIFIED", pod("b", ip="10.0.0.2", deleting=True)) == Change(
        removed=frozenset({"10.0.0.2:5555"}))
    assert not t.apply("DELETED", pod("b", ip="10.0.0.2", deleting=True))
    assert not t.apply("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert t.apply("DELETED", pod("a", ip="10.0.0.4")) == Change(
        removed=frozenset({"10.0.0.4:5555"}))
    assert t.endpoints == frozenset()


def test_a_relist_reports_only_the_difference() -> None:
    t = EndpointTable("p")
    t.reset([pod("a", ip="10.0.0.1"), pod("b", ip="10.0.0.2")])
    assert t.reset([pod("b", ip="10.0.0.2"), pod("c", ip="10.0.0.3")]) == Change(
        added=frozenset({"10.0.0.3:5555"}), removed=frozenset({"10.0.0.1:5555"}))


def test_pods_sharing_an_address_keep_it_until_both_are_gone() -> None:
    t = EndpointTable("p")
    t.reset([pod("old", ip="10.0.0.1"), pod("new", ip="10.0.0.1")])
    assert not t.apply("DELETED", pod("old", ip="10.0.0.1"))
    assert t.apply("DELETED", pod("new", ip="10.0.0.1")).removed == {"10.0.0.1:5555"}


# ---- where the API server is --------------------------------------------------------------------


def _kubeconfig(user: dict[str, Any], server: str = "http://127.0.0.1:6443") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "test",
            "contexts": [{"name": "other", "context": {"cluster": "x", "user": "x"}},
                         {"name": "test", "context": {"cluster": "c", "user": "u",
                                                      "namespace": "ns"}}],
            "clusters": [{"name": "c", "cluster": {"server": server + "/"}}],
            "users": [{"name": "u", "user": user}]}


def test_kubeconfig_json_and_yaml(tmp_path: Path) -> None:
    import yaml

    as_json = tmp_path / "config.json"
    as_json.write_text(json.dumps(_kubeconfig({"token": "abc"})))
    cfg = d.load_kube_config({"KUBECONFIG": f"{as_json}:/nonexistent"})
    assert cfg.server == "http://127.0.0.1:6443"
    assert cfg.headers() == {"Authorization": "Bearer abc"}

    (tmp_path / "tok").write_text("from-file\n")
    as_yaml = tmp_path / "config"
    as_yaml.write_text(yaml.safe_dump(_kubeconfig({"tokenFile": "tok"})))
    cfg = d.load_kube_config({"KUBECONFIG": str(as_yaml)})
    assert cfg.headers() == {"Authorization": "Bearer from-file"}  # relative to the file

    (tmp_path / "bad").write_text(json.dumps(_kubeconfig({"exec": {"command": "aws"}})))
    with pytest.raises(d.DiscoveryError, match="exec"):
        d.load_kube_config({"KUBECONFIG": str(tmp_path / "bad")})
    with pytest.raises(d.DiscoveryError, match="cannot read"):
        d.load_kube_config({"KUBECONFIG": str(tmp_path / "missing")})


def test_in_cluster_config_and_namespace(tmp_path: Path) -> None:
    sa = tmp_path / "sa"
    with pytest.raises(d.DiscoveryError, match="KUBERNETES_SERVICE_HOST"):
        d.load_kube_config({}, sa)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(d.DiscoveryError, match="token"):
        d.load_kube_config(env, sa)
    sa.mkdir()
    (sa / "token").write_text("t1")
    cfg = d.load_kube_config(env, sa)
    assert cfg.server == "https://10.96.0.1:443"
    (sa / "token").write_text("t2")  # rotated tokens are picked up
    assert cfg.headers() == {"Authorization": "Bearer t2"}

    assert d.resolve_namespace(None, {}, sa) == "default"
    (sa / "namespace").write_text("from-sa")
    assert d.resolve_namespace(None, {}, sa) == "from-sa"
    assert d.resolve_namespace(None, {"POD_NAMESPACE": "from-env"}, sa) == "from-env"
    assert d.resolve_namespace("flag", {"POD_NAMESPACE": "from-env"}, sa) == "flag"
    with pytest.raises(d.DiscoveryError, match="namespace"):
        d.resolve_namespace("Bad_NS", {}, sa)


# ---- the watch loop over HTTP (the API server's side scripted) ----------------------------------


class ScriptedAPI:
    """Answers list and watch requests from a script; records what was asked."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not self.script:
            raise httpx.ConnectError("script done", request=request)
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        status, body = step
        if isinstance(body, list):  # watch events, one JSON per line
            return httpx.Response(status, content="".join(json.dumps(e) + "\n" for e in body))
        return httpx.Response(status, json=body)


def _list(rv: str, *pods: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 200, {"kind": "PodList", "metadata": {"resourceVersion": rv}, "items": list(pods)}


def _watch_changes(script: list[Any], expected: int) -> tuple[list[Change], ScriptedAPI]:
    api = ScriptedAPI(script)
    changes: list[Change] = []

    async def run() -> None:
        async def on_change(change: Change) -> None:
            changes.append(change)

        watcher = d.PodWatcher(d.KubeConfig("http://api", token="tok"), "ns", "p", on_change,
                               request_timeout=2, watch_seconds=5, backoff_initial=0.01,
                               backoff_max=0.02, transport=httpx.MockTransport(api))
        task = asyncio.create_task(watcher.run())
        for _ in range(500):
            if len(changes) >= expected:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    return changes, api


def test_watch_resumes_from_the_list_and_relists_on_410_gone() -> None:
    a, b = pod("a", ip="10.0.0.1"), pod("b", ip="10.0.0.2")
    a["metadata"]["resourceVersion"] = "12"
    changes, api = _watch_changes([
        _list("10", a),
        (200, [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "11"}}},
               {"type": "MODIFIED", "object": pod("a", ip="10.0.0.1", running=False)}]),
        (200, [{"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                            "message": "too old resource version"}}]),
        _list("20", b),
    ], expected=3)
    assert changes == [Change(added=frozenset({"10.0.0.1:5555"})),
                       Change(removed=frozenset({"10.0.0.1:5555"})),
                       Change(added=frozenset({"10.0.0.2:5555"}))]
    lst, watch, again, relist = api.requests[:4]
    assert lst.url.params["labelSelector"] == "tandem.dev/pool=p"
    assert lst.url.path == "/api/v1/namespaces/ns/pods"
    assert lst.headers["Authorization"] == "Bearer tok"
    assert watch.url.params["watch"] == "true" and watch.url.params["resourceVersion"] == "10"
    # The watch ended normally: the next one resumes from the last version it saw.
    assert again.url.params["resourceVersion"] == "11"
    assert "watch" not in relist.url.params


def test_a_broken_watch_or_an_unreachable_api_relists_and_keeps_the_engines() -> None:
    changes, api = _watch_changes([
        _list("1", pod("a", ip="10.0.0.1")),
        httpx.ReadError("connection reset"),
        (500, {"kind": "Status", "code": 500}),
        httpx.ConnectError("refused"),
        _list("2", pod("a", ip="10.0.0.1")),
        (410, {"kind": "Status", "code": 410}),  # 410 as the watch's HTTP status
        _list("3", pod("a", ip="10.0.0.1"), pod("b", ip="10.0.0.2")),
    ], expected=2)
    assert changes == [Change(added=frozenset({"10.0.0.1:5555"})),
                       Change(added=frozenset({"10.0.0.2:5555"}))]
    kinds = ["watch" if r.url.params.get("watch") else "list" for r in api.requests[:7]]
    assert kinds == ["list", "watch", "list", "list", "list", "watch", "list"]


# ---- the router's flags -------------------------------------------------------------------------


def _router(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem_engine.router.main", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_router_wants_engines_or_a_pool_not_both(tiny_llama: Path, tmp_path: Path) -> None:
    model = ["--model", str(tiny_llama)]
    r = _router(*model)
    assert r.returncode == 2 and "one of the arguments --engine --discover-pool" in r.stderr
    r = _router(*model, "--engine", "127.0.0.1:1", "--discover-pool", "p")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = _router(*model, "--engine", "127.0.0.1:1", "--namespace", "ns")
    assert r.returncode == 2 and "--namespace goes with --discover-pool" in r.stderr
    r = _router(*model, "--discover-pool", "p", env={"PATH": "/usr/bin:/bin",
                                                     "HOME": str(tmp_path)})
    assert r.returncode == 2 and "KUBERNETES_SERVICE_HOST is not set" in r.stderr


# ---- a real router following real engine pods (the test cluster and its kubelet) ----------------


def _engine_pod(name: str, model: Path) -> dict[str, Any]:
    """An engine pod as the operator makes it (smaller: one thread, few blocks)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {
        "tandem.dev/pool": "p", "tandem.dev/role": "mixed"}},
        "spec": {"terminationGracePeriodSeconds": 5, "containers": [{
            "name": "engine", "image": "tandem/engine:test", "command": ["tandem-engine"],
            "args": ["--role", "mixed", "--model", str(model), "--served-model-name", "tiny",
                     "--host", "$(POD_IP)", "--port", "5555", "--admin-port", "8080",
                     "--engine-id", "$(POD_NAME)", "--threads", "1",
                     "--heartbeat-interval", "0.2", "--num-blocks", "256",
                     "--max-num-seqs", "8", "--shutdown-grace", "1"],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "POD_NAME",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "ports": [{"name": "zmq", "containerPort": 5555},
                      {"name": "admin", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "admin"},
                               "periodSeconds": 1, "failureThreshold": 1}}]}}


def _router_pod(model: Path) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p-router", "labels": {
        "tandem.dev/pool": "p", "tandem.dev/role": "router"}},
        "spec": {"terminationGracePeriodSeconds": 3, "containers": [{
            "name": "router", "image": "tandem/engine:test", "command": ["tandem-router"],
            "args": ["--discover-pool", "p", "--namespace", "$(POD_NAMESPACE)",
                     "--model", str(model), "--served-model-name", "tiny",
                     "--host", "$(POD_IP)", "--port", "8000", "--heartbeat-deadline", "1.0",
                     "--shutdown-grace", "1"],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "POD_NAMESPACE",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
            "ports": [{"name": "http", "containerPort": 8000}],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"},
                               "periodSeconds": 1}}]}}


@pytest.mark.slow
def test_the_router_follows_its_pools_engine_pods(test_cluster, tiny_llama: Path  # noqa: F811
                                                  ) -> None:
    import kubernetes.client
    import openai
    from kcluster.podrunner import PodRunner

    core = kubernetes.client.CoreV1Api(test_cluster.api())
    with PodRunner(test_cluster) as runner:
        def fail(what: str) -> AssertionError:
            logs = "\n".join(runner.logs(n) for n in ("p-router", "p-engine-0", "p-engine-1"))
            return AssertionError(f"{what}\nrunner errors: {runner.errors}\n{logs[-6000:]}")

        def ip(name: str) -> str:
            address = runner.pod_ip(name)
            if address is None:
                raise fail(f"pod {name} has no IP")
            return address

        def until(check: Any, what: str, timeout: float = 60.0) -> None:
            deadline = time.monotonic() + timeout
            while not check():
                if time.monotonic() > deadline:
                    raise fail(f"never {what} in {timeout} s")
                time.sleep(0.1)

        def engines() -> dict[str, str]:
            """The router's engines (GET /v1/engines), address -> state."""
            try:
                r = httpx.get(f"http://{ip('p-router')}:8000/v1/engines", timeout=2)
            except httpx.HTTPError:
                return {}
            return {e["address"]: e["state"] for e in r.json()["engines"]}

        for i in range(2):
            core.create_namespaced_pod("default", _engine_pod(f"p-engine-{i}", tiny_llama))
        core.create_namespaced_pod("default", _router_pod(tiny_llama))
        until(lambda: runner.pod_ip("p-router") and runner.pod_ip("p-engine-1"), "got IPs")
        e0, e1 = f"{ip('p-engine-0')}:5555", f"{ip('p-engine-1')}:5555"
        until(lambda: engines() == {e0: "RUNNING", e1: "RUNNING"}, "saw both engines")

        client = openai.OpenAI(base_url=f"http://{ip('p-router')}:8000/v1", api_key="x",
                               max_retries=0, timeout=30)
        r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                      temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens == 8

        # A paused engine is not Ready, yet the router keeps it (it holds its requests
        # and their KV) and routes new requests to the running one.
        admin0 = f"http://{ip('p-engine-0')}:8080"
        assert httpx.post(f"{admin0}/v1/pause", timeout=10).status_code == 200
        until(lambda: engines() == {e0: "PAUSED", e1: "RUNNING"}, "saw the pause", timeout=20)
        r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                      temperature=0)
        assert r.usage.completion_tokens == 8
        assert httpx.post(f"{admin0}/v1/unpause", timeout=10).status_code == 200
        until(lambda: engines() == {e0: "RUNNING", e1: "RUNNING"}, "saw the unpause",
              timeout=20)

        # A deleted pod leaves at once (deletionTimestamp), before its process is gone.
        core.delete_namespaced_pod("p-engine-1", "default")
        until(lambda: engines().keys() == {e0}, "dropped the deleted engine", timeout=20)
        r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                      temperature=0)
        assert r.usage.completion_tokens == 8
