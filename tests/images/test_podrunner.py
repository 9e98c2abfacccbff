"""The test kubelet (`kcluster.podrunner.PodRunner`) on the test API server: pods become
local processes on their own loopback addresses, with kubelet's env, status, probes,
restarts and graceful deletion."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import kubernetes.client
import pytest
from kcluster.fixtures import test_cluster  # noqa: F401
from kcluster.podrunner import PodRunner, expand, field_ref

# The built images are mounted once per worker: their tests share one (make test: -n 2).
NS = "default"

# Answers every GET with its environment, argv and working directory as JSON.
ENV_SERVER = """
import http.server, json, os, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"env": dict(os.environ), "argv": sys.argv[1:],
                           "cwd": os.getcwd()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((os.environ["POD_IP"], 8000), Handler).serve_forever()
"""


@pytest.fixture
def runner(test_cluster) -> Iterator[PodRunner]:  # noqa: F811
    with PodRunner(test_cluster, restart_backoff=(0.2, 1.0)) as r:
        yield r


@pytest.fixture
def core(test_cluster) -> kubernetes.client.CoreV1Api:  # noqa: F811
    return kubernetes.client.CoreV1Api(test_cluster.api())


def pod_body(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "local", "command": command,
                 **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "demo"}},
            "spec": {"containers": [container], **spec}}


def python(code: str) -> list[str]:
    return ["python", "-c", code]


def read(core: kubernetes.client.CoreV1Api, name: str) -> dict[str, Any] | None:
    try:
        pod = core.read_namespaced_pod(name, NS)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return core.api_client.sanitize_for_serialization(pod)


def wait_for(core: kubernetes.client.CoreV1Api, runner: PodRunner, name: str,
             check: Callable[[dict[str, Any] | None], bool], what: str,
             timeout: float = 20.0) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while True:
        pod = read(core, name)
        if check(pod):
            return pod
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} never {what} in {timeout} s; last: "
                                 f"{(pod or {}).get('status')}\nrunner errors: "
                                 f"{runner.errors}\n{runner.logs(name)}")
        time.sleep(0.1)


def condition(pod: dict[str, Any] | None, kind: str) -> str | None:
    for c in ((pod or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c["status"]
    return None


def container_status(pod: dict[str, Any] | None) -> dict[str, Any]:
    return (((pod or {}).get("status") or {}).get("containerStatuses") or [{}])[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pure_helpers() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$$(A) $(C) $(A", env) == "$(A) $(C) $(A"
    assert expand("cost: $5 $", env) == "cost: $5 $"
    pod = {"metadata": {"name": "p", "namespace": "n", "labels": {"app": "x"}},
           "status": {"podIP": "127.1.2.3", "podIPs": [{"ip": "127.1.2.3"}]}}
    assert field_ref(pod, "metadata.labels['app']") == "x"
    assert field_ref(pod, "status.podIPs") == "127.1.2.3"
    with pytest.raises(ValueError, match="not supported"):
        field_ref(pod, "spec.containers")


def test_a_pod_runs_on_its_own_address_with_kubelets_environment(
        test_cluster, core, runner) -> None:  # noqa: F811
    core.create_namespaced_secret(NS, {"metadata": {"name": "creds"},
                                       "data": {"token": base64.b64encode(b"s3cret").decode()}})
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
           {"name": "MISSING", "valueFrom": {"secretKeyRef": {
               "name": "nope", "key": "x", "optional": True}}},
           {"name": "GREETING", "value": "hello $(POD_NAME) in $(POD_NAMESPACE)"}]
    core.create_namespaced_pod(NS, pod_body("web", python(ENV_SERVER), container={
        "args": ["$(POD_NAME)", "$$(POD_NAME)", "$(NOT_DEFINED)", "<$(GREETING)>"],
        "env": env, "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}))
    pod = wait_for(core, runner, "web", lambda p: condition(p, "Ready") == "True", "got ready")
    assert pod is not None
    status = pod["status"]
    ip = status["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    assert status["phase"] == "Running" and status["podIPs"] == [{"ip": ip}]
    assert status["hostIP"] and pod["spec"]["nodeName"]
    assert condition(pod, "ContainersReady") == "True"
    assert container_status(pod)["ready"] and container_status(pod)["restartCount"] == 0
    assert "running" in container_status(pod)["state"]

    seen = httpx.get(f"http://{ip}:8000/", timeout=5).json()
    e = seen["env"]
    assert (e["POD_IP"], e["POD_NAME"], e["POD_NAMESPACE"], e["APP"]) == (ip, "web", NS, "demo")
    assert e["TOKEN"] == "s3cret" and "MISSING" not in e
    assert e["GREETING"] == "hello web in default"
    assert seen["argv"] == ["web", "$(POD_NAME)", "$(NOT_DEFINED)", "<hello web in default>"]
    assert e["KUBECONFIG"] == str(test_cluster.kubeconfig)
    assert e["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert runner.pod_ip("web") == ip

    pids = runner.pids("web")
    assert len(pids) == 1 and alive(pids[0])
    runner.stop()  # stop() kills every process
    assert not alive(pids[0])


def test_crashing_containers_restart_per_policy(core, runner) -> None:
    crash = python("import sys; print('crashing', flush=True); sys.exit(3)")
    core.create_namespaced_pod(NS, pod_body("crasher", crash))
    core.create_namespaced_pod(NS, pod_body("once-bad", crash, restartPolicy="Never"))
    core.create_namespaced_pod(NS, pod_body("once-ok", python("pass"), restartPolicy="Never"))
    core.create_namespaced_pod(NS, pod_body("retry-ok", python("pass"),
                                            restartPolicy="OnFailure"))
    core.create_namespaced_pod(NS, pod_body("no-command", ["no-such-command-here"],
                                            restartPolicy="Never"))

    pod = wait_for(core, runner, "crasher",
                   lambda p: container_status(p).get("restartCount", 0) >= 2,
                   "restarted twice")
    status = container_status(pod)
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert not status["ready"] and condition(pod, "Ready") == "False"
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff" or "running" in \
        status["state"]
    assert runner.logs("crasher").count("crashing") >= 2

    bad = wait_for(core, runner, "once-bad", lambda p: p["status"]["phase"] == "Failed",
                   "failed")
    assert container_status(bad)["state"]["terminated"]["exitCode"] == 3
    assert container_status(bad)["restartCount"] == 0
    for name in ("once-ok", "retry-ok"):
        ok = wait_for(core, runner, name, lambda p: p["status"]["phase"] == "Succeeded",
                      "succeeded")
        assert container_status(ok)["state"]["terminated"]["exitCode"] == 0
        assert container_status(ok)["restartCount"] == 0
    unstartable = wait_for(core, runner, "no-command", lambda p: p["status"]["phase"] == "Failed",
                           "failed to start")
    terminated = container_status(unstartable)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (128, "StartError")
    assert "no-such-command-here" in terminated["message"]


def test_readiness_and_liveness_follow_their_probes(core, runner, tmp_path) -> None:
    ready, live = tmp_path / "ready", tmp_path / "live"
    ready.touch()
    live.touch()
    core.create_namespaced_pod(NS, pod_body(
        "flappy", python("import time; time.sleep(600)"), terminationGracePeriodSeconds=1,
        container={
            "readinessProbe": {"exec": {"command": ["test", "-e", str(ready)]},
                               "periodSeconds": 1, "failureThreshold": 1},
            "livenessProbe": {"exec": {"command": ["test", "-e", str(live)]},
                              "periodSeconds": 1, "failureThreshold": 2}}))
    wait_for(core, runner, "flappy", lambda p: condition(p, "Ready") == "True", "got ready")
    ready.unlink()
    wait_for(core, runner, "flappy", lambda p: condition(p, "Ready") == "False",
             "lost readiness")
    ready.touch()
    wait_for(core, runner, "flappy", lambda p: condition(p, "Ready") == "True",
             "got ready again")
    assert container_status(read(core, "flappy"))["restartCount"] == 0
    pid = runner.pids("flappy")[0]
    live.unlink()  # two failed liveness probes: killed and started again
    wait_for(core, runner, "flappy", lambda p: container_status(p)["restartCount"] == 1,
             "restarted")
    live.touch()
    assert not alive(pid)
    wait_for(core, runner, "flappy", lambda p: condition(p, "Ready") == "True",
             "got ready after the restart")


def test_a_startup_probe_holds_liveness_and_readiness_back(core, runner, tmp_path) -> None:
    """As in kubelet: a slow start (a checkpoint loading) is not killed by liveness, nor
    ready, until the startup probe first succeeds; a start that never succeeds is restarted."""
    started, live = tmp_path / "started", tmp_path / "live"
    sleep = python("import time; time.sleep(600)")
    probes = {"readinessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 1},
              "livenessProbe": {"exec": {"command": ["test", "-e", str(live)]},
                                "periodSeconds": 1, "failureThreshold": 1}}
    core.create_namespaced_pod(NS, pod_body("slow", sleep, terminationGracePeriodSeconds=1,
                                            container={**probes, "startupProbe": {
                                                "exec": {"command": ["test", "-e",
                                                                     str(started)]},
                                                "periodSeconds": 1, "failureThreshold": 600}}))
    core.create_namespaced_pod(NS, pod_body("stuck", sleep, terminationGracePeriodSeconds=1,
                                            container={"startupProbe": {
                                                "exec": {"command": ["false"]},
                                                "periodSeconds": 1, "failureThreshold": 2}}))
    wait_for(core, runner, "slow", lambda p: "running" in container_status(p).get("state", {}),
             "ran")
    time.sleep(3)  # several liveness periods, had liveness been asked
    pod = read(core, "slow")
    assert container_status(pod)["restartCount"] == 0 and not container_status(pod)["started"]
    assert condition(pod, "Ready") == "False"
    live.touch()
    started.touch()
    pod = wait_for(core, runner, "slow", lambda p: condition(p, "Ready") == "True",
                   "got ready once started")
    assert container_status(pod)["started"] and container_status(pod)["restartCount"] == 0
    wait_for(core, runner, "stuck", lambda p: container_status(p).get("restartCount", 0) >= 1,
             "was restarted for never starting")
    assert "startup probe failed 2 times" in runner.logs("stuck")


def test_home_and_tmpdir_in_a_volume_keep_this_machines(core, runner, tmp_path) -> None:
    """Pool pods set HOME=/tmp on an emptyDir (their root is read-only); a local process has
    no such volume and keeps this machine's, so caches stay shared."""
    out = tmp_path / "env"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ['HOME'] + '|' + " \
           "os.environ.get('TMPDIR', '-') + '|' + os.environ['ELSEWHERE'])"
    core.create_namespaced_pod(NS, pod_body("homes", python(code), restartPolicy="Never",
                                            container={
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "TMPDIR", "value": "/tmp/x"},
                {"name": "ELSEWHERE", "value": "/tmp"}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]},
        volumes=[{"name": "tmp", "emptyDir": {}}]))
    wait_for(core, runner, "homes", lambda p: p["status"]["phase"] == "Succeeded", "ran")
    assert out.read_text() == f"{os.environ['HOME']}|{os.environ.get('TMPDIR', '-')}|/tmp"


