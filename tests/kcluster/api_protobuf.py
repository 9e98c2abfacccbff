"""Decoding the protobuf bodies kubectl and helm send for secrets, configmaps and namespaces.

`kubectl create secret|configmap|namespace|serviceaccount` and helm's release storage (Secrets,
and their DeleteOptions) use typed clients that always send
`application/vnd.kubernetes.protobuf` (a 415 answer is not retried as JSON), so the server
must read protobuf. This decodes the envelope (`k8s\\0` + runtime.Unknown) and the few kinds
kubectl creates that way, field by field from the numbers in k8s.io/api's generated.proto.
Answers are JSON either way: client-go decodes by the response's Content-Type.
"""

from __future__ import annotations

import base64
from typing import Any

from kmock import KubernetesError

CONTENT_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"
TOP_LEVEL_KINDS = {"Secret", "ConfigMap", "Namespace", "ServiceAccount", "DeleteOptions"}

# Message schemas: field number -> (JSON name, type). Types: "str", "bytes", "int", "bool",
# "[str]" (repeated), "{str}"/"{bytes}" (map<string, …>), or a message name (repeated: "[Msg]").
SCHEMAS: dict[str, dict[int, tuple[str, str]]] = {
    "TypeMeta": {1: ("apiVersion", "str"), 2: ("kind", "str")},
    "ObjectMeta": {1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"),
                   5: ("uid", "str"), 6: ("resourceVersion", "str"), 11: ("labels", "{str}"),
                   12: ("annotations", "{str}"),
                   13: ("ownerReferences", "[OwnerReference]"), 14: ("finalizers", "[str]")},
    "OwnerReference": {1: ("kind", "str"), 3: ("name", "str"), 4: ("uid", "str"),
                       5: ("apiVersion", "str"), 6: ("controller", "bool"),
                       7: ("blockOwnerDeletion", "bool")},
    "LocalObjectReference": {1: ("name", "str")},
    "ObjectReference": {1: ("kind", "str"), 2: ("namespace", "str"), 3: ("name", "str")},
    "Secret": {1: ("metadata", "ObjectMeta"), 2: ("data", "{bytes}"), 3: ("type", "str"),
               4: ("stringData", "{str}"), 5: ("immutable", "bool")},
    "ConfigMap": {1: ("metadata", "ObjectMeta"), 2: ("data", "{str}"),
                  3: ("binaryData", "{bytes}"), 4: ("immutable", "bool")},
    "Namespace": {1: ("metadata", "ObjectMeta"), 2: ("spec", "NamespaceSpec")},
    "NamespaceSpec": {1: ("finalizers", "[str]")},
    "DeleteOptions": {1: ("gracePeriodSeconds", "int"), 2: ("preconditions", "Preconditions"),
                      3: ("orphanDependents", "bool"), 4: ("propagationPolicy", "str"),
                      5: ("dryRun", "[str]")},
    "Preconditions": {1: ("uid", "str"), 2: ("resourceVersion", "str")},
    "ServiceAccount": {1: ("metadata", "ObjectMeta"), 2: ("secrets", "[ObjectReference]"),
                       3: ("imagePullSecrets", "[LocalObjectReference]"),
                       4: ("automountServiceAccountToken", "bool")},
}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs; length-delimited values stay raw bytes."""
    fields, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = int.from_bytes(data[pos:pos + size], "little"), pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.append((number, value))
    return fields


def _scalar(kind: str, value: int | bytes) -> Any:
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return value
    if kind == "bytes":
        return base64.b64encode(value).decode()  # JSON carries bytes as base64
    if kind == "str":
        return value.decode()
    return _message(kind, value)


def _message(name: str, data: bytes) -> dict[str, Any]:
    schema, result = SCHEMAS[name], {}
    for number, value in _fields(data):
        if number not in schema:
            continue  # fields a create never carries (status, timestamps)
        field, kind = schema[number]
        if kind.startswith("["):
            result.setdefault(field, []).append(_scalar(kind[1:-1], value))
        elif kind.startswith("{"):
            entry = dict(_fields(value))
            key = entry.get(1, b"").decode()
            result.setdefault(field, {})[key] = _scalar(kind[1:-1], entry.get(2, b""))
        elif not (kind == "str" and value == b""):  # like Go's JSON `omitempty`
            result[field] = _scalar(kind, value)
    return result


def decode(body: bytes) -> dict[str, Any]:
    """A JSON-shaped object from a Kubernetes protobuf body; 415 for kinds not listed above."""
    if not body.startswith(MAGIC):
        raise KubernetesError(400, "BadRequest", "protobuf body without the k8s envelope", None)
    try:
        envelope = dict(_fields(body[len(MAGIC):]))  # runtime.Unknown: 1 typeMeta, 2 raw
        type_meta = _message("TypeMeta", envelope.get(1, b""))
        kind = type_meta.get("kind", "")
        if kind not in TOP_LEVEL_KINDS:
            raise KubernetesError(
                415, "UnsupportedMediaType", f"the test API server cannot read {kind} as "
                "protobuf; send JSON (kubectl apply -f) instead", None)
        obj = _message(kind, envelope.get(2, b""))
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise KubernetesError(400, "BadRequest", f"unreadable protobuf body: {exc}", None) from exc
    return {"apiVersion": type_meta.get("apiVersion", "v1"), "kind": kind, **obj}
