"""Kubernetes `Status` failures, worded as the real API server words them.

Clients branch on `reason` and `code` (kopf retries 409s, the kubernetes client raises
ApiException(status=...)), and kubectl prints `message` verbatim ("Error from server
(NotFound): pods "x" not found"), so these match the real server's texts.
"""

from __future__ import annotations

from typing import Any

from kmock import KubernetesError

from .api_crd import Cause
from .api_resources import ResourceType


def status_body(error: KubernetesError) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": error.message,
                            "reason": error.reason, "code": error.status}
    if error.details:
        body["details"] = error.details
    return body


def _details(resource: ResourceType, name: str, **extra: Any) -> dict[str, Any]:
    details = {"name": name, "kind": resource.plural, **extra}
    if resource.group:
        details["group"] = resource.group
    return details


def not_found(resource: ResourceType, name: str) -> KubernetesError:
    return KubernetesError(404, "NotFound", f'{resource.group_resource} "{name}" not found',
                           _details(resource, name))


def no_such_resource() -> KubernetesError:
    return KubernetesError(404, "NotFound", "the server could not find the requested resource",
                           None)


def already_exists(resource: ResourceType, name: str) -> KubernetesError:
    return KubernetesError(409, "AlreadyExists",
                           f'{resource.group_resource} "{name}" already exists',
                           _details(resource, name))


def conflict(resource: ResourceType, name: str, why: str) -> KubernetesError:
    return KubernetesError(409, "Conflict",
                           f'Operation cannot be fulfilled on {resource.group_resource} '
                           f'"{name}": {why}', _details(resource, name))


STALE = ("the object has been modified; please apply your changes to the latest version and "
         "try again")


def invalid(resource: ResourceType, name: str, causes: list[Cause]) -> KubernetesError:
    texts = [f"{c.field}: {c.message}" if c.field else c.message for c in causes]
    summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    kind = f"{resource.kind}.{resource.group}" if resource.group else resource.kind
    details = _details(resource, name, causes=[
        {"reason": c.reason, "message": c.message, "field": c.field} for c in causes])
    details["kind"] = resource.kind
    return KubernetesError(422, "Invalid", f'{kind} "{name}" is invalid: {summary}', details)


def bad_request(message: str) -> KubernetesError:
    return KubernetesError(400, "BadRequest", message, None)


def forbidden(message: str) -> KubernetesError:
    return KubernetesError(403, "Forbidden", message, None)


def method_not_allowed() -> KubernetesError:
    return KubernetesError(405, "MethodNotAllowed",
                           "the server does not allow this method on the requested resource", None)
