"""A test kubelet: runs the test cluster's pods on this machine, on loopback addresses.

The test API server has no nodes and no kubelet, so a pod would stay Pending forever. A
`PodRunner` plays the kubelet of one node, level-triggered like the real one: every tick
it lists all pods and, for each,

* binds it to its node (`pods/{name}/binding`, or `spec.nodeName` where that is missing),
  gives it its own address 127.x.y.z (all of 127/8 is loopback on Linux, so processes
  bind it without any set-up; never 127.0.0.1) and reports it in status.podIP/podIPs;
* runs its init containers one at a time, in order, each to success (status
  initContainerStatuses, the Initialized condition, app containers waiting in
  PodInitializing; a failed one is restarted with back-off, or fails the pod under
  restartPolicy Never), then its containers, with env from the spec (fieldRef,
  secretKeyRef, configMapKeyRef, envFrom; `$(VAR)` expanded in env values, command and
  args as kubelet does);
* reports phase (Pending → Running → Succeeded/Failed), containerStatuses and the
  PodScheduled / Initialized / ContainersReady / Ready conditions, the last two from the
  readiness probe (httpGet, tcpSocket or exec) polled every periodSeconds; a startup probe,
  as in kubelet, holds readiness and liveness probes back until it first succeeds;
* restarts exited containers per restartPolicy (and on failed startup or liveness probes)
  with exponential backoff (`restart_backoff`), waiting in CrashLoopBackOff meanwhile with
  the last run in lastState.terminated (exitCode, reason Error/Completed, startedAt,
  finishedAt); a command that cannot be started ends that way too, as reason StartError
  with exit code 128 and the runtime's message; each container's output goes to a log file
  per pod (`runner.logs(name)` for failure messages);
* on graceful deletion (deletionTimestamp set) sends SIGTERM, waits the grace period,
  SIGKILLs, then deletes the pod with gracePeriodSeconds=0. A pod that vanishes from the
  API without graceful deletion is stopped the same way.

Two modes:

* process mode (the default, fast): a container is a local process. Its command + args
  must exist on this machine (console scripts are found next to `sys.executable`); the
  image is ignored and so are volumes and securityContext (processes run as this user);
  env is this machine's plus the spec's plus KUBECONFIG pointing at the test cluster;
  HOME and TMPDIR from the spec that point into a volume mount (the pods' /tmp emptyDir)
  keep this machine's values, as the volume does not exist here.
* image mode (`PodRunner(cluster, images=True)`): a container runs from its image in local
  podman storage, as a runtime would run it (`kcluster.rootfs` holds the rules,
  `kcluster/launcher.py` the namespaces and mounts): ENTRYPOINT/CMD overridden by
  command/args, the image's Env then kubelet's then the spec's, WorkingDir, USER or
  runAsUser/runAsGroup, readOnlyRootFilesystem, its own writable layer otherwise; volumes
  emptyDir, hostPath, configMap, secret and persistentVolumeClaim (a folder per claim under
  the runner's root), with readOnly and subPath; /proc, /dev, /sys, /etc/hosts,
  /etc/hostname and /etc/resolv.conf; the command is pid 1 of its own pid namespace (a
  SIGTERM reaches it only if it handles SIGTERM, as in a container). An image missing here
  cannot be pulled (no registry is reachable): the container waits in ErrImagePull, then
  ImagePullBackOff until the next try (`pull_backoff`; ErrImageNeverPull under
  imagePullPolicy Never). Pods reach the API server as real pods do, in-cluster: the
  service account folder (token, namespace, ca.crt) is mounted unless
  automountServiceAccountToken is false, and KUBERNETES_SERVICE_HOST/PORT name an https
  front of the test API server (`apifront.HttpsFront`: in-cluster clients insist on https
  and a CA, the test API server speaks http); no KUBECONFIG is set. Exec probes run
  inside the container (nsenter). Needs root (mount and pid namespaces).

`extra_env` is added to every container's env in both modes, before the spec's.

Every process runs in its own process group, dies with the thread that started it
(PR_SET_PDEATHSIG, `serve.die_with_parent`) and is killed by `stop()`. Not supported:
resource limits, sidecar init containers (restartPolicy on an init container), projected
and downward-API volumes.
"""


from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tandem_engine.cli.serve import die_with_parent

from .apifront import HttpsFront
from .cluster import TOKEN
from .probes import Probe, run_probe
from .rootfs import (
    SERVICE_ACCOUNT_PATH,
    Image,
    ImageStore,
    PullError,
    User,
    VolumeError,
    container_argv,
    exec_prefix,
    image_env,
    launcher_command,
    prepare_volumes,
    resolve_user,
    service_account,
    system_mounts,
    volume_mounts,
)

