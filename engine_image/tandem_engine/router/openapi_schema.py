"""The router's OpenAPI description (GET /openapi.json): request and response schemas.

The handlers read raw JSON (`api_params` validates it, with messages that name the
field), so FastAPI cannot derive these schemas. The request bodies are derived from the
parameter table (`param_table.PARAMS`): each implemented or informational parameter of an
endpoint, with its type and bounds (a refused one is accepted only at a neutral value, so
it is left out); the answers are written here, as plain JSON Schema. `route_docs` hands
each route its request body and responses. They describe what the router accepts and
answers, loosely where the router is more precise (it names the limit in its 400), and
every error status as the OpenAI error object. `secure` marks the operations that need
an API key when keys are configured, so a client generator (or schemathesis) knows to
send one.
"""

from __future__ import annotations

from typing import Any

from tandem_engine.router import param_table as table
from tandem_engine.router.param_table import (
    CHAT_ROLES,
    MAX_MESSAGE_FIELD_CHARS,
    MAX_PROMPTS,
    TOKEN_ID,
    Choice,
    IntRange,
    Length,
    NumberRange,
    Param,
    Status,
    params,
)

Schema = dict[str, Any]

ERROR: Schema = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "integer", "null"]}}}}}


def _integer(bound: IntRange) -> Schema:
    return {"type": "integer", "minimum": bound.low, "maximum": bound.high}


def _token_ids(bound: IntRange) -> Schema:
    return {"type": "array", "items": _integer(bound)}


def _text(bound: Length) -> Schema:
    return {"type": "string", "minLength": bound.low, "maxLength": bound.high}


_TOKEN_IDS = _token_ids(TOKEN_ID)
_NAME: Schema = {"type": "string", "maxLength": MAX_MESSAGE_FIELD_CHARS}
_MESSAGES: Schema = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"anyOf": [
            {"type": "string"}, {"type": "null"},
            {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        "name": _NAME, "tool_call_id": _NAME,
        "tool_calls": {"type": "array", "items": {
            "type": "object", "required": ["id", "type", "function"],
            "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name", "arguments"],
                                        "properties": {"name": {"type": "string"},
                                                       "arguments": {"type": "string"}}}}}}}}}


def param_schema(param: Param, model: str) -> Schema:
    """One parameter's JSON Schema, from its table entry: null (its absence) is allowed
    for every parameter but a required one; `model` names the served model."""
    def typed(name: str) -> str | list[str]:
        return name if param.required else [name, "null"]

    bound = param.bound
    schema: Schema
    if param.name == "model":
        schema = {"type": typed("string"), "enum": [model] if param.required else [model, None]}
    elif param.type == "any":
        schema = {}
    elif param.type == "boolean":
        schema = {"enum": [*bound.values, None]} if isinstance(bound, Choice) \
            else {"type": typed("boolean")}
    elif param.type == "string":
        schema = {**(_text(bound) if isinstance(bound, Length) else {}), "type": typed("string")}
    elif param.type == "integer":
        assert isinstance(bound, IntRange)
        schema = {**_integer(bound), "type": typed("integer")}
    elif param.type == "number":
        assert isinstance(bound, NumberRange)
        low = "exclusiveMinimum" if bound.low_open else "minimum"
        schema = {"type": typed("number"), low: bound.low, "maximum": bound.high}
    elif param.type == "object":
        schema = {"type": typed("object")}
        if param.members:
            schema["properties"] = {m.name: param_schema(m, model) for m in param.members}
    elif param.type == "token_ids":
        assert isinstance(bound, IntRange)
        schema = _token_ids(bound) if param.required \
            else {"anyOf": [_token_ids(bound), {"type": "null"}]}
    elif param.type == "stop":
        assert isinstance(bound, Length)
        schema = {"anyOf": [_text(bound), {"type": "array", "items": _text(bound),
                                            "maxItems": bound.max_items}, {"type": "null"}]}
    elif param.type == "prompt":
        assert isinstance(bound, IntRange)
        ids = {**_token_ids(bound), "minItems": 1}
        batch = {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS}
        schema = {"anyOf": [{"type": "string"}, ids, {**batch, "items": {"type": "string"}},
                            {**batch, "items": ids}]}
    elif param.type == "json":  # its shape is the parser's to check
        schema = {}
    else:  # messages
        schema = dict(_MESSAGES)
    if param.doc:
        schema["description"] = param.doc
    return schema


