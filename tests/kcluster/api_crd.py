"""CustomResourceDefinitions: serving them, and pruning, defaulting and validating their objects.

kmock serves any resource it is told about and stores bodies as sent. A real API server turns
a created CRD into a served resource (discovery, status subresource, printer columns) and runs
every custom object through the CRD's structural schema: unknown fields are pruned, defaults
applied top-down, the OpenAPI constraints and the CEL `x-kubernetes-validations` rules checked
(`oldSelf` rules only on updates), and a violation is a 422 Invalid whose causes name the field
and the rule's message, which is what `kubectl apply` prints. The tests of our CRD and of the
operator rely on exactly that.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema

from .api_resources import ResourceType

ROOT_FIELDS = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True)
class Cause:
    """One violation: the field path (`spec.engine.image`) and the message for it."""

    field: str
    message: str
    reason: str = "FieldValueInvalid"


class InvalidObject(Exception):
    def __init__(self, causes: list[Cause]):
        super().__init__("; ".join(f"{c.field}: {c.message}" for c in causes))
        self.causes = causes


@dataclass(frozen=True, eq=False)
class CustomSchema:
    """The openAPIV3Schema of one served version of a CRD."""

    schema: dict[str, Any]

    @functools.cached_property
    def validator(self) -> jsonschema.Draft4Validator:
        return jsonschema.Draft4Validator(_to_jsonschema(self.schema))

    def prepare(self, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """Prune, default and validate `obj` (a copy is returned); raises InvalidObject."""
        body = {k: v for k, v in obj.items() if k not in ROOT_FIELDS}
        body = _prune_and_default(body, self.schema)
        obj = {**{k: obj[k] for k in ROOT_FIELDS if k in obj}, **body}
        causes = _schema_causes(self.validator, obj)
        if not causes:
            causes = _cel_causes(self.schema, obj, old, "")
        if causes:
            raise InvalidObject(causes)
        return obj


def _prune_and_default(value: Any, schema: dict[str, Any]) -> Any:
    if schema.get("type") == "object" or "properties" in schema:
        if not isinstance(value, dict):
            return value
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        result: dict[str, Any] = {}
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if item is None and sub is not None and not sub.get("nullable"):
                continue  # nulls of non-nullable fields are dropped (then defaulted)
            if sub is not None:
                result[key] = _prune_and_default(item, sub)
            elif keep_unknown or (schema.get("x-kubernetes-embedded-resource")
                                  and key in ROOT_FIELDS):
                result[key] = item
        for key, sub in properties.items():
            if key not in result and "default" in sub:
                result[key] = _prune_and_default(copy.deepcopy(sub["default"]), sub)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune_and_default(item, schema["items"]) for item in value]
    return value


def _to_jsonschema(schema: Any) -> Any:
    """OpenAPI v3 (Kubernetes dialect) -> JSON Schema draft 4."""
    if isinstance(schema, list):
        return [_to_jsonschema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {k: _to_jsonschema(v) for k, v in schema.items()
              if not k.startswith("x-kubernetes-") and k not in ("nullable", "default",
                                                                   "description", "example")}
    if schema.get("x-kubernetes-int-or-string"):
        result.pop("type", None)
        result["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in result:
        result["type"] = [result["type"], "null"]
    return result


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "integer",
            float: "number"}.get(type(value), "null")


def _quote(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def _schema_causes(validator: jsonschema.Draft4Validator, obj: dict[str, Any]) -> list[Cause]:
    causes = []
    errors = validator.iter_errors(obj)
    for error in sorted(errors, key=lambda e: list(map(str, e.absolute_path))):
        path = ".".join(str(p) for p in error.absolute_path)
        value, limit, kind = error.instance, error.validator_value, error.validator
        if kind == "required":
            missing = [name for name in limit if name not in value]
            causes += [Cause(f"{path}.{m}" if path else m, "Required value", "FieldValueRequired")
                       for m in missing]
            continue
        message = {
            "maximum": f"should be less than or equal to {limit}",
            "minimum": f"should be greater than or equal to {limit}",
            "minLength": f"should be at least {limit} chars long",
            "pattern": f"should match '{limit}'",
            "type": f"must be of type {limit}",
        }.get(kind)
        if kind == "enum":
            allowed = ", ".join(_quote(v) for v in limit)
            causes.append(Cause(path, f"Unsupported value: {_quote(value)}: supported values: "
                                      f"{allowed}", "FieldValueNotSupported"))
        elif kind == "maxLength":
            causes.append(Cause(path, f"Too long: may not be more than {limit} bytes",
                                "FieldValueTooLong"))
        elif kind in ("maxItems", "maxProperties"):
            causes.append(Cause(path, f"Too many: {len(value)}: must have at most {limit} items",
                                "FieldValueTooMany"))
        elif message is not None:
            shown = _type_name(value) if kind == "type" else value
            causes.append(Cause(path, f"Invalid value: {_quote(shown)}: {path} in body {message}"))
        else:
            causes.append(Cause(path, f"Invalid value: {_quote(_type_name(value))}: "
                                      f"{error.message}"))
    return causes


# -- CEL --

@functools.lru_cache(maxsize=256)
def _cel_program(expression: str) -> celpy.Runner:
    environment = celpy.Environment()
    return environment.program(environment.compile(expression))


def _cel_causes(schema: dict[str, Any], value: Any, old: Any, path: str) -> list[Cause]:
    causes: list[Cause] = []
    for rule in schema.get("x-kubernetes-validations", ()):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        context = {"self": celpy.json_to_cel(value)}
        if transition:
            context["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = _cel_program(rule["rule"]).evaluate(context)
            passed = isinstance(result, celpy.celtypes.BoolType) and bool(result)
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            if not passed and rule.get("messageExpression"):
                message = str(_cel_program(rule["messageExpression"]).evaluate(context))
        except (celpy.CELEvalError, celpy.CELParseError) as exc:
            passed, message = False, f"rule evaluation error: {exc.args[0] if exc.args else exc}"
        if not passed:
            field = (path + rule.get("fieldPath", "")).lstrip(".")
            causes.append(Cause(field, f"Invalid value: {_quote(_type_name(value))}: {message}"))
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None and (path or key not in ROOT_FIELDS):
                old_item = old.get(key) if isinstance(old, dict) else None
                causes += _cel_causes(sub, item, old_item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            causes += _cel_causes(schema["items"], item, None, f"{path}[{index}]")
    return causes


# -- CRD objects --

def check_definition(crd: dict[str, Any]) -> None:
    """The few CRD rules whose violation would leave the server in a confusing state."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    causes = []
    if not names.get("plural") or not names.get("kind") or not spec.get("group"):
        causes.append(Cause("spec", "Required value: group, names.plural and names.kind"))
    elif crd["metadata"]["name"] != f"{names['plural']}.{spec['group']}":
        causes.append(Cause("metadata.name", f"Invalid value: {_quote(crd['metadata']['name'])}:"
                                             " must be spec.names.plural+\".\"+spec.group"))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        causes.append(Cause("spec.scope", "Unsupported value: supported values: "
                                          "\"Cluster\", \"Namespaced\""))
    if sum(1 for v in spec.get("versions") or () if v.get("storage")) != 1:
        causes.append(Cause("spec.versions", "Invalid value: must have exactly one version "
                                             "marked as storage version"))
    if causes:
        raise InvalidObject(causes)


