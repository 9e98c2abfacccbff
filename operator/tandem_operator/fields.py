"""Reading one field of a raw InferencePool body: its type, its bounds, the CRD's default.

`tandem_operator.spec` and `tandem_operator.pod_spec` parse a body section by section with
these; each refusal is a `SpecError` naming the field (`spec.engine.maxNumSeqs`) and the
rule, as the API server's own message would.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

_DECIMAL = re.compile(r"[0-9]{1,7}(\.[0-9]{1,6})?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


class SpecError(ValueError):
    """The body is not a spec the CRD accepts; the message names the field and the rule."""


def object_field(d: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key} must be an object, not {type(value).__name__}")
    return value


def int_field(d: Mapping[str, Any], key: str, path: str, default: int | None, lo: int,
              hi: int) -> int | None:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key} must be an integer, not {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"{path}.{key} = {value} is outside {lo}..{hi}")
    return value


def required_int(d: Mapping[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
    value = int_field(d, key, path, default, lo, hi)
    assert value is not None  # a default was given
    return value


PERCENT = re.compile(r"(100|[1-9]?[0-9])%")  # the CRD's pattern, without its anchors


def int_or_percent_field(d: Mapping[str, Any], key: str, path: str, default: int | str,
                         lo: int, hi: int) -> int | str:
    """An integer within lo..hi or a percentage from "0%" to "100%" (an IntOrString, as a
    Deployment's maxSurge), kept as written: its meaning depends on a replica count."""
    value = d.get(key, default)
    if isinstance(value, str):
        if not PERCENT.fullmatch(value):
            raise SpecError(f'{path}.{key} = {value!r} is neither an integer nor a percentage '
                            f'from "0%" to "100%" such as "25%"')
        return value
    return required_int({key: value}, key, path, 0, lo, hi)


def str_field(d: Mapping[str, Any], key: str, path: str, default: str | None, max_len: int,
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


def decimal_field(d: Mapping[str, Any], key: str, path: str,
                  problem: Callable[[float], str | None], example: str,
                  default: float | None = None) -> float | None:
    """A number written as a decimal string ("1.5": the Kubernetes API has no floats),
    within the range `problem` checks; `default` when unset."""
    if d.get(key) is None:
        return default
    text = str_field(d, key, path, None, 14)
    if not _DECIMAL.fullmatch(text):
        raise SpecError(f'{path}.{key} = {text!r} is not a decimal number such as "{example}"')
    value = float(text)
    if (why := problem(value)) is not None:
        raise SpecError(f"{path}.{key}: {why}")
    return value


# A Kubernetes quantity without a sign (resource.Quantity's syntax): a decimal number and a
# binary (Ki..Ei) or decimal (n, u, m, k..E) suffix or an exponent. The CRD's pattern too.
QUANTITY = re.compile(r"(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
                      r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))?")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_POWER = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15,
                  "E": 18}


def quantity_value(text: str) -> int | None:
    """A quantity's value as a whole number, a fraction rounded up as Kubernetes'
    Quantity.Value() rounds a pod's memory ("1.5" -> 2); None when `text` is no quantity."""
    match = QUANTITY.fullmatch(text)
    if match is None:
        return None
    value = Fraction(match["number"])
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        value *= 1024 ** _BINARY[suffix]
    elif suffix in _DECIMAL_POWER:
        value *= Fraction(10) ** _DECIMAL_POWER[suffix]
    else:  # an exponent, e.g. 5e9
        value *= Fraction(10) ** int(Fraction(suffix[1:]))
    return math.ceil(value)


def binary_quantity(value: int) -> str:
    """A byte count as the largest binary suffix that writes it whole: 16777216 -> 16Mi."""
    for suffix, power in reversed(_BINARY.items()):
        if value and value % 1024**power == 0:
            return f"{value // 1024**power}{suffix}"
    return str(value)


def quantity_field(d: Mapping[str, Any], key: str, path: str, lo: int, hi: int) -> int | None:
    """A Kubernetes quantity (an IntOrString: "512Mi", "8Gi", 1073741824) as a whole number
    within lo..hi (bytes, for memory); None when unset."""
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SpecError(f'{path}.{key} must be a quantity such as "512Mi", not {value!r}')
    number = value if isinstance(value, int) else quantity_value(value)
    if number is None or (isinstance(value, str) and len(value) > 32):
        raise SpecError(f'{path}.{key} = {value!r} is not a Kubernetes quantity such as '
                        '"512Mi", "8Gi" or "1G"')
    if not lo <= number <= hi:
        raise SpecError(f"{path}.{key} = {value!r} ({number} bytes) is outside "
                        f"{binary_quantity(lo)}..{binary_quantity(hi)}")
    return number


def list_field(d: Mapping[str, Any], key: str, path: str, max_items: int) -> tuple[Any, ...]:
    value = d.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key} must be a list")
    if len(value) > max_items:
        raise SpecError(f"{path}.{key} has {len(value)} items; at most {max_items} are allowed")
    return tuple(value)


def strings_field(d: Mapping[str, Any], key: str, path: str, max_items: int) -> tuple[str, ...]:
    items = list_field(d, key, path, max_items)
    for i, item in enumerate(items):
        if not isinstance(item, str) or len(item) > 1024:
            raise SpecError(f"{path}.{key}[{i}] must be a string of at most 1024 characters")
    return items


def absolute_paths(d: Mapping[str, Any], key: str, path: str, max_items: int
                   ) -> tuple[str, ...]:
    items = strings_field(d, key, path, max_items)
    for i, item in enumerate(items):
        if not item.startswith("/"):
            raise SpecError(f"{path}.{key}[{i}] = {item!r} must be an absolute path")
    return items


def bool_field(d: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key} must be true or false, not {value!r}")
    return value


def dns_name(d: Mapping[str, Any], key: str, path: str) -> str | None:
    """An optional object name (a DNS subdomain: PriorityClass, RuntimeClass, Secret)."""
    if d.get(key) is None:
        return None
    name = str_field(d, key, path, None, 253, min_len=1)
    if not DNS_SUBDOMAIN.fullmatch(name):
        raise SpecError(f"{path}.{key} {name!r} is not an object name (lowercase letters, "
                        "digits, '-' and '.')")
    return name


def volume_mounts(d: Mapping[str, Any], path: str, volumes: tuple[Any, ...], read_only: bool
                  ) -> tuple[Mapping[str, Any], ...]:
    """volumeMounts, each naming one of spec.engine.volumes (`read_only` by default)."""
    names = {v.get("name") for v in volumes if isinstance(v, Mapping)}
    mounts = []
    for m in list_field(d, "volumeMounts", path, 16):
        if not isinstance(m, Mapping) or m.get("name") not in names:
            raise SpecError(f"{path}.volumeMounts entry {m!r} names no volume of "
                            f"spec.engine.volumes ({', '.join(sorted(map(str, names))) or 'none'})")
        mounts.append({"readOnly": True, **m} if read_only else dict(m))
    return tuple(mounts)
