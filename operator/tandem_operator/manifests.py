"""Every object the operator creates for a pool, as pure functions of the `PoolSpec`.

No I/O here: reconcile decides *whether* to create something, these functions say *what* it
is, so the exact pod a spec produces is testable without an API server. `template_hash` names
a pod template: pods whose hash differs from the spec's are rolled. The weights are not part of
it (a weights change is refit in place, never a new pod), nor is the draft checkpoint that
travels with them, nor the weight epoch, nor the drain timeout (it bounds how a pod is
stopped, not what runs in it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from tandem_engine.fleet.adapters import AdapterRef
from tandem_engine.fleet.admin import admin_url
from tandem_engine.weights import WeightsRef, weights_source

from tandem_operator.engine_command import (
    ENGINE_ADMIN_PORT,
    ENGINE_METRICS_PORT,
    ENGINE_ZMQ_PORT,
    engine_args,
    engine_resources,
)

# Part of this module's surface too (m.engine_device, m.weights_roots), though rendered there.
from tandem_operator.engine_command import engine_device as engine_device
from tandem_operator.engine_command import weights_roots as weights_roots
from tandem_operator.pod_overrides import apply_overrides
from tandem_operator.spec import (
    API_VERSION,
    KIND,
    TMP_PATH,
    TMP_VOLUME,
    Group,
    InitContainer,
    Placement,
    PoolSpec,
)

ROUTER_HTTP_PORT = 8000

POOL_LABEL = "tandem.dev/pool"
ROLE_LABEL = "tandem.dev/role"
ENGINE_LABEL = "tandem.dev/engine"  # "true" on prefill/decode/mixed pods: the headless Service
COMPONENT_LABEL = "app.kubernetes.io/component"
TEMPLATE_HASH = "tandem.dev/template-hash"
WEIGHTS_VERSION = "tandem.dev/weights-version"
WEIGHTS_URI = "tandem.dev/weights-uri"
WEIGHTS_EPOCH = "tandem.dev/weights-epoch"  # the pool-wide refit number of those weights
DRAFT_URI = "tandem.dev/draft-uri"  # the draft checkpoint loaded with them (method Draft)
# The LoRA adapters the engine serves (JSON: [{name, version, uri}]), as it was started with
# them or an adapter transaction verified them on it: where a later transaction starts from.
ADAPTERS = "tandem.dev/adapters"
DRAINING_SINCE = "tandem.dev/draining-since"  # set by the operator when it starts a drain
ADMIN_TOKEN_KEY = "token"
# The pool's ZMQ CURVE keypairs (Z85) in the same Secret: engines serve with the server's
# secret key and accept only the client's public key; routers connect with the client's.
CURVE_KEYS: dict[str, tuple[str, str]] = {  # pair -> (public key, secret key)
    "server": ("zmq-server-public", "zmq-server-secret"),
    "client": ("zmq-client-public", "zmq-client-secret"),
}
MANAGER = "tandem-operator"
# The operator's own pods, as the Helm chart labels them (tandem.selectorLabels).
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "tandem",
                       "app.kubernetes.io/component": "operator"}

# Every pool pod runs as this user (the operator chart's too), never as root.
POD_UID = 65532
# How often a starting pod's /healthz is tried (spec.engine.startupTimeoutSeconds / this many
# tries), and the router's own startup budget (it loads only the tokenizer).
STARTUP_PERIOD_S = 2
ROUTER_STARTUP_TIMEOUT_S = 300

# What the template hash sees instead of the weights, the draft and the drain timeout.
_HASH_WEIGHTS = WeightsRef(uri="file:///weights", version="weights")
_HASH_DRAFT = "file:///draft"
_HASH_DRAIN_SECONDS = 0


def admin_secret_name(pool: str) -> str:
    """The pool's credentials Secret: the engines' admin token and the ZMQ CURVE keys (the
    name predates the keys and stays, so upgraded pools keep their token)."""
    return f"{pool}-admin-token"


def router_account_name(pool: str) -> str:
    return f"{pool}-router"


def engines_service_name(pool: str) -> str:
    return f"{pool}-engines"


def network_policy_names(pool: str) -> tuple[str, str]:
    """(engines' policy, routers' policy)."""
    return f"{pool}-engines", f"{pool}-router"


def router_endpoint(spec: PoolSpec) -> str:
    return f"http://{spec.name}.{spec.namespace}.svc:{spec.router.service_port}/v1"


# ---- metadata -----------------------------------------------------------------------------------


def common_labels(spec: PoolSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/managed-by": MANAGER, "app.kubernetes.io/part-of": "tandem",
            POOL_LABEL: spec.name}


# The scale subresource (`kubectl scale ipool`, HPA, KEDA) sets spec.decode.replicas: decode
# engines hold the generation and the KV memory that load grows first, prefill capacity
# follows prompt rate, which the planner (autoscale.py) sizes apart from it.
SCALED_GROUP: Group = "decode"


def scale_selector(spec: PoolSpec) -> str:
    """status.selector: the pods the scale subresource counts (the decode engines), as a
    label selector string, as an HPA reads it."""
    return f"{POOL_LABEL}={spec.name},{COMPONENT_LABEL}={SCALED_GROUP}"


def group_labels(spec: PoolSpec, group: Group) -> dict[str, str]:
    """Labels of the objects of one group: component prefill|decode|router, role as run."""
    role = "router" if group == "router" else str(spec.engine_role(group))
    return {**common_labels(spec), COMPONENT_LABEL: group, ROLE_LABEL: role}


def owner_reference(spec: PoolSpec) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": spec.name, "uid": spec.uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(spec: PoolSpec, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": labels,
            "ownerReferences": [owner_reference(spec)]}


# ---- pods ---------------------------------------------------------------------------------------


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _pod_env() -> list[dict[str, Any]]:
    return [_field_env("POD_IP", "status.podIP"), _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace")]


def _http_probe(path: str, port: str, **timing: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, **timing}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _credential_env(spec: PoolSpec, names: dict[str, str]) -> list[dict[str, Any]]:
    """Env from the pool's credentials Secret: variable name -> Secret key."""
    secret = admin_secret_name(spec.name)
    return [_secret_env(name, secret, key) for name, key in names.items()]


