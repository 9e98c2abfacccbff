"""The InferencePool as data: the parsed `PoolSpec` every other module reads.

The operator never reasons over raw dicts: `PoolSpec.from_body` reads a raw body (a plain
dict, checked field by field as it is read), applies the CRD's defaults (the same ones as
crds/inferencepools.tandem.dev.yaml, so a body from an API server that did not default it
means the same thing), re-checks the cross-field rules the CRD states in CEL (the operator
must never act on a spec the schema would refuse), and returns frozen dataclasses.

Each default is stated once here, as the dataclass field's default; the engine's own ones
come from `tandem_engine.config` and the refit's from `tandem_engine.refit_policy`. The one
exception is spec.engine.image, which the CRD leaves unset: `default_engine_image()`, the
chart's engine image (TANDEM_ENGINE_IMAGE), so that pools follow the operator's release.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, Literal

from tandem_engine.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_PIN_TTL_S,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DEFAULT_SPECULATIVE_TOKENS,
    DEFAULT_THREADS,
    MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
)
from tandem_engine.fleet.verify import DEFAULT_MIN_UNCERTAINTY_RATIO, uncertainty_ratio_problem
from tandem_engine.lifecycle import EngineRole
from tandem_engine.refit_policy import (
    DEFAULT_DRAIN_TIMEOUT_S,
    InFlight,
    OnFailure,
    RefitStrategy,
    choices,
    perplexity_ratio_problem,
)
from tandem_engine.weights import WeightsRef, WeightsURIError, checkpoint_path

GROUP = "tandem.dev"
_DECIMAL = re.compile(r"[0-9]{1,7}(\.[0-9]{1,6})?")
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"

Group = Literal["prefill", "decode", "router"]
GROUPS: tuple[Group, ...] = ("prefill", "decode", "router")
ENGINE_GROUPS: tuple[Group, ...] = ("prefill", "decode")


# ---- the parsed spec ----------------------------------------------------------------------------


class SpecError(ValueError):
    """The body is not a spec the CRD accepts; the message names the field and the rule."""


@dataclass(frozen=True)
class KVCache:
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class InitContainer:
    """A container run before the engine or router container of every pool pod (e.g. one
    pulling the checkpoint into an emptyDir); no image means the engine's."""

    name: str
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    image: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # (name, value)
    volume_mounts: tuple[Mapping[str, Any], ...] = ()


DEFAULT_STARTUP_TIMEOUT_S = 1800  # loading a multi-GB checkpoint from a network volume
ENGINE_IMAGE_ENV = "TANDEM_ENGINE_IMAGE"  # the chart sets it from registry and engineImage
LOCAL_ENGINE_IMAGE = "localhost/tandem/engine"  # what `make images` builds, by default


def default_engine_image() -> str:
    """spec.engine.image when a pool gives none: $TANDEM_ENGINE_IMAGE (the chart's
    `registry`/`engineImage`), else the locally built image of this operator's version."""
    if image := os.environ.get(ENGINE_IMAGE_ENV, "").strip():
        return image
    try:
        return f"{LOCAL_ENGINE_IMAGE}:{package_version('tandem')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return LOCAL_ENGINE_IMAGE


class EngineDevice(str, enum.Enum):
    """spec.engine.device: where engines run the model (`manifests.engine_device` turns it
    into each engine's `--device`)."""

    AUTO = "Auto"  # cuda when the engine's resources ask for nvidia.com/gpu, else cpu
    CPU = "CPU"
    CUDA = "CUDA"  # the engine fails at start when no GPU is visible

    def __str__(self) -> str:
        return self.value


GPU_RESOURCE = "nvidia.com/gpu"


class SpeculativeMethod(str, enum.Enum):
    """spec.engine.speculative.method, CamelCase as the CRD's enums are; `flag` is the
    engine's `--speculative-method` value (vLLM's name)."""

    NGRAM = "Ngram"  # prompt lookup in the request's own tokens
    DRAFT = "Draft"  # a small checkpoint, spec.model.weights.draft
    MTP = "MTP"  # the served checkpoint's multi-token-prediction heads

    def __str__(self) -> str:
        return self.value

    @property
    def flag(self) -> str:
        return self.name.lower()


