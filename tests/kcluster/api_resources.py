"""Which resources the test API server serves, and how it advertises them (discovery).

kmock derives discovery from whatever it has seen, reports the core group as "/v1", repeats
short names on subresources and never says which resources are namespaced. kubectl resolves
`kubectl get po`, `kubectl get ipool` and `kubectl get all` only from discovery, so here every
resource is declared once: the built-in kinds our stack touches, plus one entry per served
version of every CustomResourceDefinition created at run time.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
SUBRESOURCE_VERBS = {"status": ("get", "patch", "update"), "scale": ("get", "patch", "update"),
                     "binding": ("create",)}


@dataclass(frozen=True)
class ResourceType:
    """One served (group, version, plural) and everything the server needs to know about it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    # Set for custom resources: the CRD's schema (api_crd.CustomSchema) and printer columns.
    custom: bool = False
    schema: Any = None
    printer_columns: tuple[dict[str, Any], ...] = ()
    # The scale subresource's paths (a CRD's subresources.scale); built-ins: spec.replicas
    scale_paths: tuple[str, str, str | None] = (".spec.replicas", ".status.replicas", None)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def group_resource(self) -> str:
        """The name in error messages: `pods`, `inferencepools.tandem.dev`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def storage_key(self) -> tuple[str, str]:
        """All versions of one resource share one storage."""
        return (self.group, self.plural)

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources


def _builtin(spec: str, kind: str, cluster: bool = False, short: str = "", sub: str = "",
             cats: str = "") -> ResourceType:
    group_version, plural = spec.rsplit("/", 1)
    group, _, version = group_version.rpartition("/")
    return ResourceType(group, version, plural, kind, not cluster, tuple(short.split()),
                        tuple(cats.split()), frozenset(sub.split()))


BUILTIN_RESOURCES = (
    _builtin("v1/pods", "Pod", short="po", sub="status binding", cats="all"),
    _builtin("v1/services", "Service", short="svc", sub="status", cats="all"),
    _builtin("v1/endpoints", "Endpoints", short="ep"),
    _builtin("v1/configmaps", "ConfigMap", short="cm"),
    _builtin("v1/secrets", "Secret"),
    _builtin("v1/serviceaccounts", "ServiceAccount", short="sa"),
    _builtin("v1/events", "Event", short="ev"),
    _builtin("v1/persistentvolumeclaims", "PersistentVolumeClaim", short="pvc", sub="status"),
    _builtin("v1/namespaces", "Namespace", cluster=True, short="ns", sub="status"),
    _builtin("v1/nodes", "Node", cluster=True, short="no", sub="status"),
    _builtin("apps/v1/deployments", "Deployment", short="deploy", sub="status scale", cats="all"),
    _builtin("apps/v1/statefulsets", "StatefulSet", short="sts", sub="status scale", cats="all"),
    _builtin("apps/v1/replicasets", "ReplicaSet", short="rs", sub="status scale", cats="all"),
    _builtin("apps/v1/daemonsets", "DaemonSet", short="ds", sub="status", cats="all"),
    _builtin("apps/v1/controllerrevisions", "ControllerRevision"),
    _builtin("batch/v1/jobs", "Job", sub="status", cats="all"),
    _builtin("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", short="pdb", sub="status"),
    _builtin("rbac.authorization.k8s.io/v1/roles", "Role"),
    _builtin("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", cluster=True),
    _builtin("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding",
             cluster=True),
    _builtin("coordination.k8s.io/v1/leases", "Lease"),
    _builtin("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition",
             cluster=True, short="crd crds", sub="status"),
    _builtin("events.k8s.io/v1/events", "Event", short="ev"),
    _builtin("discovery.k8s.io/v1/endpointslices", "EndpointSlice"),
    _builtin("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", short="netpol"),
)


@dataclass
class ResourceRegistry:
    """The served resources, indexed by (group, version, plural); mutable as CRDs come and go."""

    _types: dict[tuple[str, str, str], ResourceType] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for resource in BUILTIN_RESOURCES:
            self.add(resource)

    def add(self, resource: ResourceType) -> None:
        self._types[(resource.group, resource.version, resource.plural)] = resource

    def remove_group_resource(self, group: str, plural: str) -> None:
        for key in [k for k in self._types if (k[0], k[2]) == (group, plural)]:
            del self._types[key]

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def versions_of(self, group: str, plural: str) -> list[ResourceType]:
        return [r for (g, _, p), r in self._types.items() if (g, p) == (group, plural)]

    def find_kind(self, api_version: str, kind: str) -> ResourceType | None:
        for resource in self._types.values():
            if (resource.api_version, resource.kind) == (api_version, kind):
                return resource
        return None

    def __iter__(self) -> Iterable[ResourceType]:
        return iter(list(self._types.values()))

    # -- discovery documents (the legacy, non-aggregated form: kubectl falls back to it) --

    def api_versions(self) -> dict[str, Any]:
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                "serverAddress": "127.0.0.1"}]}

    def _group_versions(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for resource in self._types.values():
            if resource.group and resource.version not in groups.setdefault(resource.group, []):
                groups[resource.group].append(resource.version)
        return groups

    def api_group(self, group: str) -> dict[str, Any] | None:
        versions = self._group_versions().get(group)
        if not versions:
            return None
        entries = [{"groupVersion": f"{group}/{v}", "version": v}
                   for v in sorted(versions, key=_version_priority)]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": entries,
                "preferredVersion": entries[0]}

    def api_group_list(self) -> dict[str, Any]:
        groups = [self.api_group(group) for group in sorted(self._group_versions())]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def api_resource_list(self, group: str, version: str) -> dict[str, Any] | None:
        served = [r for r in self._types.values() if (r.group, r.version) == (group, version)]
        if not served:
            return None
        entries: list[dict[str, Any]] = []
        for resource in sorted(served, key=lambda r: r.plural):
            main = {"name": resource.plural, "singularName": resource.singular,
                    "namespaced": resource.namespaced, "kind": resource.kind, "verbs": list(VERBS)}
            if resource.short_names:
                main["shortNames"] = list(resource.short_names)
            if resource.categories:
                main["categories"] = list(resource.categories)
            entries.append(main)
            for sub in sorted(resource.subresources):
                entry = {"name": f"{resource.plural}/{sub}", "singularName": "",
                         "namespaced": resource.namespaced, "kind": resource.kind,
                         "verbs": list(SUBRESOURCE_VERBS[sub])}
                if sub == "scale":
                    entry.update(kind="Scale", group="autoscaling", version="v1")
                elif sub == "binding":
                    entry["kind"] = "Binding"
                entries.append(entry)
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": entries}

    # -- OpenAPI v3: just enough for kubectl to leave validation to the server --
    # kubectl validates client-side unless the group version's OpenAPI document lists the
    # `fieldValidation` parameter on the kind's PATCH operation; it then sends
    # fieldValidation=Strict instead. No schemas are served (so apply's patch computation
    # falls back to kubectl's compiled-in types, as it does for a server without OpenAPI).

    def openapi_v3_root(self) -> dict[str, Any]:
        paths = {}
        for group, version in sorted({(r.group, r.version) for r in self._types.values()}):
            prefix = f"apis/{group}/{version}" if group else f"api/{version}"
            digest = hashlib.sha256(json.dumps(self.openapi_v3_document(group, version),
                                               sort_keys=True).encode()).hexdigest()[:16]
            paths[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}?hash={digest}"}
        return {"paths": paths}

    def openapi_v3_document(self, group: str, version: str) -> dict[str, Any] | None:
        served = [r for r in self._types.values() if (r.group, r.version) == (group, version)]
        if not served:
            return None
        paths = {}
        for resource in served:
            base = f"/apis/{group}/{version}" if group else f"/api/{version}"
            scope = "/namespaces/{namespace}" if resource.namespaced else ""
            paths[f"{base}{scope}/{resource.plural}/{{name}}"] = {"patch": {
                "x-kubernetes-group-version-kind": {"group": group, "version": version,
                                                    "kind": resource.kind},
                "parameters": [{"name": "fieldValidation", "in": "query",
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK"}}}}
        return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"},
                "paths": paths, "components": {"schemas": {}}}


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order: GA before beta before alpha, higher numbers first."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (3, 0, 0)
    major, stage, minor = match.groups()
    return ({None: 0, "beta": 1, "alpha": 2}[stage], -int(major), -int(minor or 0))