def _writable_env() -> list[dict[str, Any]]:
    """HOME and TMPDIR on the pod's /tmp emptyDir: the root filesystem is read-only, and the
    engine caches there (models pulled to ~/.cache/tandem; the native kernel's build under
    ~/.cache/torch_extensions, where an image without the prebuilt kernel JIT-compiles it)."""
    return [{"name": "HOME", "value": TMP_PATH}, {"name": "TMPDIR", "value": TMP_PATH}]


def _engine_env(spec: PoolSpec) -> list[dict[str, Any]]:
    env = [*_pod_env(), *_writable_env(), *_credential_env(spec, {
        "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN_KEY,
        "TANDEM_ZMQ_SERVER_SECRET_KEY": CURVE_KEYS["server"][1],
        "TANDEM_ZMQ_CLIENT_PUBLIC_KEY": CURVE_KEYS["client"][0]})]
    ucx = spec.kv_transfer
    if ucx.ucx_transports:
        env.append({"name": "UCX_TLS", "value": ucx.ucx_transports})
    if ucx.ucx_net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": ucx.ucx_net_devices})
    return [*env, *(dict(v) for v in spec.engine.env)]


def _router_env(spec: PoolSpec) -> list[dict[str, Any]]:
    env = [*_pod_env(), *_writable_env(), *_credential_env(spec, {
        "TANDEM_ZMQ_SERVER_PUBLIC_KEY": CURVE_KEYS["server"][0],
        "TANDEM_ZMQ_CLIENT_SECRET_KEY": CURVE_KEYS["client"][1]})]
    ref = spec.router.api_key_secret
    if ref is not None:
        env.append(_secret_env("TANDEM_API_KEY", ref.name, ref.key))
    return env


