"""A request's structured-outputs parameters -> one `StructuredOutputsParams`, checked.

OpenAI's `response_format`, vLLM's `structured_outputs` and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structural_tag` all say what the
output must match; a request may use one of them (two would contradict or repeat each
other, so that is a 400 naming both). `guided_whitespace_pattern` and
`guided_decoding_backend` only qualify them. `read_structured` turns the body into the
engine's parameters (pure, no grammar compiled); `GrammarCheck` then compiles the
grammar against the served tokenizer with the engines' limits, once per distinct
constraint (an LRU), on a worker thread: a schema, regex or grammar the library rejects
is a 400 quoting the library's reason, before anything reaches an engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any

from tandem_engine.errors import RequestRejected
from tandem_engine.router.request_errors import InvalidRequest, show
from tandem_engine.structured_outputs import (
    StructuredOutputsParams,
    check_grammar,
    grammar_text,
    ll_tokenizer,
)
from tandem_engine.tokenizer import Tokenizer

# Each names what the output must match; at most one per request.
SOURCES = ("response_format", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar", "structural_tag")
BACKENDS = ("auto", "llguidance", "guidance")  # guided_decoding_backend values accepted
# structured_outputs' fields: the constraints, and what qualifies them.
_QUALIFIERS = ("whitespace_pattern",)
# vLLM's options that change nothing here when at these values (anything else: a 400).
_NEUTRAL_OPTIONS = {"disable_fallback": (False, True), "disable_any_whitespace": (False,),
                    "disable_additional_properties": (False,), "backend": (None, *BACKENDS)}


def read_structured(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the parameter that set it (None, None: none)."""
    given = [name for name in SOURCES if body.get(name) is not None
             and not (name == "response_format" and _text_format(body[name]))]
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise InvalidRequest(f"guided_decoding_backend={show(backend)} is not available: this "
                             f"server constrains outputs with llguidance; use one of "
                             f"{', '.join(BACKENDS)} or leave it out",
                             "guided_decoding_backend")
    whitespace = body.get("guided_whitespace_pattern")
    if not given:
        if whitespace is not None:
            raise InvalidRequest("guided_whitespace_pattern needs a JSON constraint "
                                 "(guided_json, response_format or structured_outputs.json)",
                                 "guided_whitespace_pattern")
        return None, None
    if len(given) > 1:
        raise InvalidRequest(f"{given[0]} and {given[1]} both constrain the output: give one "
                             f"of {', '.join(SOURCES)}", given[1])
    name = given[0]
    value = body[name]
    fields = _READ[name](value)
    if whitespace is not None:
        fields.setdefault("whitespace_pattern", whitespace)
    return _params(fields, name), name


def _text_format(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1


def _params(fields: dict[str, Any], name: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except RequestRejected as exc:
        reason = str(exc).split(" is invalid: ", 1)[-1]
        kind = next(iter(fields))
        raise InvalidRequest(f"{name} is invalid ({kind}): {reason}", name) from None


def _response_format(value: Any) -> dict[str, Any]:
    where = "response_format"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object such as {{\"type\": \"json_object\"}}",
                             where)
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise InvalidRequest(f"{where}.type={show(kind)} is not one of text, json_object, "
                             "json_schema", f"{where}.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{where}.json_schema is required with type json_schema: "
                             "{\"name\": ..., \"schema\": {...}}", f"{where}.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where}.json_schema.schema must be a JSON schema object, not "
                             f"{show(schema)}", f"{where}.json_schema.schema")
    return {"json": json.dumps(schema)}


def _structured_outputs(value: Any) -> dict[str, Any]:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object with one of json, json_object, "
                             "regex, choice, grammar, structural_tag", where)
    fields: dict[str, Any] = {}
    for key, item in value.items():
        if item is None:
            continue
        if key in _NEUTRAL_OPTIONS:
            if item not in _NEUTRAL_OPTIONS[key]:
                raise InvalidRequest(f"{where}.{key}={show(item)} is not supported by this "
                                     "server", f"{where}.{key}")
            continue
        if key == "json":
            fields["json"] = _schema_text(item, f"{where}.json")
        elif key == "json_object":
            if item is not True and item is not False:
                raise InvalidRequest(f"{where}.json_object must be true or false",
                                     f"{where}.json_object")
            if item:
                fields["json_object"] = True
        elif key == "choice":
            fields["choice"] = _choices(item, f"{where}.choice")
        elif key == "structural_tag":
            fields["structural_tag"] = _schema_text(item, f"{where}.structural_tag")
        elif key in ("regex", "grammar", *_QUALIFIERS):
            if not isinstance(item, str):
                raise InvalidRequest(f"{where}.{key} must be a string", f"{where}.{key}")
            fields[key] = item
        else:
            raise InvalidRequest(f"{where}.{key} is not a structured_outputs field (one of "
                                 "json, json_object, regex, choice, grammar, structural_tag, "
                                 "whitespace_pattern)", f"{where}.{key}")
    if not any(k not in _QUALIFIERS for k in fields):
        raise InvalidRequest(f"{where} must set one of json, json_object, regex, choice, "
                             "grammar, structural_tag", where)
    return fields


def _schema_text(value: Any, where: str) -> str:
    """A JSON value given as an object or as its text, as text."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"{where} must be a JSON object (or its text), not {show(value)}",
                         where)


def _choices(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidRequest(f"{where} must be a non-empty list of strings", where)
    return tuple(value)


def _string(name: str, kind: str) -> Any:
    def read(value: Any) -> dict[str, Any]:
        if not isinstance(value, str):
            raise InvalidRequest(f"{name} must be a string", name)
        return {kind: value}
    return read


_READ = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda v: {"json": _schema_text(v, "guided_json")},
    "guided_regex": _string("guided_regex", "regex"),
    "guided_choice": lambda v: {"choice": _choices(v, "guided_choice")},
    "guided_grammar": _string("guided_grammar", "grammar"),
    "structural_tag": lambda v: {"structural_tag": _schema_text(v, "structural_tag")},
}


class GrammarCheck:
    """Compiles each distinct constraint once against the served tokenizer (what the
    engines will compile), remembering the verdict for the last `cache_size` ones."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self._ll: Any = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[StructuredOutputsParams, str] = OrderedDict()
        self.cache_size = cache_size

    async def check(self, params: StructuredOutputsParams, param: str) -> None:
        """Raise InvalidRequest (naming `param`) when `params` does not compile."""
        error = await asyncio.to_thread(self.error, params)
        if error:
            raise InvalidRequest(f"{param}: the {params.kind} constraint does not compile: "
                                 f"{error}", param)

    def error(self, params: StructuredOutputsParams) -> str:
        """The library's reason `params` does not compile ("" when it does)."""
        with self._lock:
            verdict = self._verdicts.get(params)
            if verdict is not None:
                self._verdicts.move_to_end(params)
                return verdict
            if self._ll is None:
                self._ll = ll_tokenizer(self._tokenizer)
        try:
            verdict = check_grammar(grammar_text(params), self._ll)
        except RequestRejected as exc:
            verdict = str(exc).split(" is invalid: ", 1)[-1]
        with self._lock:
            self._verdicts[params] = verdict
            while len(self._verdicts) > self.cache_size:
                self._verdicts.popitem(last=False)
        return verdict
