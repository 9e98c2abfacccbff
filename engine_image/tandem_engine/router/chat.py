"""Chat messages -> prompt text, with the checkpoint's own chat template.

The template comes from the checkpoint (`tokenizer_config.json`'s `chat_template`, or
`chat_template.jinja`) and is untrusted code as far as the router is concerned, so it
runs in jinja2's immutable sandbox, with the globals HuggingFace templates expect
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text). The rendered
text already holds the special tokens the template writes (a BOS, say), so it must be
encoded with add_special_tokens=False.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem_engine.router.api_params import InvalidRequest
from tandem_engine.tokenizer import Tokenizer


class ChatTemplateError(Exception):
    """The template itself is broken (a server-side problem)."""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the checkpoint's chat template does not parse: "
                                    f"{exc.message} (line {exc.lineno})") from exc
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate | None:
        if not tokenizer.chat_template:
            return None
        return cls(tokenizer.chat_template, bos_token=tokenizer.bos_token,
                   eos_token=tokenizer.eos_token)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
               ) -> str:
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=None, **self._specials)
        except _TemplateRefused as exc:  # the template's own raise_exception(...)
            raise InvalidRequest(f"the chat template refused these messages: {exc}",
                                 "messages") from None
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template could not render these messages: "
                                 f"{exc}", "messages") from None


class _TemplateRefused(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRefused(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
