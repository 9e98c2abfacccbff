"""The engine-flag table (config.ENGINE_FLAGS) is the one statement of each engine flag:
the CRD's bounds and defaults equal it, the `tandem-engine` parser takes every entry,
`tandem serve` passes its entries through, and the operator renders its pool fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from tandem_engine.cli.main import build_parser as tandem_parser
from tandem_engine.cli.main import serve_engine_args
from tandem_engine.config import (
    ENGINE_FLAGS,
    POOL_FLAGS,
    SERVE_FLAGS,
    SUPPORTED_DTYPES,
    EngineConfig,
    SpeculativeConfig,
)
from tandem_engine.engine_flags import EngineFlag, EngineOptionError, namespace_values
from tandem_engine.server import main as engine_main
from tandem_operator import manifests as m
from tandem_operator.fields import binary_quantity
from tandem_operator.spec import (
    RENDERED_ENGINE_FLAGS,
    Dtype,
    EngineDevice,
    PoolSpec,
    Quantization,
    SpecError,
    SpeculativeMethod,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((ROOT / "crds" / "inferencepools.tandem.dev.yaml").read_text())[
    "spec"]["versions"][0]["schema"]["openAPIV3Schema"]
BASE = ["--model", "m", "--port", "1", "--admin-port", "2"]
# The CR's enums spell the engine's values in CamelCase.
POOL_ENUMS = {"device": EngineDevice, "method": SpeculativeMethod,
              "quantization": Quantization, "dtype": Dtype, "kv_cache_dtype": Dtype}
IDS = [flag.field for flag in ENGINE_FLAGS]
# Fields that bound another from below: sampled at their lowest, so the other's default fits.
FLOORS = {flag.floor for flag in ENGINE_FLAGS if flag.floor is not None}


def schema_node(path: str) -> dict[str, Any]:
    node = SCHEMA["properties"]["spec"]
    for name in path.split("."):
        node = node["properties"][name]
    return node


def pool(**spec: Any) -> PoolSpec:
    body = {"model": {"name": "llama", "weights": {"uri": "file:///models/llama",
                                                   "version": "v1"}}, **spec}
    return PoolSpec.from_body({"metadata": {"name": "pool", "namespace": "ns"}, "spec": body})


def nest(path: str, value: Any) -> dict[str, Any]:
    """{"engine": {"kvCache": {"blockSize": value}}} of "engine.kvCache.blockSize"."""
    *parents, key = path.split(".")
    body: dict[str, Any] = {key: value}
    for parent in reversed(parents):
        body = {parent: body}
    return body


def sample(flag: EngineFlag) -> Any:
    """A value the flag's rule accepts, other than its default where it can be."""
    if flag.choices:
        return flag.choices[-1]
    if flag.type is bool:
        return not flag.default
    if flag.maximum is not None and flag.field not in FLOORS:
        return flag.maximum
    if flag.minimum is not None:
        return int(flag.minimum) + 2
    return {"device": "cpu", "dtype": "bfloat16", "model": "/models/draft",
            "lora_modules": ["a=/adapters/a", "b@2=/adapters/b"]}.get(flag.field, 3)


@pytest.mark.parametrize("flag", POOL_FLAGS, ids=[f.field for f in POOL_FLAGS])
def test_the_crds_bounds_and_defaults_are_the_tables(flag: EngineFlag) -> None:
    assert flag.pool is not None
    node = schema_node(flag.pool.path)
    if flag.pool.kind == "enum":
        kind = POOL_ENUMS[flag.field]
        assert node["enum"] == [member.value for member in kind]
        assert node.get("default", "").lower() == (flag.default or "")
        return
    if flag.pool.kind == "string":  # a checkpoint URI, bounded as spec.model.weights.uri is
        assert node["type"] == "string" and node["maxLength"] == 1024
        return
    if flag.pool.kind == "decimal":  # the pattern admits what the flag's rule does
        assert node["type"] == "string" and "default" not in node
        for text in ("0.000001", "0.05", "0.9", "0.95", "1", "1.0", "0", "0.0", "1.5",
                     "1.000001", "2", ".9", "-0.5"):
            admitted = re.fullmatch(node["pattern"], text) is not None
            try:
                flag.check(float(text))
                ok = True
            except EngineOptionError:
                ok = False
            assert admitted == (ok and text[0].isdigit()), text
        return
    if flag.pool.kind == "quantity":  # a form the schema checks; the range, the operator
        assert node["x-kubernetes-int-or-string"] and "default" not in node
        assert (f"from {binary_quantity(flag.pool.minimum or 0)} to "
                f"{binary_quantity(flag.pool.maximum or 0)}") in node["description"]
        return
    assert node["type"] == "integer"
    assert (node["minimum"], node["maximum"]) == (flag.pool.minimum, flag.pool.maximum)
    stated = flag.pool_default if flag.pool.defaulted else None
    assert node.get("default") == stated


def test_the_pools_dtypes_are_the_engines() -> None:
    assert [d.flag for d in Dtype] == ["auto", *SUPPORTED_DTYPES]
    for d in Dtype:
        EngineConfig(dtype=d.flag).validate()


@pytest.mark.parametrize("flag", POOL_FLAGS, ids=[f.field for f in POOL_FLAGS])
def test_a_pool_may_ask_only_what_the_engine_takes(flag: EngineFlag) -> None:
    """The CRD bounds every field; its range is the engine's or inside it."""
    pool_field = flag.pool
    assert pool_field is not None
    if pool_field.minimum is None:
        return
    for value in (pool_field.minimum, pool_field.maximum):
        floor = value if flag.floor is not None else None
        flag.check(value * pool_field.scale, floor)


