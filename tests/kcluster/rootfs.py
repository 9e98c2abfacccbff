"""The test kubelet's image mode: images from local podman storage, and what a container of
a pod gets from its image and its pod spec (command, env, user, working dir, mounts).

No registry is reachable here and no container runtime starts (see
/work/shared/ENVIRONMENT.md), so an image is "pulled" when podman's local storage has it
and its root filesystem comes from `podman image mount` (once per image; `ImageStore.close`
unmounts). `launcher.py` then runs the container in it. The rules follow Kubernetes:

* command replaces the image's ENTRYPOINT and drops its CMD; args alone replace CMD;
* env: the image's Env, then what kubelet adds, then the pod's (the caller's part);
* workingDir defaults to the image's WorkingDir, else /;
* the user: securityContext.runAsUser/runAsGroup (container, else pod), else the image's
  USER (numeric, or a name looked up in the image's /etc/passwd and /etc/group), else root;
  HOME from the user's /etc/passwd entry when the env sets none;
* volumes: emptyDir (a folder per pod), hostPath, configMap and secret (files written from
  the object's data; items and defaultMode honoured), persistentVolumeClaim (a folder per
  claim under the runner's root, shared by every pod that mounts the claim).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Json = dict[str, Any]
PODMAN = "podman"
SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


class PullError(Exception):
    """The image cannot be had: `reason` is kubelet's (ErrImagePull, ErrImageNeverPull)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class VolumeError(Exception):
    """A volume cannot be set up yet (a missing configMap or secret): kubelet's FailedMount."""


