"""What a request's output must match, and the grammar that says it (vLLM's names).

`StructuredOutputsParams` is vLLM's `SamplingParams.structured_outputs`: exactly one of
a JSON schema (`json`), any JSON object (`json_object`), a regular expression (`regex`),
one of a list of strings (`choice`), a context-free grammar (`grammar`: Lark, or GBNF as
llama.cpp writes it, told apart by llguidance) or a structural tag (`structural_tag`:
free text in which each trigger starts a constrained segment). It travels in
`SamplingParams` to every engine that serves the request, so a prefill engine, a decode
engine and a failover engine all hold the same constraint.

The grammar library is llguidance (the note of issue 30 says why): `grammar_text` turns
the parameters into its grammar, and `check_grammar` compiles it against a tokenizer
under this module's limits, returning the library's own error for a bad schema, regex
or grammar. The router runs that check before a request is accepted (a 400 naming the
problem); the engine compiles the same text once per distinct constraint
(engine/grammars.py). Torch-free: the router imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem_engine.errors import RequestRejected

# What one request's constraint may weigh: the schema's (regex's, grammar's, choices')
# characters, the number of choices, and the library's own bounds on the compiled
# grammar (symbols, lexer states, the work of building the lexer), so that no request can
# hold an engine's compile thread for long or fill its memory.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_GRAMMAR_SYMBOLS = 100_000  # llguidance's max_grammar_size (its default: 500,000)
MAX_LEXER_STATES = 50_000  # its max_lexer_states (default 250,000, ~1-2 kB each)
MAX_LEXER_FUEL = 1_000_000  # its initial_lexer_fuel: ~20 ms of lexer building
# JSON whitespace between tokens: one line break at most, then at most 32 spaces or tabs
# (pretty-printed JSON, indented, fits; a small model sampling at temperature otherwise
# drifts into runs of blank lines until max_tokens cuts the JSON off).
# `whitespace_pattern` overrides it.
DEFAULT_JSON_WHITESPACE = r"(\r?\n)?[\x20\x09]{0,32}"

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint. `json` is the schema as JSON text (a dict is accepted and
    stored as its text); `structural_tag` is vLLM's structural-tag object as JSON text
    (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None  # JSON only: the whitespace allowed between tokens

    def __post_init__(self) -> None:
        if isinstance(self.json, dict | list | bool):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        self._validate()

    @property
    def kind(self) -> str:
        """Which constraint it is (one of KINDS)."""
        for kind in KINDS:
            value = getattr(self, kind)
            if value not in (None, False):
                return kind
        raise AssertionError("validated: exactly one is set")

    def _validate(self) -> None:
        def bad(field: str, value: Any, limit: str) -> RequestRejected:
            shown = value if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
            return RequestRejected(f"sampling parameter structured_outputs.{field}="
                                   f"{shown!r} is invalid: {limit}")

        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise RequestRejected(
                "sampling parameter structured_outputs is invalid: give exactly one of "
                f"{', '.join(KINDS)} (got {', '.join(set_) or 'none'})")
        for field in ("json", "regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise bad(field, value, "it must be a non-empty string")
            if len(value) > MAX_GRAMMAR_CHARS:
                raise bad(field, f"{len(value)} characters",
                          f"at most {MAX_GRAMMAR_CHARS} characters are allowed: send a "
                          "smaller schema or grammar")
        if self.json_object not in (True, False):
            raise bad("json_object", self.json_object, "it must be true or false")
        if self.choice is not None:
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise bad("choice", f"{len(self.choice)} strings",
                          f"give 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise bad("choice", self.choice, "every choice must be a string")
            if sum(len(c) for c in self.choice) > MAX_GRAMMAR_CHARS:
                raise bad("choice", "its strings", f"at most {MAX_GRAMMAR_CHARS} "
                          "characters in all")
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise bad("whitespace_pattern", self.whitespace_pattern,
                      "it applies to json and json_object only")
        for field in ("json", "structural_tag"):
            value = getattr(self, field)
            if value is not None:
                try:
                    parsed = json.loads(value)
                except ValueError as exc:
                    raise bad(field, value, f"it is not JSON ({exc})") from None
                if not isinstance(parsed, dict | bool):
                    raise bad(field, value, "a JSON schema is an object")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not compiled: `check_grammar` does that).
    Raises RequestRejected for a constraint that cannot even be translated (a GBNF
    grammar that does not convert, a malformed structural tag)."""
    import llguidance

    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else '{"type": "object"}'
            options = {"whitespace_pattern": params.whitespace_pattern
                       or DEFAULT_JSON_WHITESPACE}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return llguidance.grammar_from("lark", "start: " + " | ".join(
                json.dumps(c) for c in params.choice))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", params.grammar)
        return _structural_tag(params.structural_tag)
    except ValueError as exc:
        raise RequestRejected(f"sampling parameter structured_outputs.{kind} is invalid: "
                              f"{exc}") from None


def _structural_tag(text: str) -> str:
    """vLLM's (xgrammar's) structural tag, `{"type": "structural_tag", "structures":
    [{"begin": str, "schema": {...}, "end": str}], "triggers": [str]}`, as llguidance
    structural tags: each structure is triggered by the trigger its `begin` starts with."""
    import llguidance

    tag = json.loads(text)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) \
            or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("a structural tag needs a non-empty list of structures and one of "
                         "trigger strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str) or not isinstance(s.get("schema"), dict):
            raise ValueError(f"structures[{i}] needs begin and end strings and a schema "
                             "object")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}].begin {s['begin']!r} starts with none of "
                             f"the triggers {triggers}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                         grammar=s["schema"], end=s["end"]))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def parser_limits() -> Any:
    """llguidance's limits for a compile (see MAX_GRAMMAR_SYMBOLS and the rest)."""
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS,
                                     max_lexer_states=MAX_LEXER_STATES,
                                     initial_lexer_fuel=MAX_LEXER_FUEL,
                                     verbose_errors=False)


def check_grammar(grammar: str, tokenizer: Any | None = None) -> str:
    """The library's error for `grammar` under this module's limits ("" when it
    compiles): an unsupported schema keyword, a bad regex, a grammar too large. With
    `tokenizer` (an llguidance tokenizer) the token-level parts are checked too."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=parser_limits())
    return messages[0] if is_error else ""


def ll_tokenizer(tokenizer: Any, n_vocab: int | None = None) -> Any:
    """An llguidance tokenizer for our `tandem_engine.tokenizer.Tokenizer` (its
    `tokenizers` backend as tokenizer.json text, its EOS ids): ~0.2 s, build it once.
    `n_vocab`: the model's logits width when it pads the vocabulary past the
    tokenizer's (the masks then have a bit for every logit)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.backend_json(),
                                  n_vocab=max(n_vocab or 0, tokenizer.vocab_size),
                                  eos_token=list(tokenizer.eos_token_ids) or None)
