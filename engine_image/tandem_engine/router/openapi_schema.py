"""The router's OpenAPI description (GET /openapi.json): request and response schemas.

The handlers read raw JSON (`api_params` validates it, with messages that name the
field), so FastAPI cannot derive these schemas; they are written here, as plain JSON
Schema, and `route_docs` hands each route its request body and responses. They describe
what the router accepts and answers, loosely where the router is more precise (it
names the limit in its 400), and every error status as the OpenAI error object.
`secure` marks the operations that need an API key when keys are configured, so a
client generator (or schemathesis) knows to send one.
"""

from __future__ import annotations

from typing import Any

from tandem_engine.router.api_params import CHAT_ROLES, MAX_N, MAX_SEED
from tandem_engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS

Schema = dict[str, Any]

ERROR: Schema = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "integer", "null"]}}}}}

_TOKEN_IDS: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STOP: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                                 "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]}


def _sampling(model: str) -> Schema:
    """What completions and chat share."""
    return {
        "model": {"type": "string", "enum": [model]},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"],
                           "properties": {"include_usage": {"type": ["boolean", "null"]}}},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_SEED},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1},
        "min_tokens": {"type": ["integer", "null"], "minimum": 0},
        "stop": _STOP,
        "stop_token_ids": {"anyOf": [_TOKEN_IDS, {"type": "null"}]},
        "ignore_eos": {"type": ["boolean", "null"]},
        "skip_special_tokens": {"type": ["boolean", "null"]},
        "include_stop_str_in_output": {"type": ["boolean", "null"]},
        "cache_salt": {"type": ["string", "null"], "minLength": 1, "maxLength": 256},
        "return_token_ids": {"type": ["boolean", "null"]},
    }


_MESSAGES: Schema = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        "name": {"type": "string"}}}}


def completion_request(model: str) -> Schema:
    return {"type": "object", "required": ["model", "prompt"], "properties": {
        **_sampling(model),
        "prompt": {"anyOf": [{"type": "string"}, {**_TOKEN_IDS, "minItems": 1},
                             {"type": "array", "minItems": 1, "items": {"type": "string"}},
                             {"type": "array", "minItems": 1,
                              "items": {**_TOKEN_IDS, "minItems": 1}}]},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS}}}


def chat_request(model: str) -> Schema:
    return {"type": "object", "required": ["model", "messages"], "properties": {
        **_sampling(model),
        "messages": _MESSAGES,
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS}}}


def tokenize_request(model: str) -> Schema:
    # Exact (no unknown field, null for "the default"): the router refuses anything else.
    flag: Schema = {"type": ["boolean", "null"]}
    off: Schema = {"enum": [False, None]}
    common = {"model": {"type": ["string", "null"], "enum": [model, None]},
              "return_token_strs": flag}
    return {"anyOf": [
        {"type": "object", "required": ["prompt"], "additionalProperties": False,
         "properties": {**common, "prompt": {"type": "string"}, "add_special_tokens": flag}},
        {"type": "object", "required": ["messages"], "additionalProperties": False,
         "properties": {**common, "messages": _MESSAGES, "add_generation_prompt": flag,
                        "add_special_tokens": off, "continue_final_message": off}}]}


def detokenize_request(model: str) -> Schema:
    return {"type": "object", "required": ["tokens"], "additionalProperties": False,
            "properties": {"model": {"type": ["string", "null"], "enum": [model, None]},
                           "tokens": _TOKEN_IDS}}


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
        ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
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