NODE_NAME = "tandem-test-node"
START_ERROR_EXIT = 128  # what runtimes report for a command that could not be started
_FILESYSTEM_VARS = ("HOME", "TMPDIR")
HOST_IP = "127.0.0.1"

Json = dict[str, Any]


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- pure helpers: $(VAR) expansion, fieldRef, command lookup --------------------------------


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`,
    and a reference to an undefined name is left as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(variables[name] if name in variables else text[i:end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_ref(pod: Json, path: str) -> str:
    """The value of a downward-API fieldPath (the paths kubelet supports for env)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or []),
    }
    if path in simple:
        return simple[path] or ""
    if m := _SUBSCRIPT.match(path):
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ValueError(f"fieldRef {path!r} is not supported by the test kubelet")


def resolve_command(argv0: str, search_path: str) -> str:
    """An absolute program path: as given, else next to sys.executable, else on PATH."""
    if os.sep in argv0:
        return argv0
    beside = Path(sys.executable).parent / argv0
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(argv0, path=search_path)
    if found is None:
        raise FileNotFoundError(f"executable {argv0!r} not found next to {sys.executable} "
                                f"nor on PATH")
    return found


class ConfigError(Exception):
    """A container cannot start yet (missing secret, unknown field, no command)."""


class StartError(Exception):
    """The container's command cannot be run (a runtime's StartError, exit code 128)."""


# ---- per-container and per-pod state ----------------------------------------------------------


@dataclass
class _Container:
    spec: Json
    log: Path
    init: bool = False
    process: subprocess.Popen | None = None
    restart_count: int = 0
    starts: int = 0
    started_at: str | None = None
    started_mono: float = 0.0
    last_terminated: Json | None = None  # the previous run's terminated state
    waiting: tuple[str, str] = ("ContainerCreating", "")
    next_start_at: float = 0.0
    backoff: float = 0.0
    ready: bool = False
    done: bool = False  # exited and will not be restarted
    kill_at: float | None = None  # SIGKILL if still running by then
    restart_after_kill: bool = False
    readiness: Probe | None = None
    liveness: Probe | None = None
    startup: Probe | None = None
    started: bool = False  # the startup probe (if any) succeeded since the last start
    # image mode
    image: Image | None = None
    user: User | None = None
    env: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None  # the launcher's spec, pid file and start error
    pull_backoff: float = 0.0
    pull_failed_until: float = 0.0  # ErrImagePull until then, ImagePullBackOff after

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def succeeded(self) -> bool:
        return self.done and self.process is None and \
            (self.last_terminated or {}).get("exitCode") == 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    ip: str
    dir: Path
    containers: list[_Container]
    init_containers: list[_Container] = field(default_factory=list)
    volumes: dict[str, Path] | None = None  # image mode: set up before the first start
    start_time: str = field(default_factory=now_rfc3339)
    terminating_until: float | None = None  # graceful deletion deadline
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # (status, when)
    spec: Json = field(default_factory=dict)

    @property
    def all_containers(self) -> list[_Container]:
        return [*self.init_containers, *self.containers]


# ---- the runner ---------------------------------------------------------------------------------


class PodRunner:
    """The test cluster's kubelet. `with PodRunner(cluster) as runner: ...`"""

    def __init__(self, cluster: Any, *, root: Path | None = None, tick: float = 0.1,
                 restart_backoff: tuple[float, float] = (0.5, 8.0),
                 pull_backoff: tuple[float, float] = (1.0, 10.0),
                 extra_env: Mapping[str, str] | None = None, images: bool = False) -> None:
        self.cluster = cluster
        self.kubeconfig = Path(cluster.kubeconfig)
        self._own_root = root is None  # a folder of our own is removed by stop()
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="podrunner-"))
        self.tick = tick
        self.restart_backoff = restart_backoff
        self.pull_backoff = pull_backoff
        self._images = ImageStore() if images else None
        self._front: HttpsFront | None = None  # image mode: the API server for in-cluster use
        self.extra_env = dict(extra_env or {})
        self._http = httpx.Client(base_url=cluster.url, timeout=10.0,
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        self._probes = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="probe")
        self._pods: dict[str, _Pod] = {}  # by uid
        self._used_ips: set[str] = set()
        # A random second octet per runner keeps concurrent test runs on this machine apart.
        self._next_ip = random.randrange(16, 240) << 16 | 1 << 8 | 2
        self._stopping = threading.Event()
        self._stop_grace = 1.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []  # API failures seen (the loop keeps going)

    # ---- public -------------------------------------------------------------------------------

    def start(self) -> PodRunner:
        if self._images is not None:
            self._front = HttpsFront(self.cluster.url, self.root).start()
        self._thread = threading.Thread(target=self._run, name="podrunner", daemon=True)
        self._thread.start()
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop the loop and every process: SIGTERM, then SIGKILL after `grace` seconds.
        Removes the log folder unless the caller chose it (`root`)."""
        self._stop_grace = grace
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=grace + 30)
        self._kill_all(grace)  # no-op when the loop did it (it did unless it hung)
        self._probes.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        if self._images is not None:
            self._images.close()
        if self._front is not None:
            self._front.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self, pod_name: str, namespace: str | None = None) -> str:
        """Everything the pod's containers wrote, every run, with a header per start."""
        parts = []
        for base in sorted(self.root.glob(f"{namespace or '*'}/{pod_name}/*.log")):
            parts.append(f"----- {base.parent.parent.name}/{pod_name} {base.stem} -----\n"
                         + base.read_text(errors="replace"))
        return "\n".join(parts) or f"(no logs for pod {pod_name})"

    def pod_ip(self, pod_name: str, namespace: str = "default") -> str | None:
        with self._lock:
            for pod in self._pods.values():
                if pod.name == pod_name and pod.namespace == namespace:
                    return pod.ip
        return None

    def pids(self, pod_name: str, namespace: str = "default") -> list[int]:
        """The running processes of a pod's containers."""
        with self._lock:
            return [c.process.pid for p in self._pods.values()
                    if p.name == pod_name and p.namespace == namespace
                    for c in p.all_containers if c.running and c.process is not None]

    def volume(self, pod_name: str, volume: str, namespace: str = "default") -> Path:
        """Where an emptyDir, configMap or secret volume of a pod lives on this machine
        (image mode)."""
        return self.root / namespace / pod_name / "volumes" / volume

    # ---- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self._sync()
            except Exception as exc:  # keep the node alive; tests read .errors
                self._error(f"sync failed: {type(exc).__name__}: {exc}")
            self._stopping.wait(max(0.0, self.tick - (time.monotonic() - started)))
        # The children die with this thread (PR_SET_PDEATHSIG): stop them here, gracefully,
        # so they get one SIGTERM, not a second one from the kernel.
        self._kill_all(self._stop_grace)

    def _sync(self) -> None:
        r = self._http.get("/api/v1/pods")
        r.raise_for_status()
        seen: set[str] = set()
        for obj in r.json().get("items") or []:
            uid = _uid(obj)
            seen.add(uid)
            pod = self._pods.get(uid)
            if pod is None:
                if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue  # finished before this runner started (or on another node)
                if obj.get("spec", {}).get("nodeName") not in (None, "", NODE_NAME):
                    continue
                if obj["metadata"].get("deletionTimestamp"):
                    self._delete_now(obj)
                    continue
                pod = self._admit(obj)
                if pod is None:
                    continue
            pod.spec = obj.get("spec") or {}
            self._step(pod, obj)
        for uid in list(self._pods.keys() - seen):  # gone without graceful deletion
            pod = self._pods[uid]
            self._terminate(pod, self._grace(pod.spec, {}))
            if self._reap(pod):
                self._forget(pod)

    def _admit(self, obj: Json) -> _Pod | None:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        ns, name = meta.get("namespace", "default"), meta["name"]
        if not spec.get("nodeName") and not self._bind(ns, name):
            return None
        ip = self._allocate_ip(spec)
        pod_dir = self.root / ns / name
        pod_dir.mkdir(parents=True, exist_ok=True)
        inits = [_Container(c, pod_dir / f"{c['name']}.log", init=True)
                 for c in spec.get("initContainers") or []]
        containers = []
        for c in spec.get("containers") or []:
            container = _Container(c, pod_dir / f"{c['name']}.log")
            if inits:
                container.waiting = ("PodInitializing", "")
            if "readinessProbe" in c:
                container.readiness = Probe(c["readinessProbe"])
            if "livenessProbe" in c:
                container.liveness = Probe(c["livenessProbe"])
            if "startupProbe" in c:
                container.startup = Probe(c["startupProbe"])
            containers.append(container)
        pod = _Pod(_uid(obj), ns, name, ip, pod_dir, containers, inits, spec=spec)
        with self._lock:
            self._pods[pod.uid] = pod
        return pod

    def _step(self, pod: _Pod, obj: Json) -> None:
        """One kubelet pass over one pod: deletion, exits, restarts, probes, status."""
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            self._terminate(pod, self._grace(pod.spec, meta))
            if self._reap(pod):
                self._delete_now(obj)
                self._forget(pod)
            else:
                self._write_status(pod, obj)
            return
        policy = pod.spec.get("restartPolicy", "Always")
        now = time.monotonic()
        # The downward API sees the addresses even before they are written.
        addresses = {"podIP": pod.ip, "podIPs": [{"ip": pod.ip}], "hostIP": HOST_IP,
                     "hostIPs": [{"ip": HOST_IP}]}
        seen = {**obj, "status": {**(obj.get("status") or {}), **addresses}}
        # Init containers run one at a time, in order, each to success (a failed one is
        # restarted unless restartPolicy is Never, which fails the pod); then the others.
        init = next((c for c in pod.init_containers if not c.succeeded), None)
        if init is not None:
            self._check_exit(init, "Never" if policy == "Never" else "OnFailure", now)
            self._enforce_kill(init)
            init.ready = init.succeeded
            if init.succeeded or init.done:
                self._write_status(pod, obj)
                return
            self._start_when_due(pod, init, seen, now)
            self._write_status(pod, obj)
            return
        for c in pod.containers:
            self._check_exit(c, policy, now)
            self._enforce_kill(c)
            self._start_when_due(pod, c, seen, now)
            if c.running:
                self._probe(pod, c, now)
        self._write_status(pod, obj)

    def _start_when_due(self, pod: _Pod, c: _Container, obj: Json, now: float) -> None:
        if c.process is not None or c.done:
            return
        if now >= c.next_start_at:
            self._start(pod, c, obj)
        elif c.waiting[0] == "ErrImagePull" and now >= c.pull_failed_until:
            c.waiting = ("ImagePullBackOff", f'Back-off pulling image "{c.spec.get("image")}"')

    # ---- containers ---------------------------------------------------------------------------

    def _start(self, pod: _Pod, c: _Container, obj: Json) -> None:
        policy = pod.spec.get("restartPolicy", "Always")
        if c.init:
            policy = "Never" if policy == "Never" else "OnFailure"
        try:
            if self._images is None:
                argv, env, cwd = self._process_command(pod, c, obj)
            else:
                argv, env, cwd = self._image_command(pod, c, obj)
        except PullError as exc:
            low, high = self.pull_backoff
            c.pull_backoff = min(high, max(low, c.pull_backoff * 2))
            now = time.monotonic()
            c.waiting = (exc.reason, str(exc))
            c.pull_failed_until = now + c.pull_backoff / 2
            c.next_start_at = now + c.pull_backoff
            return
        except StartError as exc:
            self._exited(c, START_ERROR_EXIT, policy, time.monotonic(), reason="StartError",
                         message=str(exc))
            return
        except (ConfigError, VolumeError, ValueError, httpx.HTTPError) as exc:
            c.waiting = ("CreateContainerConfigError", str(exc))
            c.next_start_at = time.monotonic() + 1.0
            return
        except (OSError, subprocess.SubprocessError) as exc:  # podman, the pod's folder
            c.waiting = ("CreateContainerError", str(exc))
            c.next_start_at = time.monotonic() + 1.0
            return
        c.pull_backoff = 0.0
        with c.log.open("ab") as out:
            out.write(f"===== start {c.starts + 1} at {now_rfc3339()}: {argv}\n".encode())
            out.flush()
            try:
                c.process = subprocess.Popen(
                    argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                    start_new_session=True)
            except OSError as exc:
                c.waiting = ("RunContainerError", str(exc))
                c.next_start_at = time.monotonic() + 1.0
                return
        c.starts += 1
        c.started_at, c.started_mono = now_rfc3339(), time.monotonic()
        c.ready, c.started = False, c.startup is None
        for probe in (c.readiness, c.liveness, c.startup):
            if probe is not None:
                probe.successes = probe.failures = 0
                probe.pending = None
                probe.next_at = c.started_mono + float(probe.spec.get("initialDelaySeconds", 0))

    def _process_command(self, pod: _Pod, c: _Container, obj: Json
                         ) -> tuple[list[str], dict[str, str], str]:
        """Process mode: the command on this machine, this machine's env plus the pod's."""
        env = self._environment(obj, c.spec)
        command = [expand(a, env) for a in c.spec.get("command") or []]
        args = [expand(a, env) for a in c.spec.get("args") or []]
        argv = command + args
        if not argv:
            raise ConfigError("the container has neither command nor args (images have "
                              "no entrypoint in process mode)")
        try:
            argv[0] = resolve_command(argv[0], env.get("PATH", ""))
        except FileNotFoundError as exc:
            raise StartError(str(exc)) from exc
        return argv, env, c.spec.get("workingDir") or str(pod.dir)

    def _image_command(self, pod: _Pod, c: _Container, obj: Json
                       ) -> tuple[list[str], dict[str, str], str]:
        """Image mode: the launcher (tests/kcluster/launcher.py) for the container, with
        its spec written next to the pod's logs."""
        assert self._images is not None
        ref = c.spec.get("image") or ""
        policy = c.spec.get("imagePullPolicy") or (
            "Always" if ":" not in ref.rsplit("/", 1)[-1] or ref.endswith(":latest")
            else "IfNotPresent")
        image = self._images.pull(ref, policy)
        rootfs = self._images.rootfs(image)
        c.image, c.user = image, resolve_user(pod.spec, c.spec, image, rootfs)
        if pod.volumes is None:
            pod.volumes = prepare_volumes(pod.spec, pod.namespace, pod.dir,
                                          self.root / "claims", self._data)
        declared = self._declared_env(obj, c.spec)
        assert self._front is not None, "start() the runner first"
        port = self._front.port
        env = {**image_env(image), "HOSTNAME": pod.name, "KUBERNETES_SERVICE_HOST": HOST_IP,
               "KUBERNETES_SERVICE_PORT": str(port), "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
               "KUBERNETES_PORT": f"tcp://{HOST_IP}:{port}", **self.extra_env, **declared}
        env.setdefault("HOME", c.user.home)
        argv = container_argv(image, [expand(a, declared) for a in c.spec.get("command") or []],
                              [expand(a, declared) for a in c.spec.get("args") or []])
        if not argv:
            raise ConfigError(f"no command specified: image {ref} has neither ENTRYPOINT "
                              "nor CMD and the container sets no command")
        mounts = system_mounts(pod.dir, pod.ip, pod.name)
        if pod.spec.get("automountServiceAccountToken", True):
            folder = service_account(pod.dir, pod.namespace, TOKEN,
                                     self._front.ca_file.read_text())
            mounts.append({"source": str(folder), "target": SERVICE_ACCOUNT_PATH,
                           "read_only": True})
        mounts += volume_mounts(c.spec, pod.volumes, lambda text: expand(text, declared))
        run = c.run_dir = pod.dir / "run" / c.name
        for folder in (run / "root", run / "layer"):
            folder.mkdir(parents=True, exist_ok=True)
        for stale in (run / "pid", run / "start-error"):
            stale.unlink(missing_ok=True)
        sc = c.spec.get("securityContext") or {}
        cwd = c.spec.get("workingDir") or image.working_dir or "/"
        launch = {"root": str(run / "root"), "layer": str(run / "layer"), "lower": str(rootfs),
                  "read_only": bool(sc.get("readOnlyRootFilesystem", False)),
                  "mounts": mounts, "dirs": [cwd], "argv": argv, "env": env, "cwd": cwd,
                  "uid": c.user.uid, "gid": c.user.gid, "groups": list(c.user.groups),
                  "pid_file": str(run / "pid"), "start_error_file": str(run / "start-error")}
        (run / "launch.json").write_text(json.dumps(launch))
        c.env = env
        return launcher_command(run / "launch.json"), {"PATH": os.environ.get("PATH", "")}, \
            str(pod.dir)

    def _check_exit(self, c: _Container, policy: str, now: float) -> None:
        if c.process is None or c.process.poll() is None:
            return
        code = c.process.returncode
        error = c.run_dir / "start-error" if c.run_dir is not None else None
        if error is not None and error.is_file():  # image mode: the command did not start
            self._exited(c, START_ERROR_EXIT, policy, now, reason="StartError",
                         message=error.read_text(errors="replace"))
        else:
            self._exited(c, 128 - code if code < 0 else code, policy, now,
                         signal_number=-code if code < 0 else None)

    def _exited(self, c: _Container, exit_code: int, policy: str, now: float, *,
                reason: str | None = None, message: str = "",
                signal_number: int | None = None) -> None:
        """Records a run's end (lastState) and schedules the restart with back-off."""
        c.last_terminated = {"exitCode": exit_code,
                             "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                             "startedAt": c.started_at or now_rfc3339(),
                             "finishedAt": now_rfc3339()}
        if message:
            c.last_terminated["message"] = message
        if c.process is not None:
            c.last_terminated["containerID"] = f"local://{c.process.pid}"
        if signal_number is not None:
            c.last_terminated["signal"] = signal_number
        c.process, c.ready, c.kill_at = None, False, None
        restart = c.restart_after_kill or policy == "Always" or (
            policy == "OnFailure" and exit_code != 0)
        c.restart_after_kill = False
        if not restart:
            c.done = True
            return
        c.restart_count += 1
        low, high = self.restart_backoff
        # Like kubelet: the delay doubles on every crash and resets after a long good run.
        c.backoff = low if c.started_mono and now - c.started_mono > 10 * high else min(
            high, max(low, c.backoff * 2))
        c.next_start_at = now + c.backoff
        c.waiting = ("CrashLoopBackOff", f"back-off {c.backoff:.1f}s restarting failed "
                                         f"container={c.name}")

    def _signal(self, c: _Container, sig: int) -> None:
        if c.running and c.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.process.pid, sig)

    def _enforce_kill(self, c: _Container) -> None:
        if c.kill_at is not None and c.running and time.monotonic() >= c.kill_at:
            self._signal(c, signal.SIGKILL)

    def _terminate(self, pod: _Pod, grace: float) -> None:
        """SIGTERM now and SIGKILL after `grace` seconds; called again (every tick while
        the pod terminates), it only ever brings the SIGKILL forward, as kubelet does when
        a deletion shortens the grace period."""
        until = time.monotonic() + grace
        first = pod.terminating_until is None
        if not first and until >= pod.terminating_until:
            return
        pod.terminating_until = until
        for c in pod.all_containers:
            c.done, c.ready, c.kill_at = True, False, until
            if first:
                self._signal(c, signal.SIGTERM if grace > 0 else signal.SIGKILL)

    def _reap(self, pod: _Pod) -> bool:
        """True once every container of a terminating pod has exited (SIGKILL at deadline)."""
        for c in pod.all_containers:
            self._enforce_kill(c)
        return not any(c.running for c in pod.all_containers)

    def _kill_all(self, grace: float) -> None:
        with self._lock:
            containers = [c for p in self._pods.values() for c in p.all_containers
                          if c.running]
        for c in containers:
            self._signal(c, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in containers:
            if c.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            self._signal(c, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.process.wait(timeout=5)

    @staticmethod
    def _grace(spec: Json, meta: Json) -> float:
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(grace)

    def _forget(self, pod: _Pod) -> None:
        with self._lock:
            self._pods.pop(pod.uid, None)
            self._used_ips.discard(pod.ip)

    # ---- probes -------------------------------------------------------------------------------

    def _probe(self, pod: _Pod, c: _Container, now: float) -> None:
        if not c.started and c.startup is not None:
            result = self._run_probe(pod, c, c.startup, now)
            if result:
                c.started = True
                for probe in (c.readiness, c.liveness):
                    if probe is not None:
                        probe.next_at = now + float(probe.spec.get("initialDelaySeconds", 0))
            elif result is False and c.startup.failures >= int(
                    c.startup.spec.get("failureThreshold", 3)):
                self._kill_unhealthy(pod, c, "startup", c.startup.failures)
            return
        if c.readiness is None:
            c.ready = True
        else:
            result = self._run_probe(pod, c, c.readiness, now)
            if result is not None:
                threshold = int(c.readiness.spec.get(
                    "successThreshold" if result else "failureThreshold", 1 if result else 3))
                if result and c.readiness.successes >= threshold:
                    c.ready = True
                elif not result and (c.readiness.failures >= threshold or not c.ready):
                    c.ready = False
        if c.liveness is not None:
            result = self._run_probe(pod, c, c.liveness, now)
            threshold = int(c.liveness.spec.get("failureThreshold", 3))
            if result is False and c.liveness.failures >= threshold:
                self._kill_unhealthy(pod, c, "liveness", c.liveness.failures)

    def _kill_unhealthy(self, pod: _Pod, c: _Container, which: str, failures: int) -> None:
        """A failed startup or liveness probe: stop the container gracefully, then restart
        it per restartPolicy."""
        if c.kill_at is not None:
            return
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        c.restart_after_kill = pod.spec.get("restartPolicy", "Always") != "Never"
        self._signal(c, signal.SIGTERM)
        c.kill_at = time.monotonic() + grace
        with c.log.open("ab") as out:
            out.write(f"===== {which} probe failed {failures} times: "
                      "killing the container\n".encode())

    def _run_probe(self, pod: _Pod, c: _Container, probe: Probe, now: float) -> bool | None:
        """Collects a finished probe's result (None while none is due or still running)."""
        if probe.pending is not None:
            if not probe.pending.done():
                return None
            ok = bool(probe.pending.result()) if probe.pending.exception() is None else False
            probe.pending = None
            if ok:
                probe.successes, probe.failures = probe.successes + 1, 0
            else:
                probe.successes, probe.failures = 0, probe.failures + 1
            return ok
        if now >= probe.next_at:
            probe.next_at = now + probe.period()
            probe.pending = self._probes.submit(run_probe, probe.spec, pod.ip, c.spec,
                                                str(pod.dir), *self._exec_context(c))
        return None

    @staticmethod
    def _exec_context(c: _Container) -> tuple[list[str], dict[str, str] | None]:
        """How an exec probe runs: here (process mode), or inside the container."""
        if c.run_dir is None or c.user is None:
            return [], None
        try:
            pid = int((c.run_dir / "pid").read_text())
        except (OSError, ValueError):
            return ["false"], None  # not started yet: the probe fails
        return exec_prefix(pid, c.user), c.env

    # ---- environment --------------------------------------------------------------------------

    def _environment(self, pod: Json, container: Json) -> dict[str, str]:
        """The process environment: this machine's (for the venv, HOME, TMPDIR...), then
        KUBECONFIG and the venv on PATH, then envFrom and env of the spec, in order."""
        base = dict(os.environ)
        base.pop("KUBERNETES_SERVICE_HOST", None)
        base.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                     "HOSTNAME": pod["metadata"]["name"]})
        base.update(self.extra_env)
        base["KUBECONFIG"] = str(self.kubeconfig)
        bin_dir = str(Path(sys.executable).parent)
        base["PATH"] = os.pathsep.join([bin_dir, base.get("PATH", "/usr/bin:/bin")])
        declared = self._declared_env(pod, container)
        # A path inside the pod's volumes (HOME=/tmp on its emptyDir) means nothing to a local
        # process: keep this machine's, so caches (the native kernel's build) are shared.
        mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts") or []]
        for name in _FILESYSTEM_VARS:
            if name in declared and any(
                    (declared[name].rstrip("/") + "/").startswith(m) for m in mounts):
                declared.pop(name)
        base.update(declared)
        return base

    def _declared_env(self, pod: Json, container: Json) -> dict[str, str]:
        """The container's envFrom and env, in order, `$(VAR)` expanded in values."""
        ns = pod["metadata"].get("namespace", "default")
        declared: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            ref = source.get("secretRef") or source.get("configMapRef")
            if ref is None:
                continue
            data = self._data("secrets" if "secretRef" in source else "configmaps", ns,
                              ref["name"], ref.get("optional", False))
            declared.update({prefix + k: v for k, v in (data or {}).items()})
        for var in container.get("env") or []:
            if "valueFrom" in var:
                value = self._value_from(pod, ns, var["valueFrom"])
                if value is None:
                    continue  # an optional reference that is missing
            else:
                value = expand(var.get("value", ""), declared)
            declared[var["name"]] = value
        return declared

    def _value_from(self, pod: Json, ns: str, source: Json) -> str | None:
        if "fieldRef" in source:
            return field_ref(pod, source["fieldRef"]["fieldPath"])
        for key, kind in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if key in source:
                ref = source[key]
                data = self._data(kind, ns, ref["name"], ref.get("optional", False))
                if data is None or ref["key"] not in data:
                    if ref.get("optional", False):
                        return None
                    raise ConfigError(f"{kind[:-1]} {ns}/{ref['name']} has no key "
                                      f"{ref['key']!r}")
                return data[ref["key"]]
        raise ConfigError(f"env valueFrom {sorted(source)} is not supported by the test kubelet")

    def _data(self, kind: str, ns: str, name: str, optional: bool) -> dict[str, str] | None:
        r = self._http.get(f"/api/v1/namespaces/{ns}/{kind}/{name}")
        if r.status_code == 404:
            if optional:
                return None
            raise ConfigError(f"{kind[:-1]} {ns}/{name} not found")
        r.raise_for_status()
        obj = r.json()
        data = dict(obj.get("stringData") or {})
        if kind == "secrets":
            for k, v in (obj.get("data") or {}).items():
                data.setdefault(k, base64.b64decode(v).decode())
        else:
            data.update(obj.get("data") or {})
        return data

    # ---- addresses and API writes -------------------------------------------------------------

    def _allocate_ip(self, spec: Json) -> str:
        """A fresh 127.x.y.z whose declared container ports nothing else holds."""
        ports = [p["containerPort"] for c in spec.get("containers") or []
                 for p in c.get("ports") or [] if isinstance(p.get("containerPort"), int)]
        while True:
            n = self._next_ip
            self._next_ip += 1
            if n & 0xFF in (0, 1, 255):
                continue
            ip = f"127.{n >> 16 & 0xFF}.{n >> 8 & 0xFF}.{n & 0xFF}"
            if ip not in self._used_ips and all(_can_bind(ip, p) for p in ports):
                with self._lock:
                    self._used_ips.add(ip)
                return ip

    def _bind(self, ns: str, name: str) -> bool:
        binding = {"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": name, "namespace": ns},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME}}
        r = self._http.post(f"/api/v1/namespaces/{ns}/pods/{name}/binding", json=binding)
        if r.status_code in (404, 405):  # no binding subresource: set nodeName directly
            r = self._http.patch(f"/api/v1/namespaces/{ns}/pods/{name}",
                                 json={"spec": {"nodeName": NODE_NAME}},
                                 headers={"Content-Type": "application/merge-patch+json"})
        if r.is_error:
            self._error(f"binding {ns}/{name}: HTTP {r.status_code} {r.text[:200]}")
            return False
        return True

    def _write_status(self, pod: _Pod, obj: Json) -> None:
        """Patch the pod's status where the live object differs (level-triggered: a status
        someone else overwrote is put back)."""
        status = self._status(pod)
        live = obj.get("status") or {}
        if all(live.get(k) == v for k, v in status.items()):
            return
        ns, name = pod.namespace, pod.name
        headers = {"Content-Type": "application/merge-patch+json"}
        r = self._http.patch(f"/api/v1/namespaces/{ns}/pods/{name}/status",
                             json={"status": status}, headers=headers)
        if r.status_code == 405:  # no status subresource: patch the object itself
            r = self._http.patch(f"/api/v1/namespaces/{ns}/pods/{name}",
                                 json={"status": status}, headers=headers)
        if r.status_code == 404:
            return  # deleted meanwhile
        if r.is_error:
            self._error(f"status of {ns}/{name}: HTTP {r.status_code} {r.text[:200]}")

    def _status(self, pod: _Pod) -> Json:
        statuses = [self._container_status(c) for c in pod.containers]
        all_ready = bool(pod.containers) and all(c.ready for c in pod.containers)
        if pod.terminating_until is not None:
            all_ready = False
        incomplete = [c.name for c in pod.init_containers if not c.succeeded]
        if any(c.done and not c.succeeded for c in pod.init_containers):
            phase = "Failed"  # an init container failed under restartPolicy Never
        elif incomplete:
            phase = "Pending"
        elif pod.containers and all(c.done and c.process is None for c in pod.containers):
            codes = [(c.last_terminated or {}).get("exitCode", 1) for c in pod.containers]
            phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
        elif any(c.starts for c in pod.containers):
            phase = "Running"
        else:
            phase = "Pending"
        ready = "True" if all_ready else "False"
        unready = [c.name for c in pod.containers if not c.ready]
        why_unready = ("ContainersNotReady", f"containers with unready status: {unready}"
                       .replace("'", "")) if unready else ("", "")
        conditions = [_condition(pod, "PodScheduled", "True"),
                      _condition(pod, "Initialized", "False" if incomplete else "True",
                                 ("ContainersNotInitialized", "containers with incomplete "
                                  f"status: {incomplete}".replace("'", ""))
                                 if incomplete else ("", "")),
                      _condition(pod, "ContainersReady", ready, why_unready),
                      _condition(pod, "Ready", ready, why_unready)]
        status = {"phase": phase, "podIP": pod.ip, "podIPs": [{"ip": pod.ip}],
                  "hostIP": HOST_IP, "hostIPs": [{"ip": HOST_IP}], "startTime": pod.start_time,
                  "conditions": conditions, "containerStatuses": statuses}
        if pod.init_containers:
            status["initContainerStatuses"] = [self._container_status(c)
                                               for c in pod.init_containers]
        return status

    @staticmethod
    def _container_status(c: _Container) -> Json:
        if c.running and c.process is not None:
            state: Json = {"running": {"startedAt": c.started_at}}
        elif c.done and c.last_terminated is not None:
            state = {"terminated": c.last_terminated}
        else:
            reason, message = c.waiting
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        status: Json = {"name": c.name, "image": c.spec.get("image", ""),
                        "imageID": f"sha256:{c.image.id}" if c.image else "",
                        "ready": c.ready, "started": c.running and c.started,
                        "restartCount": c.restart_count, "state": state}
        if c.running and c.process is not None:
            status["containerID"] = f"local://{c.process.pid}"
        if c.last_terminated is not None and "terminated" not in state:
            status["lastState"] = {"terminated": c.last_terminated}
        return status

    def _delete_now(self, obj: Json) -> None:
        meta = obj["metadata"]
        r = self._http.request(
            "DELETE", f"/api/v1/namespaces/{meta.get('namespace', 'default')}/pods/"
            f"{meta['name']}", params={"gracePeriodSeconds": "0"},
            json={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        if r.is_error and r.status_code != 404:
            self._error(f"deleting {meta['name']}: HTTP {r.status_code} {r.text[:200]}")

    def _error(self, message: str) -> None:
        if len(self.errors) < 1000:
            self.errors.append(message)


def _uid(obj: Json) -> str:
    meta = obj["metadata"]
    return meta.get("uid") or f"{meta.get('namespace', 'default')}/{meta['name']}"


def _condition(pod: _Pod, kind: str, status: str, why: tuple[str, str] = ("", "")) -> Json:
    if pod.transitions.get(kind, ("",))[0] != status:
        pod.transitions[kind] = (status, now_rfc3339())
    reason, message = why
    return {"type": kind, "status": status, "lastTransitionTime": pod.transitions[kind][1],
            **({"reason": reason, "message": message} if reason else {})}


def _can_bind(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True