def request_schema(endpoint: str, model: str, *, exact: bool = False) -> Schema:
    """The body of `endpoint`: its implemented and informational parameters. `exact`: no
    other field (the endpoint refuses any, so the description says so)."""
    documented = params(endpoint, Status.IMPLEMENTED, Status.INFORMATIONAL)
    schema: Schema = {"type": "object", "required": [p.name for p in documented if p.required]}
    if exact:
        schema["additionalProperties"] = False
    schema["properties"] = {p.name: param_schema(p, model) for p in documented}
    return schema


def completion_request(model: str) -> Schema:
    return request_schema(table.COMPLETIONS, model)


def chat_request(model: str) -> Schema:
    return request_schema(table.CHAT, model)


def tokenize_request(model: str) -> Schema:
    # Exact (no unknown field, null for "the default"): the router refuses anything else.
    return {"anyOf": [request_schema(table.TOKENIZE, model, exact=True),
                      request_schema(table.TOKENIZE_CHAT, model, exact=True)]}


def detokenize_request(model: str) -> Schema:
    return request_schema(table.DETOKENIZE, model, exact=True)


_CHOICES: Schema = {"type": "array", "items": {"type": "object", "required": ["index"]}}
COMPLETION: Schema = {"type": "object",
                      "required": ["id", "object", "created", "model", "choices"],
                      "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                     "created": {"type": "integer"},
                                     "model": {"type": "string"}, "choices": _CHOICES,
                                     "usage": {"type": "object"}}}
MODELS: Schema = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"},
    "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                       "created": {"type": "integer"}, "owned_by": {"type": "string"},
                       # A LoRA adapter's: its identity (name@version) and the served
                       # model; the served model's own: its name and null.
                       "root": {"type": "string"}, "parent": {"type": ["string", "null"]},
                       "max_model_len": {"type": ["integer", "null"]},
                       "default_sampling_params": {"type": "object"},
                       "generation_config": {"type": "string"}}}}}}
TOKENIZE: Schema = {"type": "object", "required": ["count", "max_model_len", "tokens"],
                    "properties": {"count": {"type": "integer", "minimum": 0},
                                   "max_model_len": {"type": ["integer", "null"]},
                                   "tokens": _TOKEN_IDS,
                                   "token_strs": {"type": "array", "items": {"type": "string"}}}}
DETOKENIZE: Schema = {"type": "object", "required": ["prompt"],
                      "properties": {"prompt": {"type": "string"}}}
VERSION: Schema = {"type": "object", "required": ["version"],
                   "properties": {"version": {"type": "string"}}}


def _json(schema: Schema, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {"default": _json(ERROR, "an error, in the OpenAI shape")}


def route_docs(body: Schema | None, answer: Schema, *, stream: bool = False
               ) -> dict[str, Any]:
    """Keyword arguments for a FastAPI route: its documented request body and responses."""
    ok = _json(answer, "the answer")
    if stream:
        # Each server-sent event: `data` is a chunk's JSON (or [DONE]).
        ok["content"]["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
    docs: dict[str, Any] = {"responses": {200: ok, **_ERRORS}}
    if body is not None:
        docs["openapi_extra"] = {"requestBody": {
            "required": True, "content": {"application/json": {"schema": body}}}}
    return docs


def secure(schema: Schema, open_paths: frozenset[str]) -> Schema:
    """The schema with bearer-key security on every operation outside `open_paths`."""
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = {
        "type": "http", "scheme": "bearer",
        "description": "one of the router's API keys (--api-key, $TANDEM_API_KEY)"}
    for path, operations in schema.get("paths", {}).items():
        if path in open_paths:
            continue
        for operation in operations.values():
            operation["security"] = [{"apiKey": []}]
            operation.setdefault("responses", {})["401"] = _json(ERROR, "no valid API key")
    return schema