# spec.engine.args the operator renders itself: refused there, with the field to use.
SPECULATIVE_FLAG_PREFIX = "--speculative"


@dataclass(frozen=True)
class Speculative:
    """spec.engine.speculative: the engines' `--speculative-*` flags. The limits and
    defaults are the engine's own (`tandem_engine.config`, SpeculativeConfig.validate); the
    prompt-lookup fields mean something to Ngram only."""

    method: SpeculativeMethod
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    disable_by_batch_size: int | None = None  # None: always propose


@dataclass(frozen=True)
class EngineSettings:
    image: str = field(default_factory=default_engine_image)
    image_pull_policy: str = "IfNotPresent"
    resources: Mapping[str, Any] | None = None
    env: tuple[Mapping[str, Any], ...] = ()
    args: tuple[str, ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()  # added to engine and router pods
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    weights_roots: tuple[str, ...] = ()  # folders refits may read, besides the mounts
    init_containers: tuple[InitContainer, ...] = ()  # in engine and router pods
    kv_cache: KVCache = KVCache()
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    threads: int = DEFAULT_THREADS
    device: EngineDevice = EngineDevice.AUTO
    startup_timeout_seconds: int = DEFAULT_STARTUP_TIMEOUT_S  # the startupProbe's budget
    rdma_ipc_lock: bool = False  # spec.engine.rdma.ipcLock: adds the IPC_LOCK capability
    speculative: Speculative | None = None  # spec.engine.speculative; None: off


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


@dataclass(frozen=True)
class RoleSettings:
    replicas: int = 1
    resources: Mapping[str, Any] | None = None  # replaces engine.resources when set
    placement: Placement = Placement()


@dataclass(frozen=True)
class SecretKey:
    """One key of a Secret in the pool's namespace (a secretKeyRef)."""

    name: str
    key: str


@dataclass(frozen=True)
class RouterSettings:
    replicas: int = 1
    service_type: str = "ClusterIP"
    service_port: int = 8000
    api_key_secret: SecretKey | None = None  # the router's API keys (comma-separated)
    placement: Placement = Placement()


@dataclass(frozen=True)
class NetworkPolicySettings:
    """spec.networkPolicy: who may reach the pool's pods. Peers are networking/v1
    NetworkPolicyPeer objects; an empty `api_from` admits the router's API from anywhere, a
    empty `metrics_from` admits the engines' metrics from anywhere; by default every pod in
    the pool's namespace may scrape them."""

    enabled: bool = False
    api_from: tuple[Mapping[str, Any], ...] = ()
    metrics_from: tuple[Mapping[str, Any], ...] = ({"podSelector": {}},)


@dataclass(frozen=True)
class PodMonitorSettings:
    """spec.monitoring.podMonitor: a prometheus-operator PodMonitor over the pool's pods,
    created only where its CRD is installed."""

    enabled: bool = False
    interval: str = "30s"
    labels: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Rollout:
    max_surge: int = 1
    max_unavailable: int = 0


@dataclass(frozen=True)
class RefitSettings:
    strategy: RefitStrategy = RefitStrategy.ROLLING
    inflight: InFlight = InFlight.DRAIN
    drain_timeout_seconds: int = DEFAULT_DRAIN_TIMEOUT_S
    on_failure: OnFailure = OnFailure.ROLLBACK
    max_perplexity_ratio: float | None = None  # spec.refit.verify.maxPerplexityRatio
    # spec.refit.verify.minUncertaintyRatio (0: off)
    min_uncertainty_ratio: float = DEFAULT_MIN_UNCERTAINTY_RATIO
    low_memory: bool = False  # spec.refit.lowMemory


@dataclass(frozen=True)
class KVTransfer:
    backend: str = "NIXL"
    pin_ttl_seconds: int = DEFAULT_KV_PIN_TTL_S
    ucx_transports: str = ""
    ucx_net_devices: str = ""


@dataclass(frozen=True)
class PoolSpec:
    """One InferencePool: its identity (name, namespace, uid, generation) and its spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    model_name: str
    weights: WeightsRef
    # spec.model.weights.draft.uri: the draft checkpoint of speculative method Draft (and of
    # it only). It travels with the weights: a refit reloads it, a rollback the previous one.
    draft_uri: str | None = None
    engine: EngineSettings = EngineSettings()
    prefill: RoleSettings = RoleSettings()
    decode: RoleSettings = RoleSettings()
    router: RouterSettings = RouterSettings()
    rollout: Rollout = Rollout()
    refit: RefitSettings = RefitSettings()
    kv_transfer: KVTransfer = KVTransfer()
    network_policy: NetworkPolicySettings = NetworkPolicySettings()
    pod_monitor: PodMonitorSettings = PodMonitorSettings()
    pod: PodSettings = PodSettings()

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolSpec:
        return parse_pool(body)

    def replicas(self, group: Group) -> int:
        if group == "router":
            return self.router.replicas
        return self.role(group).replicas

    def role(self, group: Group) -> RoleSettings:
        if group == "prefill":
            return self.prefill
        if group == "decode":
            return self.decode
        raise ValueError(f"{group!r} is not an engine group (prefill or decode)")

    def engine_role(self, group: Group) -> EngineRole:
        """What `--role` the group's engines run: decode engines serve whole requests (mixed)
        when the pool has no prefill engines."""
        if group == "prefill":
            return EngineRole.PREFILL
        if group == "decode":
            return EngineRole.DECODE if self.prefill.replicas > 0 else EngineRole.MIXED
        raise ValueError(f"{group!r} is not an engine group (prefill or decode)")


# The defaults parse_pool applies: the dataclasses' own.
_ENGINE, _KV, _ROLE = EngineSettings(), KVCache(), RoleSettings()
_ROUTER, _ROLLOUT, _REFIT, _KVT = RouterSettings(), Rollout(), RefitSettings(), KVTransfer()
_NETPOL = NetworkPolicySettings()
_PODMON = PodMonitorSettings()
_DURATION = re.compile(r"[0-9]+(ms|s|m|h)")
API_KEYS_KEY = "api-keys"  # spec.router.apiKeySecret.key when not given
_PEER_FIELDS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
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
TMP_VOLUME = "tandem-tmp"  # the emptyDir at /tmp of every pool pod (the root fs is read-only)
TMP_PATH = "/tmp"


# ---- parsing with the CRD's defaults and rules --------------------------------------------------


def _obj(d: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key} must be an object, not {type(value).__name__}")
    return value


def _int(d: Mapping[str, Any], key: str, path: str, default: int | None, lo: int, hi: int
         ) -> int | None:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key} must be an integer, not {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"{path}.{key} = {value} is outside {lo}..{hi}")
    return value


def _req_int(d: Mapping[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
    value = _int(d, key, path, default, lo, hi)
    assert value is not None  # a default was given
    return value


def _str(d: Mapping[str, Any], key: str, path: str, default: str | None, max_len: int,
         choices: tuple[str, ...] = (), min_len: int = 0) -> str:
    value = d.get(key, default)
    if value is None:
        raise SpecError(f"{path}.{key} is required")
    if not isinstance(value, str):
        raise SpecError(f"{path}.{key} must be a string, not {value!r}")
    if not min_len <= len(value) <= max_len:
        raise SpecError(f"{path}.{key} must be {min_len}..{max_len} characters long")
    if choices and value not in choices:
        raise SpecError(f"{path}.{key} = {value!r} is not one of {', '.join(choices)}")
    return value


def _decimal(d: Mapping[str, Any], key: str, path: str, problem: Callable[[float], str | None],
             example: str, default: float | None = None) -> float | None:
    """A number written as a decimal string ("1.5": the Kubernetes API has no floats),
    within the range `problem` checks; `default` when unset."""
    if d.get(key) is None:
        return default
    text = _str(d, key, path, None, 14)
    if not _DECIMAL.fullmatch(text):
        raise SpecError(f'{path}.{key} = {text!r} is not a decimal number such as "{example}"')
    value = float(text)
    if (why := problem(value)) is not None:
        raise SpecError(f"{path}.{key}: {why}")
    return value


def _list(d: Mapping[str, Any], key: str, path: str, max_items: int) -> tuple[Any, ...]:
    value = d.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key} must be a list")
    if len(value) > max_items:
        raise SpecError(f"{path}.{key} has {len(value)} items; at most {max_items} are allowed")
    return tuple(value)


def _mounts(d: Mapping[str, Any], path: str, volumes: tuple[Any, ...], read_only: bool
            ) -> tuple[Mapping[str, Any], ...]:
    """volumeMounts, each naming one of spec.engine.volumes (`read_only` by default)."""
    names = {v.get("name") for v in volumes if isinstance(v, Mapping)}
    mounts = []
    for m in _list(d, "volumeMounts", path, 16):
        if not isinstance(m, Mapping) or m.get("name") not in names:
            raise SpecError(f"{path}.volumeMounts entry {m!r} names no volume of "
                            f"spec.engine.volumes ({', '.join(sorted(map(str, names))) or 'none'})")
        mounts.append({"readOnly": True, **m} if read_only else dict(m))
    return tuple(mounts)


def _strings(d: Mapping[str, Any], key: str, path: str, max_items: int) -> tuple[str, ...]:
    items = _list(d, key, path, max_items)
    for i, item in enumerate(items):
        if not isinstance(item, str) or len(item) > 1024:
            raise SpecError(f"{path}.{key}[{i}] must be a string of at most 1024 characters")
    return items


def _absolute_paths(d: Mapping[str, Any], key: str, path: str, max_items: int
                    ) -> tuple[str, ...]:
    items = _strings(d, key, path, max_items)
    for i, item in enumerate(items):
        if not item.startswith("/"):
            raise SpecError(f"{path}.{key}[{i}] = {item!r} must be an absolute path")
    return items


def _init_containers(e: Mapping[str, Any], volumes: tuple[Any, ...]
                     ) -> tuple[InitContainer, ...]:
    containers: list[InitContainer] = []
    for i, c in enumerate(_list(e, "initContainers", "spec.engine", 4)):
        path = f"spec.engine.initContainers[{i}]"
        if not isinstance(c, Mapping):
            raise SpecError(f"{path} must be an object")
        name = _str(c, "name", path, None, 63, min_len=1)
        if any(other.name == name for other in containers):
            raise SpecError(f"{path}.name {name!r} is used twice; init containers need "
                            "unique names")
        command = _strings(c, "command", path, 64)
        if not command:
            raise SpecError(f"{path}.command is required (the program to run)")
        env = []
        for j, v in enumerate(_list(c, "env", path, 32)):
            if not isinstance(v, Mapping):
                raise SpecError(f"{path}.env[{j}] must be an object")
            env.append((_str(v, "name", f"{path}.env[{j}]", None, 256, min_len=1),
                        _str(v, "value", f"{path}.env[{j}]", "", 4096)))
        containers.append(InitContainer(
            name=name, command=command, args=_strings(c, "args", path, 64),
            image=_str(c, "image", path, None, 512, min_len=1) if "image" in c else None,
            env=tuple(env), volume_mounts=_mounts(c, path, volumes, read_only=False)))
    return tuple(containers)


def _bool(d: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key} must be true or false, not {value!r}")
    return value


def _secret_key(d: Mapping[str, Any], key: str, path: str) -> SecretKey | None:
    ref = _obj(d, key, path)
    if not ref:
        return None
    path = f"{path}.{key}"
    name = _str(ref, "name", path, None, 253, min_len=1)
    if not _DNS_SUBDOMAIN.fullmatch(name):
        raise SpecError(f"{path}.name {name!r} is not a Secret name (lowercase letters, "
                        "digits, '-' and '.')")
    secret_key = _str(ref, "key", path, API_KEYS_KEY, 253, min_len=1)
    if not _SECRET_KEY.fullmatch(secret_key):
        raise SpecError(f"{path}.key {secret_key!r} is not a Secret key (letters, digits, "
                        "'-', '_' and '.')")
    return SecretKey(name=name, key=secret_key)


def _peers(d: Mapping[str, Any], key: str, path: str) -> tuple[Mapping[str, Any], ...]:
    """NetworkPolicyPeer objects: each one of podSelector, namespaceSelector (together or
    alone) or ipBlock, passed to the NetworkPolicy as written."""
    peers = _list(d, key, path, 16)
    for i, peer in enumerate(peers):
        where = f"{path}.{key}[{i}]"
        if not isinstance(peer, Mapping) or not peer or not set(peer) <= _PEER_FIELDS:
            raise SpecError(f"{where} must be a NetworkPolicyPeer: an object with podSelector "
                            "and/or namespaceSelector, or ipBlock")
        if "ipBlock" in peer and len(peer) > 1:
            raise SpecError(f"{where}: ipBlock cannot be combined with a selector")
    return tuple(dict(p) for p in peers)


def _network_policy(spec: Mapping[str, Any]) -> NetworkPolicySettings:
    d = _obj(spec, "networkPolicy", "spec")
    path = "spec.networkPolicy"
    return NetworkPolicySettings(
        enabled=_bool(d, "enabled", path, _NETPOL.enabled),
        api_from=_peers(d, "apiFrom", path),
        metrics_from=(_peers(d, "metricsFrom", path) if "metricsFrom" in d
                      else _NETPOL.metrics_from))


def _pod_monitor(spec: Mapping[str, Any]) -> PodMonitorSettings:
    d = _obj(_obj(spec, "monitoring", "spec"), "podMonitor", "spec.monitoring")
    path = "spec.monitoring.podMonitor"
    interval = _str(d, "interval", path, _PODMON.interval, 16, min_len=2)
    if not _DURATION.fullmatch(interval):
        raise SpecError(f"{path}.interval {interval!r} is not a Prometheus duration such as "
                        "30s, 1m or 500ms")
    return PodMonitorSettings(enabled=_bool(d, "enabled", path, _PODMON.enabled),
                              interval=interval,
                              labels=_string_map(d, "labels", path, 16, label_values=True))


def _placement(d: Mapping[str, Any], path: str) -> Placement:
    return Placement(node_selector=_string_map(d, "nodeSelector", path, 32, label_values=True),
                     tolerations=_list(d, "tolerations", path, 32),
                     affinity=_obj(d, "affinity", path) or None)


def _role(spec: Mapping[str, Any], key: str) -> RoleSettings:
    d = _obj(spec, key, "spec")
    path = f"spec.{key}"
    return RoleSettings(
        replicas=_req_int(d, "replicas", path, _ROLE.replicas, 0, 64),
        resources=_obj(d, "resources", path) or None,
        placement=_placement(d, path))


def _string_map(d: Mapping[str, Any], key: str, path: str, max_items: int,
                label_values: bool, reserved: frozenset[str] = frozenset(),
                ) -> Mapping[str, str] | None:
    """A map of label or annotation keys to strings (label values when `label_values`);
    `reserved` keys and the operator's `tandem.dev/` prefix are refused."""
    value = _obj(d, key, path)
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


def _dns_name(d: Mapping[str, Any], key: str, path: str) -> str | None:
    """An optional object name (a DNS subdomain: PriorityClass, RuntimeClass, Secret)."""
    if d.get(key) is None:
        return None
    name = _str(d, key, path, None, 253, min_len=1)
    if not _DNS_SUBDOMAIN.fullmatch(name):
        raise SpecError(f"{path}.{key} {name!r} is not an object name (lowercase letters, "
                        "digits, '-' and '.')")
    return name


def _pod_settings(spec: Mapping[str, Any]) -> PodSettings:
    d = _obj(spec, "pod", "spec")
    path = "spec.pod"
    secrets = []
    for i, ref in enumerate(_list(d, "imagePullSecrets", path, 8)):
        name = _dns_name(ref, "name", f"{path}.imagePullSecrets[{i}]") if isinstance(
            ref, Mapping) else None
        if name is None:
            raise SpecError(f"{path}.imagePullSecrets[{i}] must be an object with the name "
                            "of a Secret in the pool's namespace")
        secrets.append(name)
    spread = _list(d, "topologySpreadConstraints", path, 8)
    for i, c in enumerate(spread):
        where = f"{path}.topologySpreadConstraints[{i}]"
        if not isinstance(c, Mapping):
            raise SpecError(f"{where} must be an object")
        if _int(c, "maxSkew", where, None, 1, 1024) is None:
            raise SpecError(f"{where}.maxSkew is required")
        _str(c, "topologyKey", where, None, 317, min_len=1)
        _str(c, "whenUnsatisfiable", where, None, 32, ("DoNotSchedule", "ScheduleAnyway"))
    return PodSettings(
        image_pull_secrets=tuple(secrets),
        labels=_string_map(d, "labels", path, 32, label_values=True,
                           reserved=RESERVED_LABELS),
        annotations=_string_map(d, "annotations", path, 32, label_values=False,
                                reserved=RESERVED_ANNOTATIONS),
        priority_class_name=_dns_name(d, "priorityClassName", path),
        runtime_class_name=_dns_name(d, "runtimeClassName", path),
        topology_spread_constraints=tuple(dict(c) for c in spread))


def _volumes(e: Mapping[str, Any]) -> tuple[Any, ...]:
    """spec.engine.volumes; the name and the path of the pods' own /tmp stay the operator's."""
    volumes = _list(e, "volumes", "spec.engine", 16)
    for i, v in enumerate(volumes):
        if isinstance(v, Mapping) and v.get("name") == TMP_VOLUME:
            raise SpecError(f"spec.engine.volumes[{i}].name {TMP_VOLUME!r} is the operator's "
                            f"(its emptyDir at {TMP_PATH}); pick another name")
    return volumes


def _check_tmp_mounts(mounts: tuple[Mapping[str, Any], ...], path: str) -> None:
    for i, mount in enumerate(mounts):
        if str(mount.get("mountPath", "")).rstrip("/") == TMP_PATH:
            raise SpecError(f"{path}.volumeMounts[{i}].mountPath {TMP_PATH} is the pod's own "
                            "writable emptyDir (the root filesystem is read-only); mount "
                            "elsewhere")


def _draft_uri(weights: Mapping[str, Any]) -> str | None:
    """spec.model.weights.draft.uri, checked as spec.model.weights.uri is."""
    if weights.get("draft") is None:
        return None
    path = "spec.model.weights.draft"
    uri = _str(_obj(weights, "draft", "spec.model.weights"), "uri", path, None, 1024,
               min_len=8)
    try:
        checkpoint_path(uri, what=f"{path}.uri")
    except WeightsURIError as exc:
        raise SpecError(str(exc)) from None
    return uri


def _engine_args(e: Mapping[str, Any]) -> tuple[str, ...]:
    """spec.engine.args, less the flags the operator renders from fields of their own."""
    args = tuple(str(a) for a in _list(e, "args", "spec.engine", 64))
    for i, arg in enumerate(args):
        if arg.startswith(SPECULATIVE_FLAG_PREFIX):
            raise SpecError(f"spec.engine.args[{i}] {arg!r}: the operator renders the "
                            "--speculative-* flags from spec.engine.speculative (method, "
                            "numSpeculativeTokens, promptLookupMin/Max) and the draft "
                            "checkpoint from spec.model.weights.draft.uri; set those instead")
    return args


def _speculative(e: Mapping[str, Any]) -> Speculative | None:
    """spec.engine.speculative, within the engine's own limits (SpeculativeConfig)."""
    if e.get("speculative") is None:
        return None
    d = _obj(e, "speculative", "spec.engine")
    path = "spec.engine.speculative"
    if d.get("method") is None:
        raise SpecError(f"{path}.method is required: one of "
                        f"{', '.join(choices(SpeculativeMethod))}")
    method = SpeculativeMethod(_str(d, "method", path, None, 8, choices(SpeculativeMethod)))
    tokens = _req_int(d, "numSpeculativeTokens", path, DEFAULT_SPECULATIVE_TOKENS, 1,
                      MAX_SPECULATIVE_TOKENS)
    lookup = [k for k in ("promptLookupMin", "promptLookupMax") if d.get(k) is not None]
    if lookup and method is not SpeculativeMethod.NGRAM:
        raise SpecError(f"{path}.{lookup[0]} applies to method Ngram only (prompt lookup); "
                        f"remove it for method {method}")
    low = _req_int(d, "promptLookupMin", path, DEFAULT_PROMPT_LOOKUP_MIN, 1, MAX_PROMPT_LOOKUP)
    high = _req_int(d, "promptLookupMax", path, DEFAULT_PROMPT_LOOKUP_MAX, 1,
                    MAX_PROMPT_LOOKUP)
    if high < low:
        raise SpecError(f"{path}.promptLookupMax = {high} is below promptLookupMin = {low}: "
                        "raise promptLookupMax or lower promptLookupMin")
    cap = _int(d, "disableByBatchSize", path, None, 1, 1024)  # as maxNumSeqs
    return Speculative(method=method, num_speculative_tokens=tokens, prompt_lookup_min=low,
                       prompt_lookup_max=high, disable_by_batch_size=cap)


def parse_pool(body: Mapping[str, Any]) -> PoolSpec:
    """The pool's spec with the CRD's defaults and rules applied (SpecError naming the
    field otherwise). One pass over the spec's sections, in the CRD's order: long on
    purpose, each section a few lines."""
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("spec is required")
    model = _obj(spec, "model", "spec")
    weights = _obj(model, "weights", "spec.model")
    uri = _str(weights, "uri", "spec.model.weights", None, 1024, min_len=8)
    try:
        checkpoint_path(uri, what="spec.model.weights.uri")
    except WeightsURIError as exc:
        raise SpecError(str(exc)) from None
    version = _str(weights, "version", "spec.model.weights", None, 63, min_len=1)
    draft_uri = _draft_uri(weights)

    e = _obj(spec, "engine", "spec")
    kv = _obj(e, "kvCache", "spec.engine")
    volumes = _volumes(e)
    engine = EngineSettings(
        image=_str(e, "image", "spec.engine", default_engine_image(), 512, min_len=1),
        image_pull_policy=_str(e, "imagePullPolicy", "spec.engine", _ENGINE.image_pull_policy,
                               32, ("Always", "IfNotPresent", "Never")),
        resources=_obj(e, "resources", "spec.engine") or None,
        env=_list(e, "env", "spec.engine", 64),
        args=_engine_args(e),
        volumes=volumes,
        volume_mounts=_mounts(e, "spec.engine", volumes, read_only=True),
        weights_roots=_absolute_paths(e, "weightsRoots", "spec.engine", 8),
        init_containers=_init_containers(e, volumes),
        kv_cache=KVCache(
            block_size=_req_int(kv, "blockSize", "spec.engine.kvCache", _KV.block_size, 1, 256),
            num_blocks=_int(kv, "numBlocks", "spec.engine.kvCache", None, 16, 1048576),
            memory_mib=_int(kv, "memoryMiB", "spec.engine.kvCache", None, 16, 1048576)),
        max_num_seqs=_req_int(e, "maxNumSeqs", "spec.engine", _ENGINE.max_num_seqs, 1, 1024),
        max_num_batched_tokens=_req_int(e, "maxNumBatchedTokens", "spec.engine",
                                        _ENGINE.max_num_batched_tokens, 16, 65536),
        threads=_req_int(e, "threads", "spec.engine", _ENGINE.threads, 1, 256),
        device=EngineDevice(_str(e, "device", "spec.engine", _ENGINE.device.value, 8,
                                 choices(EngineDevice))),
        startup_timeout_seconds=_req_int(e, "startupTimeoutSeconds", "spec.engine",
                                         _ENGINE.startup_timeout_seconds, 10, 86400),
        rdma_ipc_lock=_bool(_obj(e, "rdma", "spec.engine"), "ipcLock", "spec.engine.rdma",
                            _ENGINE.rdma_ipc_lock),
        speculative=_speculative(e))
    _check_tmp_mounts(engine.volume_mounts, "spec.engine")
    for i, c in enumerate(engine.init_containers):
        _check_tmp_mounts(c.volume_mounts, f"spec.engine.initContainers[{i}]")

    r = _obj(spec, "router", "spec")
    svc = _obj(r, "service", "spec.router")
    ro = _obj(spec, "rollout", "spec")
    rf = _obj(spec, "refit", "spec")
    kt = _obj(spec, "kvTransfer", "spec")
    ucx = _obj(kt, "ucx", "spec.kvTransfer")
    pool = PoolSpec(
        name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        model_name=_str(model, "name", "spec.model", None, 253, min_len=1),
        weights=WeightsRef(uri=uri, version=version),
        draft_uri=draft_uri,
        engine=engine,
        prefill=_role(spec, "prefill"),
        decode=_role(spec, "decode"),
        router=RouterSettings(
            replicas=_req_int(r, "replicas", "spec.router", _ROUTER.replicas, 1, 16),
            service_type=_str(svc, "type", "spec.router.service", _ROUTER.service_type, 32,
                              ("ClusterIP", "NodePort", "LoadBalancer")),
            service_port=_req_int(svc, "port", "spec.router.service", _ROUTER.service_port, 1,
                                  65535),
            api_key_secret=_secret_key(r, "apiKeySecret", "spec.router"),
            placement=_placement(r, "spec.router")),
        rollout=Rollout(
            max_surge=_req_int(ro, "maxSurge", "spec.rollout", _ROLLOUT.max_surge, 0, 64),
            max_unavailable=_req_int(ro, "maxUnavailable", "spec.rollout",
                                     _ROLLOUT.max_unavailable, 0, 64)),
        refit=RefitSettings(
            strategy=RefitStrategy(_str(rf, "strategy", "spec.refit", _REFIT.strategy, 32,
                                        choices(RefitStrategy))),
            inflight=InFlight(_str(rf, "inflight", "spec.refit", _REFIT.inflight, 32,
                                   choices(InFlight))),
            drain_timeout_seconds=_req_int(rf, "drainTimeoutSeconds", "spec.refit",
                                           _REFIT.drain_timeout_seconds, 1, 3600),
            on_failure=OnFailure(_str(rf, "onFailure", "spec.refit", _REFIT.on_failure, 32,
                                      choices(OnFailure))),
            max_perplexity_ratio=_decimal(_obj(rf, "verify", "spec.refit"),
                                          "maxPerplexityRatio", "spec.refit.verify",
                                          perplexity_ratio_problem, "1.5"),
            min_uncertainty_ratio=_decimal(_obj(rf, "verify", "spec.refit"),
                                           "minUncertaintyRatio", "spec.refit.verify",
                                           uncertainty_ratio_problem, "0.25",
                                           _REFIT.min_uncertainty_ratio),
            low_memory=_bool(rf, "lowMemory", "spec.refit", _REFIT.low_memory)),
        kv_transfer=KVTransfer(
            backend=_str(kt, "backend", "spec.kvTransfer", _KVT.backend, 32, ("NIXL",)),
            pin_ttl_seconds=_req_int(kt, "pinTTLSeconds", "spec.kvTransfer",
                                     _KVT.pin_ttl_seconds, 1, 3600),
            ucx_transports=_str(ucx, "transports", "spec.kvTransfer.ucx", _KVT.ucx_transports,
                                256),
            ucx_net_devices=_str(ucx, "netDevices", "spec.kvTransfer.ucx",
                                 _KVT.ucx_net_devices, 256)),
        network_policy=_network_policy(spec),
        pod_monitor=_pod_monitor(spec),
        pod=_pod_settings(spec))
    _check_rules(pool)
    return pool


def _check_rules(pool: PoolSpec) -> None:
    """The CRD's cross-field CEL rules, with the CRD's messages."""
    if pool.prefill.replicas > 0 and pool.decode.replicas < 1:
        raise SpecError("decode.replicas must be at least 1 when prefill.replicas > 0")
    if pool.prefill.replicas + pool.decode.replicas < 1:
        raise SpecError("the pool needs at least one engine")
    if pool.rollout.max_surge + pool.rollout.max_unavailable < 1:
        raise SpecError("rollout.maxSurge and rollout.maxUnavailable must not both be 0")
    kv = pool.engine.kv_cache
    if kv.num_blocks is not None and kv.memory_mib is not None:
        raise SpecError("set kvCache.numBlocks or kvCache.memoryMiB, not both")
    speculative = pool.engine.speculative
    drafting = speculative is not None and speculative.method is SpeculativeMethod.DRAFT
    if drafting and pool.draft_uri is None:
        raise SpecError("engine.speculative.method Draft needs model.weights.draft.uri, the "
                        "draft checkpoint")
    if pool.draft_uri is not None and not drafting:
        raise SpecError("model.weights.draft is read only by engine.speculative.method Draft; "
                        "remove it or set that method")
