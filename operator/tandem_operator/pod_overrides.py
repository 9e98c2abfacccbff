"""spec.pod.overrides: a strategic-merge patch of every pool pod's spec, for what the CRD
does not model (dnsConfig, shareProcessNamespace, a sidecar, an env variable of the engine
container, a securityContext tweak).

Two pure halves. `check_overrides` refuses, naming the path, what the operator owns: the
command line, image, ports and probes of its containers, the env variables and mounts it
sets, its volumes and init containers (`tandem-*`, the weights' included), the fields it
derives from others. `apply_overrides` merges the patch into a rendered pod spec as
Kubernetes' strategic merge patch does for the lists that matter (`MERGE_KEYS`), so the
patch is applied last (manifests.py) and the template hash covers it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from tandem_engine.weights import WEIGHTS_MOUNT

from tandem_operator.fields import SpecError

# The operator's container of engine pods and of router pods: a patch entry of that name
# patches those pods' container and no other pod's; any other name is a sidecar.
MAIN_CONTAINERS = ("engine", "router")
# Lists merged entry by entry on a key (a patch entry with a new key is added), as
# Kubernetes' strategic merge patch merges them; `APPENDED` lists keep their entries and
# take the patch's after them; every other list is replaced by the patch's.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "volumes": "name",
    "imagePullSecrets": "name", "hostAliases": "ip", "topologySpreadConstraints": "topologyKey",
    **{f"{kind}[].{field}": key for kind in ("containers", "initContainers")
       for field, key in (("env", "name"), ("volumeMounts", "mountPath"),
                          ("ports", "containerPort"))},
}
APPENDED = frozenset({"tolerations"})
MAX_OVERRIDES_BYTES = 32 * 1024  # as JSON

OPERATOR_PREFIX = "tandem-"  # the operator's volumes and init containers (tmp, weights)
# What the operator sets in its own containers, and the field to use instead where one is.
OWNED_CONTAINER_FIELDS = {
    "command": "the operator's (tandem-engine / tandem-router)",
    "args": "the operator's: engine flags are spec.engine's fields and spec.engine.args",
    "image": "spec.engine.image",
    "ports": "the operator's (its Services and NetworkPolicies name them)",
    "startupProbe": "spec.engine.startupTimeoutSeconds",
    "readinessProbe": "the operator's (/readyz)",
    "livenessProbe": "the operator's (/healthz)",
}
OWNED_ENV = frozenset({"POD_IP", "POD_NAME", "POD_NAMESPACE", "HOME", "TMPDIR", "UCX_TLS",
                       "UCX_NET_DEVICES"})
OWNED_ENV_PREFIX = "TANDEM_"
OWNED_MOUNTS = ("/tmp", WEIGHTS_MOUNT)  # and everything under them
OWNED_POD_FIELDS = {
    "terminationGracePeriodSeconds": "spec.refit.drainTimeoutSeconds",
    "serviceAccountName": "the operator's (routers: <pool>-router, which watches the pods)",
    "serviceAccount": "the operator's (routers: <pool>-router, which watches the pods)",
    "metadata": "spec.pod.labels and spec.pod.annotations (a patch of the pod's spec "
                "takes no metadata)",
}


def check_overrides(patch: Any, path: str, engine_volumes: frozenset[str] = frozenset(),
                    engine_mounts: frozenset[str] = frozenset()) -> Mapping[str, Any] | None:
    """spec.pod.overrides, refused (SpecError naming the path and what to use instead)
    where it would change what the operator owns; `engine_volumes` and `engine_mounts` are
    spec.engine's volume names and mount paths, which are edited there. None when unset."""
    if patch is None:
        return None
    if not isinstance(patch, Mapping):
        raise SpecError(f"{path} must be an object: a patch of the pod's spec")
    if len(json.dumps(patch)) > MAX_OVERRIDES_BYTES:
        raise SpecError(f"{path} is over {MAX_OVERRIDES_BYTES} bytes as JSON")
    _no_directives(patch, path)
    if {"spec", "apiVersion", "kind"} & set(patch):
        raise SpecError(f"{path} is a patch of the pod's spec: write its fields (containers, "
                        "dnsConfig, ...) at the top, not a whole pod")
    for key, use in OWNED_POD_FIELDS.items():
        if key in patch:
            raise SpecError(f"{path}.{key} is the operator's to set: use {use}")
    for i, container in enumerate(_entries(patch, "containers", path)):
        _check_container(container, f"{path}.containers[{i}]", engine_mounts)
    for i, init in enumerate(_entries(patch, "initContainers", path)):
        if str(init["name"]).startswith(OPERATOR_PREFIX):
            raise SpecError(f"{path}.initContainers[{i}].name {init['name']!r}: init "
                            f"containers named {OPERATOR_PREFIX}* are the operator's (the "
                            "weights' copy); pick another name")
    for i, volume in enumerate(_entries(patch, "volumes", path)):
        name = str(volume["name"])
        if name.startswith(OPERATOR_PREFIX) or name in engine_volumes:
            raise SpecError(f"{path}.volumes[{i}].name {name!r}: "
                            + (f"volumes named {OPERATOR_PREFIX}* are the operator's (/tmp, "
                               "the weights)" if name.startswith(OPERATOR_PREFIX)
                               else "a volume of spec.engine.volumes: edit it there"))
    return patch


