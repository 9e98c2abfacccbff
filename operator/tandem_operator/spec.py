"""The InferencePool as data: the parsed `PoolSpec` every other module reads.

The operator never reasons over raw dicts: `PoolSpec.from_body` reads a raw body (a plain
dict, checked field by field as it is read), applies the CRD's defaults (the same ones as
crds/inferencepools.tandem.dev.yaml, so a body from an API server that did not default it
means the same thing), re-checks the cross-field rules the CRD states in CEL (the operator
must never act on a spec the schema would refuse), and returns frozen dataclasses.

Each default is stated once here, as the dataclass field's default; the engine's own ones,
with their bounds, come from its flag table (`tandem_engine.config.ENGINE_FLAGS`: the
engine's own rules are applied by `EngineConfig.validate`, not stated again here) and the
refit's from `tandem_engine.refit_policy`. The one
exception is spec.engine.image, which the CRD leaves unset: `default_engine_image()`, the
chart's engine image (TANDEM_ENGINE_IMAGE), so that pools follow the operator's release.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, Literal

from tandem_engine.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_KV_PIN_TTL_S,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DEFAULT_SPECULATIVE_TOKENS,
    DEFAULT_THREADS,
    POOL_FLAGS,
    EngineConfig,
    SpeculativeConfig,
    engine_flag,
)
from tandem_engine.engine_flags import EngineOptionError
from tandem_engine.fleet.adapters import STAGING_PREFIX, AdapterRef
from tandem_engine.fleet.verify import DEFAULT_MIN_UNCERTAINTY_RATIO, uncertainty_ratio_problem
from tandem_engine.lifecycle import EngineRole
from tandem_engine.lora_request import ADAPTER_NAME
from tandem_engine.refit_policy import (
    DEFAULT_DRAIN_TIMEOUT_S,
    InFlight,
    OnFailure,
    RefitStrategy,
    choices,
    perplexity_ratio_problem,
)
from tandem_engine.weights import WeightsRef, WeightsURIError, checkpoint_path

from tandem_operator.autoscale import (
    DEFAULT_PERCENTILE,
    SLO,
    Autoscaling,
    AutoscalingError,
    Bounds,
)
from tandem_operator.fields import (
    SpecError,
    absolute_paths,
    bool_field,
    decimal_field,
    int_field,
    int_or_percent_field,
    list_field,
    object_field,
    quantity_field,
    required_int,
    str_field,
    strings_field,
    volume_mounts,
)

# Part of this module's surface too, though spec.pod's parser owns them.
from tandem_operator.pod_spec import (
    RESERVED_ANNOTATIONS as RESERVED_ANNOTATIONS,
)
from tandem_operator.pod_spec import (
    RESERVED_LABELS as RESERVED_LABELS,
)
from tandem_operator.pod_spec import (
    NetworkPolicySettings,
    Placement,
    PodMonitorSettings,
    PodSettings,
    SecretKey,
    network_policy_settings,
    placement,
    pod_monitor_settings,
    pod_settings,
    secret_key,
)

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"

Group = Literal["prefill", "decode", "router"]
GROUPS: tuple[Group, ...] = ("prefill", "decode", "router")
ENGINE_GROUPS: tuple[Group, ...] = ("prefill", "decode")


# ---- the parsed spec ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KVCache:
    """spec.engine.kvCache: the block size and at most one size, a block count or a byte
    budget (kvCache.memory, or the deprecated memoryMiB in bytes)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    memory_bytes: int | None = None


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


class Quantization(str, enum.Enum):
    """spec.engine.quantization, CamelCase as the CRD's enums are; `flag` is the engine's
    `--quantization` value (config.QUANTIZATION_CHOICES)."""

    AUTO = "Auto"  # a GGUF's quantized tensors stay quantized, an HF checkpoint dense
    NONE = "None"  # dense: a GGUF dequantized at load
    INT8 = "Int8"  # weight-only int8 rows, quantized at load
    INT4 = "Int4"  # weight-only int4 in groups of 32, quantized at load

    def __str__(self) -> str:
        return self.value

    @property
    def flag(self) -> str:
        return self.name.lower()


class Dtype(str, enum.Enum):
    """spec.engine.dtype, CamelCase as the CRD's enums are; `flag` is the engine's `--dtype`
    value (auto or one of config.SUPPORTED_DTYPES)."""

    AUTO = "Auto"  # the device's and the checkpoint's choice (model/device.auto_dtype)
    FLOAT32 = "Float32"
    BFLOAT16 = "BFloat16"
    FLOAT16 = "Float16"

    def __str__(self) -> str:
        return self.value

    @property
    def flag(self) -> str:
        return self.name.lower()


