"""The pool's pod-level settings as data: spec.pod, each group's placement, spec.networkPolicy,
spec.monitoring and the Secret the router's pods read API keys from, parsed from a raw body
with the CRD's defaults and rules (`tandem_operator.spec` assembles them into a PoolSpec)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem_operator.fields import (
    DNS_SUBDOMAIN,
    SpecError,
    bool_field,
    dns_name,
    int_field,
    list_field,
    object_field,
    str_field,
)
from tandem_operator.pod_overrides import check_overrides

_DURATION = re.compile(r"[0-9]+(ms|s|m|h)")
API_KEYS_KEY = "api-keys"  # spec.router.apiKeySecret.key when not given
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_PEER_FIELDS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# A label or annotation key: an optional DNS-subdomain prefix and a name of at most 63.
_QUALIFIED_NAME = re.compile(rf"({_DNS_LABEL}(\.{_DNS_LABEL})*/)?"
                             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
# What the operator itself sets on its pods (manifests.py): spec.pod may not replace it.
OPERATOR_PREFIX = "tandem.dev/"
RESERVED_LABELS = frozenset({"app.kubernetes.io/name", "app.kubernetes.io/instance",
                             "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of",
                             "app.kubernetes.io/component"})
RESERVED_ANNOTATIONS = frozenset({"prometheus.io/scrape", "prometheus.io/port",
                                  "prometheus.io/path"})


@dataclass(frozen=True)
class Placement:
    """Where a group's pods may run: core/v1 nodeSelector, tolerations and affinity, passed
    to the pods as written."""

    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PodSettings:
    """spec.pod: pod-level fields of every engine and router pod. Extra labels and
    annotations never replace the operator's own (`RESERVED_LABELS`, `RESERVED_ANNOTATIONS`);
    a topology spread constraint without a labelSelector spreads the pod's own group."""

    image_pull_secrets: tuple[str, ...] = ()
    labels: Mapping[str, str] | None = None
    annotations: Mapping[str, str] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    # spec.pod.overrides: a strategic-merge patch of the pod spec, applied last (checked by
    # pod_overrides.check_overrides)
    overrides: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SecretKey:
    """One key of a Secret in the pool's namespace (a secretKeyRef)."""

    name: str
    key: str


@dataclass(frozen=True)
class NetworkPolicySettings:
    """spec.networkPolicy: who may reach the pool's pods. Peers are networking/v1
    NetworkPolicyPeer objects; an empty `api_from` admits the router's API from anywhere, a
    empty `metrics_from` admits the engines' metrics from anywhere; by default every pod in
    the pool's namespace may scrape them."""

    enabled: bool = True  # inert where the CNI enforces no NetworkPolicy
    api_from: tuple[Mapping[str, Any], ...] = ()
    metrics_from: tuple[Mapping[str, Any], ...] = ({"podSelector": {}},)


@dataclass(frozen=True)
class PodMonitorSettings:
    """spec.monitoring.podMonitor: a prometheus-operator PodMonitor over the pool's pods,
    created only where its CRD is installed."""

    enabled: bool = False
    interval: str = "30s"
    labels: Mapping[str, str] | None = None


_NETPOL = NetworkPolicySettings()
_PODMON = PodMonitorSettings()


def _peers(d: Mapping[str, Any], key: str, path: str) -> tuple[Mapping[str, Any], ...]:
    """NetworkPolicyPeer objects: each one of podSelector, namespaceSelector (together or
    alone) or ipBlock, passed to the NetworkPolicy as written."""
    peers = list_field(d, key, path, 16)
    for i, peer in enumerate(peers):
        where = f"{path}.{key}[{i}]"
        if not isinstance(peer, Mapping) or not peer or not set(peer) <= _PEER_FIELDS:
            raise SpecError(f"{where} must be a NetworkPolicyPeer: an object with podSelector "
                            "and/or namespaceSelector, or ipBlock")
        if "ipBlock" in peer and len(peer) > 1:
            raise SpecError(f"{where}: ipBlock cannot be combined with a selector")
    return tuple(dict(p) for p in peers)


def network_policy_settings(spec: Mapping[str, Any]) -> NetworkPolicySettings:
    d = object_field(spec, "networkPolicy", "spec")
    path = "spec.networkPolicy"
    return NetworkPolicySettings(
        enabled=bool_field(d, "enabled", path, _NETPOL.enabled),
        api_from=_peers(d, "apiFrom", path),
        metrics_from=(_peers(d, "metricsFrom", path) if "metricsFrom" in d
                      else _NETPOL.metrics_from))