def _no_directives(value: Any, path: str) -> None:
    """No `$patch`, `$setElementOrder`, `$retainKeys` or other directive keys anywhere."""
    if isinstance(value, Mapping):
        for key, sub in value.items():
            if str(key).startswith("$"):
                raise SpecError(f"{path}.{key}: strategic-merge directives are not supported; "
                                "write the fields to set (null deletes one)")
            _no_directives(sub, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_directives(item, f"{path}[{i}]")


def _entries(patch: Mapping[str, Any], key: str, path: str, within: str = ""
             ) -> list[Mapping[str, Any]]:
    """A merged list of the patch (of a `within` entry: `containers[].`): objects, each
    with its merge key."""
    items = patch.get(key)
    if items is None:
        return []
    merge_key = MERGE_KEYS[within + key]
    if not isinstance(items, list) or not all(
            isinstance(item, Mapping) and isinstance(item.get(merge_key), str | int)
            for item in items):
        raise SpecError(f"{path}.{key} must be a list of objects, each with its {merge_key}")
    return items


def _check_container(container: Mapping[str, Any], path: str,
                     engine_mounts: frozenset[str]) -> None:
    if container["name"] not in MAIN_CONTAINERS:
        if not container.get("image"):
            raise SpecError(f"{path} ({container['name']!r}) is a sidecar (any name but "
                            f"{' and '.join(MAIN_CONTAINERS)}): it needs an image")
        return
    for key, use in OWNED_CONTAINER_FIELDS.items():
        if key in container:
            raise SpecError(f"{path}.{key}: the {container['name']} container's {key} is "
                            f"not overridden: {use}")
    for j, env in enumerate(_entries(container, "env", path, "containers[].")):
        name = str(env["name"])
        if name in OWNED_ENV or name.startswith(OWNED_ENV_PREFIX):
            raise SpecError(f"{path}.env[{j}].name {name!r} is set by the operator "
                            f"({', '.join(sorted(OWNED_ENV))} and {OWNED_ENV_PREFIX}*); pick "
                            "another variable")
    for j, mount in enumerate(_entries(container, "volumeMounts", path, "containers[].")):
        where = str(mount["mountPath"]).rstrip("/") or "/"
        owned = any(where == root or where.startswith(root + "/") for root in OWNED_MOUNTS)
        if owned or str(mount.get("name", "")).startswith(OPERATOR_PREFIX):
            raise SpecError(f"{path}.volumeMounts[{j}] at {where}: /tmp, {WEIGHTS_MOUNT} and "
                            f"the {OPERATOR_PREFIX}* volumes are the operator's; mount "
                            "elsewhere")
        if where in engine_mounts:
            raise SpecError(f"{path}.volumeMounts[{j}] at {where} is a mount of "
                            "spec.engine.volumeMounts: edit it there")


def apply_overrides(pod_spec: dict[str, Any], patch: Mapping[str, Any] | None, main: str
                    ) -> dict[str, Any]:
    """`pod_spec` with `patch` merged in, for a pod whose container is `main`: entries for
    the other main container are left out (they patch the other group's pods)."""
    if not patch:
        return pod_spec
    if "containers" in patch:
        others = set(MAIN_CONTAINERS) - {main}
        patch = {**patch, "containers": [c for c in patch["containers"]
                                         if c.get("name") not in others]}
    return strategic_merge(pod_spec, patch)


def strategic_merge(base: Any, patch: Any, path: str = "") -> Any:
    """`patch` merged into `base` (neither changed): objects key by key, a null deleting
    the key; the lists of `MERGE_KEYS` entry by entry, `APPENDED` ones appended to, other
    lists and values replaced. `path` names the list being merged (`containers[].env`)."""
    if isinstance(patch, Mapping):
        merged = dict(base) if isinstance(base, Mapping) else {}
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(merged.get(key), value,
                                              f"{path}.{key}" if path else key)
        return merged
    if isinstance(patch, list) and isinstance(base, list):
        if path in APPENDED:
            return [*copy.deepcopy(base), *copy.deepcopy(patch)]
        key = MERGE_KEYS.get(path)
        if key is not None:
            merged_list = list(base)
            for item in patch:
                at = next((i for i, old in enumerate(merged_list)
                           if isinstance(old, Mapping) and old.get(key) == item.get(key)), None)
                if at is None:
                    merged_list.append(strategic_merge(None, item, f"{path}[]"))
                else:
                    merged_list[at] = strategic_merge(merged_list[at], item, f"{path}[]")
            return merged_list
    return copy.deepcopy(patch)