def test_deletion_terminates_within_the_grace_period(core, runner) -> None:
    polite = python("import signal, sys, time\n"
                    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                    "print('up', flush=True); time.sleep(600)")
    stubborn = python("import signal, time\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('up', flush=True); time.sleep(600)")
    core.create_namespaced_pod(NS, pod_body("polite", polite))  # grace 30 s by default
    core.create_namespaced_pod(NS, pod_body("stubborn", stubborn,
                                            terminationGracePeriodSeconds=1))
    for name in ("polite", "stubborn"):
        wait_for(core, runner, name, lambda p: container_status(p).get("started"), "started")
    pids = {name: runner.pids(name)[0] for name in ("polite", "stubborn")}
    time.sleep(0.3)  # let the scripts install their SIGTERM handlers

    started = time.monotonic()
    core.delete_namespaced_pod("polite", NS)
    pod = read(core, "polite")
    assert pod is None or pod["metadata"]["deletionTimestamp"]  # terminating, or gone
    wait_for(core, runner, "polite", lambda p: p is None, "went away", timeout=10)
    assert time.monotonic() - started < 10 and not alive(pids["polite"])

    started = time.monotonic()
    core.delete_namespaced_pod("stubborn", NS)
    time.sleep(0.5)
    assert alive(pids["stubborn"])  # it ignores SIGTERM: it gets its grace period
    wait_for(core, runner, "stubborn", lambda p: p is None, "went away", timeout=10)
    assert 1.0 <= time.monotonic() - started < 10 and not alive(pids["stubborn"])


