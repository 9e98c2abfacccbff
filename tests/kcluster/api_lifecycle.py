"""What each write verb does to an object: the semantics kmock leaves out.

create stamps uid, creationTimestamp, generation and defaults; update/patch honour
resourceVersion preconditions, keep spec and status apart (the status subresource), bump
generation on spec changes only and write nothing for no-op changes; delete honours
finalizers (deletionTimestamp first, removal when the last finalizer goes), graceful pod
deletion (a pod bound to a node stays, terminating, until deleted again with grace 0, which
is what the kubelet does), ownerReference garbage collection (Background, Foreground, Orphan)
and namespace/CRD teardown of their contents. All methods are synchronous: the server runs on
one event loop, so each call is atomic.
"""

from __future__ import annotations

import base64
import copy
import random
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from . import api_crd, api_errors
from .api_patch import APPLY_PATCH, STRATEGIC_MERGE_PATCH, PatchError, apply_patch
from .api_resources import ResourceRegistry, ResourceType
from .api_storage import ObjectStore

CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY = ("", "namespaces")
POD_KEY = ("", "pods")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the real server uses for generateName


def now(offset_seconds: int = 0) -> str:
    moment = datetime.now(timezone.utc) + timedelta(seconds=offset_seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_part(obj: dict[str, Any], has_status: bool) -> dict[str, Any]:
    skipped = ("metadata", "status") if has_status else ("metadata",)
    return {k: v for k, v in obj.items() if k not in skipped}


class ObjectLifecycle:
    """The write verbs over one registry and store (see the module docstring)."""

    def __init__(self, registry: ResourceRegistry, store: ObjectStore):
        self.registry = registry
        self.store = store
        self._applied: dict[tuple[str, str], dict[str, Any]] = {}  # (uid, manager) -> config
        self._next_cluster_ip = 1

    # -- reads --

    def get(self, resource: ResourceType, namespace: str, name: str) -> dict[str, Any]:
        obj = self.store.get(resource.storage_key, namespace, name)
        if obj is None:
            raise api_errors.not_found(resource, name)
        return obj

    # -- create --

    def create(self, resource: ResourceType, namespace: str, body: Any,
               dry_run: bool = False) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise api_errors.bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if resource.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise api_errors.bad_request("the namespace of the provided object does not "
                                             "match the namespace sent on the request")
            self._check_namespace_open(namespace)
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise api_errors.invalid(resource, "", [api_crd.Cause(
                    "metadata.name", "Required value: name or generateName is required",
                    "FieldValueRequired")])
            meta["name"] = self._generate_name(resource, namespace, meta["generateName"])
        if self.store.get(resource.storage_key, namespace, meta["name"]) is not None:
            raise api_errors.already_exists(resource, meta["name"])
        for field in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "selfLink"):
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        if resource.has_status:
            obj.pop("status", None)  # create cannot set status
        obj = self._admit(resource, obj, None)
        if dry_run:
            return obj
        if resource.storage_key == CRD_KEY:
            self._serve_crd(obj)
        return self.store.put(resource.storage_key, obj, "ADDED")

    def _generate_name(self, resource: ResourceType, namespace: str, prefix: str) -> str:
        while True:
            name = prefix + "".join(random.choices(_SUFFIX_CHARS, k=5))
            if self.store.get(resource.storage_key, namespace, name) is None:
                return name

    def _check_namespace_open(self, namespace: str) -> None:
        ns = self.store.get(NAMESPACE_KEY, "", namespace)
        if ns is None:
            raise api_errors.not_found(self.registry.get("", "v1", "namespaces"), namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise api_errors.forbidden(f"unable to create new content in namespace {namespace} "
                                       "because it is being terminated")

    # -- update and patch --

    def update(self, resource: ResourceType, namespace: str, name: str, body: Any,
               subresource: str | None = None, dry_run: bool = False) -> dict[str, Any]:
        current = self.get(resource, namespace, name)
        if not isinstance(body, dict):
            raise api_errors.bad_request("the request body must be a JSON object")
        if subresource == "scale":
            body = self._from_scale(resource, current, body)
        wanted = body.get("metadata", {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise api_errors.conflict(resource, name, api_errors.STALE)
        if body.get("metadata", {}).get("name", name) != name:
            raise api_errors.bad_request("the name of the object does not match the name on "
                                         "the URL")
        return self._replace(resource, current, body, subresource, dry_run)

    def patch(self, resource: ResourceType, namespace: str, name: str, content_type: str,
              patch: Any, subresource: str | None = None, field_manager: str = "",
              dry_run: bool = False) -> tuple[dict[str, Any], bool]:
        """Returns the patched object and whether the patch created it (server-side apply)."""
        current = self.store.get(resource.storage_key, namespace, name)
        if current is None and content_type == APPLY_PATCH and subresource is None:
            body = copy.deepcopy(patch)
            body.setdefault("metadata", {})["name"] = name
            created = self.create(resource, namespace, body, dry_run)
            self._applied[(created["metadata"]["uid"], field_manager)] = patch
            return created, True
        if current is None:
            raise api_errors.not_found(resource, name)
        if content_type == STRATEGIC_MERGE_PATCH and resource.custom:
            raise api_errors.KubernetesError(
                415, "UnsupportedMediaType", "the body of the request was in an unknown format"
                " - accepted media types include: application/json-patch+json, "
                "application/merge-patch+json, application/apply-patch+yaml", None)
        target = self.scale_of(resource, current) if subresource == "scale" else current
        applied_key = (current["metadata"]["uid"], field_manager)
        try:
            patched = apply_patch(target, content_type, patch, strategic=not resource.custom,
                                  last_applied=self._applied.get(applied_key))
        except PatchError as exc:
            raise api_errors.KubernetesError(exc.code, "Invalid" if exc.code == 422 else
                                             "BadRequest", str(exc), None) from exc
        if subresource == "scale":
            patched = self._from_scale(resource, current, patched)
        elif patched.get("metadata", {}).get("resourceVersion") not in (
                None, current["metadata"]["resourceVersion"]):
            raise api_errors.conflict(resource, name, api_errors.STALE)
        if content_type == APPLY_PATCH and not dry_run:
            self._applied[applied_key] = patch
        return self._replace(resource, current, patched, subresource, dry_run), False

    def scale_of(self, resource: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """The object's autoscaling/v1 Scale, read at the resource's scale paths."""
        meta = obj["metadata"]
        spec_path, status_path, selector_path = resource.scale_paths
        status = {"replicas": _at(obj, status_path, 0)}
        if selector_path is not None and _at(obj, selector_path, None) is not None:
            status["selector"] = _at(obj, selector_path, None)
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                  "creationTimestamp") if k in meta},
                "spec": {"replicas": _at(obj, spec_path, 1)}, "status": status}

    def _from_scale(self, resource: ResourceType, current: dict[str, Any],
                    scale: dict[str, Any]) -> dict[str, Any]:
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise api_errors.bad_request("spec.replicas must be a non-negative integer")
        obj = copy.deepcopy(current)
        *parents, leaf = resource.scale_paths[0].lstrip(".").split(".")
        node = obj
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = replicas
        obj["metadata"]["resourceVersion"] = scale.get("metadata", {}).get("resourceVersion")
        return obj

    def _replace(self, resource: ResourceType, current: dict[str, Any], body: dict[str, Any],
                 subresource: str | None, dry_run: bool) -> dict[str, Any]:
        if subresource == "status":
            new = {**copy.deepcopy(current), "status": copy.deepcopy(body.get("status"))}
            if new["status"] is None:
                del new["status"]
        else:
            new = copy.deepcopy(body)
            meta = new.setdefault("metadata", {})
            for field in ("uid", "creationTimestamp", "deletionTimestamp",
                          "deletionGracePeriodSeconds", "namespace", "name", "generation"):
                if field in current["metadata"]:
                    meta[field] = current["metadata"][field]
                else:
                    meta.pop(field, None)
            if resource.has_status:
                new.pop("status", None)
                if "status" in current:
                    new["status"] = current["status"]
        new["apiVersion"], new["kind"] = resource.api_version, resource.kind
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        new = self._admit(resource, new, current)
        if _spec_part(new, resource.has_status) != _spec_part(current, resource.has_status):
            new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        if new == current or dry_run:
            return new
        if resource.storage_key == CRD_KEY:
            self._serve_crd(new)
        self.store.put(resource.storage_key, new, "MODIFIED")
        return self._remove_if_released(resource, new)

    # -- defaults and validation on every write --

    def _admit(self, resource: ResourceType, obj: dict[str, Any],
               old: dict[str, Any] | None) -> dict[str, Any]:
        if resource.schema is not None:
            try:
                obj = resource.schema.prepare(obj, old)
            except api_crd.InvalidObject as exc:
                raise api_errors.invalid(resource, obj["metadata"]["name"], exc.causes) from exc
        key = resource.storage_key
        if key == POD_KEY:
            _default_pod(obj)
        elif key == ("", "services"):
            self._default_service(obj, old)
        elif key == ("", "secrets"):
            _fold_string_data(obj)
        elif key == NAMESPACE_KEY:
            obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
            obj.setdefault("status", {}).setdefault("phase", "Active")
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = \
                obj["metadata"]["name"]
        elif key in (("apps", "deployments"), ("apps", "statefulsets"), ("apps", "replicasets")):
            obj.setdefault("spec", {}).setdefault("replicas", 1)
        elif key == CRD_KEY:
            try:
                api_crd.check_definition(obj)
            except api_crd.InvalidObject as exc:
                raise api_errors.invalid(resource, obj["metadata"]["name"], exc.causes) from exc
            obj["status"] = (old or {}).get("status") or api_crd.established_status(obj, now())
        return obj

    def _default_service(self, service: dict[str, Any], old: dict[str, Any] | None) -> None:
        spec = service.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        old_ip = ((old or {}).get("spec") or {}).get("clusterIP")
        if not spec.get("clusterIP"):
            if old_ip is None:
                old_ip = f"10.96.{self._next_cluster_ip // 250}.{self._next_cluster_ip % 250 + 1}"
                self._next_cluster_ip += 1
            spec["clusterIP"] = old_ip
        spec["clusterIPs"] = [spec["clusterIP"]]
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))

    # -- delete, finalizers, graceful deletion, garbage collection --

    def delete(self, resource: ResourceType, namespace: str, name: str,
               options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Returns the last state and whether the object is gone (False: terminating)."""
        obj = self.get(resource, namespace, name)
        meta = obj["metadata"]
        preconditions = options.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) and preconditions[field] != meta.get(field):
                raise api_errors.conflict(resource, name, f"Precondition failed: {field} in "
                                          f"precondition: {preconditions[field]}, {field} in "
                                          f"object meta: {meta.get(field)}")
        grace = self._grace_period(resource, obj, options)
        if meta.get("deletionTimestamp"):  # already terminating: a pod's grace may only shrink
            if grace < meta.get("deletionGracePeriodSeconds", 0):
                obj = copy.deepcopy(obj)
                obj["metadata"].update(deletionTimestamp=now(grace),
                                       deletionGracePeriodSeconds=grace)
                self.store.put(resource.storage_key, obj, "MODIFIED")
            obj = self._remove_if_released(resource, obj)
            return obj, self.store.get(resource.storage_key, namespace, name) is None
        policy = options.get("propagationPolicy") or (
            "Orphan" if options.get("orphanDependents") else "Background")
        if policy == "Orphan":
            self._orphan_dependents(meta["uid"])
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and self.store.dependents(meta["uid"]):
            finalizers.append("foregroundDeletion")
        if not finalizers and grace == 0 and not self._contents(resource, obj):
            return self._remove(resource, obj), True
        obj = copy.deepcopy(obj)
        obj["metadata"].update(deletionTimestamp=now(grace), deletionGracePeriodSeconds=grace)
        if finalizers:
            obj["metadata"]["finalizers"] = finalizers
        if resource.storage_key == NAMESPACE_KEY:
            obj.setdefault("status", {})["phase"] = "Terminating"
        self.store.put(resource.storage_key, obj, "MODIFIED")
        if policy == "Foreground":
            self._collect(meta["uid"], force=True)
        for content_resource, content in self._contents(resource, obj):
            self.delete(content_resource, content["metadata"].get("namespace", ""),
                        content["metadata"]["name"], {})
        current = self.store.get(resource.storage_key, namespace, name)
        if current is None:  # its contents or dependents went, and released it on the way
            return obj, True
        current = self._remove_if_released(resource, current)
        return current, self.store.get(resource.storage_key, namespace, name) is None

    def _grace_period(self, resource: ResourceType, obj: dict[str, Any],
                      options: dict[str, Any]) -> int:
        """Only pods running on a node terminate gracefully; everything else goes at once."""
        if resource.storage_key != POD_KEY:
            return 0
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
            return 0
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return max(int(grace), 0)

    def _contents(self, resource: ResourceType,
                  obj: dict[str, Any]) -> list[tuple[ResourceType, dict[str, Any]]]:
        """What goes before the object itself: a namespace's objects, a CRD's custom objects."""
        if resource.storage_key == NAMESPACE_KEY:
            name = obj["metadata"]["name"]
            return [(r, o) for r in self._storage_types() if r.namespaced
                    for o in self.store.list(r.storage_key, name)]
        if resource.storage_key == CRD_KEY:
            spec = obj["spec"]
            served = self.registry.versions_of(spec["group"], spec["names"]["plural"])
            if served:
                return [(served[0], o) for o in self.store.list(served[0].storage_key)]
        return []

    def _storage_types(self) -> list[ResourceType]:
        seen: dict[tuple[str, str], ResourceType] = {}
        for resource in self.registry:
            seen.setdefault(resource.storage_key, resource)
        return list(seen.values())

    def _remove_if_released(self, resource: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        if (meta.get("deletionTimestamp") and not meta.get("finalizers")
                and not meta.get("deletionGracePeriodSeconds")
                and not self._contents(resource, obj)):
            return self._remove(resource, obj)
        return obj

    def _remove(self, resource: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        gone = self.store.remove(resource.storage_key, obj)
        meta = gone["metadata"]
        self._applied = {k: v for k, v in self._applied.items() if k[0] != meta["uid"]}
        if resource.storage_key == CRD_KEY:
            self.registry.remove_group_resource(obj["spec"]["group"],
                                                obj["spec"]["names"]["plural"])
        self._collect(meta["uid"])
        for owner in meta.get("ownerReferences") or ():
            self._release_foreground_owner(owner.get("uid", ""))
        if meta.get("namespace"):
            self._release_container(NAMESPACE_KEY, "", meta["namespace"])
        if resource.custom:
            self._release_container(CRD_KEY, "", f"{resource.plural}.{resource.group}")
        return gone

    def _release_container(self, key: tuple[str, str], namespace: str, name: str) -> None:
        container = self.store.get(key, namespace, name)
        resource = self._type_of(key)
        if container is not None and container["metadata"].get("deletionTimestamp") and resource:
            self._remove_if_released(resource, container)

    def _collect(self, owner_uid: str, force: bool = False) -> None:
        """Garbage-collect the dependents of a removed (or foreground-deleted) owner."""
        for key, namespace, name in self.store.dependents(owner_uid):
            dependent = self.store.get(key, namespace, name)
            resource = self._type_of(key)
            if dependent is None or resource is None:
                continue
            refs = dependent["metadata"].get("ownerReferences") or []
            alive = [r for r in refs if r.get("uid") != owner_uid
                     and self.store.find_uid(r.get("uid", "")) is not None]
            if alive and not force:
                updated = copy.deepcopy(dependent)
                updated["metadata"]["ownerReferences"] = alive
                self.store.put(key, updated, "MODIFIED")
            elif not dependent["metadata"].get("deletionTimestamp"):
                self.delete(resource, namespace, name, {})

    def _orphan_dependents(self, owner_uid: str) -> None:
        for key, namespace, name in self.store.dependents(owner_uid):
            dependent = copy.deepcopy(self.store.get(key, namespace, name))
            dependent["metadata"]["ownerReferences"] = [
                r for r in dependent["metadata"]["ownerReferences"] if r.get("uid") != owner_uid]
            self.store.put(key, dependent, "MODIFIED")

    def _release_foreground_owner(self, owner_uid: str) -> None:
        ref = self.store.find_uid(owner_uid)
        if ref is None or self.store.dependents(owner_uid):
            return
        owner = self.store.get(*ref)
        if owner is None or "foregroundDeletion" not in (owner["metadata"].get("finalizers") or []):
            return
        owner = copy.deepcopy(owner)
        owner["metadata"]["finalizers"].remove("foregroundDeletion")
        self.store.put(ref[0], owner, "MODIFIED")
        resource = self._type_of(ref[0])
        if resource is not None:
            self._remove_if_released(resource, owner)

    def _type_of(self, key: tuple[str, str]) -> ResourceType | None:
        return next((r for r in self.registry if r.storage_key == key), None)

    # -- pods and CRDs --

    def bind(self, namespace: str, name: str, binding: dict[str, Any]) -> None:
        """POST pods/{name}/binding: what the scheduler does; our kubelet calls it too."""
        pods = self.registry.get("", "v1", "pods")
        pod = self.get(pods, namespace, name)
        node = ((binding or {}).get("target") or {}).get("name")
        if not node:
            raise api_errors.bad_request("a Binding needs target.name (the node)")
        if (pod.get("spec") or {}).get("nodeName"):
            raise api_errors.conflict(pods, name, f"pod {name} is already assigned to node "
                                                  f"\"{pod['spec']['nodeName']}\"")
        pod = copy.deepcopy(pod)
        pod.setdefault("spec", {})["nodeName"] = node
        conditions = [c for c in pod.setdefault("status", {}).get("conditions") or []
                      if c.get("type") != "PodScheduled"]
        pod["status"]["conditions"] = [
            *conditions, {"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}]
        self.store.put(POD_KEY, pod, "MODIFIED")

    def _serve_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        self.registry.remove_group_resource(spec["group"], spec["names"]["plural"])
        for resource in api_crd.served_types(crd):
            self.registry.add(resource)


def _default_pod(pod: dict[str, Any]) -> None:
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    for container in spec.get("containers") or []:
        image = container.get("image", "")
        latest = ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
        container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        for port in container.get("ports") or []:
            port.setdefault("protocol", "TCP")
    pod.setdefault("status", {}).setdefault("phase", "Pending")


def _fold_string_data(secret: dict[str, Any]) -> None:
    """The API server stores stringData as base64 data and never returns stringData."""
    secret["type"] = secret.get("type") or "Opaque"
    string_data = secret.pop("stringData", None) or {}
    if string_data:
        data = secret.setdefault("data", {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()


def _at(obj: dict[str, Any], path: str, default: Any) -> Any:
    """The value at a JSON path such as .spec.decode.replicas, or `default`."""
    node: Any = obj
    for key in path.lstrip(".").split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node
