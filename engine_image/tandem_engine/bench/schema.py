"""The JSON report's schema (`--json`), as JSON Schema; docs/bench.md explains each field.

`SCHEMA_VERSION` changes only when a field is removed or changes meaning; new fields may
appear in any version. Tests validate every report against `REPORT_SCHEMA`.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT = {"type": "integer", "minimum": 0}
_INT_OR_NULL = {"type": ["integer", "null"], "minimum": 0}
_STATS = {"oneOf": [{"type": "null"}, {
    "type": "object",
    "required": ["count", "mean", "min", "max", "p50", "p90", "p99"],
    "properties": {"count": _INT, "mean": _NUM, "min": _NUM, "max": _NUM, "p50": _NUM,
                   "p90": _NUM, "p99": _NUM}}]}

_SUMMARY = {
    "type": "object",
    "required": ["requests", "duration_s", "tokens", "throughput", "latency_ms",
                 "prefix_cache", "goodput"],
    "properties": {
        "requests": {"type": "object", "required": ["sent", "completed", "failed"],
                     "properties": {"sent": _INT, "completed": _INT, "failed": _INT}},
        "duration_s": _NUM,
        "tokens": {"type": "object", "required": ["input", "output", "cached"],
                   "properties": {"input": _INT, "output": _INT, "cached": _INT_OR_NULL}},
        "throughput": {"type": "object",
                       "required": ["requests_per_s", "input_tokens_per_s",
                                    "output_tokens_per_s", "total_tokens_per_s"],
                       "additionalProperties": _NUM},
        "latency_ms": {"type": "object", "required": ["ttft", "itl", "tpot", "e2e"],
                       "additionalProperties": _STATS},
        "prefix_cache": {"type": "object", "required": ["reported", "cached_tokens",
                                                        "hit_rate"],
                         "properties": {"reported": {"type": "boolean"},
                                        "cached_tokens": _INT_OR_NULL,
                                        "hit_rate": _NUM_OR_NULL}},
        "goodput": {"oneOf": [{"type": "null"}, {
            "type": "object",
            "required": ["slo_ms", "good_requests", "requests_per_s", "fraction"],
            "properties": {"slo_ms": {"type": "object", "additionalProperties": _NUM},
                           "good_requests": _INT, "requests_per_s": _NUM,
                           "fraction": _NUM}}]},
    },
}

_REQUEST = {
    "type": "object",
    "required": ["index", "sent_s", "ok", "error", "output_len", "prompt_tokens",
                 "completion_tokens", "cached_tokens", "finish_reason", "chunks", "ttft_ms",
                 "e2e_ms", "tpot_ms", "itl_ms"],
    "properties": {
        "index": _INT, "model": {"type": ["string", "null"]}, "sent_s": _NUM,
        "ok": {"type": "boolean"},
        "error": {"type": ["string", "null"]}, "output_len": _INT,
        "prompt_tokens": _INT_OR_NULL, "completion_tokens": _INT_OR_NULL,
        "cached_tokens": _INT_OR_NULL, "finish_reason": {"type": ["string", "null"]},
        "chunks": _INT, "ttft_ms": _NUM_OR_NULL, "e2e_ms": _NUM_OR_NULL,
        "tpot_ms": _NUM_OR_NULL, "itl_ms": {"type": "array", "items": _NUM}},
}

_RUN = {
    "type": "object",
    "required": ["point", "arrivals", "summary", "timeline", "weight_versions", "requests"],
    "properties": {
        "point": {"type": ["object", "null"]},
        "arrivals": {"type": "object", "required": ["kind"]},
        "summary": _SUMMARY,
        # A multi-adapter workload (--lora-modules): each model's summary, by name.
        "by_model": {"oneOf": [{"type": "null"}, {"type": "object",
                                                  "additionalProperties": _SUMMARY}]},
        "timeline": {"type": "object",
                     "required": ["bin_s", "t_s", "output_tokens_per_s", "running_requests"],
                     "properties": {"bin_s": _NUM,
                                    "t_s": {"type": "array", "items": _NUM},
                                    "output_tokens_per_s": {"type": "array", "items": _NUM},
                                    "running_requests": {"type": "array", "items": _INT}}},
        "weight_versions": {"type": "array", "items": {
            "type": "object", "required": ["t_s", "versions"],
            "properties": {"t_s": _NUM, "versions": {"type": "array",
                                                     "items": {"type": "string"}}}}},
        "requests": {"type": "array", "items": _REQUEST},
    },
}

REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tandem bench report",
    "type": "object",
    "required": ["schema_version", "tool", "created_utc", "command", "environment", "server",
                 "config", "sweep", "runs"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "tool": {"const": "tandem bench"},
        "created_utc": {"type": "string"},
        "command": {"type": "array", "items": {"type": "string"}},
        "environment": {"type": "object",
                        "required": ["tandem_version", "python_version", "platform"]},
        "server": {"type": "object",
                   "required": ["base_url", "model", "version", "tokens_per_word",
                                "tokens_per_word_source"],
                   "properties": {"base_url": {"type": "string"},
                                  "model": {"type": "string"},
                                  "tokens_per_word": _NUM,
                                  "tokens_per_word_source": {"enum": ["tokenize",
                                                                      "assumed"]}}},
        "config": {"type": "object",
                   "required": ["workload", "arrivals", "num_requests", "seed", "slo_ms",
                                "warmup", "ignore_eos"]},
        "sweep": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["parameter", "values"],
            "properties": {"parameter": {"enum": ["rate", "concurrency"]},
                           "values": {"type": "array", "items": _NUM}}}]},
        "runs": {"type": "array", "minItems": 1, "items": _RUN},
    },
}