def _container_security(capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    """No privilege escalation, no capabilities but those asked for, a read-only root
    filesystem (/tmp is an emptyDir)."""
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if capabilities:
        caps["add"] = list(capabilities)
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": caps}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": POD_UID, "runAsGroup": POD_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _probes(port: str, startup_timeout_s: int) -> dict[str, Any]:
    """/healthz must answer within `startup_timeout_s` of the start (the engine serves it
    while it loads its checkpoint), then keeps being asked on a short period; /readyz says
    when the pod takes traffic. Liveness and readiness wait for the startup probe."""
    return {"startupProbe": _http_probe("/healthz", port, periodSeconds=STARTUP_PERIOD_S,
                                        failureThreshold=-(-startup_timeout_s
                                                           // STARTUP_PERIOD_S)),
            "readinessProbe": _http_probe("/readyz", port, periodSeconds=2),
            "livenessProbe": _http_probe("/healthz", port, periodSeconds=10,
                                         failureThreshold=3)}


def _pod_spec(spec: PoolSpec, group: Group, weights: WeightsRef, drain_seconds: int,
              epoch: int | None = None, draft_uri: str | None = None,
              adapters: Sequence[AdapterRef] | None = None) -> dict[str, Any]:
    """The group's pod spec; spec.pod.overrides is merged in last (it may not touch the
    weights' volume, which `_with_weights` adds after)."""
    e = spec.engine
    if group == "router":
        container: dict[str, Any] = {
            "name": "router", "image": e.image, "imagePullPolicy": e.image_pull_policy,
            "command": ["tandem-router"],
            "args": ["--discover-pool", spec.name, "--namespace", "$(POD_NAMESPACE)",
                     "--model", weights.path, "--served-model-name", spec.model_name,
                     "--host", "$(POD_IP)", "--port", str(ROUTER_HTTP_PORT),
                     *(("--max-num-requests", str(spec.router.max_num_requests))
                       if spec.router.max_num_requests is not None else ())],
            "env": _router_env(spec),
            "ports": [{"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"}],
            **_probes("http", ROUTER_STARTUP_TIMEOUT_S),
            "securityContext": _container_security()}
        resources = {k: dict(v) for k, v in spec.router.resources.items() if v}
        if resources:
            container["resources"] = resources
        return apply_overrides(_pod_fields(spec, group, spec.router.placement, {
            "restartPolicy": "Always", "serviceAccountName": router_account_name(spec.name),
            "containers": [container]}), spec.pod.overrides, "router")
    role = spec.role(group)
    container = {
        "name": "engine", "image": e.image, "imagePullPolicy": e.image_pull_policy,
        "command": ["tandem-engine"],
        "args": engine_args(spec, group, weights, drain_seconds, epoch, draft_uri, adapters),
        "env": _engine_env(spec),
        "ports": [{"name": "zmq", "containerPort": ENGINE_ZMQ_PORT, "protocol": "TCP"},
                  {"name": "admin", "containerPort": ENGINE_ADMIN_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ENGINE_METRICS_PORT, "protocol": "TCP"}],
        **_probes("metrics", e.startup_timeout_seconds),
        "securityContext": _container_security(("IPC_LOCK",) if e.rdma_ipc_lock else ())}
    resources = engine_resources(spec, group)
    if resources:
        container["resources"] = {k: dict(v) for k, v in resources.items()}
    return apply_overrides(_pod_fields(spec, group, role.placement, {
        "restartPolicy": "Always", "terminationGracePeriodSeconds": drain_seconds + 10,
        "containers": [container]}), spec.pod.overrides, "engine")


def _pod_fields(spec: PoolSpec, group: Group, placement: Placement, pod: dict[str, Any]
                ) -> dict[str, Any]:
    """What every pool pod has around its container: the security context, the group's
    placement, spec.pod's scheduling fields, and the volumes."""
    p = spec.pod
    pod["securityContext"] = _pod_security()
    if p.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in p.image_pull_secrets]
    if p.priority_class_name:
        pod["priorityClassName"] = p.priority_class_name
    if p.runtime_class_name:
        pod["runtimeClassName"] = p.runtime_class_name
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod["tolerations"] = [dict(t) for t in placement.tolerations]
    if placement.affinity:
        pod["affinity"] = dict(placement.affinity)
    if p.topology_spread_constraints:
        own = {"matchLabels": {POOL_LABEL: spec.name, COMPONENT_LABEL: group}}
        pod["topologySpreadConstraints"] = [{"labelSelector": own, **c}
                                            for c in p.topology_spread_constraints]
    return _with_volumes(spec, pod)


def _with_volumes(spec: PoolSpec, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod's writable /tmp, spec.engine.volumes on the pod, mounted into its container,
    and the init containers that may fill them (the weights live there in a real cluster:
    the router reads the tokenizer from the same path)."""
    e = spec.engine
    pod["volumes"] = [{"name": TMP_VOLUME, "emptyDir": {}}, *(dict(v) for v in e.volumes)]
    pod["containers"][0]["volumeMounts"] = [_TMP_MOUNT, *(dict(m) for m in e.volume_mounts)]
    if e.init_containers:
        pod["initContainers"] = [init_container(spec, c) for c in e.init_containers]
    return pod


_TMP_MOUNT = {"name": TMP_VOLUME, "mountPath": TMP_PATH}


def init_container(spec: PoolSpec, c: InitContainer) -> dict[str, Any]:
    """An init container as the pod runs it: non-root with a read-only root filesystem like
    the main container, HOME and TMPDIR on /tmp, then its own env."""
    container: dict[str, Any] = {"name": c.name, "image": c.image or spec.engine.image,
                                 "imagePullPolicy": spec.engine.image_pull_policy,
                                 "command": list(c.command)}
    if c.args:
        container["args"] = list(c.args)
    container["env"] = [*_writable_env(),
                        *({"name": name, "value": value} for name, value in c.env)]
    container["volumeMounts"] = [_TMP_MOUNT, *(dict(m) for m in c.volume_mounts)]
    container["securityContext"] = _container_security()
    return container


def _pod_labels(spec: PoolSpec, group: Group) -> dict[str, str]:
    """spec.pod.labels, then the operator's own (spec.py refuses keys that would clash)."""
    labels = {**(spec.pod.labels or {}), **group_labels(spec, group)}
    if group != "router":
        labels[ENGINE_LABEL] = "true"
    return labels


def template_hash(spec: PoolSpec, group: Group) -> str:
    """A stable name for what defines the group's pods (image, pull policy, resources, env,
    args, volumes and init containers, KV cache and limits, threads, role, placement, probes,
    security context and spec.pod's labels, annotations and fields); never the weights, but
    for engines the volume they come from (a PVC, a model image): weights on the same volume
    refit in place, weights on another need new engine pods. Routers keep theirs (they read
    the tokenizer at start, and a refit never restarts them either)."""
    weights = _hash_weights(spec.weights) if group != "router" else _HASH_WEIGHTS
    pod_spec = _with_weights(_pod_spec(spec, group, weights, _HASH_DRAIN_SECONDS,
                                       draft_uri=_HASH_DRAFT if spec.draft_uri else None),
                             weights)
    template = {"labels": _pod_labels(spec, group),
                "annotations": dict(spec.pod.annotations or {}),
                "spec": _with_adapter_volumes(pod_spec, spec, group)}
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _scrape_annotations(group: Group) -> dict[str, str]:
    """For Prometheus' usual pod discovery: engines on their read-only metrics port, routers
    on their HTTP port (its /metrics needs no API key)."""
    port = ROUTER_HTTP_PORT if group == "router" else ENGINE_METRICS_PORT
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def pod(spec: PoolSpec, group: Group, weights: WeightsRef, epoch: int = 0,
        adapters: Sequence[AdapterRef] = ()) -> dict[str, Any]:
    """A new pod of `group` (created with generateName `<pool>-<group>-`) on `weights`, whose
    pool-wide weight epoch is `epoch` (engines start with it; routers prefer the highest).
    Engines load the spec's draft checkpoint, named in their DRAFT_URI annotation (where a
    refit's rollback finds it), and start serving the LoRA `adapters` (named in their
    ADAPTERS annotation, where an adapter transaction finds them)."""
    meta = _meta(spec, "", _pod_labels(spec, group))
    del meta["name"]
    meta["generateName"] = f"{spec.name}-{group}-"
    meta["annotations"] = {**(spec.pod.annotations or {}),
                           TEMPLATE_HASH: template_hash(spec, group),
                           WEIGHTS_VERSION: weights.version, WEIGHTS_URI: weights.uri,
                           **_scrape_annotations(group)}
    if group != "router":
        meta["annotations"][WEIGHTS_EPOCH] = str(epoch)
        if spec.draft_uri is not None:
            meta["annotations"][DRAFT_URI] = spec.draft_uri
        if spec.engine.lora is not None:
            meta["annotations"][ADAPTERS] = adapters_annotation(adapters)
    engine = group != "router"
    pod_spec = _with_weights(_pod_spec(spec, group, weights, spec.refit.drain_timeout_seconds,
                                       epoch if engine else None, spec.draft_uri,
                                       adapters if engine else None), weights)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": _with_adapter_volumes(pod_spec, spec, group)}


def engine_admin_url(ip: str | None) -> str:
    """The admin API of the engine pod at `ip`."""
    return admin_url(ip or "", ENGINE_ADMIN_PORT)


def adapters_annotation(adapters: Sequence[AdapterRef]) -> str:
    return json.dumps([a.to_dict() for a in sorted(adapters, key=lambda a: a.name)],
                      separators=(",", ":"))


def read_adapters_annotation(value: str | None) -> tuple[AdapterRef, ...] | None:
    """The ADAPTERS annotation's adapters; None when absent or not ours."""
    if value is None:
        return None
    try:
        return tuple(AdapterRef.from_dict(a) for a in json.loads(value))
    except (ValueError, KeyError, TypeError):
        return None


# ---- the weights' volume ------------------------------------------------------------------------

WEIGHTS_VOLUME = "tandem-weights"


def _hash_weights(weights: WeightsRef) -> WeightsRef:
    """What of the weights the template hash sees: their volume, never their path."""
    source = weights_source(weights.uri)
    if source.claim is not None:
        return WeightsRef(uri=f"pvc://{source.claim}/weights", version="weights")
    if source.image is not None:
        return WeightsRef(uri=weights.uri, version="weights")
    return _HASH_WEIGHTS


def _with_weights(pod: dict[str, Any], weights: WeightsRef) -> dict[str, Any]:
    """The volume a `pvc://` or `oci://` checkpoint comes from, mounted read-only where the
    URI's path points (`tandem_engine.weights.WeightsSource`) in the pod's container: the
    claim itself; or an emptyDir that an init container running the model image fills with
    its /model (`cp -R`: a non-root copy keeps no owner or times), first of the pod's init
    containers. Chosen over an `image` volume, which needs Kubernetes 1.31+ with a feature
    gate off by default before 1.33: the copy works on every cluster, at the cost of the
    pod's disk and the copy's time. file:// adds nothing (its volume is the spec's)."""
    source = weights_source(weights.uri)
    mount = source.mount_path
    if mount is None:
        return pod
    if source.claim is not None:
        volume = {"name": WEIGHTS_VOLUME,
                  "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
    else:
        volume = {"name": WEIGHTS_VOLUME, "emptyDir": {}}
        copy = {"name": "tandem-weights", "image": source.image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["cp", "-R", "/model/.", f"{mount}/"],
                "volumeMounts": [{"name": WEIGHTS_VOLUME, "mountPath": mount}],
                "securityContext": _container_security()}
        pod["initContainers"] = [copy, *pod.get("initContainers", ())]
    pod["volumes"] = [*pod.get("volumes", ()), volume]
    pod["containers"][0]["volumeMounts"] = [
        *pod["containers"][0].get("volumeMounts", ()),
        {"name": WEIGHTS_VOLUME, "mountPath": mount, "readOnly": True}]
    return pod


def _with_adapter_volumes(pod: dict[str, Any], spec: PoolSpec, group: Group
                          ) -> dict[str, Any]:
    """An engine pod's volumes for the spec's adapters on `pvc://` claims and `oci://`
    images (as `_with_weights` mounts the weights': one per claim or image not mounted
    already). They depend on the spec's adapters' volumes only, never on versions or paths
    within them: another version on a mounted claim loads in place; an adapter on a claim
    or image the pods do not mount yet rolls them once (they start with it)."""
    if group == "router":
        return pod
    mounted = {m.get("mountPath") for m in pod["containers"][0].get("volumeMounts", ())}
    sources = {}
    for adapter in spec.adapters:
        source = weights_source(adapter.uri)
        if source.mount_path is not None and source.mount_path not in mounted:
            sources.setdefault(source.mount_path, source)
    for i, (mount, source) in enumerate(sorted(sources.items())):
        name = f"{ADAPTER_VOLUME}-{i}"
        if source.claim is not None:
            volume = {"name": name,
                      "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        else:
            volume = {"name": name, "emptyDir": {}}
            copy = {"name": name, "image": source.image, "imagePullPolicy": "IfNotPresent",
                    "command": ["cp", "-R", "/model/.", f"{mount}/"],
                    "volumeMounts": [{"name": name, "mountPath": mount}],
                    "securityContext": _container_security()}
            pod["initContainers"] = [*pod.get("initContainers", ()), copy]
        pod["volumes"] = [*pod.get("volumes", ()), volume]
        pod["containers"][0]["volumeMounts"] = [
            *pod["containers"][0].get("volumeMounts", ()),
            {"name": name, "mountPath": mount, "readOnly": True}]
    return pod


ADAPTER_VOLUME = "tandem-adapters"


# ---- the pool's other objects -------------------------------------------------------------------


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def admin_secret(spec: PoolSpec, token: str, curve: dict[str, str] | None = None
                 ) -> dict[str, Any]:
    """The pool's credentials: the engines' admin bearer token and `curve`, the ZMQ CURVE
    keys (`CURVE_KEYS` names -> Z85). Created once, never rotated by reconcile."""
    labels = {**common_labels(spec), COMPONENT_LABEL: "engine"}
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": _meta(spec, admin_secret_name(spec.name), labels),
            "type": "Opaque",
            "data": {ADMIN_TOKEN_KEY: _b64(token),
                     **{key: _b64(value) for key, value in (curve or {}).items()}}}


def curve_keys_data(curve: dict[str, str]) -> dict[str, str]:
    """A Secret's `data` for CURVE keys (name -> Z85), to merge into an existing Secret."""
    return {key: _b64(value) for key, value in curve.items()}


def missing_curve_pairs(secret: dict[str, Any]) -> tuple[str, ...]:
    """The CURVE keypairs ("server", "client") a Secret lacks a half of: each is made anew
    whole (a public key without its secret half is useless)."""
    have = {*(secret.get("data") or {}), *(secret.get("stringData") or {})}
    return tuple(pair for pair, keys in CURVE_KEYS.items() if not set(keys) <= have)


def secret_token(secret: dict[str, Any]) -> str | None:
    raw = (secret.get("data") or {}).get(ADMIN_TOKEN_KEY)
    if raw:
        return base64.b64decode(raw).decode()
    return (secret.get("stringData") or {}).get(ADMIN_TOKEN_KEY)


def router_service(spec: PoolSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(spec, spec.name, group_labels(spec, "router")),
            "spec": {"type": spec.router.service_type,
                     "selector": {POOL_LABEL: spec.name, ROLE_LABEL: "router"},
                     "ports": [{"name": "http", "port": spec.router.service_port,
                                "targetPort": "http", "protocol": "TCP"}]}}


def engines_service(spec: PoolSpec) -> dict[str, Any]:
    labels = {**common_labels(spec), COMPONENT_LABEL: "engine"}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(spec, engines_service_name(spec.name), labels),
            "spec": {"type": "ClusterIP", "clusterIP": "None", "publishNotReadyAddresses": False,
                     "selector": {POOL_LABEL: spec.name, ENGINE_LABEL: "true"},
                     "ports": [{"name": "zmq", "port": ENGINE_ZMQ_PORT, "targetPort": "zmq",
                                "protocol": "TCP"},
                               {"name": "admin", "port": ENGINE_ADMIN_PORT,
                                "targetPort": "admin", "protocol": "TCP"},
                               {"name": "metrics", "port": ENGINE_METRICS_PORT,
                                "targetPort": "metrics", "protocol": "TCP"}]}}


def _disruptions(max_unavailable: int | str) -> int | str:
    """A PDB's maxUnavailable from the rollout's: at least one pod (a node drain must be able
    to move a pod), a percentage as written (the PDB resolves it against the pods it
    selects)."""
    if isinstance(max_unavailable, str) and max_unavailable != "0%":
        return max_unavailable
    return max(1, max_unavailable) if isinstance(max_unavailable, int) else 1


def pod_disruption_budget(spec: PoolSpec, group: Group) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(spec, f"{spec.name}-{group}", group_labels(spec, group)),
            "spec": {"maxUnavailable": _disruptions(spec.rollout.max_unavailable),
                     "selector": {"matchLabels": {POOL_LABEL: spec.name,
                                                  COMPONENT_LABEL: group}}}}


def router_service_account(spec: PoolSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _meta(spec, router_account_name(spec.name),
                              group_labels(spec, "router"))}


def router_role(spec: PoolSpec) -> dict[str, Any]:
    """Routers watch their pool's pods to find engines (namespace-scoped, read-only)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(spec, router_account_name(spec.name),
                              group_labels(spec, "router")),
            "rules": [{"apiGroups": [""], "resources": ["pods"],
                       "verbs": ["get", "list", "watch"]}]}


def router_role_binding(spec: PoolSpec) -> dict[str, Any]:
    name = router_account_name(spec.name)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _meta(spec, name, group_labels(spec, "router")),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name,
                          "namespace": spec.namespace}]}


# ---- network policies ---------------------------------------------------------------------------


def _tcp(port: int | None = None) -> dict[str, Any]:
    """A NetworkPolicyPort: one TCP port, or every TCP port when None."""
    return {"protocol": "TCP"} if port is None else {"protocol": "TCP", "port": port}


def _rule(peers: tuple[dict[str, Any], ...] | list[dict[str, Any]], ports: list[dict[str, Any]]
          ) -> dict[str, Any]:
    """An ingress rule; no peers admits any source (Kubernetes' meaning of an absent `from`)."""
    return {"from": [dict(p) for p in peers], "ports": ports} if peers else {"ports": ports}


def network_policies(spec: PoolSpec) -> list[dict[str, Any]]:
    """The pool's ingress NetworkPolicies (egress is left open), when spec.networkPolicy
    enables them:

    * engines: ZMQ (5555) from the pool's routers; admin (8080) from the pool's routers and
      the operator's pods (chart labels, any namespace: the admin API also wants the
      token), metrics (9100) from those pods too (the autoscaler reads them); every TCP
      port from the pool's engines (NIXL over UCX listens on ephemeral ports); metrics
      from `metricsFrom`;
    * routers: their HTTP port (8000: API and /metrics) from `apiFrom`.
    """
    if not spec.network_policy.enabled:
        return []
    np = spec.network_policy
    engines_name, router_name = network_policy_names(spec.name)
    routers = {"podSelector": {"matchLabels": {POOL_LABEL: spec.name, ROLE_LABEL: "router"}}}
    engines = {"podSelector": {"matchLabels": {POOL_LABEL: spec.name, ENGINE_LABEL: "true"}}}
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}

    def policy(name: str, labels: dict[str, str], selector: dict[str, Any],
               ingress: list[dict[str, Any]]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": _meta(spec, name, labels),
                "spec": {"podSelector": selector["podSelector"], "policyTypes": ["Ingress"],
                         "ingress": ingress}}

    return [
        policy(engines_name, {**common_labels(spec), COMPONENT_LABEL: "engine"}, engines, [
            _rule([routers], [_tcp(ENGINE_ZMQ_PORT), _tcp(ENGINE_ADMIN_PORT)]),
            _rule([operator], [_tcp(ENGINE_ADMIN_PORT), _tcp(ENGINE_METRICS_PORT)]),
            _rule([engines], [_tcp()]),
            _rule([dict(p) for p in np.metrics_from], [_tcp(ENGINE_METRICS_PORT)])]),
        policy(router_name, group_labels(spec, "router"), routers, [
            _rule([dict(p) for p in np.api_from], [_tcp(ROUTER_HTTP_PORT)])]),
    ]


# ---- monitoring ---------------------------------------------------------------------------------


def pod_monitor(spec: PoolSpec) -> dict[str, Any]:
    """A prometheus-operator PodMonitor named after the pool: its engines on their read-only
    metrics port, its routers on their HTTP port (whose /metrics needs no API key). A pod
    lacking an endpoint's port name is simply not scraped on that endpoint. Every series
    gets a `pool` label (the dashboard's filter), from the pods' pool label."""
    pm = spec.pod_monitor
    labels = {**(pm.labels or {}), **common_labels(spec)}
    pool_label = "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", POOL_LABEL)
    relabel = [{"sourceLabels": [pool_label], "targetLabel": "pool", "action": "replace"}]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": _meta(spec, spec.name, labels),
            "spec": {"selector": {"matchLabels": {POOL_LABEL: spec.name}},
                     "podMetricsEndpoints": [
                         {"port": port, "path": "/metrics", "interval": pm.interval,
                          "relabelings": relabel}
                         for port in ("metrics", "http")]}}


