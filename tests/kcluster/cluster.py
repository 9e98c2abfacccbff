"""A Kubernetes API server per test: started in a thread, reachable by kubectl, helm and clients.

Tests are synchronous and also run their own event loops (kopf), so the API server gets a
thread with its own asyncio loop. `TestCluster` writes a kubeconfig for it, runs kubectl with
that kubeconfig and a private discovery cache (kubectl caches discovery per host:port for
hours; ports get reused between tests), and hands out `kubernetes` clients bound to it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml
from aiohttp.test_utils import RawTestServer

from .apiserver import LoggedRequest, TestAPIServer

KUBECTL = "/usr/bin/kubectl"
TOKEN = "test-token"  # the kubeconfig's bearer token (the server accepts any)
T = TypeVar("T")


class TestCluster:
    """Context manager: `with TestCluster() as cluster: cluster.kubectl("get", "pods")`."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, *, history_size: int = 10_000, keep_requests: bool = False):
        self.server = TestAPIServer(history_size=history_size, keep_requests=keep_requests)
        self.url = ""
        self.folder = Path()
        self.kubeconfig = Path()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._saved_defaults: tuple[str | None, str] | None = None

    def __enter__(self) -> TestCluster:
        started = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(started, failure),
                                        name="test-apiserver", daemon=True)
        self._thread.start()
        started.wait(30)
        if failure or not self.url:
            raise RuntimeError("the test API server did not start") from (failure or [None])[0]
        self.folder = Path(tempfile.mkdtemp(prefix="tandem-cluster-"))
        self.kubeconfig = self.folder / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(self.kubeconfig_dict()))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.restore_default()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.server.internal_errors and exc is None:
            raise AssertionError("the test API server failed (a bug in tests/kcluster): "
                                 f"{self.server.internal_errors!r}")

    def _run(self, started: threading.Event, failure: list[BaseException]) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            # aiohttp's raw server directly, not kmock.Server: that one also swaps aiohttp's
            # process-wide DNS resolver, which breaks when clusters do not exit in LIFO order.
            async with self.server, RawTestServer(self.server, host="127.0.0.1") as http:
                self.url = str(http.make_url("")).rstrip("/")
                started.set()
                await self._stop.wait()

        try:
            asyncio.run(serve())
        except BaseException as exc:  # reported to __enter__ if it happens during startup
            failure.append(exc)
            started.set()

    def kubeconfig_dict(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                "users": [{"name": "test", "user": {"token": TOKEN}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                          "namespace": "default"}}]}

    # -- clients --

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60, env: dict[str, str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises with its stderr if `check` and it fails.

        `env` adds environment variables (e.g. EDITOR for `kubectl edit`).
        """
        command = [KUBECTL, f"--kubeconfig={self.kubeconfig}",
                   f"--cache-dir={self.folder / 'kubectl-cache'}", *args]
        done = subprocess.run(command, input=input, capture_output=True, text=True,
                              timeout=timeout, check=False, env={**os.environ, **(env or {})})
        if check and done.returncode != 0:
            raise AssertionError(f"`kubectl {' '.join(args)}` failed ({done.returncode}):\n"
                                 f"{done.stderr}{done.stdout}")
        return done

    def client(self) -> Any:
        """A `kubernetes.client.ApiClient` bound to this cluster."""
        import kubernetes.client

        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        configuration.api_key = {"authorization": f"Bearer {TOKEN}"}
        return kubernetes.client.ApiClient(configuration)

    api = client  # the name the shared contract uses

    def make_default(self) -> None:
        """Point $KUBECONFIG and the kubernetes client's default location at this cluster.

        The kubernetes client reads $KUBECONFIG once at import, so kopf's default login (and
        `kubernetes.config.load_kube_config()`) would otherwise find the wrong cluster.
        Undone when the cluster exits.
        """
        from kubernetes.config import kube_config

        if self._saved_defaults is None:
            self._saved_defaults = (os.environ.get("KUBECONFIG"),
                                    kube_config.KUBE_CONFIG_DEFAULT_LOCATION)
        os.environ["KUBECONFIG"] = str(self.kubeconfig)
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(self.kubeconfig)

    def restore_default(self) -> None:
        if self._saved_defaults is None:
            return
        from kubernetes.config import kube_config

        environ, location = self._saved_defaults
        if environ is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = environ
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = location
        self._saved_defaults = None

    # -- direct access, on the server's loop --

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """Run `function(*args)` on the server's loop (the store is not thread-safe)."""
        assert self._loop is not None

        async def run() -> T:
            return function(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def requests(self, since: float = 0.0) -> list[LoggedRequest]:
        """The requests the API server received at or after `since` (time.monotonic())."""
        return self.call(lambda: [r for r in self.server.request_log if r.at >= since])

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object directly (no HTTP); its apiVersion and kind pick the resource."""
        resource = self.server.registry.find_kind(body["apiVersion"], body["kind"])
        if resource is None:
            raise LookupError(f"the cluster serves no {body['kind']} in {body['apiVersion']}")
        namespace = body.get("metadata", {}).get("namespace", "default") if \
            resource.namespaced else ""
        return self.call(self.server.lifecycle.create, resource, namespace, body)

    def install_crds(self, folder: Path | str) -> list[str]:
        """Create every CustomResourceDefinition in the folder's YAML files; returns names."""
        names = []
        for path in sorted(Path(folder).glob("*.y*ml")):
            for document in yaml.safe_load_all(path.read_text()):
                if document and document.get("kind") == "CustomResourceDefinition":
                    names.append(self.create(document)["metadata"]["name"])
        return names
