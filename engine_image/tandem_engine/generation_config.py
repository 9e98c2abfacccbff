"""A model's default sampling parameters, as vLLM's `--generation-config auto` reads them.

A request that sets no temperature should sample the way the model's creator recommends,
not at the neutral 1.0 that turns a small chat model's answer into nonsense. So, as vLLM
does, the defaults come from the checkpoint: the keys `temperature`, `top_p`, `top_k`,
`min_p` and `repetition_penalty` of a folder's `generation_config.json`; a GGUF file has
no such file, so a GGUF known to `tandem models` (matched by file name, else by its
pinned sha256) takes the registry's recommendation (`known_models`). A request's own
values always win: these fill only the fields it leaves out.

Every value is checked when the defaults are read (at start), against the same limits a
request meets (`SamplingParams`), so a bad generation_config.json stops the server with
the file, the key and the limit, rather than failing every request. Torch-free: the
router, `tandem generate` and `tandem chat` all read the defaults here.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem_engine.errors import CheckpointError, RequestRejected
from tandem_engine.known_models import KNOWN_MODELS, KnownModel
from tandem_engine.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# The generation_config.json keys vLLM reads with `--generation-config auto` (its
# `max_new_tokens` aside); each is also a SamplingParams field of the same name.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# `--generation-config`: the model's own defaults, or vLLM's neutral ones whatever the
# model says (or a folder holding a generation_config.json).
GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults of a served model; None: the field keeps SamplingParams'
    neutral default. `source` says where they came from (a file, the registry, a flag)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = "none"

    def sampling_kwargs(self) -> dict[str, Any]:
        """The set fields, as SamplingParams keyword arguments."""
        return {key: getattr(self, key) for key in SAMPLING_KEYS
                if getattr(self, key) is not None}

    def describe(self) -> str:
        """One line for a log or a banner: the values and where they came from."""
        kwargs = self.sampling_kwargs()
        values = ", ".join(f"{k}={v:g}" for k, v in kwargs.items()) or "neutral defaults"
        return f"{values} (from {self.source})"


def generation_defaults(model: Path) -> GenerationDefaults:
    """The defaults `model` recommends: a checkpoint folder's generation_config.json, or,
    for a GGUF file, its entry in the `tandem models` registry. No defaults (all None)
    when there is no such file or the GGUF is not a known model. A bad value is a
    CheckpointError naming the file, the key and the limit."""
    model = Path(model)
    if model.is_dir():
        file = model / GENERATION_CONFIG_FILE
        if not file.is_file():
            return GenerationDefaults(source=f"none: {model} has no {GENERATION_CONFIG_FILE}")
        return _from_file(file)
    if model.is_file():
        known = known_model_of(model)
        if known is None:
            return GenerationDefaults(source=f"none: {model.name} is not a model known to "
                                             "`tandem models`")
        return _checked(dict(known.sampling), f"the `tandem models` registry entry "
                        f"{known.name!r} (recommended by {known.sampling_source or 'its card'})")
    raise CheckpointError(f"{model}: no such checkpoint folder or GGUF file, so it has no "
                          "generation config; give the path the model is served from")


def serving_defaults(model: Path, generation_config: str = "auto",
                     override: str | None = None) -> GenerationDefaults:
    """The defaults a server applies, by vLLM's two flags: `--generation-config` is `auto`
    (the model's own, `generation_defaults`), `vllm` (none: the neutral defaults) or a
    folder holding a generation_config.json; `--override-generation-config` is a JSON
    object of the same keys, laid over them (alone, with `vllm`)."""
    if generation_config == "auto":
        base = generation_defaults(model)
    elif generation_config == "vllm":
        base = GenerationDefaults(source="vllm's neutral defaults (--generation-config vllm)")
    else:
        folder = Path(generation_config).expanduser()
        if not (folder / GENERATION_CONFIG_FILE).is_file():
            raise CheckpointError(
                f"--generation-config {generation_config!r}: not 'auto' or 'vllm', and no "
                f"folder with a {GENERATION_CONFIG_FILE} there; give auto (the model's own "
                "defaults), vllm (neutral defaults) or such a folder")
        base = _from_file(folder / GENERATION_CONFIG_FILE)
    if override is None:
        return base
    where = "--override-generation-config"
    try:
        extra = json.loads(override)
    except ValueError as exc:
        raise CheckpointError(f"{where} {override!r} is not JSON ({exc}); give an object "
                              "such as '{\"temperature\": 0.5}'") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{where} {override!r} must be a JSON object such as "
                              "'{\"temperature\": 0.5}'")
    unknown = sorted(set(extra) - set(SAMPLING_KEYS))
    if unknown:
        raise CheckpointError(f"{where}: {', '.join(map(repr, unknown))} is not a sampling "
                              f"default this server applies; use {', '.join(SAMPLING_KEYS)}")
    checked = _checked(extra, where)
    merged = {**base.sampling_kwargs(), **checked.sampling_kwargs()}
    return GenerationDefaults(**merged, source=f"{base.source}, overridden by {where}")


def known_model_of(gguf: Path) -> KnownModel | None:
    """The registry entry a GGUF file is: by file name, else (same size) by sha256."""
    for known in KNOWN_MODELS.values():
        if gguf.name == known.filename:
            return known
    size = gguf.stat().st_size
    same_size = [m for m in KNOWN_MODELS.values() if m.size == size]
    if not same_size:
        return None
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return next((m for m in same_size if m.sha256 == digest.hexdigest()), None)


def _from_file(file: Path) -> GenerationDefaults:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot be read as JSON ({exc}); fix or remove it, or "
                              "start with --generation-config vllm") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: must hold a JSON object; fix or remove it, or start "
                              "with --generation-config vllm")
    return _checked({k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}, str(file))


def _checked(values: dict[str, Any], where: str) -> GenerationDefaults:
    """`values` as GenerationDefaults, each checked against SamplingParams' own limits;
    the error names `where`, the key, the value and the limit."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        integral = key == "top_k"
        if isinstance(value, float) and integral and value.is_integer():
            value = int(value)
        ok_type = (isinstance(value, int) if integral else isinstance(value, int | float)) \
            and not isinstance(value, bool) and math.isfinite(value)
        if not ok_type:
            kind = "an integer" if integral else "a finite number"
            raise _bad(where, key, value, f"must be {kind}")
        try:
            SamplingParams(**{key: value})
        except RequestRejected as exc:
            raise _bad(where, key, value, str(exc).split(" is invalid: ", 1)[-1]) from None
        out[key] = value if integral else float(value)
    return GenerationDefaults(**out, source=where)


def _bad(where: str, key: str, value: Any, limit: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}={value!r} is invalid as a default sampling "
                           f"parameter: {limit}. Fix or remove it, or start with "
                           "--generation-config vllm (neutral defaults) or "
                           f"--override-generation-config '{{\"{key}\": ...}}'")