# The engine flags the operator renders, each with the field that sets it (spec.engine.args
# may not set them: a later flag would silently win over the field): the flag table's pool
# flags, and the command line the operator wires itself (engine_command.engine_args).
RENDERED_ENGINE_FLAGS: dict[str, str] = {
    **{flag.flag: f"spec.{flag.pool.path}" for flag in POOL_FLAGS if flag.pool is not None},
    "--role": "spec.prefill.replicas (prefill and decode engines, or mixed ones without "
              "prefill)",
    "--model": "spec.model.weights.uri",
    "--served-model-name": "spec.model.name",
    "--weight-version": "spec.model.weights.version",
    "--weight-epoch": "the refit transaction (status.weights.epoch)",
    "--weights-root": "spec.engine.weightsRoots (and the volume mounts holding the weights)",
    "--shutdown-grace": "spec.refit.drainTimeoutSeconds",
    "--enable-lora": "spec.engine.lora",
    "--max-loras": "spec.engine.lora.maxLoras",
    "--max-lora-rank": "spec.engine.lora.maxLoraRank",
    "--max-cpu-loras": "spec.engine.lora.maxCpuLoras",
    "--lora-modules": "spec.adapters",
    **{flag: "the pod's address, ports and name"
       for flag in ("--host", "--port", "--admin-port", "--metrics-port", "--engine-id")},
}
SPECULATIVE_FLAG_PREFIX = "--speculative"  # any other --speculative-* is spec.engine.speculative

# The CRD's CEL messages of the engine's sizing rules, which _check_rules states again.
ADAPTERS_NEED_LORA = ("adapters need engine.lora (the engines' LoRA slots: maxLoras, "
                      "maxLoraRank): set it, e.g. engine: {lora: {maxLoras: 4}}")
KV_CACHE_SIZES = "set at most one of kvCache.numBlocks, kvCache.memory and kvCache.memoryMiB"
GPU_MEMORY_ON_CPU = ("engine.gpuMemoryUtilization sizes a CUDA engine's memory; remove it "
                     "for device CPU")
GPU_MEMORY_WITH_KV_SIZE = ("engine.gpuMemoryUtilization sizes the KV cache only where kvCache "
                           "gives no size; remove it or kvCache's numBlocks, memory or "
                           "memoryMiB")


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
    max_queued_requests: int | None = None  # spec.engine.maxQueuedRequests; None: no bound
    max_model_len: int | None = None  # spec.engine.maxModelLen; None: the model's context
    threads: int = DEFAULT_THREADS
    device: EngineDevice = EngineDevice.AUTO
    dtype: Dtype = Dtype.AUTO  # spec.engine.dtype
    kv_cache_dtype: Dtype = Dtype.AUTO  # spec.engine.kvCacheDtype (the same values)
    quantization: Quantization = Quantization.AUTO  # spec.engine.quantization
    # spec.engine.gpuMemoryUtilization; None: the engine's default (CUDA engines only)
    gpu_memory_utilization: float | None = None
    startup_timeout_seconds: int = DEFAULT_STARTUP_TIMEOUT_S  # the startupProbe's budget
    rdma_ipc_lock: bool = False  # spec.engine.rdma.ipcLock: adds the IPC_LOCK capability
    speculative: Speculative | None = None  # spec.engine.speculative; None: off
    lora: LoRASettings | None = None  # spec.engine.lora; None: engines serve no adapters


