"""Router engine discovery: which pod is which engine, list/watch bookkeeping, cluster config
(kubeconfig, exec credential plugins, in-cluster), the watch loop, the router's flags, and
(with the test cluster) a watch through an exec-plugin kubeconfig and a real router following
real engine pods."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kcluster.fixtures import test_cluster  # noqa: F401
from kubernetes_asyncio.config import incluster_config
from tandem_engine import kubeclient
from tandem_engine.kubeclient import KubeClient, KubeConfigError, KubeError, load_configuration
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


# ---- where the API server is (tandem_engine.kubeclient) -----------------------------------------


def _kubeconfig(user: dict[str, Any], server: str = "http://127.0.0.1:6443") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "test",
            "contexts": [{"name": "other", "context": {"cluster": "x", "user": "x"}},
                         {"name": "test", "context": {"cluster": "c", "user": "u",
                                                      "namespace": "ns"}}],
            "clusters": [{"name": "c", "cluster": {"server": server + "/"}}],
            "users": [{"name": "u", "user": user}]}


def _load(env: dict[str, str], sa: Path | None = None) -> tuple[Any, str | None]:
    """The configuration from `env`, and the Authorization header it sends now."""
    async def load() -> tuple[Any, str | None]:
        cfg = await load_configuration(env=env, service_account_dir=sa or Path("/nonexistent"))
        return cfg, await cfg.get_api_key_with_prefix("BearerToken")
    return asyncio.run(load())


def test_kubeconfig_json_and_yaml(tmp_path: Path) -> None:
    as_json = tmp_path / "config.json"
    as_json.write_text(json.dumps(_kubeconfig({"token": "abc"})))
    cfg, header = _load({"KUBECONFIG": f"{as_json}:/nonexistent"})
    assert (cfg.host, header) == ("http://127.0.0.1:6443", "Bearer abc")

    (tmp_path / "tok").write_text("from-file")
    as_yaml = tmp_path / "config"
    as_yaml.write_text(yaml.safe_dump(_kubeconfig({"tokenFile": "tok"})))
    _, header = _load({"KUBECONFIG": str(as_yaml)})
    assert header == "Bearer from-file"  # relative to the kubeconfig's folder

    with pytest.raises(KubeConfigError, match="cannot read"):
        _load({"KUBECONFIG": str(tmp_path / "missing")})
    (tmp_path / "bad").write_text(json.dumps({"current-context": "nowhere", "contexts": []}))
    with pytest.raises(KubeConfigError, match="bad"):
        _load({"KUBECONFIG": str(tmp_path / "bad")})

    # Without KUBECONFIG or a pod around: ~/.kube/config, else a clear error.
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST is not set"):
        _load({"HOME": str(tmp_path)})
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text(yaml.safe_dump(_kubeconfig({"token": "home"})))
    assert _load({"HOME": str(tmp_path)})[1] == "Bearer home"


def test_in_cluster_config_and_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    sa = tmp_path / "sa"
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeConfigError, match="token"):
        _load(env, sa)
    sa.mkdir()
    (sa / "token").write_text("t1")
    (sa / "ca.crt").write_text("a CA bundle")
    cfg, header = _load(env, sa)
    assert (cfg.host, cfg.ssl_ca_cert, header) == ("https://10.96.0.1:443", str(sa / "ca.crt"),
                                                   "Bearer t1")
    # Rotated tokens are read again (every minute; here at once).
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", dt.timedelta(0))
    cfg, _ = _load(env, sa)
    (sa / "token").write_text("t2")
    assert asyncio.run(cfg.get_api_key_with_prefix("BearerToken")) == "Bearer t2"

    assert d.resolve_namespace(None, {}, sa) == "default"
    (sa / "namespace").write_text("from-sa")
    assert d.resolve_namespace(None, {}, sa) == "from-sa"
    assert d.resolve_namespace(None, {"POD_NAMESPACE": "from-env"}, sa) == "from-env"
    assert d.resolve_namespace("flag", {"POD_NAMESPACE": "from-env"}, sa) == "flag"
    with pytest.raises(d.DiscoveryError, match="namespace"):
        d.resolve_namespace("Bad_NS", {}, sa)


def _exec_kubeconfig(tmp_path: Path, server: str) -> tuple[Path, Path, Path]:
    """A kubeconfig whose user runs a credential plugin (as EKS, GKE and AKS ones do): a
    script that prints an ExecCredential with the token in a file, counting its runs."""
    token, runs = tmp_path / "token", tmp_path / "runs"
    token.write_text("from-exec")
    plugin = tmp_path / "credential-plugin"
    plugin.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import json, os, pathlib, sys
        runs = pathlib.Path(sys.argv[2])
        runs.write_text((runs.read_text() if runs.exists() else "") + "x")
        info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
        print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                          "status": {"token": pathlib.Path(sys.argv[1]).read_text()}}))
        """))
    plugin.chmod(0o755)
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(_kubeconfig({"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin),
        "args": [str(token), str(runs)], "interactiveMode": "Never"}}, server)))
    return path, token, runs