def test_the_table_defaults_are_the_configs() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    defaults |= {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    for flag in ENGINE_FLAGS:
        if flag.scope == "process" or flag.field == "method":  # the flag's None: off
            continue
        assert defaults[flag.field] == flag.default, flag.field
    flags = [f.flag for f in ENGINE_FLAGS]
    assert len(flags) == len(set(flags)), "a flag is declared twice"


@pytest.mark.parametrize("flag", ENGINE_FLAGS, ids=IDS)
def test_tandem_engine_takes_every_entry(flag: EngineFlag) -> None:
    parser = engine_main.build_parser()
    assert getattr(parser.parse_args(BASE), flag.dest) == flag.default
    value = sample(flag)
    speculative = [] if flag.field == "method" or flag.scope != "speculative" else [
        "--speculative-method", "draft" if flag.field == "model" else "ngram"]
    draft = ["--speculative-model", "/d"] if value == "draft" else []
    args = parser.parse_args([*BASE, *speculative, *draft, *flag.args(value)])
    assert getattr(args, flag.dest) == value
    config = engine_main.engine_config(args)
    if flag.scope == "engine":
        assert getattr(config, flag.field) == value
    elif flag.scope == "speculative":
        assert getattr(config.speculative, flag.field) == value


def test_tandem_serve_passes_every_serve_entry_through() -> None:
    argv = ["serve", "--demo", "--speculative-method", "ngram"]
    for flag in SERVE_FLAGS:
        if flag.field not in ("method", "model"):
            argv += flag.args(sample(flag))
    serve = tandem_parser().parse_args(argv)
    engine_args = serve_engine_args(serve)
    passed = engine_main.build_parser().parse_args([*BASE, *engine_args])
    values = namespace_values(SERVE_FLAGS, serve)
    for flag in SERVE_FLAGS:
        if flag.field != "model" and flag.applies(values):
            assert getattr(passed, flag.dest) == getattr(serve, flag.dest), flag.flag
    # a CUDA-only flag means nothing to the CPU engines it would start
    assert values["device"] == "cpu" and "--gpu-memory-utilization" not in engine_args


@pytest.mark.parametrize("flag", POOL_FLAGS, ids=[f.field for f in POOL_FLAGS])
def test_the_operator_renders_every_pool_entry(flag: EngineFlag) -> None:
    assert flag.pool is not None
    spec: dict[str, Any] = {}
    if flag.scope == "speculative":
        spec = {"engine": {"speculative": {"method": "Ngram"}}}
    if flag.field == "model":
        spec = {"engine": {"speculative": {"method": "Draft"}}, "model": {
            "name": "llama", "weights": {"uri": "file:///models/llama", "version": "v1",
                                         "draft": {"uri": "file:///models/draft"}}}}
        value, want = None, "/models/draft"
    elif flag.field in POOL_ENUMS:
        value = list(POOL_ENUMS[flag.field])[-1].value
        want = value.lower()
    elif flag.pool.kind == "decimal":
        value, want = "0.5", "0.5"
        spec = {"engine": {"device": "CUDA"}}  # a CUDA-only flag
    else:
        value = flag.pool.minimum if flag.field in FLOORS else flag.pool.maximum
        want = str(value * flag.pool.scale)
    if value is not None:
        section = nest(flag.pool.path, value)
        for key, sub in section.items():
            spec[key] = {**spec.get(key, {}), **sub}
            if key == "engine" and "speculative" in sub:
                spec[key]["speculative"] = {**{"method": "Ngram"}, **sub["speculative"]}
    parsed = pool(**spec)
    args = m.pod(parsed, "decode", parsed.weights)["spec"]["containers"][0]["args"]
    assert args[args.index(flag.flag) + 1] == want
    # What the operator renders, tandem-engine takes.
    engine_main.build_parser().parse_args([*BASE, *args[args.index("--max-num-seqs"):]])


_PASSED = [f for f in ENGINE_FLAGS if f.pool is None and f.flag not in RENDERED_ENGINE_FLAGS]
_RENDERED = [f for f in ENGINE_FLAGS if f.pool is None and f.flag in RENDERED_ENGINE_FLAGS]


@pytest.mark.parametrize("flag", _PASSED, ids=[f.field for f in _PASSED])
def test_flags_without_a_pool_field_pass_through_engine_args(flag: EngineFlag) -> None:
    parsed = pool(engine={"args": flag.args(sample(flag))})
    args = m.pod(parsed, "decode", parsed.weights)["spec"]["containers"][0]["args"]
    assert args[-len(flag.args(sample(flag))):] == flag.args(sample(flag))


@pytest.mark.parametrize("flag", _RENDERED, ids=[f.field for f in _RENDERED])
def test_flags_the_operator_renders_from_other_fields_are_refused_in_engine_args(
        flag: EngineFlag) -> None:
    """The LoRA flags come from spec.engine.lora and spec.adapters, not engine.args."""
    with pytest.raises(SpecError, match=re.escape(f"the operator renders {flag.flag} from")):
        pool(engine={"args": flag.args(sample(flag))})


def test_the_engines_ordering_rule_names_the_pools_fields() -> None:
    """spec.py states no bound of its own: the engine's rule refuses, in the CR's names."""
    with pytest.raises(SpecError, match=r"spec\.engine\.speculative\.promptLookupMax = 3 is "
                       r"below promptLookupMin = 5: raise promptLookupMax or lower "
                       r"promptLookupMin"):
        pool(engine={"speculative": {"method": "Ngram", "promptLookupMin": 5,
                                     "promptLookupMax": 3}})
