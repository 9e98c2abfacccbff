"""What one engine flag is, and what is derived from it.

An engine flag is stated once, as an `EngineFlag` in the table beside the config it sets
(`tandem_engine.config.ENGINE_FLAGS`): its field, flag name, type, default, bounds, the
rule's words and its help. From that entry come the `tandem-engine` parser
(`add_flags`), the bounds `EngineConfig.validate` and `SpeculativeConfig.validate` apply
(`check_fields`), the flags `tandem serve` gives its engines and the operator renders into
pod args (`flag_args`), and the operator's bounds and defaults for the InferencePool field
that sets it (`PoolField`), which tests/server/test_engine_flags.py holds equal to the CRD's.

Torch-free and free of the rest of the engine: the operator imports it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

# Which object carries the flag's value: EngineConfig, its SpeculativeConfig, or the engine
# process itself (a flag no config holds, such as torch's thread count).
Scope = Literal["engine", "speculative", "process"]
# How an InferencePool field spells a flag's value: an integer within the field's range; a
# CamelCase enum word (the flag's value, lowercased); a string; a decimal string ("0.9":
# the Kubernetes API has no floats); a Kubernetes quantity ("2Gi") of the flag's unit.
PoolKind = Literal["integer", "enum", "string", "decimal", "quantity"]


@dataclass(frozen=True)
class PoolField:
    """The InferencePool field that sets a flag: `path` under `spec`, as the CRD spells
    it, `kind` how it spells the value, and for an integer or a quantity the range the CRD
    allows (a quantity's in the flag's unit). The CRD bounds every field, so where the
    engine sets no limit the pool's range is the narrower one. `scale` turns the field's
    unit into the flag's (MiB into bytes); `defaulted` says whether the CRD states the
    table's default (a CEL rule fills it in where the field is refused for some specs)."""

    path: str
    minimum: int | None = None
    maximum: int | None = None
    scale: int = 1
    defaulted: bool = True
    kind: PoolKind = "integer"

    @property
    def key(self) -> str:
        """The field's own name: `maxNumSeqs` of `engine.maxNumSeqs`."""
        return self.path.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        """Where the field sits, as an error names it: `spec.engine`."""
        return "spec." + self.path.rpartition(".")[0]


class EngineOptionError(ValueError):
    """An engine option its flag's rule refuses. `field` names the config field, `value`
    its value, `limit` the rule in words; when the value is below another field's (an
    ordering rule), `floor` names that field and `floor_value` holds its value."""

    def __init__(self, scope: Scope, field: str, value: Any, limit: str,
                 floor: str | None = None, floor_value: Any = None) -> None:
        word = "speculative" if scope == "speculative" else "engine"
        super().__init__(f"{word} option {field}={value!r} is invalid: {limit}")
        self.field, self.value, self.limit = field, value, limit
        self.floor, self.floor_value = floor, floor_value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: Any) -> str:
    """A value as a flag's argument: a whole float as an integer (60, not 60.0)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag. `field` is the config field it sets (vLLM's name); `default` is
    the flag's, None meaning unset. The bounds are inclusive unless `above_minimum`;
    `floor` names a field of the same config whose value bounds this one below; `whole`
    refuses anything but an int (a bool or a float too). `limit` is the rule in words,
    as the error gives it (`{floor}` becomes the floor's value)."""

    field: str
    flag: str
    type: Callable[[str], Any]
    default: Any
    help: str
    scope: Scope = "engine"
    minimum: float | None = None
    maximum: float | None = None
    above_minimum: bool = False
    floor: str | None = None
    whole: bool = False
    choices: tuple[str, ...] = ()
    limit: str = ""
    metavar: str | None = None
    # "+": several values after one flag, as a list (a process flag such as
    # --lora-modules); its default is None (unset), and it renders as one flag and them.
    nargs: str | None = None
    serve: bool = False  # `tandem serve` takes it and gives it to every engine it starts
    ngram_only: bool = False  # means something to speculative method ngram only
    cuda_only: bool = False  # means nothing to an engine on the CPU: not rendered for one
    pool: PoolField | None = None  # the InferencePool field the operator renders it from

    @property
    def dest(self) -> str:
        """The parsed namespace's attribute: argparse's own for the flag."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def pool_default(self) -> int | float | str | None:
        """The flag's default in the pool field's unit (None: the flag has none)."""
        if self.pool is None or self.default is None:
            return None
        if self.pool.kind in ("integer", "quantity"):
            return int(self.default) // self.pool.scale
        return self.default

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        if self.type is bool:
            parser.add_argument(self.flag, action=argparse.BooleanOptionalAction,
                                default=self.default, help=self.help)
            return
        options: dict[str, Any] = {"default": self.default, "help": self.help}
        if self.choices:
            options["choices"] = self.choices
        elif self.type is not str:
            options["type"] = self.type
        if self.metavar:
            options["metavar"] = self.metavar
        if self.nargs:
            options["nargs"] = self.nargs
        parser.add_argument(self.flag, **options)

    def check(self, value: Any, floor_value: Any = None) -> None:
        """EngineOptionError unless `value` keeps the flag's rule (`floor_value`: the value
        of the `floor` field). Unset (None) is allowed where the default is unset."""
        if self.choices:
            ok = value in self.choices
        elif value is None:
            ok = self.default is None
        elif self.whole and not _is_int(value):
            ok = False
        else:
            if self.floor is not None and value < floor_value:
                raise EngineOptionError(self.scope, self.field, value,
                                        self.limit.format(floor=floor_value), self.floor,
                                        floor_value)
            low = self.minimum
            ok = ((low is None or (value > low if self.above_minimum else value >= low))
                  and (self.maximum is None or value <= self.maximum))
        if not ok:
            raise EngineOptionError(self.scope, self.field, value,
                                    self.limit.format(floor=floor_value))

    def args(self, value: Any) -> list[str]:
        """The flag with `value`, as a command line takes it (nothing for None)."""
        if value is None:
            return []
        if self.nargs:
            return [self.flag, *map(_text, value)] if value else []
        if self.type is bool:
            return [self.flag if value else "--no-" + self.flag.removeprefix("--")]
        return [self.flag, _text(value)]

    def applies(self, values: Mapping[str, Any]) -> bool:
        """Whether the flag means something among `values` (field -> value): speculative
        flags only with a method, the prompt-lookup ones only with method ngram, CUDA-only
        ones unless the device is the CPU."""
        if (self.scope == "speculative" and self.field != "method"
                and values.get("method") is None):
            return False
        if self.cuda_only and str(values.get("device", "")).strip().lower() == "cpu":
            return False
        return not self.ngram_only or values.get("method") == "ngram"


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
              flags: Iterable[EngineFlag]) -> None:
    for flag in flags:
        flag.add_to(parser)


def check_fields(config: object, flags: Iterable[EngineFlag]) -> None:
    """Each flag's rule on `config`'s field of the same name (flags of its scope)."""
    for flag in flags:
        floor = getattr(config, flag.floor) if flag.floor is not None else None
        flag.check(getattr(config, flag.field), floor)


def flag_args(flags: Iterable[EngineFlag], values: Mapping[str, Any]) -> list[str]:
    """The command line of `values` (field -> value), in the table's order: every flag
    whose field has a value there and means something beside the others."""
    out: list[str] = []
    for flag in flags:
        if flag.field in values and flag.applies(values):
            out += flag.args(values[flag.field])
    return out


def namespace_values(flags: Iterable[EngineFlag], args: argparse.Namespace
                     ) -> dict[str, Any]:
    """The values a parsed command line gives the flags' fields."""
    return {flag.field: getattr(args, flag.dest) for flag in flags}
