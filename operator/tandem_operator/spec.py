"""The InferencePool as data: typed raw bodies, and the parsed `PoolSpec` every other module reads.

Raw Kubernetes bodies stay plain dicts on the wire; the TypedDicts below name their shape. The
operator never reasons over raw dicts: `PoolSpec.from_body` applies the CRD's defaults (the same
ones as crds/inferencepools.tandem.dev.yaml, so a body from an API server that did not default
it means the same thing), re-checks the cross-field rules the CRD states in CEL (the operator
must never act on a spec the schema would refuse), and returns frozen dataclasses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict
from urllib.parse import unquote, urlparse

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"

Group = Literal["prefill", "decode", "router"]
EngineRole = Literal["prefill", "decode", "mixed"]
GROUPS: tuple[Group, ...] = ("prefill", "decode", "router")
ENGINE_GROUPS: tuple[Group, ...] = ("prefill", "decode")


# ---- raw bodies ---------------------------------------------------------------------------------


class ObjectMeta(TypedDict, total=False):
    name: str
    generateName: str
    namespace: str
    uid: str
    generation: int
    resourceVersion: str
    creationTimestamp: str
    deletionTimestamp: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[dict[str, Any]]
    finalizers: list[str]


class WeightsDict(TypedDict, total=False):
    uri: str
    version: str


class ModelDict(TypedDict, total=False):
    name: str
    weights: WeightsDict


class KVCacheDict(TypedDict, total=False):
    blockSize: int
    numBlocks: int
    memoryMiB: int


class EngineDict(TypedDict, total=False):
    image: str
    imagePullPolicy: str
    resources: dict[str, dict[str, Any]]
    env: list[dict[str, Any]]
    args: list[str]
    kvCache: KVCacheDict
    maxNumSeqs: int
    maxNumBatchedTokens: int
    threads: int


class RoleDict(TypedDict, total=False):
    replicas: int
    resources: dict[str, dict[str, Any]]
    nodeSelector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any]


class ServiceDict(TypedDict, total=False):
    type: str
    port: int


class RouterDict(TypedDict, total=False):
    replicas: int
    service: ServiceDict


class RolloutDict(TypedDict, total=False):
    maxSurge: int
    maxUnavailable: int


class RefitDict(TypedDict, total=False):
    strategy: str
    inflight: str
    drainTimeoutSeconds: int
    onFailure: str


class UcxDict(TypedDict, total=False):
    transports: str
    netDevices: str


class KVTransferDict(TypedDict, total=False):
    backend: str
    pinTTLSeconds: int
    ucx: UcxDict


class PoolSpecDict(TypedDict, total=False):
    model: ModelDict
    engine: EngineDict
    prefill: RoleDict
    decode: RoleDict
    router: RouterDict
    rollout: RolloutDict
    refit: RefitDict
    kvTransfer: KVTransferDict


class ConditionDict(TypedDict, total=False):
    type: str
    status: str
    reason: str
    message: str
    observedGeneration: int
    lastTransitionTime: str


class RoleStatusDict(TypedDict, total=False):
    replicas: int
    ready: int
    updated: int


class WeightsStatusDict(TypedDict, total=False):
    current: str
    target: str
    epoch: int


class PoolStatusDict(TypedDict, total=False):
    observedGeneration: int
    conditions: list[ConditionDict]
    prefill: RoleStatusDict
    decode: RoleStatusDict
    router: RoleStatusDict
    weights: WeightsStatusDict
    routerEndpoint: str
    refit: dict[str, Any]


class PoolBody(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PoolSpecDict
    status: PoolStatusDict


class PodStatusDict(TypedDict, total=False):
    phase: str
    podIP: str
    conditions: list[dict[str, Any]]
    containerStatuses: list[dict[str, Any]]


class PodBody(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: dict[str, Any]
    status: PodStatusDict


# ---- the parsed spec ----------------------------------------------------------------------------


class SpecError(ValueError):
    """The body is not a spec the CRD accepts; the message names the field and the rule."""


@dataclass(frozen=True)
class Weights:
    uri: str
    version: str

    @property
    def path(self) -> str:
        """The checkpoint folder named by the file:// uri (as the engine containers see it)."""
        return weights_path(self.uri)