@dataclass(frozen=True)
class LoRASettings:
    """spec.engine.lora: the engines start with --enable-lora and these slots (vLLM's
    --max-loras, --max-lora-rank, --max-cpu-loras; the engine's own defaults)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: --max-loras


MAX_ADAPTERS = 64  # spec.adapters' maxItems
# the CRD's pattern, as spec.model.weights.version's
ADAPTER_VERSION = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class RoleSettings:
    replicas: int = 1
    resources: Mapping[str, Any] | None = None  # replaces engine.resources when set
    placement: Placement = field(default_factory=Placement)


# spec.router.resources' defaults, sized from a measurement (docs/benchmarks.md, "Router
# resources"): a pod's router idles at ~126 MiB RSS and ~2m CPU and spends 7.5-8.2 ms of
# CPU per request (256 prompt, 64 output tokens): 0.40 of a core at 57 requests/s. Requests:
# ~2x the idle RSS and the CPU of ~60 requests/s; limits: room for bursts and long prompts.
DEFAULT_ROUTER_RESOURCES: Mapping[str, Mapping[str, str]] = {
    "requests": {"cpu": "500m", "memory": "256Mi"},
    "limits": {"cpu": "2", "memory": "1Gi"},
}


@dataclass(frozen=True)
class RouterSettings:
    replicas: int = 1
    service_type: str = "ClusterIP"
    service_port: int = 8000
    # the router's API keys: comma-separated, or key lines (docs/routing.md)
    api_key_secret: SecretKey | None = None
    max_num_requests: int | None = None  # requests in flight per router; None: no bound
    placement: Placement = field(default_factory=Placement)
    # the router container's requests and limits; each half defaults on its own
    resources: Mapping[str, Any] = field(
        default_factory=lambda: {k: dict(v) for k, v in DEFAULT_ROUTER_RESOURCES.items()})


DEFAULT_REVISION_HISTORY_LIMIT = 10  # as a Deployment's revisionHistoryLimit
DEFAULT_PROGRESS_DEADLINE_S = 600  # as a Deployment's progressDeadlineSeconds
# A new engine counts as available to a rollout (its old peer may then leave) this long after
# it turned Ready: time for every router to connect to it and hear its first heartbeats (every
# 0.5 s), so that no router is left knowing only the engines being drained.
DEFAULT_MIN_READY_S = 5


@dataclass(frozen=True)
class Rollout:
    """spec.rollout: how pod-template changes replace pods (rollout.py keeps the revisions
    and the deadline). maxSurge and maxUnavailable stay as written, a pod count or a
    percentage such as "25%": `budget` resolves them for one role's replicas."""

    max_surge: int | str = 1
    max_unavailable: int | str = 0
    revision_history_limit: int = DEFAULT_REVISION_HISTORY_LIMIT  # besides the live ones
    progress_deadline_seconds: int = DEFAULT_PROGRESS_DEADLINE_S
    on_failure: OnFailure = OnFailure.ROLLBACK  # a rollout past its deadline: Rollback|Halt
    min_ready_seconds: int = DEFAULT_MIN_READY_S  # Ready this long before it is available

    def budget(self, replicas: int) -> tuple[int, int]:
        """(surge, unavailable) in pods for a role of `replicas`, as a Deployment resolves
        them: a percentage of the replicas, surge rounded up and unavailable down; when both
        come to 0, one pod may be unavailable (plan.py still never takes a role's last
        ready pod: it surges one instead)."""
        surge = _pods(self.max_surge, replicas, round_up=True)
        unavailable = _pods(self.max_unavailable, replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        return surge, unavailable


def _pods(value: int | str, replicas: int, round_up: bool) -> int:
    """A rollout budget in pods: an integer as it is, "N%" of `replicas`."""
    if isinstance(value, int):
        return value
    share = int(value.removesuffix("%")) * replicas
    return -(-share // 100) if round_up else share // 100


def _zero(value: int | str) -> bool:
    return value in (0, "0%")


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
    network_policy: NetworkPolicySettings = field(default_factory=NetworkPolicySettings)
    pod_monitor: PodMonitorSettings = field(default_factory=PodMonitorSettings)
    pod: PodSettings = field(default_factory=PodSettings)
    # spec.autoscaling, validated: the planner (autoscale.py) the operator runs (autoscaler.py)
    autoscaling: Autoscaling | None = None
    # spec.adapters: the LoRA adapters every engine serves, changed in place by an adapter
    # transaction (tandem_operator.adapters) when edited
    adapters: tuple[AdapterRef, ...] = ()

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
TMP_VOLUME = "tandem-tmp"  # the emptyDir at /tmp of every pool pod (the root fs is read-only)
TMP_PATH = "/tmp"


# ---- parsing with the CRD's defaults and rules --------------------------------------------------


def _init_containers(e: Mapping[str, Any], volumes: tuple[Any, ...]
                     ) -> tuple[InitContainer, ...]:
    containers: list[InitContainer] = []
    for i, c in enumerate(list_field(e, "initContainers", "spec.engine", 4)):
        path = f"spec.engine.initContainers[{i}]"
        if not isinstance(c, Mapping):
            raise SpecError(f"{path} must be an object")
        name = str_field(c, "name", path, None, 63, min_len=1)
        if any(other.name == name for other in containers):
            raise SpecError(f"{path}.name {name!r} is used twice; init containers need "
                            "unique names")
        command = strings_field(c, "command", path, 64)
        if not command:
            raise SpecError(f"{path}.command is required (the program to run)")
        env = []
        for j, v in enumerate(list_field(c, "env", path, 32)):
            if not isinstance(v, Mapping):
                raise SpecError(f"{path}.env[{j}] must be an object")
            env.append((str_field(v, "name", f"{path}.env[{j}]", None, 256, min_len=1),
                        str_field(v, "value", f"{path}.env[{j}]", "", 4096)))
        containers.append(InitContainer(
            name=name, command=command, args=strings_field(c, "args", path, 64),
            image=str_field(c, "image", path, None, 512, min_len=1) if "image" in c else None,
            env=tuple(env), volume_mounts=volume_mounts(c, path, volumes, read_only=False)))
    return tuple(containers)


def _role(spec: Mapping[str, Any], key: str) -> RoleSettings:
    d = object_field(spec, key, "spec")
    path = f"spec.{key}"
    return RoleSettings(
        replicas=required_int(d, "replicas", path, _ROLE.replicas, 0, 64),
        resources=object_field(d, "resources", path) or None,
        placement=placement(d, path))


def _volumes(e: Mapping[str, Any]) -> tuple[Any, ...]:
    """spec.engine.volumes; the name and the path of the pods' own /tmp stay the operator's."""
    volumes = list_field(e, "volumes", "spec.engine", 16)
    for i, v in enumerate(volumes):
        if isinstance(v, Mapping) and v.get("name") == TMP_VOLUME:
            raise SpecError(f"spec.engine.volumes[{i}].name {TMP_VOLUME!r} is the operator's "
                            f"(its emptyDir at {TMP_PATH}); pick another name")
    return volumes


def _check_tmpvolume_mounts(mounts: tuple[Mapping[str, Any], ...], path: str) -> None:
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
    uri = str_field(object_field(weights, "draft", "spec.model.weights"), "uri", path, None,
                    1024, min_len=8)
    if not uri.startswith("file://"):
        raise SpecError(f"{path}.uri {uri!r}: must be a file:// URI (the draft checkpoint is "
                        "read from a volume the spec mounts; pvc:// and oci:// name the main "
                        "weights only), e.g. file:///models/draft")
    try:
        checkpoint_path(uri, what=f"{path}.uri")
    except WeightsURIError as exc:
        raise SpecError(str(exc)) from None
    return uri


def _engine_args(e: Mapping[str, Any]) -> tuple[str, ...]:
    """spec.engine.args, less the flags the operator renders (`RENDERED_ENGINE_FLAGS`), as
    `--flag value` or `--flag=value`: each refusal names the field to set instead."""
    args = tuple(str(a) for a in list_field(e, "args", "spec.engine", 64))
    for i, arg in enumerate(args):
        flag = arg.partition("=")[0]
        if flag in RENDERED_ENGINE_FLAGS:
            where = RENDERED_ENGINE_FLAGS[flag]
            fix = "set that instead" if where.startswith("spec.") else "leave it out"
            raise SpecError(f"spec.engine.args[{i}] {arg!r}: the operator renders {flag} from "
                            f"{where}; {fix}")
        if flag.startswith(SPECULATIVE_FLAG_PREFIX):
            raise SpecError(f"spec.engine.args[{i}] {arg!r}: the operator renders the "
                            "--speculative-* flags from spec.engine.speculative; set that "
                            "instead")
    return args


def _speculative(e: Mapping[str, Any]) -> Speculative | None:
    """spec.engine.speculative, within the engine's own limits (SpeculativeConfig)."""
    if e.get("speculative") is None:
        return None
    d = object_field(e, "speculative", "spec.engine")
    path = "spec.engine.speculative"
    if d.get("method") is None:
        raise SpecError(f"{path}.method is required: one of "
                        f"{', '.join(choices(SpeculativeMethod))}")
    method = SpeculativeMethod(str_field(d, "method", path, None, 8, choices(SpeculativeMethod)))
    tokens = _flag_int(d, "num_speculative_tokens")
    lookup = [k for k in ("promptLookupMin", "promptLookupMax") if d.get(k) is not None]
    if lookup and method is not SpeculativeMethod.NGRAM:
        raise SpecError(f"{path}.{lookup[0]} applies to method Ngram only (prompt lookup); "
                        f"remove it for method {method}")
    return Speculative(method=method, num_speculative_tokens=tokens,
                       prompt_lookup_min=_flag_int(d, "prompt_lookup_min"),
                       prompt_lookup_max=_flag_int(d, "prompt_lookup_max"),
                       disable_by_batch_size=_flag_int(d, "disable_by_batch_size"))


def _flag_int(d: Mapping[str, Any], field: str) -> Any:
    """The pool field that sets engine flag `field` (config.POOL_FLAGS), read from its
    section `d`: within the CRD's range; unset, the flag's default in the field's unit (the
    CRD states it, or a CEL rule fills it in), or None where the flag has none."""
    flag = engine_flag(field)
    pool = flag.pool
    assert pool is not None and pool.minimum is not None and pool.maximum is not None
    assert pool.kind == "integer", f"{pool.path} is a {pool.kind}"
    return int_field(d, pool.key, pool.parent, flag.pool_default, pool.minimum, pool.maximum)


_MIB = 1024 * 1024
MEMORY_MIB_RANGE = (16, 1024 * 1024)  # the deprecated kvCache.memoryMiB's, 16Mi..1Ti


def _kv_cache(kv: Mapping[str, Any]) -> KVCache:
    """spec.engine.kvCache: its size is a block count or bytes, from kvCache.memory (the
    flag table's quantity field) or, deprecated, kvCache.memoryMiB (whole MiB)."""
    pool = engine_flag("kv_cache_memory_bytes").pool
    assert pool is not None and pool.minimum is not None and pool.maximum is not None
    memory = quantity_field(kv, pool.key, pool.parent, pool.minimum, pool.maximum)
    mib = int_field(kv, "memoryMiB", pool.parent, None, *MEMORY_MIB_RANGE)
    if memory is not None and mib is not None:
        raise SpecError(KV_CACHE_SIZES)
    return KVCache(block_size=_flag_int(kv, "block_size"),
                   num_blocks=_flag_int(kv, "num_blocks"),
                   memory_bytes=memory if mib is None else mib * _MIB)


def _flag_decimal(d: Mapping[str, Any], field: str) -> float | None:
    """The decimal-string pool field that sets engine flag `field` (config.POOL_FLAGS), read
    from its section `d` within the flag's own rule; None when unset (the engine's default
    then applies)."""
    flag = engine_flag(field)
    pool = flag.pool
    assert pool is not None and pool.kind == "decimal", f"{field} has no decimal pool field"

    def problem(value: float) -> str | None:
        try:
            flag.check(value)
        except EngineOptionError as exc:
            return exc.limit
        return None

    return decimal_field(d, pool.key, pool.parent, problem, str(flag.default))


def _router_resources(r: Mapping[str, Any]) -> Mapping[str, Any]:
    """spec.router.resources: requests and limits, each the default unless given (as the
    CRD defaults them; `{}` for none)."""
    given = object_field(r, "resources", "spec.router")
    return {part: dict(object_field(given, part, "spec.router.resources")
                       if part in given else DEFAULT_ROUTER_RESOURCES[part])
            for part in ("requests", "limits")}


def parse_pool(body: Mapping[str, Any]) -> PoolSpec:
    """The pool's spec with the CRD's defaults and rules applied (SpecError naming the
    field otherwise). One pass over the spec's sections, in the CRD's order: long on
    purpose, each section a few lines."""
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("spec is required")
    model = object_field(spec, "model", "spec")
    weights = object_field(model, "weights", "spec.model")
    uri = str_field(weights, "uri", "spec.model.weights", None, 1024, min_len=8)
    try:
        checkpoint_path(uri, what="spec.model.weights.uri")
    except WeightsURIError as exc:
        raise SpecError(str(exc)) from None
    version = str_field(weights, "version", "spec.model.weights", None, 63, min_len=1)
    draft_uri = _draft_uri(weights)

    e = object_field(spec, "engine", "spec")
    kv = object_field(e, "kvCache", "spec.engine")
    volumes = _volumes(e)
    engine = EngineSettings(
        image=str_field(e, "image", "spec.engine", default_engine_image(), 512, min_len=1),
        image_pull_policy=str_field(e, "imagePullPolicy", "spec.engine",
                                    _ENGINE.image_pull_policy, 32,
                                    ("Always", "IfNotPresent", "Never")),
        resources=object_field(e, "resources", "spec.engine") or None,
        env=list_field(e, "env", "spec.engine", 64),
        args=_engine_args(e),
        volumes=volumes,
        volume_mounts=volume_mounts(e, "spec.engine", volumes, read_only=True),
        weights_roots=absolute_paths(e, "weightsRoots", "spec.engine", 8),
        init_containers=_init_containers(e, volumes),
        kv_cache=_kv_cache(kv),
        max_num_seqs=_flag_int(e, "max_num_seqs"),
        max_queued_requests=_flag_int(e, "max_queued_requests"),
        max_num_batched_tokens=_flag_int(e, "max_num_batched_tokens"),
        max_model_len=_flag_int(e, "max_model_len"),
        threads=_flag_int(e, "threads"),
        device=EngineDevice(str_field(e, "device", "spec.engine", _ENGINE.device.value, 8,
                                      choices(EngineDevice))),
        dtype=Dtype(str_field(e, "dtype", "spec.engine", _ENGINE.dtype.value, 8,
                              choices(Dtype))),
        kv_cache_dtype=Dtype(str_field(e, "kvCacheDtype", "spec.engine",
                                       _ENGINE.kv_cache_dtype.value, 8, choices(Dtype))),
        quantization=Quantization(str_field(e, "quantization", "spec.engine",
                                            _ENGINE.quantization.value, 8,
                                            choices(Quantization))),
        gpu_memory_utilization=_flag_decimal(e, "gpu_memory_utilization"),
        startup_timeout_seconds=required_int(e, "startupTimeoutSeconds", "spec.engine",
                                             _ENGINE.startup_timeout_seconds, 10, 86400),
        rdma_ipc_lock=bool_field(object_field(e, "rdma", "spec.engine"), "ipcLock",
                                 "spec.engine.rdma", _ENGINE.rdma_ipc_lock),
        speculative=_speculative(e),
        lora=_lora(e))
    _check_tmpvolume_mounts(engine.volume_mounts, "spec.engine")
    for i, c in enumerate(engine.init_containers):
        _check_tmpvolume_mounts(c.volume_mounts, f"spec.engine.initContainers[{i}]")

    r = object_field(spec, "router", "spec")
    svc = object_field(r, "service", "spec.router")
    ro = object_field(spec, "rollout", "spec")
    rf = object_field(spec, "refit", "spec")
    kt = object_field(spec, "kvTransfer", "spec")
    ucx = object_field(kt, "ucx", "spec.kvTransfer")
    pool = PoolSpec(
        name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        model_name=str_field(model, "name", "spec.model", None, 253, min_len=1),
        weights=WeightsRef(uri=uri, version=version),
        draft_uri=draft_uri,
        engine=engine,
        prefill=_role(spec, "prefill"),
        decode=_role(spec, "decode"),
        router=RouterSettings(
            replicas=required_int(r, "replicas", "spec.router", _ROUTER.replicas, 1, 16),
            service_type=str_field(svc, "type", "spec.router.service", _ROUTER.service_type,
                                   32, ("ClusterIP", "NodePort", "LoadBalancer")),
            service_port=required_int(svc, "port", "spec.router.service",
                                      _ROUTER.service_port, 1, 65535),
            api_key_secret=secret_key(r, "apiKeySecret", "spec.router"),
            max_num_requests=int_field(r, "maxNumRequests", "spec.router", None, 1,
                                       1_000_000),
            placement=placement(r, "spec.router"),
            resources=_router_resources(r)),
        rollout=Rollout(
            max_surge=int_or_percent_field(ro, "maxSurge", "spec.rollout",
                                           _ROLLOUT.max_surge, 0, 64),
            max_unavailable=int_or_percent_field(ro, "maxUnavailable", "spec.rollout",
                                                 _ROLLOUT.max_unavailable, 0, 64),
            revision_history_limit=required_int(ro, "revisionHistoryLimit", "spec.rollout",
                                                _ROLLOUT.revision_history_limit, 0, 100),
            progress_deadline_seconds=required_int(ro, "progressDeadlineSeconds",
                                                   "spec.rollout",
                                                   _ROLLOUT.progress_deadline_seconds, 1,
                                                   86400),
            min_ready_seconds=required_int(ro, "minReadySeconds", "spec.rollout",
                                           _ROLLOUT.min_ready_seconds, 0, 3600),
            on_failure=OnFailure(str_field(ro, "onFailure", "spec.rollout",
                                           _ROLLOUT.on_failure, 32, choices(OnFailure)))),
        refit=RefitSettings(
            strategy=RefitStrategy(str_field(rf, "strategy", "spec.refit", _REFIT.strategy,
                                             32, choices(RefitStrategy))),
            inflight=InFlight(str_field(rf, "inflight", "spec.refit", _REFIT.inflight, 32,
                                        choices(InFlight))),
            drain_timeout_seconds=required_int(rf, "drainTimeoutSeconds", "spec.refit",
                                               _REFIT.drain_timeout_seconds, 1, 3600),
            on_failure=OnFailure(str_field(rf, "onFailure", "spec.refit", _REFIT.on_failure,
                                           32, choices(OnFailure))),
            max_perplexity_ratio=decimal_field(object_field(rf, "verify", "spec.refit"),
                                               "maxPerplexityRatio", "spec.refit.verify",
                                               perplexity_ratio_problem, "1.5"),
            min_uncertainty_ratio=decimal_field(object_field(rf, "verify", "spec.refit"),
                                                "minUncertaintyRatio", "spec.refit.verify",
                                                uncertainty_ratio_problem, "0.25",
                                                _REFIT.min_uncertainty_ratio),
            low_memory=bool_field(rf, "lowMemory", "spec.refit", _REFIT.low_memory)),
        kv_transfer=KVTransfer(
            backend=str_field(kt, "backend", "spec.kvTransfer", _KVT.backend, 32, ("NIXL",)),
            pin_ttl_seconds=_flag_int(kt, "kv_pin_ttl_s"),
            ucx_transports=str_field(ucx, "transports", "spec.kvTransfer.ucx",
                                     _KVT.ucx_transports, 256),
            ucx_net_devices=str_field(ucx, "netDevices", "spec.kvTransfer.ucx",
                                      _KVT.ucx_net_devices, 256)),
        network_policy=network_policy_settings(spec),
        pod_monitor=pod_monitor_settings(spec),
        pod=pod_settings(spec, frozenset(str(v.get("name")) for v in engine.volumes
                                         if isinstance(v, Mapping)),
                         frozenset(str(m["mountPath"]).rstrip("/") for m in engine.volume_mounts)),
        autoscaling=autoscaling_settings(spec),
        adapters=_adapters(spec))
    _check_rules(pool)
    _check_engine_config(pool)
    return pool


_BOUNDS = Bounds()  # the planner's defaults are the CRD's (tests/operator_tests/test_crd.py)
_SCALING = Autoscaling(SLO(1.0, 1.0))


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be more than 0"


def autoscaling_settings(spec: Mapping[str, Any]) -> Autoscaling | None:
    """spec.autoscaling as the planner's `Autoscaling`, or None when unset. Each bound is
    the CRD's; `Autoscaling.check` refuses what its CEL rules refuse."""
    if spec.get("autoscaling") is None:
        return None
    path = "spec.autoscaling"
    a = object_field(spec, "autoscaling", "spec")
    slo = object_field(a, "slo", path)
    ratio = object_field(a, "ratio", path)

    def bounds(role: str) -> Bounds:
        b = object_field(a, role, path)
        return Bounds(required_int(b, "minReplicas", f"{path}.{role}", _BOUNDS.min_replicas,
                                   1, 64),
                      required_int(b, "maxReplicas", f"{path}.{role}", _BOUNDS.max_replicas,
                                   1, 64))

    def seconds(key: str) -> float:
        value = decimal_field(slo, key, f"{path}.slo", _positive, "1.5")
        if value is None:
            raise SpecError(f"{path}.slo.{key} is required (a decimal string of seconds)")
        return value

    kv = int_field(slo, "kvUsageCeiling", f"{path}.slo", None, 1, 100)
    queue = int_field(slo, "queueDepth", f"{path}.slo", None, 0, 100000)
    scaling = Autoscaling(
        SLO(seconds("ttftSeconds"), seconds("itlSeconds"),
            required_int(slo, "percentile", f"{path}.slo",
                         round(DEFAULT_PERCENTILE * 100), 50, 99) / 100,
            None if kv is None else kv / 100, None if queue is None else float(queue)),
        bounds("prefill"), bounds("decode"),
        window_seconds=required_int(a, "windowSeconds", path, int(_SCALING.window_seconds),
                                    10, 3600),
        scale_up_stabilization_seconds=required_int(
            a, "scaleUpStabilizationSeconds", path,
            int(_SCALING.scale_up_stabilization_seconds), 0, 3600),
        scale_down_stabilization_seconds=required_int(
            a, "scaleDownStabilizationSeconds", path,
            int(_SCALING.scale_down_stabilization_seconds), 0, 3600),
        max_step=required_int(a, "maxStep", path, _SCALING.max_step, 1, 16),
        min_decode_per_prefill=decimal_field(ratio, "minDecodePerPrefill", f"{path}.ratio",
                                             _positive, "1"),
        max_decode_per_prefill=decimal_field(ratio, "maxDecodePerPrefill", f"{path}.ratio",
                                             _positive, "4"))
    try:
        return scaling.check()
    except AutoscalingError as exc:
        raise SpecError(str(exc)) from None


def _lora(e: Mapping[str, Any]) -> LoRASettings | None:
    """spec.engine.lora, or None when absent (engines start without LoRA)."""
    if e.get("lora") is None:
        return None
    d, path, flags = object_field(e, "lora", "spec.engine"), "spec.engine.lora", LoRASettings()
    return LoRASettings(
        max_loras=required_int(d, "maxLoras", path, flags.max_loras, 1, 64),
        max_lora_rank=required_int(d, "maxLoraRank", path, flags.max_lora_rank, 1, 512),
        max_cpu_loras=int_field(d, "maxCpuLoras", path, None, 1, 4096))


def _adapters(spec: Mapping[str, Any]) -> tuple[AdapterRef, ...]:
    """spec.adapters, each entry's name, version and uri checked as the CRD checks them
    (the uri as the weights' is: file://, pvc:// or oci://)."""
    out: list[AdapterRef] = []
    for i, item in enumerate(list_field(spec, "adapters", "spec", MAX_ADAPTERS)):
        path = f"spec.adapters[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(f"{path} must be an object with name, version and uri")
        name = str_field(item, "name", path, None, 128, min_len=1)
        if not ADAPTER_NAME.match(name):
            raise SpecError(f"{path}.name {name!r}: 1-128 letters, digits and . _ : - "
                            "(starting with a letter or digit); requests name it in `model`")
        if name.startswith(STAGING_PREFIX):
            raise SpecError(f"{path}.name {name!r}: names starting {STAGING_PREFIX!r} are "
                            "the operator's (it verifies an adapter under one before it "
                            "serves); choose another")
        version = str_field(item, "version", path, None, 63, min_len=1)
        if not ADAPTER_VERSION.match(version):
            raise SpecError(f"{path}.version {version!r}: 1-63 letters, digits and . _ - "
                            "(starting and ending with a letter or digit), e.g. 2 or step-1200")
        uri = str_field(item, "uri", path, None, 1024, min_len=8)
        try:
            checkpoint_path(uri, what=f"{path}.uri")
        except WeightsURIError as exc:
            raise SpecError(str(exc)) from None
        if any(a.name == name for a in out):
            raise SpecError(f"{path}.name {name!r} is listed twice in spec.adapters: one "
                            "entry per adapter name (edit its version to change it)")
        out.append(AdapterRef(name, version, uri))
    return tuple(out)


def _check_rules(pool: PoolSpec) -> None:
    """The CRD's cross-field CEL rules, with the CRD's messages."""
    if pool.prefill.replicas > 0 and pool.decode.replicas < 1:
        raise SpecError("decode.replicas must be at least 1 when prefill.replicas > 0")
    if pool.prefill.replicas + pool.decode.replicas < 1:
        raise SpecError("the pool needs at least one engine")
    if _zero(pool.rollout.max_surge) and _zero(pool.rollout.max_unavailable):
        raise SpecError("rollout.maxSurge and rollout.maxUnavailable must not both be 0")
    scaling = pool.autoscaling
    if scaling is not None and not (
            scaling.prefill.min_replicas <= pool.prefill.replicas <= scaling.prefill.max_replicas
            and scaling.decode.min_replicas <= pool.decode.replicas
            <= scaling.decode.max_replicas):
        raise SpecError("with autoscaling, prefill.replicas and decode.replicas must lie "
                        "within their autoscaling minReplicas..maxReplicas")
    kv = pool.engine.kv_cache
    if kv.num_blocks is not None and kv.memory_bytes is not None:
        raise SpecError(KV_CACHE_SIZES)
    if pool.engine.gpu_memory_utilization is not None:
        if pool.engine.device is EngineDevice.CPU:
            raise SpecError(GPU_MEMORY_ON_CPU)
        if kv.num_blocks is not None or kv.memory_bytes is not None:
            raise SpecError(GPU_MEMORY_WITH_KV_SIZE)
    if pool.adapters and pool.engine.lora is None:
        raise SpecError(ADAPTERS_NEED_LORA)
    if any(a.name == pool.model_name for a in pool.adapters):
        raise SpecError(f"spec.adapters: an adapter cannot be named {pool.model_name!r}, "
                        "spec.model.name: requests name the model to run without an adapter")
    speculative = pool.engine.speculative
    drafting = speculative is not None and speculative.method is SpeculativeMethod.DRAFT
    if drafting and pool.draft_uri is None:
        raise SpecError("engine.speculative.method Draft needs model.weights.draft.uri, the "
                        "draft checkpoint")
    if pool.draft_uri is not None and not drafting:
        raise SpecError("model.weights.draft is read only by engine.speculative.method Draft; "
                        "remove it or set that method")


def engine_config(spec: PoolSpec, device: str = DEFAULT_DEVICE,
                  draft_uri: str | None = None) -> EngineConfig:
    """What the pool asks of its engines as the engine's own config, whose flags the
    operator renders (manifests.engine_args): the spec's KV cache, batch limits, pin TTL
    and speculative decoding, on `device`, with the draft checkpoint `draft_uri`."""
    e, s = spec.engine, spec.engine.speculative
    speculative = None if s is None else SpeculativeConfig(
        s.method.flag, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max,
        None if draft_uri is None else checkpoint_path(draft_uri), s.disable_by_batch_size)
    utilization = e.gpu_memory_utilization
    return EngineConfig(
        block_size=e.kv_cache.block_size, num_blocks=e.kv_cache.num_blocks,
        kv_cache_memory_bytes=e.kv_cache.memory_bytes,
        gpu_memory_utilization=(engine_flag("gpu_memory_utilization").default
                                if utilization is None else utilization),
        max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
        max_queued_requests=e.max_queued_requests,
        max_model_len=e.max_model_len, dtype=e.dtype.flag,
        kv_cache_dtype=e.kv_cache_dtype.flag,
        device=device, quantization=e.quantization.flag,
        kv_pin_ttl_s=spec.kv_transfer.pin_ttl_seconds, speculative=speculative)


_POOL_FLAG = {flag.field: flag.pool for flag in POOL_FLAGS if flag.pool is not None}


def _check_engine_config(pool: PoolSpec) -> None:
    """The engine's own rules (EngineConfig.validate, not stated again here) on what the
    pool asks, each refusal naming the pool's fields."""
    try:
        engine_config(pool, draft_uri=pool.draft_uri).validate()
    except EngineOptionError as exc:
        field = _POOL_FLAG.get(exc.field)
        if field is None:
            raise SpecError(f"spec.engine: {exc}") from None
        if exc.floor is not None and exc.floor in _POOL_FLAG:
            low = _POOL_FLAG[exc.floor].key
            raise SpecError(f"spec.{field.path} = {exc.value} is below {low} = "
                            f"{exc.floor_value}: raise {field.key} or lower {low}") from None
        raise SpecError(f"spec.{field.path} = {exc.value!r}: {exc.limit}") from None
