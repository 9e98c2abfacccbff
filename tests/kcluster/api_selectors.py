"""Label and field selectors, as list and watch requests send them.

kmock ignores both, so a kubelet watching `spec.nodeName=node-1` or a router watching
`tandem.dev/pool=p` would see every pod. Field selectors here accept any dotted field path
(the real server allows only a few per kind; a superset keeps tests simple), with a missing
field reading as "".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]

_LABEL_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_SET_REQ = re.compile(rf"^({_LABEL_KEY})\s+(in|notin)\s+\(([^)]*)\)$")
_CMP_REQ = re.compile(rf"^({_LABEL_KEY})\s*(==|=|!=|>|<)\s*([-A-Za-z0-9_.]*)$")
_EXISTS_REQ = re.compile(rf"^(!?)\s*({_LABEL_KEY})$")


def _split_top_level(selector: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b` -> ['a in (x,y)', 'b']."""
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


def _label_requirement(text: str) -> Callable[[dict[str, str]], bool]:
    if match := _SET_REQ.match(text):
        key, op, values_text = match.groups()
        values = {v.strip() for v in values_text.split(",")}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _CMP_REQ.match(text):
        key, op, value = match.groups()
        if op in ("=", "=="):
            return lambda labels: labels.get(key) == value
        if op == "!=":
            return lambda labels: labels.get(key) != value
        bound, sign = int(value), 1 if op == ">" else -1  # > and < compare integers
        return lambda labels: labels.get(key, "").isdigit() and \
            (int(labels[key]) - bound) * sign > 0
    if match := _EXISTS_REQ.match(text):
        negated, key = match.groups()
        return (lambda labels: key not in labels) if negated else (lambda labels: key in labels)
    raise ValueError(f"unable to parse requirement: {text!r}")


def label_selector(selector: str) -> Predicate:
    """A predicate over whole objects for a labelSelector string; raises ValueError if invalid."""
    requirements = [_label_requirement(part) for part in _split_top_level(selector)]

    def matches(obj: dict[str, Any]) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(requirement(labels) for requirement in requirements)

    return matches


def field_value(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def field_selector(selector: str) -> Predicate:
    """A predicate for a fieldSelector string (`=`, `==`, `!=`); raises ValueError if invalid."""
    requirements: list[tuple[str, bool, str]] = []
    for part in _split_top_level(selector):
        match = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", part)
        if not match:
            raise ValueError(f"invalid field selector: {part!r}")
        path, op, value = match.groups()
        requirements.append((path, op != "!=", value.replace("\\", "")))

    def matches(obj: dict[str, Any]) -> bool:
        return all((field_value(obj, path) == value) == equal
                   for path, equal, value in requirements)

    return matches


def selector_predicate(label: str | None, field: str | None) -> Predicate:
    """Combine the optional label and field selectors of one request."""
    label_match = label_selector(label) if label else None
    field_match = field_selector(field) if field else None
    return lambda obj: ((label_match is None or label_match(obj))
                        and (field_match is None or field_match(obj)))