@dataclass(frozen=True)
class KVCache:
    block_size: int = 16
    num_blocks: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class EngineSettings:
    image: str = "tandem/engine:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    resources: Mapping[str, Any] | None = None
    env: tuple[Mapping[str, Any], ...] = ()
    args: tuple[str, ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()  # added to engine and router pods
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    kv_cache: KVCache = KVCache()
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    threads: int = 1


@dataclass(frozen=True)
class RoleSettings:
    replicas: int = 1
    resources: Mapping[str, Any] | None = None  # replaces engine.resources when set
    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RouterSettings:
    replicas: int = 1
    service_type: str = "ClusterIP"
    service_port: int = 8000


@dataclass(frozen=True)
class Rollout:
    max_surge: int = 1
    max_unavailable: int = 0


@dataclass(frozen=True)
class RefitSettings:
    strategy: str = "Rolling"
    inflight: str = "Drain"
    drain_timeout_seconds: int = 120
    on_failure: str = "Rollback"


@dataclass(frozen=True)
class KVTransfer:
    backend: str = "NIXL"
    pin_ttl_seconds: int = 60
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
    weights: Weights
    engine: EngineSettings = EngineSettings()
    prefill: RoleSettings = RoleSettings()
    decode: RoleSettings = RoleSettings()
    router: RouterSettings = RouterSettings()
    rollout: Rollout = Rollout()
    refit: RefitSettings = RefitSettings()
    kv_transfer: KVTransfer = KVTransfer()

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
            return "prefill"
        if group == "decode":
            return "decode" if self.prefill.replicas > 0 else "mixed"
        raise ValueError(f"{group!r} is not an engine group (prefill or decode)")


def weights_path(uri: str) -> str:
    """`file:///abs/path` (or `file://localhost/abs/path`) -> `/abs/path`."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise SpecError(f"spec.model.weights.uri {uri!r}: weights.uri must be a file:// URI")
    if parsed.netloc not in ("", "localhost"):
        raise SpecError(f"spec.model.weights.uri {uri!r}: a file:// URI must not name a host "
                        "(write file:///absolute/path)")
    path = unquote(parsed.path)
    if not path.startswith("/") or path == "/":
        raise SpecError(f"spec.model.weights.uri {uri!r}: needs an absolute checkpoint folder, "
                        "e.g. file:///models/demo")
    return path


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


def _list(d: Mapping[str, Any], key: str, path: str, max_items: int) -> tuple[Any, ...]:
    value = d.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key} must be a list")
    if len(value) > max_items:
        raise SpecError(f"{path}.{key} has {len(value)} items; at most {max_items} are allowed")
    return tuple(value)


def _mounts(e: Mapping[str, Any], volumes: tuple[Any, ...]) -> tuple[Mapping[str, Any], ...]:
    """volumeMounts, each naming one of spec.engine.volumes (read-only by default)."""
    names = {v.get("name") for v in volumes if isinstance(v, Mapping)}
    mounts = []
    for m in _list(e, "volumeMounts", "spec.engine", 16):
        if not isinstance(m, Mapping) or m.get("name") not in names:
            raise SpecError(f"spec.engine.volumeMounts entry {m!r} names no volume of "
                            f"spec.engine.volumes ({', '.join(sorted(map(str, names))) or 'none'})")
        mounts.append({"readOnly": True, **m})
    return tuple(mounts)


def _role(spec: Mapping[str, Any], key: str) -> RoleSettings:
    d = _obj(spec, key, "spec")
    path = f"spec.{key}"
    return RoleSettings(
        replicas=_req_int(d, "replicas", path, 1, 0, 64),
        resources=_obj(d, "resources", path) or None,
        node_selector=_obj(d, "nodeSelector", path) or None,
        tolerations=_list(d, "tolerations", path, 32),
        affinity=_obj(d, "affinity", path) or None)


def parse_pool(body: Mapping[str, Any]) -> PoolSpec:
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("spec is required")
    model = _obj(spec, "model", "spec")
    weights = _obj(model, "weights", "spec.model")
    uri = _str(weights, "uri", "spec.model.weights", None, 1024, min_len=8)
    weights_path(uri)
    version = _str(weights, "version", "spec.model.weights", None, 63, min_len=1)

    e = _obj(spec, "engine", "spec")
    kv = _obj(e, "kvCache", "spec.engine")
    engine = EngineSettings(
        image=_str(e, "image", "spec.engine", "tandem/engine:0.1.0", 512, min_len=1),
        image_pull_policy=_str(e, "imagePullPolicy", "spec.engine", "IfNotPresent", 32,
                               ("Always", "IfNotPresent", "Never")),
        resources=_obj(e, "resources", "spec.engine") or None,
        env=_list(e, "env", "spec.engine", 64),
        args=tuple(str(a) for a in _list(e, "args", "spec.engine", 64)),
        volumes=_list(e, "volumes", "spec.engine", 16),
        volume_mounts=_mounts(e, _list(e, "volumes", "spec.engine", 16)),
        kv_cache=KVCache(
            block_size=_req_int(kv, "blockSize", "spec.engine.kvCache", 16, 1, 256),
            num_blocks=_int(kv, "numBlocks", "spec.engine.kvCache", None, 16, 1048576),
            memory_mib=_int(kv, "memoryMiB", "spec.engine.kvCache", None, 16, 1048576)),
        max_num_seqs=_req_int(e, "maxNumSeqs", "spec.engine", 64, 1, 1024),
        max_num_batched_tokens=_req_int(e, "maxNumBatchedTokens", "spec.engine", 512, 16, 65536),
        threads=_req_int(e, "threads", "spec.engine", 1, 1, 256))

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
        weights=Weights(uri=uri, version=version),
        engine=engine,
        prefill=_role(spec, "prefill"),
        decode=_role(spec, "decode"),
        router=RouterSettings(
            replicas=_req_int(r, "replicas", "spec.router", 1, 1, 16),
            service_type=_str(svc, "type", "spec.router.service", "ClusterIP", 32,
                              ("ClusterIP", "NodePort", "LoadBalancer")),
            service_port=_req_int(svc, "port", "spec.router.service", 8000, 1, 65535)),
        rollout=Rollout(
            max_surge=_req_int(ro, "maxSurge", "spec.rollout", 1, 0, 64),
            max_unavailable=_req_int(ro, "maxUnavailable", "spec.rollout", 0, 0, 64)),
        refit=RefitSettings(
            strategy=_str(rf, "strategy", "spec.refit", "Rolling", 32,
                          ("Rolling", "AllAtOnce")),
            inflight=_str(rf, "inflight", "spec.refit", "Drain", 32, ("Drain", "Recompute")),
            drain_timeout_seconds=_req_int(rf, "drainTimeoutSeconds", "spec.refit", 120, 1,
                                           3600),
            on_failure=_str(rf, "onFailure", "spec.refit", "Rollback", 32,
                            ("Rollback", "Halt"))),
        kv_transfer=KVTransfer(
            backend=_str(kt, "backend", "spec.kvTransfer", "NIXL", 32, ("NIXL",)),
            pin_ttl_seconds=_req_int(kt, "pinTTLSeconds", "spec.kvTransfer", 60, 1, 3600),
            ucx_transports=_str(ucx, "transports", "spec.kvTransfer.ucx", "", 256),
            ucx_net_devices=_str(ucx, "netDevices", "spec.kvTransfer.ucx", "", 256)))
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
