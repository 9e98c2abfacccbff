"""Container probes of the test kubelet: httpGet, tcpSocket and exec, as kubelet runs them.

`run_probe` does one check (the kubelet runs it in a thread pool); `Probe` holds a probe's
spec and its success/failure counters. What the results mean (readiness, restarts) is the
kubelet's business (`podrunner.PodRunner._probe`).
"""

from __future__ import annotations

import concurrent.futures
import socket
import subprocess
from dataclasses import dataclass
from typing import Any

import httpx

Json = dict[str, Any]


@dataclass
class Probe:
    """A probe of one container and its counters since the container last started."""

    spec: Json
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0
    pending: concurrent.futures.Future[bool] | None = None

    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))


def _port(value: Any, container: Json) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    for p in container.get("ports") or []:
        if p.get("name") == value:
            return int(p["containerPort"])
    raise ValueError(f"probe port {value!r} is not a container port name")


def run_probe(probe: Json, ip: str, container: Json, cwd: str, prefix: list[str],
           env: dict[str, str] | None) -> bool:
    """Runs one probe (in the probe thread pool); an exec probe's command after `prefix`,
    with `env` (None: this process's)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    if "httpGet" in probe:
        get = probe["httpGet"]
        scheme = get.get("scheme", "HTTP").lower()
        url = (f"{scheme}://{get.get('host') or ip}:{_port(get['port'], container)}"
               f"{get.get('path', '/')}")
        headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
        try:
            r = httpx.get(url, headers=headers, timeout=timeout, verify=False)
        except httpx.HTTPError:
            return False
        return 200 <= r.status_code < 400
    if "tcpSocket" in probe:
        tcp = probe["tcpSocket"]
        try:
            socket.create_connection((tcp.get("host") or ip, _port(tcp["port"], container)),
                                     timeout=timeout).close()
        except OSError:
            return False
        return True
    if "exec" in probe:
        try:
            return subprocess.run([*prefix, *probe["exec"]["command"]], cwd=cwd, env=env,
                                  timeout=timeout, capture_output=True).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    return False

