"""Server-side printing: `meta.k8s.io/v1` Table responses for `kubectl get`.

kubectl asks for `application/json;as=Table;v=v1;g=meta.k8s.io` and prints the columns the
server chose; only the server knows a CRD's additionalPrinterColumns, so `kubectl get ipool`
shows Prefill/Decode/Ready only if the server converts objects to rows. Built-in kinds get the
columns people read first (pods: Ready, Status, Restarts); everything else Name and Age.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from .api_resources import ResourceType

_NAME_COLUMN = {"name": "Name", "type": "string", "format": "name", "priority": 0,
                "description": "Name must be unique within a namespace."}
_AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
_TOKEN = re.compile(r"""\.([A-Za-z0-9_-]+)|\[(\d+|\*)\]|\[['"]([^'"]+)['"]\]"""
                    r"""|\[\?\(@\.([\w.-]+)\s*(==|!=)\s*(?:"([^"]*)"|'([^']*)'|([\w.-]+))\)\]""")


def _filter_value(item: Any, path: str) -> str | None:
    found = jsonpath(item, "." + path)
    return str(found[0]) if found else None


def jsonpath(obj: Any, expression: str) -> list[Any]:
    """Values at a kubectl-style JSONPath: `.a.b`, `[0]`, `[*]`, `[?(@.type=="Ready")]`."""
    expression = expression.strip().removeprefix("{").removesuffix("}")
    values, position = [obj], 0
    while position < len(expression):
        match = _TOKEN.match(expression, position)
        if match is None:
            raise ValueError(f"unsupported JSONPath {expression!r} at {position}")
        position = match.end()
        key, index, quoted, filter_path, op = match.group(1, 2, 3, 4, 5)
        wanted = next((g for g in match.group(6, 7, 8) if g is not None), None)
        found: list[Any] = []
        for value in values:
            if key is not None or quoted is not None:
                if isinstance(value, dict) and (key or quoted) in value:
                    found.append(value[key or quoted])
            elif index is not None and isinstance(value, list):
                found += value if index == "*" else value[int(index):int(index) + 1]
            elif filter_path is not None and isinstance(value, list):
                found += [item for item in value
                          if (_filter_value(item, filter_path) == wanted) == (op == "==")]
        values = found
    return values


def human_age(timestamp: str, now: datetime | None = None) -> str:
    """Kubernetes' duration.HumanDuration of the time since `timestamp`."""
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int(((now or datetime.now(timezone.utc)) - then).total_seconds())
    if seconds < -1:
        return "<invalid>"
    seconds = max(seconds, 0)
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 730:
        return f"{days}d"
    return f"{days // 365}y{days % 365}d" if days < 2920 else f"{days // 365}y"


def _pod_cells(pod: dict[str, Any]) -> list[Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or [])
    ready = sum(1 for s in statuses if s.get("ready"))
    phase = (pod.get("status") or {}).get("phase", "Pending")
    if pod["metadata"].get("deletionTimestamp"):
        phase = "Terminating"
    restarts = sum(s.get("restartCount", 0) for s in statuses)
    return [f"{ready}/{total}", phase, restarts]


def _service_cells(service: dict[str, Any]) -> list[Any]:
    spec = service.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
    external = ",".join(spec.get("externalIPs") or []) or (
        "<pending>" if spec.get("type") == "LoadBalancer" else "<none>")
    return [spec.get("type", "ClusterIP"), spec.get("clusterIP", "<none>"), external,
            ports or "<none>"]


def _deployment_cells(deployment: dict[str, Any]) -> list[Any]:
    status = deployment.get("status") or {}
    desired = (deployment.get("spec") or {}).get("replicas", 1)
    return [f"{status.get('readyReplicas', 0)}/{desired}", status.get("updatedReplicas", 0),
            status.get("availableReplicas", 0)]


def _revision_cells(revision: dict[str, Any]) -> list[Any]:
    """kubectl's: the controller as `kind.group/name`, and the revision number."""
    owner = next((r for r in revision["metadata"].get("ownerReferences") or ()
                  if r.get("controller")), None)
    controller = "<none>"
    if owner is not None:
        group = owner.get("apiVersion", "").rpartition("/")[0]
        kind = owner.get("kind", "").lower()
        controller = f"{kind}.{group}/{owner.get('name')}" if group else \
            f"{kind}/{owner.get('name')}"
    return [controller, revision.get("revision", 0)]


def _string_columns(*names: str) -> list[dict[str, Any]]:
    return [{"name": name, "type": "string", "priority": 0, "description": ""} for name in names]


_BUILTIN_COLUMNS = {
    ("", "pods"): ([*_string_columns("Ready", "Status"), {
        "name": "Restarts", "type": "integer", "priority": 0, "description": ""}], _pod_cells),
    ("", "services"): (_string_columns("Type", "Cluster-IP", "External-IP", "Port(s)"),
                       _service_cells),
    ("apps", "deployments"): (_string_columns("Ready", "Up-to-date", "Available"),
                              _deployment_cells),
    ("apps", "controllerrevisions"): ([*_string_columns("Controller"), {
        "name": "Revision", "type": "integer", "priority": 0, "description": ""}],
        _revision_cells),
    ("", "namespaces"): (_string_columns("Status"),
                         lambda ns: [(ns.get("status") or {}).get("phase", "Active")]),
}


def _custom_cell(obj: dict[str, Any], column: dict[str, Any]) -> Any:
    values = jsonpath(obj, column["jsonPath"])
    if not values:
        return None
    if column.get("type") == "date":
        return human_age(values[0]) if isinstance(values[0], str) else values[0]
    return values[0] if len(values) == 1 else ",".join(str(v) for v in values)


def to_table(resource: ResourceType, objects: list[dict[str, Any]], resource_version: str,
             include_object: str = "PartialObjectMetadata") -> dict[str, Any]:
    builtin = _BUILTIN_COLUMNS.get(resource.storage_key)
    if builtin is not None:
        columns, cells_of = builtin[0] + [_AGE_COLUMN], builtin[1]
    else:
        columns = list(resource.printer_columns) or [_AGE_COLUMN]
        cells_of = None
    rows = []
    for obj in objects:
        cells = [obj["metadata"]["name"]]
        if cells_of is not None:
            cells += [*cells_of(obj), human_age(obj["metadata"]["creationTimestamp"])]
        else:
            cells += [_custom_cell(obj, column) for column in columns]
        row: dict[str, Any] = {"cells": cells}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": obj["metadata"]}
        rows.append(row)
    definitions = [_NAME_COLUMN] + [
        {"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
         "description": c.get("description", ""), "priority": c.get("priority", 0)}
        for c in columns]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": definitions, "rows": rows}