# ---- image mode: pods run from their images (local podman storage) ----------------------------

BASE_IMAGE = "localhost/tandem/base:bookworm"  # scripts/base-image.sh (`make base-image`)
MISSING_IMAGE = "localhost/tandem-test/never-built:1"
# USER by name (nobody: 65534:65534 in Debian's /etc/passwd), WORKDIR, ENV, ENTRYPOINT + CMD.
CONTAINERFILE = f"""FROM {BASE_IMAGE}
ENV GREETING=from-image
WORKDIR /srv/app
USER nobody
ENTRYPOINT ["python3", "-c"]
CMD ["print('the image CMD')"]
"""
TEST_IMAGE = "localhost/tandem-test/podrunner:" + hashlib.sha256(CONTAINERFILE.encode()
                                                                ).hexdigest()[:12]

# Serves what the container sees as JSON, after reading its own pod from the API server
# as an in-cluster client does (https, the service account's token and ca.crt).
IMAGE_SERVER = """
import http.server, json, os, ssl, sys, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
server = "https://{KUBERNETES_SERVICE_HOST}:{KUBERNETES_SERVICE_PORT}".format(**os.environ)
me = urllib.request.Request(
    f"{server}/api/v1/namespaces/{open(sa + 'namespace').read()}/pods/{os.environ['HOSTNAME']}",
    headers={"Authorization": "Bearer " + open(sa + "token").read()})
tls = ssl.create_default_context(cafile=sa + "ca.crt")
body = json.dumps({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(),
                   "ids": [os.getuid(), os.getgid()], "pid": os.getpid(),
                   "me": json.load(urllib.request.urlopen(me, timeout=5, context=tls)
                                   )["metadata"]["name"],
                   "hosts": open("/etc/hosts").read()}).encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((os.environ["POD_IP"], 8000), Handler).serve_forever()
"""


