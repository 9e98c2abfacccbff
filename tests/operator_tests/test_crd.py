"""The InferencePool CRD, checked offline the way the API server would treat it.

No API server validates CRD schemas here, so this file does its three jobs itself: apply the
schema's defaults (a small pure default-applier), validate with jsonschema after translating
the OpenAPI v3 subset Kubernetes uses (structural: unknown fields are errors unless a node
preserves them), and evaluate every CEL `x-kubernetes-validations` rule with cel-python. The
examples must pass; broken manifests must fail on the field that is wrong. A structural lint
keeps every field bounded, as the Kubernetes API conventions ask.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
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
    engine_flag,
)
from tandem_engine.fleet.adapters import (
    AdapterEngineRecord,
    AdapterObs,
    AdapterRef,
    AdapterTransaction,
    adapter_set,
)
from tandem_engine.fleet.transaction import Failure, Phase
from tandem_engine.lifecycle import EngineState
from tandem_engine.lora_request import ADAPTER_NAME
from tandem_engine.refit_policy import DEFAULT_DRAIN_TIMEOUT_S, InFlight, OnFailure, RefitStrategy
from tandem_operator.adapters import MESSAGE_LIMIT as ADAPTER_MESSAGE_LIMIT
from tandem_operator.adapters import report as adapter_report
from tandem_operator.autoscale import SLO as PlannerSLO
from tandem_operator.autoscale import Autoscaling, Bounds
from tandem_operator.plan import ADAPTER_CONDITION, CONDITION_TYPES, PodView, condition
from tandem_operator.pod_spec import NetworkPolicySettings
from tandem_operator.spec import (
    ADAPTER_VERSION,
    ADAPTERS_NEED_LORA,
    DEFAULT_MIN_READY_S,
    DEFAULT_PROGRESS_DEADLINE_S,
    DEFAULT_REVISION_HISTORY_LIMIT,
    DEFAULT_ROUTER_RESOURCES,
    DEFAULT_STARTUP_TIMEOUT_S,
    ENGINE_IMAGE_ENV,
    GPU_MEMORY_ON_CPU,
    GPU_MEMORY_WITH_KV_SIZE,
    KV_CACHE_SIZES,
    MAX_ADAPTERS,
    RENDERED_ENGINE_FLAGS,
    Dtype,
    EngineDevice,
    LoRASettings,
    PoolSpec,
    SpecError,
    SpeculativeMethod,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferencepools.tandem.dev.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("inferencepool*.yaml"))

CRD: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
VERSION: dict[str, Any] = CRD["spec"]["versions"][0]
SCHEMA: dict[str, Any] = VERSION["schema"]["openAPIV3Schema"]

# The only nodes allowed to keep fields the schema does not name.
# Volume objects (any volume source) and affinity keep their Kubernetes schemas, not ours.
# spec.pod.overrides is a pod-spec patch: its typed nodes are the ones its CEL rules read.
OVERRIDES_PRESERVED = {"spec.pod.overrides", *(f"spec.pod.overrides.{p}" for p in (
    "metadata", "containers[]", "containers[].ports[]", "containers[].startupProbe",
    "containers[].readinessProbe", "containers[].livenessProbe", "containers[].env[]",
    "containers[].volumeMounts[]", "initContainers[]", "volumes[]"))}
PRESERVE_UNKNOWN_PATHS = {*OVERRIDES_PRESERVED, "spec.prefill.affinity", "spec.decode.affinity",
                          "spec.router.affinity", "status.refit", "status.adapterRefit",
                          "spec.engine.volumes[]"}


# --- the API server's work, offline --------------------------------------------------------------


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of `value` with the schema's defaults filled in, as the API server does.

    A missing property with a `default` gets a copy of it, and the result is defaulted in turn,
    so `default: {}` on an object brings its children's defaults along.
    """
    if isinstance(value, dict):
        out = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in out.keys() - schema.get("properties", {}).keys():
                out[name] = apply_defaults(extra, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def to_jsonschema(node: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Translate a structural OpenAPI v3 schema node into JSON Schema (Draft 2020-12).

    Kubernetes prunes (or, with strict field validation, rejects) fields a structural schema
    does not name, so an object without `x-kubernetes-preserve-unknown-fields` gets
    `additionalProperties: false`. Root `metadata` is the API server's, not ours, to check.
    """
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "default"):
            continue
        if key == "properties":
            out[key] = {
                name: to_jsonschema(sub, f"{path}.{name}".lstrip("."))
                for name, sub in value.items()
            }
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = to_jsonschema(value, f"{path}.*")
        elif key == "items":
            out[key] = to_jsonschema(value, f"{path}[]")
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_jsonschema(sub, path) for sub in value]
        else:
            out[key] = value
    if node.get("nullable"):
        out.pop("nullable")
        out["type"] = [node["type"], "null"]
    is_object = node.get("type") == "object"
    open_object = node.get("x-kubernetes-preserve-unknown-fields") or path == "metadata"
    if is_object and "additionalProperties" not in node and not open_object:
        out["additionalProperties"] = False
    return out


JSON_SCHEMA = to_jsonschema(SCHEMA)
jsonschema.Draft202012Validator.check_schema(JSON_SCHEMA)
VALIDATOR = jsonschema.Draft202012Validator(JSON_SCHEMA)
CEL_ENV = celpy.Environment()


def walk_values(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[str, dict, Any]]:
    """Every (path, schema node, value) pair of a value, the value itself first."""
    yield path, schema, value
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name, sub in value.items():
            sub_schema = props.get(name, extra if isinstance(extra, dict) else None)
            if sub_schema is not None:
                yield from walk_values(sub_schema, sub, f"{path}.{name}".lstrip("."))
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from walk_values(schema["items"], item, f"{path}[{i}]")


def cel_errors(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) of every CEL rule that fails on a defaulted object."""
    errors = []
    for path, node, value in walk_values(SCHEMA, obj, ""):
        for rule in node.get("x-kubernetes-validations", []):
            program = CEL_ENV.program(CEL_ENV.compile(rule["rule"]))
            result = program.evaluate({"self": celpy.json_to_cel(value)})
            if isinstance(result, celpy.CELEvalError):
                raise result
            if not result:
                field = path + rule.get("fieldPath", "")
                errors.append((field, rule["message"]))
    return errors


def list_map_errors(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(item, message) of every item of an `x-kubernetes-list-type: map` list whose keys an
    earlier item has, as the API server refuses it ("Duplicate value")."""
    errors = []
    for path, node, value in walk_values(SCHEMA, obj, ""):
        if node.get("x-kubernetes-list-type") != "map" or not isinstance(value, list):
            continue
        keys, seen = node["x-kubernetes-list-map-keys"], set()
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                value = dict(zip(keys, key, strict=True))
                errors.append((f"{path}[{i}]", f"Duplicate value: {value}"))
            seen.add(key)
    return errors


def validate(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) of everything the API server would reject in a new InferencePool."""
    obj = apply_defaults(SCHEMA, manifest)
    schema_errors = [
        (field_path(error.absolute_path), error.message) for error in VALIDATOR.iter_errors(obj)
    ] + list_map_errors(obj)
    # The API server runs CEL rules only on objects that pass the schema.
    return schema_errors or cel_errors(obj)


def field_path(parts: Iterator[str | int]) -> str:
    """A field as Kubernetes names it in errors: spec.engine.env[0].name."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".")


def minimal_pool(**spec: Any) -> dict[str, Any]:
    base = {"model": {"name": "demo", "weights": {"uri": "file:///models/demo", "version": "v1"}}}
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": merge(base, spec),
    }


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386): None deletes a key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# --- the resource's identity ---------------------------------------------------------------------


def test_names_scope_and_version():
    assert CRD["metadata"]["name"] == "inferencepools.tandem.dev"
    spec = CRD["spec"]
    assert spec["group"] == "tandem.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferencePool"
    assert spec["names"]["plural"] == "inferencepools"
    assert spec["names"]["shortNames"] == ["ipool"]
    assert spec["names"]["categories"] == ["tandem"]
    assert [(v["name"], v["served"], v["storage"]) for v in spec["versions"]] == [
        ("v1alpha1", True, True)
    ]
    # scale: kubectl scale, HPA and KEDA set the decode engines (manifests.SCALED_GROUP)
    assert VERSION["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas", "labelSelectorPath": ".status.selector"}}


def test_printer_columns():
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert [c["name"] for c in VERSION["additionalPrinterColumns"]] == [
        "Prefill", "Prefill-Ready", "Decode", "Decode-Ready", "Weights", "Target", "Refit", "Ready",
        "Adapters", "Endpoint", "Age",
    ]
    assert columns["Prefill"]["jsonPath"] == ".spec.prefill.replicas"
    assert columns["Prefill-Ready"]["jsonPath"] == ".status.prefill.ready"
    assert columns["Decode"]["jsonPath"] == ".spec.decode.replicas"
    assert columns["Decode-Ready"]["jsonPath"] == ".status.decode.ready"
    assert columns["Weights"]["jsonPath"] == ".status.weights.current"
    assert columns["Target"]["jsonPath"] == ".status.weights.target"
    assert columns["Refit"]["jsonPath"] == ".status.refit.phase"
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Adapters"]["jsonPath"] == ".status.adapterSummary"
    assert columns["Age"] == {
        "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp",
    }
    # Every column but Age and Ready names a field the schema has, with a matching type.
    kinds = {"integer": "integer", "string": "string"}
    for column in columns.values():
        if column["name"] in ("Age", "Ready"):
            continue
        node = SCHEMA
        for part in column["jsonPath"].lstrip(".").split("."):
            node = node["properties"][part]
        assert kinds[node["type"]] == column["type"], column


# --- structural lint -----------------------------------------------------------------------------


def walk_schema(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk_schema(sub, f"{path}.{name}".lstrip("."))
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk_schema(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from walk_schema(node["items"], f"{path}[]")


def validator_for(node: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(to_jsonschema(node))


INT_OR_STRING_ANY_OF = [{"type": "integer"}, {"type": "string"}]


def test_every_field_is_bounded():
    problems = []
    for path, node in walk_schema(SCHEMA):
        kind = node.get("type")
        if node.get("x-kubernetes-int-or-string"):
            # The one shape Kubernetes allows `type` inside anyOf for; strings still bounded.
            if node.get("anyOf") != INT_OR_STRING_ANY_OF or "type" in node:
                problems.append(f"{path}: int-or-string must be exactly anyOf integer|string")
            if "maxLength" not in node or "pattern" not in node:
                problems.append(f"{path}: int-or-string needs maxLength and pattern")
            continue
        if "anyOf" in node or "oneOf" in node or "allOf" in node or "not" in node:
            problems.append(f"{path}: logical junctors are not used in this schema")
        if kind is None:
            problems.append(f"{path}: no type (a structural schema types every node)")
        if kind == "number":
            problems.append(f"{path}: type number (no floats in the API)")
        if kind == "string" and "maxLength" not in node and "enum" not in node:
            problems.append(f"{path}: string without maxLength")
        if kind == "array" and "maxItems" not in node:
            problems.append(f"{path}: array without maxItems")
        if kind == "integer" and ("minimum" not in node or "maximum" not in node):
            problems.append(f"{path}: integer without minimum and maximum")
        is_map = kind == "object" and isinstance(node.get("additionalProperties"), dict)
        if is_map and "maxProperties" not in node:
            problems.append(f"{path}: map without maxProperties")
        for value in node.get("enum", []):
            if not (isinstance(value, str) and re.fullmatch(r"[A-Z][A-Za-z0-9]*", value)):
                problems.append(f"{path}: enum value {value!r} is not CamelCase")
        if node.get("x-kubernetes-preserve-unknown-fields") and path not in PRESERVE_UNKNOWN_PATHS:
            problems.append(f"{path}: preserves unknown fields")
        if "default" in node:
            try:
                validator_for(node).validate(apply_defaults(node, node["default"]))
            except jsonschema.ValidationError as exc:
                problems.append(f"{path}: default {node['default']!r} is invalid: {exc.message}")
    assert not problems, "\n".join(problems)


def test_every_property_is_described():
    """`kubectl explain inferencepools.tandem.dev --recursive` has something to say about
    every field."""
    undescribed = [path for path, node in walk_schema(SCHEMA)
                   if path and not path.endswith(("[]", ".*"))
                   and not str(node.get("description", "")).strip()]
    assert undescribed == []


def test_preserved_unknown_fields_are_exactly_the_allowed_ones():
    preserved = {
        path
        for path, node in walk_schema(SCHEMA)
        if node.get("x-kubernetes-preserve-unknown-fields")
    }
    assert preserved == PRESERVE_UNKNOWN_PATHS


def all_cel_rules() -> list[dict[str, str]]:
    return [
        rule for _, node in walk_schema(SCHEMA) for rule in node.get("x-kubernetes-validations", [])
    ]


def test_every_cel_rule_compiles():
    rules = [rule["rule"] for rule in all_cel_rules()]
    assert len(rules) == 34
    for rule in rules:
        CEL_ENV.compile(rule)


# --- defaults ------------------------------------------------------------------------------------

DOCUMENTED_DEFAULTS = {
    "engine": {  # no image: the operator's default (test_engine_image_is_the_operators)
        "imagePullPolicy": "IfNotPresent",
        "kvCache": {"blockSize": 16},
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 512,
        "threads": 1,
        "device": "Auto",
        "dtype": "Auto",
        "kvCacheDtype": "Auto",
        "quantization": "Auto",
        "startupTimeoutSeconds": 1800,
        "rdma": {"ipcLock": False},  # no capability unless asked for
    },
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "router": {"replicas": 1, "service": {"type": "ClusterIP", "port": 8000},
               "resources": {"requests": {"cpu": "500m", "memory": "256Mi"},
                             "limits": {"cpu": "2", "memory": "1Gi"}}},
    "rollout": {"maxSurge": 1, "maxUnavailable": 0, "revisionHistoryLimit": 10,
                "progressDeadlineSeconds": 600, "minReadySeconds": 5,
                "onFailure": "Rollback"},
    "refit": {
        "strategy": "Rolling",
        "inflight": "Drain",
        "drainTimeoutSeconds": 120,
        "onFailure": "Rollback",
        "lowMemory": False,  # new weights beside the old ones unless asked
        "verify": {},  # no perplexity limit unless one is set
    },
    "kvTransfer": {
        "backend": "NIXL",
        "pinTTLSeconds": 60,
        "ucx": {"transports": "", "netDevices": ""},
    },
    # NetworkPolicies unless disabled (inert without a CNI that enforces them); metrics
    # from the pool's namespace
    "networkPolicy": {"enabled": True, "metricsFrom": [{"podSelector": {}}]},
}


def test_minimal_pool_gets_the_documented_defaults():
    manifest = minimal_pool()
    defaulted = apply_defaults(SCHEMA, manifest)
    assert defaulted["spec"] == {"model": manifest["spec"]["model"], **DOCUMENTED_DEFAULTS}
    assert validate(manifest) == []


def test_defaults_fill_in_around_given_fields():
    spec = apply_defaults(SCHEMA, minimal_pool(engine={"kvCache": {"numBlocks": 64}}))["spec"]
    assert spec["engine"]["kvCache"] == {"numBlocks": 64, "blockSize": 16}
    assert spec["engine"]["maxNumSeqs"] == 64
    spec = apply_defaults(SCHEMA, minimal_pool(router={"service": {"port": 80}}))["spec"]
    assert spec["router"] == {"replicas": 1, "service": {"type": "ClusterIP", "port": 80},
                              "resources": DOCUMENTED_DEFAULTS["router"]["resources"]}
    # requests and limits default apart: one given replaces that half alone
    spec = apply_defaults(SCHEMA, minimal_pool(router={"resources": {"limits": {}}}))["spec"]
    assert spec["router"]["resources"] == {
        "limits": {}, "requests": DOCUMENTED_DEFAULTS["router"]["resources"]["requests"]}


def test_defaulting_is_idempotent_and_pure():
    manifest = minimal_pool()
    before = copy.deepcopy(manifest)
    once = apply_defaults(SCHEMA, manifest)
    assert manifest == before
    assert apply_defaults(SCHEMA, once) == once


def schema_node(path: str) -> dict[str, Any]:
    """The schema of a field: `spec.engine.maxNumSeqs`."""
    node = SCHEMA
    for name in path.split("."):
        node = node["properties"][name]
    return node


# The CRD cannot import the engine's defaults or the refit's words, so it states them again;
# these are the constants that own them.
OWNED_DEFAULTS = [
    ("spec.engine.kvCache.blockSize", DEFAULT_BLOCK_SIZE),
    ("spec.engine.maxNumSeqs", DEFAULT_MAX_NUM_SEQS),
    ("spec.engine.maxNumBatchedTokens", DEFAULT_MAX_NUM_BATCHED_TOKENS),
    ("spec.engine.threads", DEFAULT_THREADS),
    ("spec.engine.device", EngineDevice.AUTO.value),
    ("spec.engine.startupTimeoutSeconds", DEFAULT_STARTUP_TIMEOUT_S),
    ("spec.kvTransfer.pinTTLSeconds", DEFAULT_KV_PIN_TTL_S),
    ("spec.refit.drainTimeoutSeconds", DEFAULT_DRAIN_TIMEOUT_S),
    ("spec.refit.strategy", RefitStrategy.ROLLING.value),
    ("spec.refit.inflight", InFlight.DRAIN.value),
    ("spec.refit.onFailure", OnFailure.ROLLBACK.value),
    ("spec.engine.speculative.numSpeculativeTokens", DEFAULT_SPECULATIVE_TOKENS),
    ("spec.rollout.revisionHistoryLimit", DEFAULT_REVISION_HISTORY_LIMIT),
    ("spec.rollout.progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE_S),
    ("spec.rollout.minReadySeconds", DEFAULT_MIN_READY_S),
    ("spec.rollout.onFailure", OnFailure.ROLLBACK.value),
    ("spec.engine.dtype", Dtype.AUTO.value),
    ("spec.networkPolicy.enabled", NetworkPolicySettings().enabled),
    ("spec.router.resources.requests", DEFAULT_ROUTER_RESOURCES["requests"]),
    ("spec.router.resources.limits", DEFAULT_ROUTER_RESOURCES["limits"]),
    ("spec.engine.lora.maxLoras", engine_flag("max_loras").default),
    ("spec.engine.lora.maxLoraRank", engine_flag("max_lora_rank").default),
]
OWNED_ENUMS = [
    ("spec.engine.dtype", Dtype),
    ("spec.engine.device", EngineDevice),
    ("spec.engine.speculative.method", SpeculativeMethod),
    ("spec.refit.strategy", RefitStrategy),
    ("spec.refit.inflight", InFlight),
    ("spec.refit.onFailure", OnFailure),
    ("spec.rollout.onFailure", OnFailure),  # a failed rollout's words are a failed refit's
    ("status.refit.strategy", RefitStrategy),
    ("status.refit.inflight", InFlight),
    ("status.refit.phase", Phase),
    ("status.adapterRefit.phase", Phase),
    ("status.adapterRefit.strategy", RefitStrategy),
    ("status.adapterRefit.on_failure", OnFailure),
]


@pytest.mark.parametrize(("path", "constant"), OWNED_DEFAULTS, ids=[p for p, _ in OWNED_DEFAULTS])
def test_crd_defaults_are_the_engines_and_the_refits(path: str, constant: Any):
    assert schema_node(path)["default"] == constant


def test_engine_image_is_the_operators():
    """No image is written into pools: the operator's TANDEM_ENGINE_IMAGE (the chart's)
    applies when spec.engine.image is unset, so pools follow the release that runs them."""
    node = schema_node("spec.engine.image")
    assert "default" not in node
    assert ENGINE_IMAGE_ENV in node["description"]


# The engine's limits (SpeculativeConfig.validate, the LoRA flags'), stated again as the
# schema's bounds.
OWNED_LIMITS = [
    ("spec.engine.speculative.numSpeculativeTokens", 1, MAX_SPECULATIVE_TOKENS),
    ("spec.engine.speculative.promptLookupMin", 1, MAX_PROMPT_LOOKUP),
    ("spec.engine.speculative.promptLookupMax", 1, MAX_PROMPT_LOOKUP),
    *((f"spec.engine.lora.{key}", engine_flag(field).minimum, engine_flag(field).maximum)
      for key, field in (("maxLoras", "max_loras"), ("maxLoraRank", "max_lora_rank"),
                         ("maxCpuLoras", "max_cpu_loras"))),
]


@pytest.mark.parametrize(("path", "low", "high"), OWNED_LIMITS, ids=[p for p, *_ in OWNED_LIMITS])
def test_crd_limits_are_the_engines(path: str, low: int, high: int):
    node = schema_node(path)
    assert (node["minimum"], node["maximum"]) == (low, high)


def test_the_prompt_lookup_rule_uses_the_engines_defaults():
    """The CEL rule comparing promptLookupMin and promptLookupMax fills in the defaults the
    schema cannot set (they are refused for methods other than Ngram)."""
    (rule,) = [r["rule"] for r in schema_node("spec.engine.speculative")[
        "x-kubernetes-validations"] if "<=" in r["rule"]]
    assert f": {DEFAULT_PROMPT_LOOKUP_MIN})" in rule
    assert f": {DEFAULT_PROMPT_LOOKUP_MAX})" in rule


@pytest.mark.parametrize(("path", "kind"), OWNED_ENUMS, ids=[p for p, _ in OWNED_ENUMS])
def test_crd_enums_are_the_refits(path: str, kind: type):
    assert schema_node(path)["enum"] == [member.value for member in kind]


def test_condition_types_are_the_ones_the_operator_writes():
    node = schema_node("status.conditions")["items"]["properties"]["type"]
    assert node["enum"] == [*CONDITION_TYPES, ADAPTER_CONDITION]


def test_lora_is_off_unless_set_and_defaults_to_the_engines_slots():
    """No default: a pool without engine.lora starts its engines without --enable-lora. Set
    (even empty), its slots are the engine's flag defaults, --max-cpu-loras the engine's own
    (maxLoras) unless given."""
    assert "default" not in schema_node("spec.engine.lora")
    assert "default" not in schema_node("spec.engine.lora.maxCpuLoras")
    assert engine_flag("max_cpu_loras").default is None
    assert PoolSpec.from_body(minimal_pool()).engine.lora is None
    body = minimal_pool(engine={"lora": {}})
    defaulted = apply_defaults(SCHEMA, body)
    assert defaulted["spec"]["engine"]["lora"] == {"maxLoras": 1, "maxLoraRank": 16}
    assert validate(body) == []
    assert PoolSpec.from_body(body).engine.lora == PoolSpec.from_body(defaulted).engine.lora \
        == LoRASettings(engine_flag("max_loras").default, engine_flag("max_lora_rank").default)
    given = minimal_pool(engine={"lora": {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 32}})
    assert validate(given) == []
    assert PoolSpec.from_body(given).engine.lora == LoRASettings(4, 64, 32)


# --- the examples --------------------------------------------------------------------------------


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def test_examples_exist():
    assert [p.name for p in EXAMPLES] == [
        "inferencepool-autoscaling.yaml", "inferencepool-gpu.yaml", "inferencepool-lora.yaml",
        "inferencepool-mixed.yaml", "inferencepool-rl.yaml", "inferencepool.yaml",
    ]


def test_lora_example_serves_adapters_from_one_mounted_claim():
    from tandem_operator import manifests as m

    pool = PoolSpec.from_body(load_example("inferencepool-lora.yaml"))
    assert [a.identity for a in pool.adapters] == ["sql@1", "support@1"]
    pod = m.pod(pool, "decode", pool.weights, 0, pool.adapters)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == ["adapters"]  # one volume for both adapters
    args = pod["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and args[args.index("--max-loras") + 1] == "4"


def test_gpu_example_asks_for_a_gpu_per_engine_on_gpu_nodes_with_rdma():
    from tandem_operator import manifests as m

    manifest = load_example("inferencepool-gpu.yaml")
    pool = PoolSpec.from_body({**manifest, "metadata": {**manifest["metadata"],
                                                        "namespace": "llm"}})
    for group in ("prefill", "decode"):
        pod = m.pod(pool, group, pool.weights)
        (engine,) = pod["spec"]["containers"]
        assert engine["image"].endswith("-cu13")  # `make images CUDA=13`
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert engine["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        args = engine["args"]
        assert args[args.index("--device") + 1] == "cuda"
        assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc,tcp"} in engine["env"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod["spec"]["tolerations"]
        assert pod["spec"]["volumes"][-1]["persistentVolumeClaim"]["claimName"] == "models"
    router = m.pod(pool, "router", pool.weights)
    assert "tolerations" not in router["spec"]  # the router stays off the GPU nodes


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_a_valid_pool(path: Path):
    manifest = yaml.safe_load(path.read_text())
    assert manifest["apiVersion"] == "tandem.dev/v1alpha1"
    assert manifest["kind"] == "InferencePool"
    assert validate(manifest) == []


def test_disaggregated_example():
    spec = apply_defaults(SCHEMA, load_example("inferencepool.yaml"))["spec"]
    replicas = [spec[role]["replicas"] for role in ("prefill", "decode", "router")]
    assert replicas == [1, 1, 1]
    # It serves the real model, which an init container pulls where weights.uri points.
    assert spec["model"]["weights"]["uri"] == "file:///models/smollm2-135m-instruct.gguf"
    (init,) = spec["engine"]["initContainers"]
    assert init["command"] == ["tandem", "models", "pull", "smollm2-135m-instruct",
                               "/models/smollm2-135m-instruct.gguf"]
    assert [v["name"] for v in spec["engine"]["volumes"]] == ["models"]
    assert "emptyDir" in spec["engine"]["volumes"][0]


def test_autoscaling_example_leaves_replicas_to_the_planner():
    manifest = load_example("inferencepool-autoscaling.yaml")
    assert "replicas" not in manifest["spec"].get("prefill", {})
    assert "replicas" not in manifest["spec"].get("decode", {})
    pool = PoolSpec.from_body({**manifest, "metadata": {**manifest["metadata"],
                                                        "namespace": "default"}})
    assert pool.autoscaling is not None and pool.autoscaling.decode.max_replicas == 8
    assert pool.autoscaling.slo.ttft_seconds == 0.5


@pytest.mark.parametrize("name", ["hpa.yaml", "keda-scaledobject.yaml"])
def test_hpa_and_keda_examples_drive_the_pools_scale_subresource(name: str):
    target = load_example(name)["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("tandem.dev/v1alpha1", "InferencePool")
    version = next(v for v in CRD["spec"]["versions"] if v["name"] == "v1alpha1")
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.decode.replicas"
    assert scale["labelSelectorPath"] == ".status.selector"


def test_mixed_example_is_colocated():
    spec = apply_defaults(SCHEMA, load_example("inferencepool-mixed.yaml"))["spec"]
    assert spec["prefill"]["replicas"] == 0
    assert spec["decode"]["replicas"] >= 1


def test_rl_example_refits_all_at_once_and_recomputes():
    spec = apply_defaults(SCHEMA, load_example("inferencepool-rl.yaml"))["spec"]
    assert spec["refit"]["strategy"] == "AllAtOnce"
    assert spec["refit"]["inflight"] == "Recompute"


# --- rejected manifests --------------------------------------------------------------------------

SQL = {"name": "sql", "version": "2", "uri": "file:///adapters/sql-v2"}


def adapters(*items: dict[str, Any]) -> dict[str, Any]:
    """A patch serving `items` as spec.adapters, with the LoRA slots they need."""
    return {"engine": {"lora": {"maxLoras": 4}}, "adapters": list(items)}


SCHEMA_REJECTS = [
    # out-of-bounds integers
    ({"prefill": {"replicas": 65}}, "spec.prefill.replicas", "maximum of 64"),
    ({"decode": {"replicas": -1}}, "spec.decode.replicas", "minimum of 0"),
    ({"router": {"replicas": 0}}, "spec.router.replicas", "minimum of 1"),
    ({"router": {"service": {"port": 70000}}}, "spec.router.service.port", "maximum of 65535"),
    ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs", "minimum of 1"),
    ({"engine": {"kvCache": {"blockSize": 512}}}, "spec.engine.kvCache.blockSize", "maximum"),
    ({"engine": {"kvCache": {"memoryMiB": 8}}}, "spec.engine.kvCache.memoryMiB", "minimum"),
    # kvCache.memory is a quantity; engine.maxModelLen, dtype and gpuMemoryUtilization
    ({"engine": {"kvCache": {"memory": "12Q"}}}, "spec.engine.kvCache.memory", "match"),
    ({"engine": {"kvCache": {"memory": "-1Gi"}}}, "spec.engine.kvCache.memory", "match"),
    ({"engine": {"kvCache": {"memory": "2 Gi"}}}, "spec.engine.kvCache.memory", "match"),
    ({"engine": {"kvCache": {"memory": 1.5}}}, "spec.engine.kvCache.memory",
     "is not valid under any of the given schemas"),
    ({"engine": {"maxModelLen": 8}}, "spec.engine.maxModelLen", "minimum of 16"),
    ({"engine": {"maxModelLen": 2**20 + 1}}, "spec.engine.maxModelLen", "maximum"),
    ({"engine": {"dtype": "bfloat16"}}, "spec.engine.dtype", "is not one of"),
    ({"engine": {"gpuMemoryUtilization": "1.5"}}, "spec.engine.gpuMemoryUtilization", "match"),
    ({"engine": {"gpuMemoryUtilization": "0"}}, "spec.engine.gpuMemoryUtilization", "match"),
    ({"engine": {"gpuMemoryUtilization": "0.0"}}, "spec.engine.gpuMemoryUtilization", "match"),
    ({"engine": {"gpuMemoryUtilization": ".9"}}, "spec.engine.gpuMemoryUtilization", "match"),
    ({"engine": {"gpuMemoryUtilization": 0.9}}, "spec.engine.gpuMemoryUtilization",
     "is not of type 'string'"),
    # router resources are quantities, as an engine's
    ({"router": {"resources": {"requests": {"cpu": "half"}}}},
     "spec.router.resources.requests.cpu", "match"),
    ({"router": {"resources": {"limit": {"cpu": "2"}}}}, "spec.router.resources", "unexpected"),
    # pod.overrides: its containers, init containers and volumes are named
    ({"pod": {"overrides": {"containers": [{"env": []}]}}},
     "spec.pod.overrides.containers[0]", "'name' is a required property"),
    ({"pod": {"overrides": {"volumes": [{"emptyDir": {}}]}}},
     "spec.pod.overrides.volumes[0]", "'name' is a required property"),
    ({"refit": {"drainTimeoutSeconds": 0}}, "spec.refit.drainTimeoutSeconds", "minimum of 1"),
    ({"kvTransfer": {"pinTTLSeconds": 3601}}, "spec.kvTransfer.pinTTLSeconds", "maximum"),
    ({"rollout": {"maxSurge": 65}}, "spec.rollout.maxSurge", "maximum of 64"),
    ({"rollout": {"maxSurge": "150x"}}, "spec.rollout.maxSurge", "does not match"),
    ({"rollout": {"maxUnavailable": "101%"}}, "spec.rollout.maxUnavailable", "does not match"),
    ({"rollout": {"maxUnavailable": "05%"}}, "spec.rollout.maxUnavailable", "does not match"),
    ({"rollout": {"maxSurge": "1000%"}}, "spec.rollout.maxSurge", "is too long"),
    ({"rollout": {"revisionHistoryLimit": 101}}, "spec.rollout.revisionHistoryLimit",
     "maximum of 100"),
    ({"rollout": {"minReadySeconds": 3601}}, "spec.rollout.minReadySeconds",
     "maximum of 3600"),
    ({"rollout": {"progressDeadlineSeconds": 0}}, "spec.rollout.progressDeadlineSeconds",
     "minimum of 1"),
    ({"rollout": {"onFailure": "Pause"}}, "spec.rollout.onFailure", "is not one of"),
    # no floats
    ({"prefill": {"replicas": 1.5}}, "spec.prefill.replicas", "is not of type 'integer'"),
    # bad enums (CamelCase is part of the value)
    ({"refit": {"strategy": "rolling"}}, "spec.refit.strategy", "is not one of"),
    ({"refit": {"inflight": "Abort"}}, "spec.refit.inflight", "is not one of"),
    ({"refit": {"onFailure": "Retry"}}, "spec.refit.onFailure", "is not one of"),
    ({"engine": {"imagePullPolicy": "always"}}, "spec.engine.imagePullPolicy", "is not one of"),
    ({"router": {"service": {"type": "ExternalName"}}},
     "spec.router.service.type", "is not one of"),
    ({"kvTransfer": {"backend": "TCP"}}, "spec.kvTransfer.backend", "is not one of"),
    ({"engine": {"quantization": "Int3"}}, "spec.engine.quantization", "is not one of"),
    ({"engine": {"quantization": "int8"}}, "spec.engine.quantization", "is not one of"),
    # the weights version
    ({"model": {"weights": {"version": "v1 beta"}}}, "spec.model.weights.version", "match"),
    ({"model": {"weights": {"version": "-v1"}}}, "spec.model.weights.version", "match"),
    ({"model": {"weights": {"version": "v1."}}}, "spec.model.weights.version", "match"),
    ({"model": {"weights": {"version": "v" * 64}}}, "spec.model.weights.version", "too long"),
    ({"model": {"weights": {"version": ""}}}, "spec.model.weights.version", "should be non-empty"),
    # required fields
    ({"model": {"weights": None}}, "spec.model", "'weights' is a required property"),
    ({"model": {"name": None}}, "spec.model", "'name' is a required property"),
    ({"model": {"weights": {"uri": "file://"}}}, "spec.model.weights.uri", "is too short"),
    # unknown fields: the schema is structural, typos are errors, not silently dropped
    ({"prefil": {"replicas": 2}}, "spec", "'prefil' was unexpected"),
    ({"engine": {"imagePullPolicyy": "Always"}},
     "spec.engine", "'imagePullPolicyy' was unexpected"),
    ({"model": {"weights": {"sha256": "ab"}}}, "spec.model.weights", "'sha256' was unexpected"),
    ({"refit": {"strategy": "Rolling", "waves": 2}}, "spec.refit", "'waves' was unexpected"),
    # strings, lists and maps are bounded
    ({"engine": {"args": ["--x"] * 65}}, "spec.engine.args", "is too long"),
    ({"engine": {"args": ["x" * 257]}}, "spec.engine.args[0]", "is too long"),
    ({"prefill": {"nodeSelector": {f"k{i}": "v" for i in range(33)}}},
     "spec.prefill.nodeSelector", "too many properties"),
    ({"engine": {"env": [{"name": "1BAD", "value": "x"}]}}, "spec.engine.env[0].name", "match"),
    ({"decode": {"tolerations": [{"operator": "In"}]}},
     "spec.decode.tolerations[0].operator", "is not one of"),
    # resource quantities are int-or-string with a quantity pattern
    ({"engine": {"resources": {"limits": {"cpu": "2 cores"}}}},
     "spec.engine.resources.limits.cpu", "match"),
    ({"engine": {"resources": {"limit": {"cpu": "2"}}}}, "spec.engine.resources", "unexpected"),
    ({"decode": {"resources": {"requests": {"memory": 1.5}}}},
     "spec.decode.resources.requests.memory", "is not valid under any of the given schemas"),
    # init containers: bounded, typed, a command each
    ({"engine": {"initContainers": [{"name": "pull"}]}},
     "spec.engine.initContainers[0]", "'command' is a required property"),
    ({"engine": {"initContainers": [{"name": f"c{i}", "command": ["true"]} for i in range(5)]}},
     "spec.engine.initContainers", "is too long"),
    ({"engine": {"initContainers": [{"name": "Pull", "command": ["true"]}]}},
     "spec.engine.initContainers[0].name", "match"),
    ({"engine": {"initContainers": [{"name": "pull", "command": []}]}},
     "spec.engine.initContainers[0].command", "should be non-empty"),
    ({"engine": {"initContainers": [{"name": "pull", "command": ["x"], "securityContext": {}}]}},
     "spec.engine.initContainers[0]", "'securityContext' was unexpected"),
    # start-up, RDMA and the pod-level fields
    ({"engine": {"startupTimeoutSeconds": 5}}, "spec.engine.startupTimeoutSeconds", "minimum"),
    ({"engine": {"startupTimeoutSeconds": 86401}}, "spec.engine.startupTimeoutSeconds",
     "maximum"),
    ({"engine": {"rdma": {"ipcLock": "yes"}}}, "spec.engine.rdma.ipcLock", "'boolean'"),
    ({"engine": {"rdma": {"sysAdmin": True}}}, "spec.engine.rdma", "'sysAdmin' was unexpected"),
    ({"pod": {"imagePullSecrets": [{"name": "Regcred"}]}},
     "spec.pod.imagePullSecrets[0].name", "match"),
    ({"pod": {"imagePullSecrets": [{"name": f"r{i}"} for i in range(9)]}},
     "spec.pod.imagePullSecrets", "is too long"),
    ({"pod": {"labels": {"team": "x" * 64}}}, "spec.pod.labels.team", "is too long"),
    ({"pod": {"labels": {"team": "a b"}}}, "spec.pod.labels.team", "match"),
    ({"pod": {"annotations": {f"k{i}": "v" for i in range(33)}}},
     "spec.pod.annotations", "too many properties"),
    ({"pod": {"priorityClassName": "High"}}, "spec.pod.priorityClassName", "match"),
    ({"pod": {"runtimeClassName": ""}}, "spec.pod.runtimeClassName", "should be non-empty"),
    ({"pod": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}},
     "spec.pod.topologySpreadConstraints[0]", "'whenUnsatisfiable' is a required property"),
    ({"pod": {"topologySpreadConstraints": [
        {"maxSkew": 0, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]}},
     "spec.pod.topologySpreadConstraints[0].maxSkew", "minimum of 1"),
    ({"pod": {"hostNetwork": True}}, "spec.pod", "'hostNetwork' was unexpected"),
    ({"router": {"tolerations": [{"operator": "In"}]}},
     "spec.router.tolerations[0].operator", "is not one of"),
    ({"router": {"nodeSelector": {f"k{i}": "v" for i in range(33)}}},
     "spec.router.nodeSelector", "too many properties"),
    # speculative decoding: the engine's limits, a method named
    ({"engine": {"speculative": {"method": "Ngram", "numSpeculativeTokens": 17}}},
     "spec.engine.speculative.numSpeculativeTokens", "maximum of 16"),
    ({"engine": {"speculative": {"method": "Ngram", "numSpeculativeTokens": 0}}},
     "spec.engine.speculative.numSpeculativeTokens", "minimum of 1"),
    ({"engine": {"speculative": {"method": "Ngram", "promptLookupMax": 65}}},
     "spec.engine.speculative.promptLookupMax", "maximum of 64"),
    ({"engine": {"speculative": {"method": "ngram"}}},
     "spec.engine.speculative.method", "is not one of"),
    ({"engine": {"speculative": {"method": "Ngram", "disableByBatchSize": 0}}},
     "spec.engine.speculative.disableByBatchSize", "minimum of 1"),
    ({"engine": {"speculative": {"numSpeculativeTokens": 4}}},
     "spec.engine.speculative", "'method' is a required property"),
    ({"engine": {"speculative": {"method": "Ngram", "temperature": 1}}},
     "spec.engine.speculative", "'temperature' was unexpected"),
    ({"model": {"weights": {"draft": {}}}, "engine": {"speculative": {"method": "Draft"}}},
     "spec.model.weights.draft", "'uri' is a required property"),
    ({"model": {"weights": {"draft": {"uri": "file://"}}},
      "engine": {"speculative": {"method": "Draft"}}},
     "spec.model.weights.draft.uri", "is too short"),
    # LoRA: the engine's slot limits; each adapter named, versioned and found as weights are
    ({"engine": {"lora": {"maxLoras": 0}}}, "spec.engine.lora.maxLoras", "minimum of 1"),
    ({"engine": {"lora": {"maxLoras": 65}}}, "spec.engine.lora.maxLoras", "maximum of 64"),
    ({"engine": {"lora": {"maxLoras": 2.5}}}, "spec.engine.lora.maxLoras",
     "is not of type 'integer'"),
    ({"engine": {"lora": {"maxLoraRank": 0}}}, "spec.engine.lora.maxLoraRank", "minimum of 1"),
    ({"engine": {"lora": {"maxLoraRank": 513}}}, "spec.engine.lora.maxLoraRank",
     "maximum of 512"),
    ({"engine": {"lora": {"maxCpuLoras": 0}}}, "spec.engine.lora.maxCpuLoras", "minimum of 1"),
    ({"engine": {"lora": {"maxCpuLoras": 4097}}}, "spec.engine.lora.maxCpuLoras",
     "maximum of 4096"),
    ({"engine": {"lora": {"slots": 4}}}, "spec.engine.lora", "'slots' was unexpected"),
    (adapters({**SQL, "name": "-sql"}), "spec.adapters[0].name", "match"),
    (adapters({**SQL, "name": "my sql"}), "spec.adapters[0].name", "match"),
    (adapters({**SQL, "name": "org/sql"}), "spec.adapters[0].name", "match"),
    (adapters({**SQL, "name": "a" * 129}), "spec.adapters[0].name", "is too long"),
    (adapters({**SQL, "name": ""}), "spec.adapters[0].name", "should be non-empty"),
    (adapters({**SQL, "version": "v2."}), "spec.adapters[0].version", "match"),
    (adapters({**SQL, "version": "v 2"}), "spec.adapters[0].version", "match"),
    (adapters({**SQL, "version": "v" * 64}), "spec.adapters[0].version", "is too long"),
    (adapters({**SQL, "version": ""}), "spec.adapters[0].version", "should be non-empty"),
    (adapters({**SQL, "version": 2}), "spec.adapters[0].version", "is not of type 'string'"),
    (adapters({**SQL, "uri": "file://"}), "spec.adapters[0].uri", "is too short"),
    (adapters({**SQL, "uri": "file:///" + "a" * 1017}), "spec.adapters[0].uri", "is too long"),
    (adapters({"name": "sql", "version": "2"}), "spec.adapters[0]",
     "'uri' is a required property"),
    (adapters({"name": "sql", "uri": SQL["uri"]}), "spec.adapters[0]",
     "'version' is a required property"),
    (adapters({"version": "2", "uri": SQL["uri"]}), "spec.adapters[0]",
     "'name' is a required property"),
    (adapters({**SQL, "rank": 8}), "spec.adapters[0]", "'rank' was unexpected"),
    (adapters(*({**SQL, "name": f"a{i}"} for i in range(MAX_ADAPTERS + 1))), "spec.adapters",
     "is too long"),
    # a list-map keyed by name: one entry per adapter
    (adapters(SQL, {**SQL, "version": "3"}), "spec.adapters[1]", "Duplicate value"),
]


@pytest.mark.parametrize(("patch", "field", "message"), SCHEMA_REJECTS)
def test_schema_rejects(patch: dict[str, Any], field: str, message: str):
    errors = validate(minimal_pool(**patch))
    assert any(f == field and message in m for f, m in errors), errors


def test_schema_accepts_what_it_should():
    accepted = [
        {"engine": {"resources": {"limits": {"cpu": 2, "memory": "4Gi", "nvidia.com/gpu": "1"},
                                  "requests": {"cpu": "500m"}}}},
        {"engine": {"env": [
            {"name": "HF_HOME", "value": "/tmp/hf"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ]}},
        {"prefill": {"affinity": {"nodeAffinity": {"anything": ["goes", "here"]}}}},
        {"decode": {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
        {"model": {"weights": {"version": "step-1200.ckpt_2"}}},
        {"model": {"weights": {"version": "7"}}},
        {"engine": {"startupTimeoutSeconds": 7200, "rdma": {"ipcLock": True}}},
        {"pod": {"imagePullSecrets": [{"name": "regcred"}],
                 "labels": {"team": "ml", "app.kubernetes.io/version": "1.2"},
                 "annotations": {"example.com/owner": "ml team"},
                 "priorityClassName": "inference-high", "runtimeClassName": "nvidia",
                 "topologySpreadConstraints": [{
                     "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                     "whenUnsatisfiable": "ScheduleAnyway", "matchLabelKeys": ["pod-x"],
                     "labelSelector": {"matchLabels": {"tandem.dev/pool": "demo"}}}]}},
        {"router": {"nodeSelector": {"pool": "cpu"}, "affinity": {"podAntiAffinity": {}},
                    "tolerations": [{"key": "cpu", "operator": "Exists"}]}},
        {"prefill": {"replicas": 0}, "decode": {"replicas": 1}},
        {"rollout": {"maxSurge": 0, "maxUnavailable": 1}},
        {"rollout": {"maxSurge": "25%", "maxUnavailable": "0%"}},
        {"rollout": {"maxSurge": 0, "maxUnavailable": "100%", "revisionHistoryLimit": 0,
                     "progressDeadlineSeconds": 86400, "onFailure": "Halt"}},
        {"engine": {"speculative": {"method": "Ngram"}}},
        {"engine": {"speculative": {"method": "Ngram", "numSpeculativeTokens": 16,
                                    "promptLookupMin": 1, "promptLookupMax": 64}}},
        {"engine": {"speculative": {"method": "MTP", "numSpeculativeTokens": 2,
                                    "disableByBatchSize": 4}}},
        {"engine": {"speculative": {"method": "Draft"}, "args": ["--kernels", "torch"]},
         "model": {"weights": {"draft": {"uri": "file:///models/demo-draft"}}}},
        {"engine": {"kvCache": {"memory": "8Gi"}, "maxModelLen": 8192, "dtype": "BFloat16"}},
        {"engine": {"kvCache": {"memory": 536870912}, "dtype": "Float16"}},
        {"engine": {"device": "CUDA", "gpuMemoryUtilization": "0.85"}},
        {"engine": {"gpuMemoryUtilization": "1"}},
        {"engine": {"gpuMemoryUtilization": "1.0"}},
        {"engine": {"gpuMemoryUtilization": "0.05"}},
        {"router": {"resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {}}}},
        {"engine": {"volumes": [{"name": "models", "emptyDir": {}}]},
         "pod": {"overrides": {
             "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
             "shareProcessNamespace": True,
             "securityContext": {"fsGroup": 65532},
             "tolerations": [{"key": "spot", "operator": "Exists"}],
             "containers": [
                 {"name": "engine", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                  "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                  "securityContext": {"readOnlyRootFilesystem": True}},
                 {"name": "router", "resources": {"limits": {"memory": "2Gi"}}},
                 {"name": "shipper", "image": "fluent/fluent-bit:3", "args": ["-c", "/x"],
                  "ports": [{"containerPort": 2020}],
                  "volumeMounts": [{"name": "tandem-tmp", "mountPath": "/logs"}]}],
             "volumes": [{"name": "scratch", "emptyDir": {}}],
             "initContainers": [{"name": "warm", "image": "busybox:1", "command": ["true"]}]}}},
        {"engine": {"lora": {}}},
        {"engine": {"lora": {"maxLoras": 64, "maxLoraRank": 512, "maxCpuLoras": 4096}}},
        {"adapters": []},  # no adapters need no LoRA slots
        adapters(SQL, {"name": "Org:chat_v1.2-x", "version": "step-1200.ckpt_2",
                       "uri": "pvc://adapters/chat"},
                 {"name": "7", "version": "7", "uri": "oci://registry.example.com/sql:2"}),
        adapters(*({**SQL, "name": f"a{i}"} for i in range(MAX_ADAPTERS))),
        {"engine": {"volumes": [{"name": "models", "emptyDir": {}}],
                    "initContainers": [{"name": "pull", "image": "busybox:1", "command": ["sh"],
                                        "args": ["-c", "true"],
                                        "env": [{"name": "PIP_INDEX_URL", "value": "http://x"}],
                                        "volumeMounts": [{"name": "models",
                                                          "mountPath": "/models"}]}]}},
    ]
    for patch in accepted:
        assert validate(minimal_pool(**patch)) == [], patch


def test_pool_name_fits_every_derived_name():
    for name in ("a" * 41, "Demo", "1pool", "my.pool", "pool-"):
        manifest = minimal_pool()
        manifest["metadata"]["name"] = name
        assert [f for f, _ in validate(manifest)] == ["metadata.name"], name
    manifest = minimal_pool()
    manifest["metadata"]["name"] = "a" * 40
    assert validate(manifest) == []


def test_status_is_bounded_too():
    manifest = minimal_pool()
    manifest["status"] = {
        "observedGeneration": 3,
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllEnginesReady",
                        "message": "", "observedGeneration": 3,
                        "lastTransitionTime": "2025-01-01T00:00:00Z"}],
        "prefill": {"replicas": 1, "ready": 1, "updated": 1},
        "weights": {"current": "v1", "target": "v1", "epoch": 0},
        "routerEndpoint": "http://demo.default.svc:8000/v1",
        "selector": "tandem.dev/pool=demo,app.kubernetes.io/component=decode",
        # The operator's transaction record: named fields are checked, the rest is kept.
        "refit": {"phase": "Progressing", "epoch": 2, "wave": 1, "strategy": "Rolling",
                  "target": {"uri": "file:///models/v2", "version": "v2"},
                  "previous": {"uri": "file:///models/v1", "version": "v1"},
                  "progress": "1/2 engines serve v2", "started_at": 1700000000.5,
                  "engines": {"demo-prefill-abcde": {"step": "refit", "since": 1700000001.25,
                                                     "version": "v1", "verified": False}},
                  "canary": {"v2": [5, 6, 7, 8]}},
    }
    assert validate(manifest) == []
    # Conditions are metav1.Conditions: these five fields are required, reason is one word.
    for field in ("type", "status", "reason", "message", "lastTransitionTime"):
        broken = copy.deepcopy(manifest)
        del broken["status"]["conditions"][0][field]
        assert validate(broken) == [
            ("status.conditions[0]", f"'{field}' is a required property")], field
    broken = copy.deepcopy(manifest)
    broken["status"]["conditions"][0]["reason"] = ""
    assert {f for f, _ in validate(broken)} == {"status.conditions[0].reason"}
    manifest["status"]["conditions"][0]["type"] = "Healthy"
    manifest["status"]["conditions"][0]["reason"] = "all engines ready"
    manifest["status"]["refit"]["phase"] = "Idle"
    assert {f for f, _ in validate(manifest)} == {
        "status.conditions[0].type", "status.conditions[0].reason", "status.refit.phase",
    }


# --- CEL rules -----------------------------------------------------------------------------------

VALUE_FROM_ONE_SOURCE = (
    "env valueFrom needs exactly one of fieldRef, secretKeyRef, configMapKeyRef, resourceFieldRef"
)
DRAFT_NEEDED = ("engine.speculative.method Draft needs model.weights.draft.uri, the draft "
                "checkpoint")
DRAFT_UNREAD = ("model.weights.draft is read only by engine.speculative.method Draft; remove "
                "it or set that method")
LOOKUP_NGRAM_ONLY = ("speculative.promptLookupMin and promptLookupMax apply to method Ngram "
                     "only; remove them")
LOOKUP_ORDER = ("speculative.promptLookupMax must be at least promptLookupMin (defaults 2 and "
                "4): raise it or lower promptLookupMin")
ENGINE_ARGS = ("engine.args must not set a flag the operator renders: set its field instead "
               "(e.g. engine.maxModelLen for --max-model-len, engine.speculative for "
               "--speculative-*; engine.args' description lists them all)")
OVERRIDE_OWNED_FIELDS = ("pod.overrides must not change the engine or router container's "
                         "command, args, image, ports or probes")
OVERRIDE_SIDECAR_IMAGE = ("pod.overrides: a sidecar container (any name but engine and router) "
                          "needs an image")
OVERRIDE_ENV = ("pod.overrides must not set the env variables the operator sets in the engine "
                "and router containers (POD_IP, POD_NAME, POD_NAMESPACE, HOME, TMPDIR, UCX_TLS, "
                "UCX_NET_DEVICES, TANDEM_*)")
OVERRIDE_MOUNTS = ("pod.overrides must not mount over /tmp, /weights or the tandem-* volumes in "
                   "the engine and router containers")
OVERRIDE_TANDEM_NAMES = ("pod.overrides must not name volumes or init containers tandem-* (the "
                         "operator's: /tmp, the weights)")
OVERRIDE_POD_FIELDS = ("pod.overrides must not set terminationGracePeriodSeconds (set "
                       "refit.drainTimeoutSeconds), serviceAccountName or metadata (set "
                       "pod.labels and pod.annotations)")
OVERRIDE_ENGINE_VOLUMES = ("pod.overrides.volumes must not name a volume of engine.volumes; "
                           "edit it there")
ADAPTER_NAMED_AS_MODEL = ("adapters: an adapter cannot be named as model.name: requests name "
                          "the model to run without an adapter")
ADAPTER_URI = "adapters[].uri must be a file://, pvc:// or oci:// URI"
SLO = {"ttftSeconds": "1.5", "itlSeconds": "0.1"}
AUTOSCALING_BOUNDS = ("with autoscaling, prefill.replicas and decode.replicas must lie within "
                      "their autoscaling minReplicas..maxReplicas")
# What the operator's own parser says for the same specs (it re-checks every CEL rule).
SPEC_PY_SAYS = {
    DRAFT_NEEDED: DRAFT_NEEDED,
    DRAFT_UNREAD: DRAFT_UNREAD,
    "weights.draft.uri must be a file:// URI": r"spec\.model\.weights\.draft\.uri .*file://",
    LOOKUP_NGRAM_ONLY: r"spec\.engine\.speculative\.promptLookupMin applies to method Ngram "
                       r"only \(prompt lookup\); remove it for method Draft",
    LOOKUP_ORDER: r"spec\.engine\.speculative\.promptLookupMax = \d is below promptLookupMin",
    ENGINE_ARGS: r"spec\.engine\.args\[\d\] '--[a-z-]+(=[a-z0-9]+)?': the operator renders "
                 r"--[a-z-]+ from ",
    KV_CACHE_SIZES: re.escape(KV_CACHE_SIZES),
    GPU_MEMORY_ON_CPU: re.escape(GPU_MEMORY_ON_CPU),
    GPU_MEMORY_WITH_KV_SIZE: re.escape(GPU_MEMORY_WITH_KV_SIZE),
    OVERRIDE_OWNED_FIELDS: r"spec\.pod\.overrides\.containers\[0\]\.(command|livenessProbe): the "
                           r"(engine|router) container's \w+ is not overridden",
    OVERRIDE_SIDECAR_IMAGE: r"spec\.pod\.overrides\.containers\[0\] \('shipper'\) is a sidecar "
                            r".*: it needs an image",
    OVERRIDE_ENV: r"spec\.pod\.overrides\.containers\[0\]\.env\[0\]\.name 'TANDEM_ADMIN_TOKEN' "
                  r"is set by the operator",
    OVERRIDE_MOUNTS: r"spec\.pod\.overrides\.containers\[0\]\.volumeMounts\[0\] at /tmp: .* "
                     r"are the operator's; mount elsewhere",
    OVERRIDE_TANDEM_NAMES: r"spec\.pod\.overrides\.volumes\[0\]\.name 'tandem-weights': volumes "
                           r"named tandem-\* are the operator's",
    OVERRIDE_POD_FIELDS: r"spec\.pod\.overrides\.(terminationGracePeriodSeconds|metadata) is the "
                         r"operator's to set: use spec\.(refit\.drainTimeoutSeconds|pod\.labels)",
    OVERRIDE_ENGINE_VOLUMES: r"spec\.pod\.overrides\.volumes\[0\]\.name 'models': a volume of "
                             r"spec\.engine\.volumes: edit it there",
    ADAPTERS_NEED_LORA: re.escape(ADAPTERS_NEED_LORA),
    ADAPTER_NAMED_AS_MODEL: r"spec\.adapters: an adapter cannot be named 'demo', "
                            r"spec\.model\.name: requests name the model to run without an "
                            r"adapter",
    ADAPTER_URI: r"spec\.adapters\[0\]\.uri '[^']+': must be file:///ABSOLUTE/PATH, "
                 r"pvc://CLAIM/PATH .* or oci://",
}
CEL_REJECTS = [
    ({"prefill": {"replicas": 2}, "decode": {"replicas": 0}},
     "spec.decode.replicas", "decode.replicas must be at least 1 when prefill.replicas > 0"),
    ({"prefill": {"replicas": 0}, "decode": {"replicas": 0}},
     "spec.decode.replicas", "the pool needs at least one engine"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
     "spec.rollout", "rollout.maxSurge and rollout.maxUnavailable must not both be 0"),
    ({"rollout": {"maxSurge": "0%", "maxUnavailable": 0}},
     "spec.rollout", "rollout.maxSurge and rollout.maxUnavailable must not both be 0"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
     "spec.rollout", "rollout.maxSurge and rollout.maxUnavailable must not both be 0"),
    ({"engine": {"kvCache": {"numBlocks": 1024, "memoryMiB": 512}}},
     "spec.engine.kvCache", KV_CACHE_SIZES),
    ({"engine": {"kvCache": {"numBlocks": 1024, "memory": "512Mi"}}},
     "spec.engine.kvCache", KV_CACHE_SIZES),
    ({"engine": {"kvCache": {"memory": "512Mi", "memoryMiB": 512}}},
     "spec.engine.kvCache", KV_CACHE_SIZES),
    ({"engine": {"device": "CPU", "gpuMemoryUtilization": "0.8"}},
     "spec.engine.gpuMemoryUtilization", GPU_MEMORY_ON_CPU),
    ({"engine": {"kvCache": {"memory": "8Gi"}, "gpuMemoryUtilization": "0.8"}},
     "spec.engine.gpuMemoryUtilization", GPU_MEMORY_WITH_KV_SIZE),
    ({"engine": {"kvCache": {"numBlocks": 64}, "gpuMemoryUtilization": "0.8"}},
     "spec.engine.gpuMemoryUtilization", GPU_MEMORY_WITH_KV_SIZE),
    ({"engine": {"args": ["--max-model-len", "4096"]}}, "spec.engine.args", ENGINE_ARGS),
    ({"engine": {"args": ["--dtype=float16"]}}, "spec.engine.args", ENGINE_ARGS),
    ({"engine": {"args": ["--port", "1"]}}, "spec.engine.args", ENGINE_ARGS),
    ({"pod": {"overrides": {"containers": [{"name": "engine", "command": ["sh"]}]}}},
     "spec.pod.overrides.containers[0]", OVERRIDE_OWNED_FIELDS),
    ({"pod": {"overrides": {"containers": [{"name": "router", "livenessProbe": {}}]}}},
     "spec.pod.overrides.containers[0]", OVERRIDE_OWNED_FIELDS),
    ({"pod": {"overrides": {"containers": [{"name": "shipper"}]}}},
     "spec.pod.overrides.containers[0]", OVERRIDE_SIDECAR_IMAGE),
    ({"pod": {"overrides": {"containers": [
        {"name": "engine", "env": [{"name": "TANDEM_ADMIN_TOKEN", "value": "x"}]}]}}},
     "spec.pod.overrides.containers[0]", OVERRIDE_ENV),
    ({"pod": {"overrides": {"containers": [
        {"name": "engine", "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]}]}}},
     "spec.pod.overrides.containers[0]", OVERRIDE_MOUNTS),
    ({"pod": {"overrides": {"volumes": [{"name": "tandem-weights", "emptyDir": {}}]}}},
     "spec.pod.overrides.volumes[0]", OVERRIDE_TANDEM_NAMES),
    ({"pod": {"overrides": {"terminationGracePeriodSeconds": 5}}},
     "spec.pod.overrides", OVERRIDE_POD_FIELDS),
    ({"pod": {"overrides": {"metadata": {"labels": {"a": "b"}}}}},
     "spec.pod.overrides", OVERRIDE_POD_FIELDS),
    ({"engine": {"volumes": [{"name": "models", "emptyDir": {}}]},
      "pod": {"overrides": {"volumes": [{"name": "models", "hostPath": {"path": "/m"}}]}}},
     "spec.pod.overrides.volumes", OVERRIDE_ENGINE_VOLUMES),
    ({"model": {"weights": {"uri": "s3://bucket/models/demo"}}},
     "spec.model.weights.uri", "weights.uri must be a file://, pvc:// or oci:// URI"),
    ({"model": {"weights": {"uri": "/models/demo/file://"}}},
     "spec.model.weights.uri", "weights.uri must be a file://, pvc:// or oci:// URI"),
    ({"engine": {"env": [
        {"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "x"}}},
    ]}},
     "spec.engine.env[0]", "set env value or valueFrom, not both"),
    ({"engine": {"env": [{"name": "A", "valueFrom": {}}]}},
     "spec.engine.env[0].valueFrom", VALUE_FROM_ONE_SOURCE),
    ({"engine": {"env": [{"name": "A", "valueFrom": {
        "fieldRef": {"fieldPath": "metadata.name"},
        "secretKeyRef": {"name": "s", "key": "k"}}}]}},
     "spec.engine.env[0].valueFrom", VALUE_FROM_ONE_SOURCE),
    ({"networkPolicy": {"apiFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                     "podSelector": {}}]}},
     "spec.networkPolicy.apiFrom[0]",
     "ipBlock cannot be combined with podSelector or namespaceSelector"),
    ({"pod": {"labels": {"tandem.dev/role": "decode"}}},
     "spec.pod.labels", "pod.labels must not set the operator's own labels"),
    ({"pod": {"annotations": {"prometheus.io/port": "1"}}},
     "spec.pod.annotations", "pod.annotations must not set the operator's own annotations"),
    ({"engine": {"speculative": {"method": "Draft"}}},
     "spec.model.weights", DRAFT_NEEDED),
    ({"model": {"weights": {"draft": {"uri": "file:///models/draft"}}}},
     "spec.model.weights.draft", DRAFT_UNREAD),
    ({"model": {"weights": {"draft": {"uri": "file:///models/draft"}}},
      "engine": {"speculative": {"method": "MTP"}}},
     "spec.model.weights.draft", DRAFT_UNREAD),
    ({"model": {"weights": {"draft": {"uri": "/models/draft"}}},
      "engine": {"speculative": {"method": "Draft"}}},
     "spec.model.weights.draft.uri", "weights.draft.uri must be a file:// URI"),
    ({"engine": {"speculative": {"method": "Draft", "promptLookupMin": 3}},
      "model": {"weights": {"draft": {"uri": "file:///models/draft"}}}},
     "spec.engine.speculative", LOOKUP_NGRAM_ONLY),
    ({"engine": {"speculative": {"method": "Ngram", "promptLookupMin": 5,
                                 "promptLookupMax": 3}}},
     "spec.engine.speculative.promptLookupMax", LOOKUP_ORDER),
    ({"engine": {"speculative": {"method": "Ngram", "promptLookupMax": 1}}},  # min's default 2
     "spec.engine.speculative.promptLookupMax", LOOKUP_ORDER),
    ({"engine": {"args": ["--kernels", "torch", "--speculative-tokens=8"]}},
     "spec.engine.args", ENGINE_ARGS),
    ({"autoscaling": {"slo": SLO, "prefill": {"minReplicas": 3, "maxReplicas": 2}},
      "prefill": {"replicas": 2}},
     "spec.autoscaling.prefill", "autoscaling.prefill.minReplicas must not exceed maxReplicas"),
    ({"autoscaling": {"slo": SLO, "decode": {"minReplicas": 5}}},  # maxReplicas' default 4
     "spec.autoscaling.decode", "autoscaling.decode.minReplicas must not exceed maxReplicas"),
    ({"autoscaling": {"slo": SLO, "decode": {"maxReplicas": 2}}, "decode": {"replicas": 3}},
     "spec.autoscaling", AUTOSCALING_BOUNDS),
    ({"autoscaling": {"slo": SLO, "ratio": {"minDecodePerPrefill": "3",
                                            "maxDecodePerPrefill": "2.5"}}},
     "spec.autoscaling.ratio",
     "autoscaling.ratio.minDecodePerPrefill must not exceed maxDecodePerPrefill"),
    ({"adapters": [SQL]}, "spec.adapters", ADAPTERS_NEED_LORA),
    (adapters({**SQL, "name": "demo"}), "spec.adapters", ADAPTER_NAMED_AS_MODEL),
    (adapters(SQL, {**SQL, "name": "demo"}), "spec.adapters", ADAPTER_NAMED_AS_MODEL),
    (adapters({**SQL, "uri": "s3://bucket/adapters/sql"}), "spec.adapters[0].uri", ADAPTER_URI),
    (adapters({**SQL, "uri": "/adapters/sql/file://"}), "spec.adapters[0].uri", ADAPTER_URI),
]


@pytest.mark.parametrize(("patch", "field", "message"), CEL_REJECTS)
def test_cel_rejects(patch: dict[str, Any], field: str, message: str):
    assert validate(minimal_pool(**patch)) == [(field, message)]


def test_every_cel_rule_has_a_failing_case():
    messages = {rule["message"] for rule in all_cel_rules()}
    assert messages == {message for _, _, message in CEL_REJECTS}


def test_cel_rules_see_defaults():
    # prefill defaults to 1 replica, so decode 0 alone breaks the first rule.
    assert validate(minimal_pool(decode={"replicas": 0})) == [
        ("spec.decode.replicas", "decode.replicas must be at least 1 when prefill.replicas > 0"),
    ]
    # maxUnavailable defaults to 0, so maxSurge 0 alone breaks the rollout rule.
    assert [m for _, m in validate(minimal_pool(rollout={"maxSurge": 0}))] == [
        "rollout.maxSurge and rollout.maxUnavailable must not both be 0",
    ]


@pytest.mark.parametrize(("patch", "field", "message"),
                         [c for c in CEL_REJECTS if c[2] in SPEC_PY_SAYS])
def test_the_operator_refuses_what_the_engine_and_override_rules_refuse(
        patch: dict[str, Any], field: str, message: str):
    """spec.py states the speculative, KV sizing, engine.args, pod.overrides and adapter rules
    again (an API server that skipped them must not make the operator act): the same specs are
    refused, naming the field and the fix."""
    with pytest.raises(SpecError, match=SPEC_PY_SAYS[message]):
        PoolSpec.from_body(minimal_pool(**patch))


NEW_ENGINE_FIELDS = (".kvCache.memory", ".maxModelLen", ".dtype", ".gpuMemoryUtilization",
                     "spec.router.resources.requests", "spec.pod.overrides")


@pytest.mark.parametrize(("patch", "field", "message"),
                         [c for c in SCHEMA_REJECTS if any(f in c[1] for f in NEW_ENGINE_FIELDS)
                          and "unexpected" not in c[2] and "required" not in c[2]
                          and not c[1].startswith("spec.router")])
def test_the_operator_refuses_what_the_schema_refuses_of_the_new_fields(
        patch: dict[str, Any], field: str, message: str):
    with pytest.raises(SpecError, match=re.escape(field)):
        PoolSpec.from_body(minimal_pool(**patch))


@pytest.mark.parametrize(("memory", "size"), [
    ("512Mi", 512 * 2**20), ("8Gi", 8 * 2**30), ("1Ti", 2**40), ("1G", 10**9),
    ("0.5Gi", 2**29), ("1.5e9", 1_500_000_000), (2**30, 2**30),
    ("16777216.5", 16777217),  # a fraction of a byte rounds up, as Quantity.Value() does
])
def test_kv_cache_memory_is_a_quantity_passed_in_bytes(memory: Any, size: int):
    body = minimal_pool(engine={"kvCache": {"memory": memory}})
    assert validate(body) == []
    assert PoolSpec.from_body(body).engine.kv_cache.memory_bytes == size


@pytest.mark.parametrize("memory", ["15Mi", "1025Gi", "2Ti", 1024])
def test_kv_cache_memory_outside_16mi_to_1ti_is_refused_by_the_operator(memory: Any):
    """The schema checks the quantity's form (the API server's CEL has no quantities before
    Kubernetes 1.29), the operator its range."""
    with pytest.raises(SpecError, match=r"spec\.engine\.kvCache\.memory = .* bytes\) is "
                                        r"outside 16Mi\.\.1Ti"):
        PoolSpec.from_body(minimal_pool(engine={"kvCache": {"memory": memory}}))


def test_memory_mib_still_works_and_says_to_use_memory():
    node = schema_node("spec.engine.kvCache.memoryMiB")
    assert node["description"].startswith("Deprecated: use memory")
    old = PoolSpec.from_body(minimal_pool(engine={"kvCache": {"memoryMiB": 512}}))
    new = PoolSpec.from_body(minimal_pool(engine={"kvCache": {"memory": "512Mi"}}))
    assert old.engine.kv_cache == new.engine.kv_cache


def test_engine_args_refuses_every_flag_the_operator_renders():
    """The CEL rule's list is spec.py's `RENDERED_ENGINE_FLAGS` (the flag table's pool flags
    and the operator's own wiring), --speculative-* by prefix; the description names each."""
    (rule,) = schema_node("spec.engine.args")["x-kubernetes-validations"]
    listed = set(re.findall(r"'(--[a-z-]+)'", rule["rule"])) - {"--speculative"}
    assert listed == {f for f in RENDERED_ENGINE_FLAGS if not f.startswith("--speculative")}
    description = schema_node("spec.engine.args")["description"]
    for flag in RENDERED_ENGINE_FLAGS:
        shown = "--speculative-*" if flag.startswith("--speculative") else flag
        assert shown in description, flag
        for arg in ([flag, "1"], [f"{flag}=1"]):
            assert validate(minimal_pool(engine={"args": ["--kernels", "torch", *arg]})) == [
                ("spec.engine.args", ENGINE_ARGS)], arg
            with pytest.raises(SpecError, match=re.escape(f"the operator renders {flag} from")):
                PoolSpec.from_body(minimal_pool(engine={"args": arg}))
    # a flag that merely starts like one is not one of them
    assert validate(minimal_pool(engine={"args": ["--portable-x"]})) == []


@pytest.mark.parametrize(("patch", "field", "message"),
                         [c for c in SCHEMA_REJECTS if (".speculative" in c[1]
                          or ".draft" in c[1]) and "unexpected" not in c[2]])
def test_the_operator_refuses_what_the_speculative_schema_refuses(
        patch: dict[str, Any], field: str, message: str):
    with pytest.raises(SpecError, match=re.escape(field.removesuffix("[0]"))):
        PoolSpec.from_body(minimal_pool(**patch))


def test_speculative_specs_the_schema_accepts_parse_to_the_same_values():
    spec = apply_defaults(SCHEMA, minimal_pool(engine={"speculative": {"method": "MTP"}}))
    assert validate(spec) == []
    assert spec["spec"]["engine"]["speculative"] == {"method": "MTP",
                                                    "numSpeculativeTokens": 4}
    parsed = PoolSpec.from_body(spec).engine.speculative
    undefaulted = PoolSpec.from_body(minimal_pool(engine={"speculative": {"method": "MTP"}}))
    assert parsed == undefaulted.engine.speculative
    assert parsed is not None and parsed.method is SpeculativeMethod.MTP
    assert parsed.num_speculative_tokens == DEFAULT_SPECULATIVE_TOKENS


# --- spec.engine.lora and spec.adapters -------------------------------------------------------

LORA_REJECTS = [c for c in SCHEMA_REJECTS
                if c[1].startswith(("spec.adapters", "spec.engine.lora"))]


@pytest.mark.parametrize(("patch", "field", "message"),
                         [c for c in LORA_REJECTS if "unexpected" not in c[2]])
def test_the_operator_refuses_what_the_lora_and_adapter_schema_refuses(
        patch: dict[str, Any], field: str, message: str):
    """Duplicate names too: the API server refuses them as list-map keys, the operator names
    the entry listed twice."""
    with pytest.raises(SpecError, match=re.escape(field)):
        PoolSpec.from_body(minimal_pool(**patch))


def test_adapter_fields_are_the_operators_and_the_engines():
    """spec.adapters' bounds and patterns are those spec.py checks again and the engine's
    adapter names (lora_request.ADAPTER_NAME): what the schema takes, the operator takes."""
    assert schema_node("spec.adapters")["maxItems"] == MAX_ADAPTERS
    item = schema_node("spec.adapters")["items"]["properties"]
    assert item["version"]["pattern"] == ADAPTER_VERSION.pattern
    assert item["version"]["pattern"] == schema_node("spec.model.weights.version")["pattern"]
    for name in ("a", "A" * 128, "7", "org:sql_v1.2-x", "a-", "a:"):
        assert re.fullmatch(item["name"]["pattern"], name) and len(name) <= 128, name
        assert ADAPTER_NAME.match(name), name
    for name in ("", "-a", ".a", "a b", "org/sql", "a" * 129, "sql@2"):
        schema_takes = re.fullmatch(item["name"]["pattern"], name) and len(name) <= 128
        assert not schema_takes and not ADAPTER_NAME.match(name), name


def test_adapters_the_schema_accepts_parse_to_the_same_adapters():
    body = minimal_pool(**adapters(SQL, {"name": "chat", "version": "1",
                                         "uri": "pvc://adapters/chat-v1"}))
    assert validate(body) == []
    pool = PoolSpec.from_body(body)
    assert pool == PoolSpec.from_body(apply_defaults(SCHEMA, body))
    assert pool.adapters == (AdapterRef("sql", "2", "file:///adapters/sql-v2"),
                             AdapterRef("chat", "1", "pvc://adapters/chat-v1"))
    assert pool.engine.lora == LoRASettings(max_loras=4)
    assert PoolSpec.from_body(minimal_pool()).adapters == ()


def adapter_status(tx: AdapterTransaction, served: dict[str, tuple[str, ...]]
                   ) -> dict[str, Any]:
    """The status the operator writes for `tx` while the engines named in `served`
    (prefill-* or decode-*) serve those adapter identities."""
    engines = [AdapterObs(name, name.split("-")[0], f"http://{name}", EngineState.RUNNING,
                          loras) for name, loras in served.items()]
    pods = {name: PodView(name, name.split("-")[0]) for name in served}  # type: ignore[arg-type]
    report = adapter_report(tx, engines, pods)
    return {"conditions": [condition({}, ADAPTER_CONDITION, *report.refitting, 1,
                                     "2025-01-01T00:00:00Z")],
            "adapterRefit": dict(report.record), "adapters": report.adapters,
            "adapterSummary": report.summary}


def test_status_takes_what_the_adapter_transaction_writes():
    sql1, sql2 = AdapterRef("sql", "1", "file:///adapters/sql-v1"), AdapterRef(**SQL)
    chat = AdapterRef("chat", "1", "pvc://adapters/chat-v1")
    tx = AdapterTransaction(
        target=adapter_set([sql2, chat]), previous=adapter_set([sql1]), wave=1,
        max_unavailable=1, started_at=1700000000.5,
        engines={"decode-a": AdapterEngineRecord(since=1700000001.25, verified=["chat@1"])},
        scores={"chat@1": 0.25})
    manifest = minimal_pool(**adapters(SQL))
    manifest["status"] = adapter_status(tx, {"prefill-a": ("sql@1",),
                                             "decode-a": ("sql@2", "chat@1")})
    assert validate(manifest) == []
    status = manifest["status"]
    assert status["adapterSummary"] == "chat@1 sql@1|2"  # chat is on decode-a alone
    assert status["adapters"][1] == {"name": "sql", "version": "2", "current": "",
                                     "prefill": "1", "decode": "2"}
    # a failed change keeps the engine's error, cut to the schema's bound
    tx.phase, tx.finished_at = Phase.ROLLED_BACK, 1700000100.0
    tx.failure = Failure("decode-a", "/v1/load_lora_adapter", "x" * 10000)
    manifest["status"] = adapter_status(tx, {"prefill-a": ("sql@1",), "decode-a": ("sql@1",)})
    assert validate(manifest) == []
    assert len(manifest["status"]["adapterRefit"]["failure"]["message"]) == ADAPTER_MESSAGE_LIMIT
    assert schema_node("status.adapterRefit.failure.message")["maxLength"] == ADAPTER_MESSAGE_LIMIT
    manifest["status"]["adapterRefit"]["phase"] = "Done"
    manifest["status"]["adapters"][0]["current"] = "v" * 64
    assert {f for f, _ in validate(manifest)} == {"status.adapterRefit.phase",
                                                  "status.adapters[0].current"}


def test_status_fits_the_most_adapters_the_operator_writes():
    """64 adapters of the longest names and versions going to 64 others, each name served at
    two versions: the progress, the rows and the kubectl column stay within their bounds."""
    def refs(prefix: str, version: str) -> list[AdapterRef]:
        return [AdapterRef(f"{prefix}{i:02d}".ljust(128, "x"), version.ljust(63, "v"),
                           "file:///" + "a" * 1016) for i in range(MAX_ADAPTERS)]
    target, previous = refs("t", "1"), refs("p", "1")
    tx = AdapterTransaction(target=adapter_set(target), previous=adapter_set(previous))
    served = {"prefill-a": tuple(a.identity for a in [*target, *previous]),
              "decode-a": tuple(f"{a.name}@{'2'.ljust(63, 'v')}" for a in [*target, *previous])}
    manifest = minimal_pool(**adapters(SQL))
    manifest["status"] = adapter_status(tx, served)
    assert len(manifest["status"]["adapters"]) == 2 * MAX_ADAPTERS
    assert validate(manifest) == []


# --- spec.autoscaling ------------------------------------------------------------------------


def test_autoscaling_is_off_unless_set():
    assert PoolSpec.from_body(minimal_pool()).autoscaling is None


def test_autoscaling_parses_to_the_planner_s_settings():
    body = minimal_pool(prefill={"replicas": 1}, decode={"replicas": 2}, autoscaling={
        "slo": {"ttftSeconds": "1.5", "itlSeconds": "0.08", "percentile": 95,
                "kvUsageCeiling": 85, "queueDepth": 4},
        "prefill": {"maxReplicas": 3}, "decode": {"minReplicas": 2, "maxReplicas": 6},
        "windowSeconds": 120, "maxStep": 2, "ratio": {"minDecodePerPrefill": "1.5"}})
    assert validate(body) == []
    assert PoolSpec.from_body(apply_defaults(SCHEMA, body)).autoscaling == Autoscaling(
        PlannerSLO(1.5, 0.08, 0.95, 0.85, 4.0), Bounds(1, 3), Bounds(2, 6), window_seconds=120,
        scale_up_stabilization_seconds=30, scale_down_stabilization_seconds=300, max_step=2,
        min_decode_per_prefill=1.5)
    # the parser's defaults are the CRD's, with or without the API server's defaulting
    assert PoolSpec.from_body(body).autoscaling == PoolSpec.from_body(
        apply_defaults(SCHEMA, body)).autoscaling


@pytest.mark.parametrize(("patch", "field", "message"),
                         [c for c in CEL_REJECTS if c[1].startswith("spec.autoscaling")])
def test_the_operator_refuses_what_the_autoscaling_rules_refuse(
        patch: dict[str, Any], field: str, message: str):
    said = {AUTOSCALING_BOUNDS: re.escape(AUTOSCALING_BOUNDS)}.get(
        message, re.escape(field) + r".*must")
    with pytest.raises(SpecError, match=said):
        PoolSpec.from_body(apply_defaults(SCHEMA, minimal_pool(**patch)))


# --- spec.rollout --------------------------------------------------------------------------------

ROLLOUT_REJECTS = [c for c in SCHEMA_REJECTS + CEL_REJECTS if c[1].startswith("spec.rollout")]


def test_rollout_parses_to_the_crds_defaults():
    body = minimal_pool(rollout={"maxSurge": "25%", "onFailure": "Halt"})
    assert validate(body) == []
    assert PoolSpec.from_body(body).rollout == PoolSpec.from_body(
        apply_defaults(SCHEMA, body)).rollout
    rollout = PoolSpec.from_body(body).rollout
    assert (rollout.max_surge, rollout.max_unavailable, rollout.on_failure) == (
        "25%", 0, OnFailure.HALT)


@pytest.mark.parametrize(("patch", "field", "message"), ROLLOUT_REJECTS)
def test_the_operator_refuses_what_the_rollout_schema_and_rule_refuse(
        patch: dict[str, Any], field: str, message: str):
    said = re.escape(message) if field == "spec.rollout" else re.escape(field)
    with pytest.raises(SpecError, match=said):
        PoolSpec.from_body(minimal_pool(**patch))