def _scale_paths(version: dict[str, Any]) -> dict[str, Any]:
    scale = (version.get("subresources") or {}).get("scale")
    if scale is None:
        return {}
    return {"scale_paths": (scale["specReplicasPath"], scale["statusReplicasPath"],
                            scale.get("labelSelectorPath"))}


def served_types(crd: dict[str, Any]) -> list[ResourceType]:
    spec, names = crd["spec"], crd["spec"]["names"]
    served = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        served.append(ResourceType(
            group=spec["group"], version=version["name"], plural=names["plural"],
            kind=names["kind"], namespaced=spec["scope"] == "Namespaced",
            short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            subresources=frozenset(version.get("subresources") or {}),
            custom=True, schema=CustomSchema(schema) if schema else None,
            printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
            **_scale_paths(version),
        ))
    return served


def established_status(crd: dict[str, Any], now: str) -> dict[str, Any]:
    conditions = [{"type": kind, "status": "True", "reason": reason, "message": message,
                   "lastTransitionTime": now}
                  for kind, reason, message in (
                      ("NamesAccepted", "NoConflicts", "no conflicts found"),
                      ("Established", "InitialNamesAccepted", "the initial names have been "
                                                              "accepted"))]
    stored = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
    return {"acceptedNames": crd["spec"]["names"], "conditions": conditions,
            "storedVersions": stored}