def monitoring_objects(spec: PoolSpec) -> list[dict[str, Any]]:
    """The monitoring objects the spec asks for; reconcile creates them only where the
    cluster serves their kind (prometheus-operator's CRDs are installed)."""
    return [pod_monitor(spec)] if spec.pod_monitor.enabled else []


def monitoring_names(spec: PoolSpec) -> list[tuple[str, str]]:
    """(kind, name) of every monitoring object a pool may have, wanted or not."""
    return [("PodMonitor", spec.name)]


def support_objects(spec: PoolSpec) -> list[dict[str, Any]]:
    """Everything but pods and the credentials Secret, in the order to create them."""
    return [router_service_account(spec), router_role(spec), router_role_binding(spec),
            router_service(spec), engines_service(spec),
            pod_disruption_budget(spec, "prefill"), pod_disruption_budget(spec, "decode"),
            *network_policies(spec)]


def optional_objects(spec: PoolSpec) -> list[tuple[str, str]]:
    """(kind, name) of the objects a pool has only while its spec asks for them: reconcile
    looks for them always and deletes those the spec no longer wants."""
    return [("NetworkPolicy", name) for name in network_policy_names(spec.name)]


# Fields of each kind the operator keeps equal to the spec (the rest is the API server's).
MANAGED_FIELDS: dict[str, tuple[str, ...]] = {
    "Service": ("spec.type", "spec.selector", "spec.ports"),
    "PodDisruptionBudget": ("spec.maxUnavailable", "spec.selector"),
    "Role": ("rules",),
    "RoleBinding": ("subjects",),
    "ServiceAccount": (),
    "NetworkPolicy": ("spec.podSelector", "spec.policyTypes", "spec.ingress"),
    "PodMonitor": ("metadata.labels", "spec.selector", "spec.podMetricsEndpoints"),
}


def _get(obj: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)  # type: ignore[assignment]
    return obj


def _ports_equal(desired: list[dict[str, Any]], observed: list[dict[str, Any]] | None) -> bool:
    if not observed or len(desired) != len(observed):
        return False
    # The API server adds nodePorts, defaults the protocol: compare what we set.
    return all(all(o.get(k, "TCP" if k == "protocol" else None) == v for k, v in d.items())
               for d, o in zip(desired, observed, strict=True))


def drift_patch(desired: dict[str, Any], observed: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch bringing `observed`'s managed fields back to `desired`, or None."""
    patch: dict[str, Any] = {}
    for dotted in MANAGED_FIELDS.get(desired["kind"], ()):
        want, have = _get(desired, dotted), _get(observed, dotted)
        if want is None:
            continue  # not ours to set: whatever the server chose stands
        if dotted == "spec.ports":
            same = _ports_equal(want, have)
        elif dotted == "metadata.labels":  # others may add labels; ours must be there
            same = want.items() <= (have or {}).items()
        else:
            same = want == have
        if not same:
            node = patch
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = want
    return patch or None