@dataclass(frozen=True)
class Image:
    ref: str
    id: str
    env: tuple[str, ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    working_dir: str
    user: str


class ImageStore:
    """Local podman storage as the node's image cache. Thread-safe."""

    def __init__(self) -> None:
        self._images: dict[str, Image] = {}
        self._mounts: dict[str, Path] = {}  # by image id
        self._lock = threading.Lock()

    def pull(self, ref: str, policy: str) -> Image:
        """The image, as kubelet's pull would give it; raises PullError (no registry is
        reachable, so an image missing here cannot be pulled, whatever the policy)."""
        with self._lock:
            if ref in self._images:
                return self._images[ref]
        r = subprocess.run([PODMAN, "image", "inspect", ref], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            if policy == "Never":
                raise PullError("ErrImageNeverPull", f'Container image "{ref}" is not present '
                                "with pull policy of Never")
            raise PullError("ErrImagePull", f'failed to pull and unpack image "{ref}": not '
                            "found in local podman storage and no registry is reachable "
                            "(build it, e.g. `make images`)")
        config = json.loads(r.stdout)[0].get("Config") or {}
        image = Image(ref=ref, id=json.loads(r.stdout)[0]["Id"],
                      env=tuple(config.get("Env") or ()),
                      entrypoint=tuple(config.get("Entrypoint") or ()),
                      cmd=tuple(config.get("Cmd") or ()),
                      working_dir=config.get("WorkingDir") or "",
                      user=config.get("User") or "")
        with self._lock:
            self._images[ref] = image
        return image

    def rootfs(self, image: Image) -> Path:
        """The image's root filesystem (mounted on first use; read-only for containers)."""
        with self._lock:
            if image.id not in self._mounts:
                out = subprocess.run([PODMAN, "image", "mount", image.id], check=True,
                                     capture_output=True, text=True, timeout=60).stdout
                self._mounts[image.id] = Path(out.strip())
            return self._mounts[image.id]

    def close(self) -> None:
        with self._lock:
            mounted, self._mounts = list(self._mounts), {}
        for image_id in mounted:
            subprocess.run([PODMAN, "image", "unmount", image_id], capture_output=True,
                           timeout=60)


# ---- pure rules ---------------------------------------------------------------------------------


def container_argv(image: Image, command: list[str], args: list[str]) -> list[str]:
    """Kubernetes' override rules for ENTRYPOINT/CMD."""
    if command:
        return [*command, *args]
    return [*image.entrypoint, *(args or image.cmd)]


def image_env(image: Image) -> dict[str, str]:
    return dict(item.partition("=")[::2] for item in image.env)


@dataclass(frozen=True)
class User:
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def _table(path: Path) -> list[list[str]]:
    try:
        return [line.split(":") for line in path.read_text().splitlines()
                if line and not line.startswith("#")]
    except OSError:
        return []


def resolve_user(pod_spec: Json, container: Json, image: Image, rootfs: Path) -> User:
    """The uid, gid, supplementary groups and home the container runs with. As runtimes do,
    a user's primary group (and home) comes from the image's /etc/passwd, else 0 (and /)."""
    pod_sc, sc = pod_spec.get("securityContext") or {}, container.get("securityContext") or {}
    passwd = _table(rootfs / "etc/passwd")
    name, _, group_name = image.user.partition(":")
    run_as = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if run_as is not None:
        name = str(int(run_as))
    entry = next((e for e in passwd if len(e) > 5 and name in (e[0], e[2])), None)
    if name and entry is None and not name.isdigit():
        raise ValueError(f"image {image.ref}: USER {name!r} is not in its /etc/passwd")
    uid = int(entry[2]) if entry else int(name or 0)
    gid = int(entry[3]) if entry else 0
    if group_name and run_as is None:
        group = next((e for e in _table(rootfs / "etc/group") if e[0] == group_name), None)
        if group is None and not group_name.isdigit():
            raise ValueError(f"image {image.ref}: group {group_name!r} is not in its "
                             "/etc/group")
        gid = int(group[2]) if group else int(group_name)
    run_as_group = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if run_as_group is not None:
        gid = int(run_as_group)
    extra = [int(g) for g in pod_sc.get("supplementalGroups") or []]
    if pod_sc.get("fsGroup") is not None:
        extra.append(int(pod_sc["fsGroup"]))
    return User(uid, gid, tuple(dict.fromkeys([gid, *extra])), entry[5] if entry else "/")


def hosts_file(ip: str, hostname: str) -> str:
    return ("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost "
            f"ip6-localhost ip6-loopback\n{ip}\t{hostname}\n")


# ---- volumes ------------------------------------------------------------------------------------


def prepare_volumes(pod_spec: Json, namespace: str, pod_dir: Path, claims_dir: Path,
                    data: Callable[[str, str, str, bool], dict[str, str] | None]
                    ) -> dict[str, Path]:
    """Every volume of the pod as a host path, by volume name. `data(kind, ns, name,
    optional)` reads a configMap's or secret's data (None: optional and missing)."""
    paths: dict[str, Path] = {}
    for volume in pod_spec.get("volumes") or []:
        name = volume["name"]
        folder = pod_dir / "volumes" / name
        if "emptyDir" in volume:
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o777)  # as kubelet makes it: writable by any user of the pod
            paths[name] = folder
        elif "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
            kind = volume["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            elif not path.exists():
                raise VolumeError(f"hostPath {path} of volume {name!r} does not exist")
            paths[name] = path
        elif "configMap" in volume or "secret" in volume:
            kind = "configMap" if "configMap" in volume else "secret"
            source = volume[kind]
            ref = source.get("name") or source.get("secretName", "")
            values = data("configmaps" if kind == "configMap" else "secrets", namespace, ref,
                          bool(source.get("optional", False)))
            _write_files(folder, values or {}, source.get("items"),
                         int(source.get("defaultMode", 0o644)))
            paths[name] = folder
        elif "persistentVolumeClaim" in volume:
            claim = claims_dir / namespace / volume["persistentVolumeClaim"]["claimName"]
            claim.mkdir(parents=True, exist_ok=True)
            claim.chmod(0o777)
            paths[name] = claim
        else:
            raise VolumeError(f"volume {name!r}: only emptyDir, hostPath, configMap, secret "
                              "and persistentVolumeClaim are supported by the test kubelet")
    return paths


def _write_files(folder: Path, values: dict[str, str], items: list[Json] | None,
                 mode: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    chosen = [(i["key"], i["path"], int(i.get("mode", mode))) for i in items] if items \
        else [(key, key, mode) for key in values]
    for key, path, file_mode in chosen:
        if key not in values:
            raise VolumeError(f"key {key!r} is not in the volume's data")
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(values[key])
        target.chmod(file_mode)


def volume_mounts(container: Json, volumes: dict[str, Path], expand: Callable[[str], str]
                  ) -> list[Json]:
    """The launcher's mounts for a container's volumeMounts (subPath, subPathExpr,
    readOnly)."""
    mounts = []
    for m in container.get("volumeMounts") or []:
        if m["name"] not in volumes:
            raise VolumeError(f"volumeMount {m['name']!r} names no volume of the pod")
        source = volumes[m["name"]]
        sub = m.get("subPath") or expand(m.get("subPathExpr", ""))
        if sub:
            if sub.startswith("/") or ".." in Path(sub).parts:
                raise VolumeError(f"subPath {sub!r} must be a relative path inside the volume")
            source = source / sub
            if not source.exists():
                source.mkdir(parents=True)
                source.chmod(0o777)
        mounts.append({"source": str(source), "target": m["mountPath"],
                       "read_only": bool(m.get("readOnly", False))})
    return mounts


def service_account(pod_dir: Path, namespace: str, token: str, ca: str) -> Path:
    """The folder kubelet mounts at SERVICE_ACCOUNT_PATH: token, namespace and ca.crt."""
    folder = pod_dir / "serviceaccount"
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in (("token", token), ("namespace", namespace), ("ca.crt", ca)):
        (folder / name).write_text(value)
        (folder / name).chmod(0o644)
    return folder


def system_mounts(pod_dir: Path, ip: str, hostname: str) -> list[Json]:
    """/dev, /sys (read-only), /etc/hosts, /etc/hostname and /etc/resolv.conf."""
    (pod_dir / "hosts").write_text(hosts_file(ip, hostname))
    (pod_dir / "hostname").write_text(hostname + "\n")
    resolv = Path("/etc/resolv.conf")
    if not resolv.is_file():
        resolv = pod_dir / "resolv.conf"
        resolv.write_text("")
    return [{"source": "/dev", "target": "/dev", "recursive": True},
            {"source": "/sys", "target": "/sys", "recursive": True, "read_only": True},
            {"source": str(pod_dir / "hosts"), "target": "/etc/hosts"},
            {"source": str(pod_dir / "hostname"), "target": "/etc/hostname"},
            {"source": str(resolv), "target": "/etc/resolv.conf", "read_only": True}]


def launcher_command(spec_file: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).with_name("launcher.py")), str(spec_file)]


def exec_prefix(pid: int, user: User) -> list[str]:
    """Runs a command (an exec probe) inside a running container, as its user."""
    return ["nsenter", "-t", str(pid), "-m", "-p", "-r", "-w", "-S", str(user.uid), "-G",
            str(user.gid), "--"]
