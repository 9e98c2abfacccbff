"""The four PATCH flavours clients send, applied to plain JSON objects.

kmock merges every patch body recursively as a dict, which breaks JSON patches (kopf's
finalizer patches), strategic merges of container lists (`kubectl apply`, `kubectl patch`)
and server-side apply (helm 4). Strategic merge knows the merge keys of the built-in kinds by
field name; server-side apply is approximated as a strategic merge that also drops the fields
the same field manager applied last time but no longer sends (no managedFields are kept).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# patchMergeKey of the built-in list fields that merge (by field name; `ports` is resolved by
# content: container ports merge on containerPort, service ports on port).
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "imagePullSecrets": "name", "conditions": "type", "ownerReferences": "uid",
    "hostAliases": "ip", "topologySpreadConstraints": "topologyKey", "resourceClaims": "name",
    "schedulingGates": "name", "ports": "port",
}
MERGED_PRIMITIVE_LISTS = {"finalizers"}


class PatchError(Exception):
    """A patch that cannot be applied; `code` is the HTTP status the real server answers."""

    def __init__(self, message: str, code: int = 422):
        super().__init__(message)
        self.code = code


def parse_body(content_type: str, body: bytes) -> Any:
    try:
        if content_type == APPLY_PATCH:
            return yaml.safe_load(body)
        return json.loads(body)
    except (ValueError, yaml.YAMLError) as exc:
        raise PatchError(f"the patch body is not valid: {exc}", code=400) from exc


def apply_patch(target: dict[str, Any], content_type: str, patch: Any, *, strategic: bool,
                last_applied: dict[str, Any] | None = None) -> dict[str, Any]:
    """The patched copy of `target`. `strategic` is False for custom resources."""
    target = copy.deepcopy(target)
    if content_type == JSON_PATCH:
        return json_patch(target, patch)
    if not isinstance(patch, dict):
        raise PatchError("the patch must be a JSON object", code=400)
    if content_type == MERGE_PATCH:
        return merge_patch(target, patch)
    if content_type == STRATEGIC_MERGE_PATCH:
        return strategic_merge(target, patch)
    if content_type == APPLY_PATCH:
        patch = _with_removals(copy.deepcopy(patch), last_applied or {})
        return strategic_merge(target, patch) if strategic else merge_patch(target, patch)
    raise PatchError(f"the patch content type {content_type!r} is not supported", code=415)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null removes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [item for item in result.get(field) or [] if item not in value]
        elif key.startswith("$"):  # $setElementOrder/..., $retainKeys: ordering hints only
            continue
        elif value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            result[key] = strategic_merge(result.get(key), value)
    return result


def _merge_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    if not isinstance(current, list):
        current = []
    if field in MERGED_PRIMITIVE_LISTS:
        return current + [item for item in patch if item not in current]
    merge_key = MERGE_KEYS.get(field)
    if field == "ports" and any(isinstance(p, dict) and "containerPort" in p for p in patch):
        merge_key = "containerPort"
    if merge_key is None or not all(isinstance(item, dict) for item in patch + current):
        return [item for item in copy.deepcopy(patch) if item != {"$patch": "replace"}]
    if any(item.get("$patch") == "replace" for item in patch):
        return [item for item in copy.deepcopy(patch) if item.get("$patch") != "replace"]
    result = list(current)
    for item in patch:
        index = next((i for i, old in enumerate(result)
                      if old.get(merge_key) == item.get(merge_key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(strategic_merge({}, item))
        else:
            result[index] = strategic_merge(result[index], item)
    return result


def _with_removals(applied: Any, last: Any) -> Any:
    """Mark fields the manager applied last time but dropped now for removal (null)."""
    if isinstance(applied, dict) and isinstance(last, dict):
        for key, old in last.items():
            if key not in applied:
                applied[key] = None
            else:
                applied[key] = _with_removals(applied[key], old)
    return applied


# -- RFC 6902 JSON patch --

def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}", code=400)
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        try:
            doc = doc[int(part)] if isinstance(doc, list) else doc[part]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise PatchError(f"path {path!r} does not exist in the object") from exc
    return doc


def _add(doc: Any, parts: list[str], value: Any, path: str) -> Any:
    if not parts:
        return value
    parent, last = _resolve(doc, parts[:-1], path), parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise PatchError(f"index out of range in {path!r}")
        parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise PatchError(f"cannot add at {path!r}")
    return doc


def _remove(doc: Any, parts: list[str], path: str) -> Any:
    parent, last = _resolve(doc, parts[:-1], path), parts[-1] if parts else ""
    try:
        if isinstance(parent, list):
            return parent.pop(int(last))
        return parent.pop(last)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise PatchError(f"unable to remove nonexistent key {path!r}") from exc


def json_patch(doc: Any, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations", code=400)
    for operation in operations:
        op, path = operation.get("op"), operation.get("path", "")
        parts = _pointer(path)
        if op == "test":
            if _resolve(doc, parts, path) != operation.get("value"):
                raise PatchError(f"testing value {path} failed: test failed")
        elif op == "add":
            doc = _add(doc, parts, copy.deepcopy(operation.get("value")), path)
        elif op == "remove":
            _remove(doc, parts, path)
        elif op == "replace":
            _resolve(doc, parts, path)  # must exist
            if parts:
                _remove(doc, parts, path)
            doc = _add(doc, parts, copy.deepcopy(operation.get("value")), path)
        elif op in ("move", "copy"):
            source = operation.get("from", "")
            value = copy.deepcopy(_resolve(doc, _pointer(source), source))
            if op == "move":
                _remove(doc, _pointer(source), source)
            doc = _add(doc, parts, value, path)
        else:
            raise PatchError(f"unsupported JSON patch operation {op!r}", code=400)
    return doc