def pod_monitor_settings(spec: Mapping[str, Any]) -> PodMonitorSettings:
    d = object_field(object_field(spec, "monitoring", "spec"), "podMonitor", "spec.monitoring")
    path = "spec.monitoring.podMonitor"
    interval = str_field(d, "interval", path, _PODMON.interval, 16, min_len=2)
    if not _DURATION.fullmatch(interval):
        raise SpecError(f"{path}.interval {interval!r} is not a Prometheus duration such as "
                        "30s, 1m or 500ms")
    return PodMonitorSettings(enabled=bool_field(d, "enabled", path, _PODMON.enabled),
                              interval=interval,
                              labels=string_map(d, "labels", path, 16, label_values=True))


def placement(d: Mapping[str, Any], path: str) -> Placement:
    return Placement(node_selector=string_map(d, "nodeSelector", path, 32, label_values=True),
                     tolerations=list_field(d, "tolerations", path, 32),
                     affinity=object_field(d, "affinity", path) or None)


def string_map(d: Mapping[str, Any], key: str, path: str, max_items: int,
               label_values: bool, reserved: frozenset[str] = frozenset(),
               ) -> Mapping[str, str] | None:
    """A map of label or annotation keys to strings (label values when `label_values`);
    `reserved` keys and the operator's `tandem.dev/` prefix are refused."""
    value = object_field(d, key, path)
    if len(value) > max_items:
        raise SpecError(f"{path}.{key} has {len(value)} entries; at most {max_items} are "
                        "allowed")
    for k, v in value.items():
        if not isinstance(k, str) or len(k) > 317 or not _QUALIFIED_NAME.fullmatch(k):
            raise SpecError(f"{path}.{key}: {k!r} is not a label or annotation key "
                            "([prefix/]name, the name at most 63 characters)")
        if reserved and (k in reserved or k.startswith(OPERATOR_PREFIX)):
            raise SpecError(f"{path}.{key}: {k!r} is the operator's own; pick another key")
        limit = 63 if label_values else 4096
        if not isinstance(v, str) or len(v) > limit or (label_values
                                                        and not _LABEL_VALUE.fullmatch(v)):
            raise SpecError(f"{path}.{key}[{k!r}] must be a "
                            f"{'label value' if label_values else 'string'} of at most "
                            f"{limit} characters")
    return dict(value) or None


def pod_settings(spec: Mapping[str, Any], engine_volumes: frozenset[str] = frozenset(),
                 engine_mounts: frozenset[str] = frozenset()) -> PodSettings:
    """spec.pod; `engine_volumes` and `engine_mounts` (spec.engine's volume names and mount
    paths) are what its overrides may not patch."""
    d = object_field(spec, "pod", "spec")
    path = "spec.pod"
    secrets = []
    for i, ref in enumerate(list_field(d, "imagePullSecrets", path, 8)):
        name = dns_name(ref, "name", f"{path}.imagePullSecrets[{i}]") if isinstance(
            ref, Mapping) else None
        if name is None:
            raise SpecError(f"{path}.imagePullSecrets[{i}] must be an object with the name "
                            "of a Secret in the pool's namespace")
        secrets.append(name)
    spread = list_field(d, "topologySpreadConstraints", path, 8)
    for i, c in enumerate(spread):
        where = f"{path}.topologySpreadConstraints[{i}]"
        if not isinstance(c, Mapping):
            raise SpecError(f"{where} must be an object")
        if int_field(c, "maxSkew", where, None, 1, 1024) is None:
            raise SpecError(f"{where}.maxSkew is required")
        str_field(c, "topologyKey", where, None, 317, min_len=1)
        str_field(c, "whenUnsatisfiable", where, None, 32, ("DoNotSchedule", "ScheduleAnyway"))
    return PodSettings(
        image_pull_secrets=tuple(secrets),
        labels=string_map(d, "labels", path, 32, label_values=True,
                          reserved=RESERVED_LABELS),
        annotations=string_map(d, "annotations", path, 32, label_values=False,
                               reserved=RESERVED_ANNOTATIONS),
        priority_class_name=dns_name(d, "priorityClassName", path),
        runtime_class_name=dns_name(d, "runtimeClassName", path),
        topology_spread_constraints=tuple(dict(c) for c in spread),
        overrides=check_overrides(d.get("overrides"), f"{path}.overrides", engine_volumes,
                                  engine_mounts))


def secret_key(d: Mapping[str, Any], key: str, path: str) -> SecretKey | None:
    ref = object_field(d, key, path)
    if not ref:
        return None
    path = f"{path}.{key}"
    name = str_field(ref, "name", path, None, 253, min_len=1)
    if not DNS_SUBDOMAIN.fullmatch(name):
        raise SpecError(f"{path}.name {name!r} is not a Secret name (lowercase letters, "
                        "digits, '-' and '.')")
    secret_key = str_field(ref, "key", path, API_KEYS_KEY, 253, min_len=1)
    if not _SECRET_KEY.fullmatch(secret_key):
        raise SpecError(f"{path}.key {secret_key!r} is not a Secret key (letters, digits, "
                        "'-', '_' and '.')")
    return SecretKey(name=name, key=secret_key)