def test_exec_credentials_are_fetched_again(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path, token, runs = _exec_kubeconfig(tmp_path, "https://api.example:443")
    monkeypatch.setattr(kubeclient, "EXEC_REFRESH_SECONDS", 0.0)

    async def scenario() -> list[str | None]:
        cfg = await load_configuration(path)
        first = await cfg.get_api_key_with_prefix("BearerToken")
        token.write_text("rotated")  # a plugin without expiry is asked again (each minute)
        return [first, await cfg.get_api_key_with_prefix("BearerToken")]

    assert asyncio.run(scenario()) == ["Bearer from-exec", "Bearer rotated"]
    assert runs.read_text() == "xxx"  # on loading, then (refresh period 0) on every look


def test_discovery_with_an_exec_plugin_watches_the_test_cluster(
        test_cluster, tmp_path: Path) -> None:  # noqa: F811
    import kubernetes.client

    path, _, runs = _exec_kubeconfig(tmp_path, test_cluster.url)
    core = kubernetes.client.CoreV1Api(test_cluster.api())
    engine = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "p-decode-0", "labels": {"tandem.dev/pool": "p", "tandem.dev/role": "decode"}},
        "spec": {"containers": [{"name": "engine", "image": "tandem/engine:test",
                                 "ports": [{"name": "zmq", "containerPort": 5555}]}]}}
    running = {"status": {"phase": "Running", "podIP": "10.1.2.3", "containerStatuses": [
        {"name": "engine", "ready": True, "restartCount": 0, "image": "tandem/engine:test",
         "imageID": "", "state": {"running": {}}}]}}

    async def scenario() -> list[Change]:
        client = KubeClient(await load_configuration(path), timeout=5,
                            user_agent="discovery-test")
        changes: asyncio.Queue[Change] = asyncio.Queue()
        watcher = d.PodWatcher(client, "default", "p", changes.put, watch_seconds=5)
        task = asyncio.create_task(watcher.run())
        seen = []
        try:
            await asyncio.to_thread(core.create_namespaced_pod, "default", engine)
            await asyncio.to_thread(core.patch_namespaced_pod_status, "p-decode-0", "default",
                                    running)
            seen.append(await asyncio.wait_for(changes.get(), 20))
            await asyncio.to_thread(core.delete_namespaced_pod, "p-decode-0", "default")
            seen.append(await asyncio.wait_for(changes.get(), 20))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
        return seen

    assert asyncio.run(scenario()) == [Change(added=frozenset({"10.1.2.3:5555"})),
                                       Change(removed=frozenset({"10.1.2.3:5555"}))]
    ours = [r for r in test_cluster.requests() if r.user_agent == "discovery-test"]
    assert ours and {r.watch for r in ours} == {False, True}  # a list, then a watch
    assert {r.authorization for r in ours} == {"Bearer from-exec"}
    assert runs.read_text() == "x"  # the plugin ran once


# ---- the watch loop (the API server's side scripted) --------------------------------------------


class ScriptedAPI:
    """Stands in for the KubeClient: answers list and watch calls from a script, records them.
    A script step is a list body (a dict), a watch's events (a list) or an exception."""

    server = "https://scripted"
    timeout = 2.0

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    def _step(self) -> Any:
        if not self.script:
            raise KubeError(0, "ClientConnectorError", "script done")
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    async def request(self, method: str, path: str, *, query: dict[str, str] | None = None,
                      **_: Any) -> dict[str, Any]:
        self.calls.append(("list", path, dict(query or {})))
        return self._step()

    async def watch(self, path: str, query: dict[str, str], *, idle_timeout: float
                    ) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(("watch", path, dict(query)))
        for event in self._step():
            yield event


def _list(rv: str, *pods: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "PodList", "metadata": {"resourceVersion": rv}, "items": list(pods)}


def _watch_changes(script: list[Any], expected: int) -> tuple[list[Change], ScriptedAPI]:
    api = ScriptedAPI(script)
    changes: list[Change] = []

    async def run() -> None:
        async def on_change(change: Change) -> None:
            changes.append(change)

        watcher = d.PodWatcher(api, "ns", "p", on_change,  # type: ignore[arg-type]
                               watch_seconds=5, backoff_initial=0.01, backoff_max=0.02)
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
        [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "11"}}},
         {"type": "MODIFIED", "object": pod("a", ip="10.0.0.1", running=False)}],
        [{"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                      "message": "too old resource version"}}],
        _list("20", b),
    ], expected=3)
    assert changes == [Change(added=frozenset({"10.0.0.1:5555"})),
                       Change(removed=frozenset({"10.0.0.1:5555"})),
                       Change(added=frozenset({"10.0.0.2:5555"}))]
    lst, watch, again, relist = api.calls[:4]
    assert lst == ("list", "/api/v1/namespaces/ns/pods", {"labelSelector": "tandem.dev/pool=p"})
    assert watch[0] == "watch" and watch[2]["resourceVersion"] == "10"
    assert watch[2]["labelSelector"] == "tandem.dev/pool=p"
    # The watch ended normally: the next one resumes from the last version it saw.
    assert again[0] == "watch" and again[2]["resourceVersion"] == "11"
    assert relist[0] == "list"


def test_a_broken_watch_or_an_unreachable_api_relists_and_keeps_the_engines() -> None:
    changes, api = _watch_changes([
        _list("1", pod("a", ip="10.0.0.1")),
        KubeError(0, "ServerDisconnectedError", "connection reset"),
        KubeError(500, "InternalError", "GET /api/v1/namespaces/ns/pods: boom"),
        KubeError(0, "ClientConnectorError", "refused"),
        _list("2", pod("a", ip="10.0.0.1")),
        KubeError(410, "Expired", "too old"),  # 410 as the watch's HTTP status
        _list("3", pod("a", ip="10.0.0.1"), pod("b", ip="10.0.0.2")),
    ], expected=2)
    assert changes == [Change(added=frozenset({"10.0.0.1:5555"})),
                       Change(added=frozenset({"10.0.0.2:5555"}))]
    assert [kind for kind, _, _ in api.calls[:7]] == ["list", "watch", "list", "list", "list",
                                                      "watch", "list"]


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