@pytest.fixture(scope="session")
def test_image(tmp_path_factory) -> str:
    if shutil.which("podman") is None or subprocess.run(
            ["podman", "image", "exists", BASE_IMAGE]).returncode != 0:
        pytest.skip(f"image mode needs podman and {BASE_IMAGE} (make base-image)")
    if subprocess.run(["podman", "image", "exists", TEST_IMAGE]).returncode != 0:
        folder = tmp_path_factory.mktemp("image")
        (folder / "Containerfile").write_text(CONTAINERFILE)
        subprocess.run(["podman", "build", "--isolation", "chroot", "--layers=false", "-q",
                        "-t", TEST_IMAGE, str(folder)], check=True, capture_output=True,
                       timeout=120)
    return TEST_IMAGE


@pytest.fixture
def image_runner(test_cluster, test_image) -> Iterator[PodRunner]:  # noqa: F811
    with PodRunner(test_cluster, images=True, restart_backoff=(0.2, 1.0),
                   pull_backoff=(2.0, 4.0)) as r:
        yield r


def image_pod(name: str, image: str = TEST_IMAGE, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": image, **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [container], **spec}}


def state(pod: dict[str, Any] | None, kind: str = "containerStatuses") -> dict[str, Any]:
    """The first container's state, as {reason-or-kind: details}."""
    statuses = ((pod or {}).get("status") or {}).get(kind) or [{}]
    return statuses[0].get("state") or {}


def waiting_reason(pod: dict[str, Any] | None) -> str | None:
    return (state(pod).get("waiting") or {}).get("reason")


POD_IP_ENV = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def test_a_pod_runs_from_its_image(core, image_runner) -> None:
    """ENTRYPOINT kept and CMD replaced by args; the image's env, WORKDIR and USER (a name in
    its /etc/passwd); the pod's env on top; an exec probe runs inside the container; the pod
    reaches the API server with its service account token."""
    core.create_namespaced_pod(NS, image_pod("imaged", container={
        "args": [IMAGE_SERVER, "$(POD_IP)"], "env": [*POD_IP_ENV, {"name": "FOO", "value": "bar"}],
        "ports": [{"containerPort": 8000}],
        "readinessProbe": {"periodSeconds": 1, "exec": {"command": [
            "python3", "-c", "import os, sys; sys.exit(os.getuid() != 65534 or "
            "os.getcwd() != '/srv/app' or os.environ['FOO'] != 'bar')"]}}}))
    pod = wait_for(core, image_runner, "imaged", lambda p: condition(p, "Ready") == "True",
                   "got ready")
    ip = pod["status"]["podIP"]
    seen = httpx.get(f"http://{ip}:8000/", timeout=5).json()
    assert seen["argv"] == ["-c", ip]
    assert (seen["cwd"], seen["ids"], seen["pid"]) == ("/srv/app", [65534, 65534], 1)
    e = seen["env"]
    assert (e["GREETING"], e["FOO"], e["HOME"], e["HOSTNAME"]) == (
        "from-image", "bar", "/nonexistent", "imaged")
    assert seen["me"] == "imaged" and f"{ip}\timaged" in seen["hosts"]
    assert container_status(pod)["imageID"].startswith("sha256:")
    pids = image_runner.pids("imaged")
    image_runner.stop()
    assert pids and not any(alive(pid) for pid in pids)


def test_a_missing_image_backs_off_like_kubelet(core, image_runner) -> None:
    core.create_namespaced_pod(NS, image_pod("unpulled", MISSING_IMAGE))
    core.create_namespaced_pod(NS, image_pod("never", MISSING_IMAGE, container={
        "imagePullPolicy": "Never"}))
    pod = wait_for(core, image_runner, "unpulled",
                   lambda p: waiting_reason(p) == "ErrImagePull", "failed to pull")
    assert MISSING_IMAGE in state(pod)["waiting"]["message"]
    pod = wait_for(core, image_runner, "unpulled",
                   lambda p: waiting_reason(p) == "ImagePullBackOff", "backed off")
    assert state(pod)["waiting"]["message"] == f'Back-off pulling image "{MISSING_IMAGE}"'
    assert pod["status"]["phase"] == "Pending"
    wait_for(core, image_runner, "never", lambda p: waiting_reason(p) == "ErrImageNeverPull",
             "refused to pull")


def test_crashing_and_unstartable_commands_back_off(core, image_runner) -> None:
    core.create_namespaced_pod(NS, image_pod("crashy", container={
        "command": ["python3", "-c", "import sys; sys.exit(7)"]}))
    core.create_namespaced_pod(NS, image_pod("nocommand", container={
        "command": ["no-such-command"], "args": ["x"]}))
    pod = wait_for(core, image_runner, "crashy",
                   lambda p: waiting_reason(p) == "CrashLoopBackOff"
                   and container_status(p)["restartCount"] >= 2, "crash-looped")
    last = container_status(pod)["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (7, "Error")
    assert last["startedAt"] <= last["finishedAt"]
    pod = wait_for(core, image_runner, "nocommand",
                   lambda p: waiting_reason(p) == "CrashLoopBackOff", "crash-looped")
    last = container_status(pod)["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (128, "StartError")
    assert '"no-such-command": executable file not found in $PATH' in last["message"]


def test_init_containers_run_first_and_share_an_emptydir(core, image_runner) -> None:
    work = {"name": "work", "mountPath": "/work"}
    init = {"name": "fetch", "image": TEST_IMAGE, "volumeMounts": [work],
            "command": ["sh", "-c", "echo fetched > /work/model"]}
    core.create_namespaced_pod(NS, image_pod(
        "initialized", restartPolicy="Never", initContainers=[init],
        volumes=[{"name": "work", "emptyDir": {}}],
        container={"volumeMounts": [work], "args": ["print(open('/work/model').read())"]}))
    core.create_namespaced_pod(NS, image_pod(
        "init-fails", restartPolicy="Never",
        initContainers=[{**init, "command": ["sh", "-c", "exit 2"]}],
        volumes=[{"name": "work", "emptyDir": {}}]))
    pod = wait_for(core, image_runner, "initialized",
                   lambda p: p["status"]["phase"] == "Succeeded", "succeeded")
    assert condition(pod, "Initialized") == "True"
    assert state(pod, "initContainerStatuses")["terminated"]["reason"] == "Completed"
    assert "fetched" in image_runner.logs("initialized")
    pod = wait_for(core, image_runner, "init-fails", lambda p: p["status"]["phase"] == "Failed",
                   "failed")
    assert state(pod, "initContainerStatuses")["terminated"]["exitCode"] == 2
    assert waiting_reason(pod) == "PodInitializing" and condition(pod, "Initialized") == "False"


def test_a_read_only_root_keeps_its_volumes_writable(core, image_runner) -> None:
    """As the pool pods run: read-only root, non-root uid, /tmp an emptyDir. Without
    readOnlyRootFilesystem each container writes its own layer, unseen by other pods."""
    probe = ("import os\nfor path in ('/etc/probe', '/tmp/probe'):\n"
             "    try:\n        open(path, 'w').write('x'); print(path, 'written')\n"
             "    except OSError as exc:\n        print(path, exc.strerror)\n"
             "print('ids', os.getuid(), os.getgid(), 'seen' if os.path.exists('/etc/mark') "
             "else 'unseen'); open('/etc/mark', 'w')")
    tmp = {"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    core.create_namespaced_pod(NS, image_pod(
        "locked", restartPolicy="Never", volumes=[{"name": "tmp", "emptyDir": {}}],
        securityContext={"runAsUser": 65532, "runAsGroup": 65532},
        container={**tmp, "args": [probe], "securityContext": {
            "readOnlyRootFilesystem": True}}))
    for name in ("open-1", "open-2"):
        core.create_namespaced_pod(NS, image_pod(name, restartPolicy="Never", container={
            "args": [probe], "securityContext": {"runAsUser": 0}}))
        wait_for(core, image_runner, name, lambda p: p["status"]["phase"] == "Succeeded",
                 "succeeded")
        assert "/etc/probe written" in image_runner.logs(name)
        assert "ids 0 0 unseen" in image_runner.logs(name)
    wait_for(core, image_runner, "locked", lambda p: p["status"]["phase"] == "Failed",
             "failed to mark its root")
    logs = image_runner.logs("locked")
    assert "/etc/probe Read-only file system" in logs and "/tmp/probe written" in logs
    assert "ids 65532 65532" in logs
    assert (image_runner.volume("locked", "tmp") / "probe").read_text() == "x"


def test_sigterm_reaches_the_containers_pid_1(core, image_runner) -> None:
    """As in a container: the command is pid 1, so SIGTERM reaches its handler, and a pid 1
    without one ignores it until the grace period ends in SIGKILL."""
    handler = ("import os, signal, sys, time\n"
               "def bye(*_):\n    open('/tmp/bye', 'w').write(str(os.getpid())); sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, bye)\nprint('up', flush=True)\ntime.sleep(600)")
    core.create_namespaced_pod(NS, image_pod(
        "handler", volumes=[{"name": "tmp", "emptyDir": {}}],
        container={"args": [handler], "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}))
    core.create_namespaced_pod(NS, image_pod("deaf", terminationGracePeriodSeconds=1,
                                             container={"args": ["import time; print('up', "
                                                                 "flush=True); time.sleep(600)"]}))
    for name in ("handler", "deaf"):
        wait_for(core, image_runner, name, lambda p, n=name: "up" in image_runner.logs(n),
                 "started")
    started = time.monotonic()
    core.delete_namespaced_pod("handler", NS)  # a grace period of 30 s
    wait_for(core, image_runner, "handler", lambda p: p is None, "went away", timeout=10)
    assert (image_runner.volume("handler", "tmp") / "bye").read_text() == "1"
    started = time.monotonic()
    core.delete_namespaced_pod("deaf", NS)
    wait_for(core, image_runner, "deaf", lambda p: p is None, "went away", timeout=10)
    assert time.monotonic() - started >= 1.0


def test_volumes_from_objects_claims_and_the_host(core, image_runner, tmp_path) -> None:
    core.create_namespaced_config_map(NS, {"metadata": {"name": "settings"},
                                           "data": {"mode": "fast", "unused": "-"}})
    core.create_namespaced_secret(NS, {"metadata": {"name": "keys"},
                                       "data": {"key": base64.b64encode(b"s3cret").decode()}})
    tmp_path.chmod(0o777)
    (tmp_path / "from-host").write_text("host")
    script = ("import os\n"
              "print('read', open('/cfg/m').read(), sorted(os.listdir('/cfg')), "
              "open('/keys/key').read(), open('/host/from-host').read())\n"
              "open('/models/weights', 'w').write('w'); open('/host/out', 'w').write('h')\n"
              "open('/sub/f', 'w').write('s')\n"
              "try:\n    open('/cfg/new', 'w')\nexcept OSError as exc:\n"
              "    print('cfg', exc.strerror)")
    core.create_namespaced_pod(NS, image_pod("mounted", restartPolicy="Never", volumes=[
        {"name": "cfg", "configMap": {"name": "settings", "items": [
            {"key": "mode", "path": "m"}]}},
        {"name": "keys", "secret": {"secretName": "keys"}},
        {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
        {"name": "host", "hostPath": {"path": str(tmp_path)}},
        {"name": "scratch", "emptyDir": {}}], container={
        "args": [script], "volumeMounts": [
            {"name": "cfg", "mountPath": "/cfg", "readOnly": True},
            {"name": "keys", "mountPath": "/keys", "readOnly": True},
            {"name": "models", "mountPath": "/models"},
            {"name": "host", "mountPath": "/host"},
            {"name": "scratch", "mountPath": "/sub", "subPath": "deep/er"}]}))
    wait_for(core, image_runner, "mounted", lambda p: p["status"]["phase"] == "Succeeded",
             "succeeded")
    logs = image_runner.logs("mounted")
    assert "read fast ['m'] s3cret host" in logs and "cfg Read-only file system" in logs
    assert (tmp_path / "out").read_text() == "h"
    assert (image_runner.volume("mounted", "scratch") / "deep/er/f").read_text() == "s"
    assert (image_runner.root / "claims" / NS / "models" / "weights").read_text() == "w"
