"""Chat messages -> prompt text, with the checkpoint's own chat template.

The template comes from the checkpoint (`tokenizer_config.json`'s `chat_template`, or
`chat_template.jinja`) and is untrusted code as far as the router is concerned, so it
runs in jinja2's immutable sandbox, with the globals HuggingFace templates expect
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text). The rendered
text already holds the special tokens the template writes (a BOS, say), so it is
encoded with add_special_tokens=False.

Only the template's own special tokens are special: message content is text, so a user
who types `<|im_start|>system` gets those characters' ordinary tokens, not a forged turn
(role injection). `ChatTemplate.parts` renders the conversation twice, once with each
message's content replaced by a placeholder, to learn which characters of the prompt
are content; `ChatEncoder` splits the prompt at the template's special tokens and
tokenizes everything between them with special tokens off. The HF tokenizer splits at
special tokens before anything else too, so a conversation whose content spells no
special token gets exactly the ids it always had. `tandem-router
--allow-special-tokens-in-content` restores the old, unsafe behaviour.
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from dataclasses import dataclass
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
        # Whether the template renders a request's tools itself (it reads `tools`);
        # otherwise the router writes them into the conversation (router/tools.py).
        self.takes_tools = "tools" in source

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate | None:
        if not tokenizer.chat_template:
            return None
        return cls(tokenizer.chat_template, bos_token=tokenizer.bos_token,
                   eos_token=tokenizer.eos_token)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               template_kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the template writes it (what HF's apply_chat_template
        returns with tokenize=False)."""
        try:
            return self._template.render(**(template_kwargs or {}), messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self._specials)
        except _TemplateRefused as exc:  # the template's own raise_exception(...)
            raise InvalidRequest(f"the chat template refused these messages: {exc}",
                                 "messages") from None
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template could not render these messages: "
                                 f"{exc}", "messages") from None
        except (TypeError, ValueError, LookupError, ArithmeticError) as exc:
            # Template code meeting a value it did not expect (a chat_template_kwargs
            # value of the wrong type, say): the request's problem, not the server's.
            raise InvalidRequest(f"the chat template could not render these messages: "
                                 f"{type(exc).__name__}: {exc}", "messages") from None

    def parts(self, prompt: ChatPrompt) -> list[Part]:
        """The rendered prompt as template text and message content, in order (their
        concatenation is the prompt). With `continue_final_message`, the prompt ends
        right after the final message's content: no end-of-turn, the model continues it.

        When the template rewrites content (trims it, say), the content cannot be told
        apart: the whole prompt is then one template part, and `ChatEncoder` refuses
        content that spells a special token rather than tokenize it as control tokens."""
        messages, kwargs, tools = prompt.messages, prompt.template_kwargs, prompt.tools
        add_gen = prompt.add_generation_prompt
        final = len(messages) - 1
        if prompt.continue_final_message and not messages[final]["content"]:
            raise InvalidRequest("continue_final_message needs a final message with "
                                 "content to continue", f"messages[{final}].content")
        text = self.render(messages, add_gen, kwargs, tools)
        nonce = uuid.uuid4().hex
        # An empty content stays empty: a template may test it ({% if content %}).
        marked = [{**m, "content": f"\x00{nonce}:{i}\x00"} if m["content"] else m
                  for i, m in enumerate(messages)]
        pieces = re.split(f"\x00{nonce}:(\\d+)\x00",
                          self.render(marked, add_gen, kwargs, tools))
        parts: list[Part] = []
        for k, piece in enumerate(pieces):  # text, message index, text, ...
            if k % 2:
                parts.append(Part(messages[int(piece)]["content"], int(piece)))
            else:
                parts.append(Part(piece))
        if "".join(p.text for p in parts) != text:
            if prompt.continue_final_message:
                return [Part(_cut_after_final(text, messages[final]["content"]))]
            return [Part(text)]
        if prompt.continue_final_message:
            last = max((k for k, p in enumerate(parts) if p.message == final), default=None)
            if last is None:
                raise InvalidRequest("continue_final_message: the chat template does not "
                                     "write the final message", f"messages[{final}]")
            parts = parts[:last + 1]
        return [p for p in parts if p.text]


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request asks of the template."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True  # end with the assistant's turn opening
    continue_final_message: bool = False  # end inside the final message instead
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs
    tools: list[dict[str, Any]] | None = None  # for a template that renders tools


@dataclass(frozen=True)
class Part:
    """A stretch of the rendered prompt: the template's text, or a message's content."""

    text: str
    message: int | None = None  # the index of the message whose content it is, if any

    @property
    def content(self) -> bool:
        return self.message is not None


class ChatEncoder:
    """A chat prompt -> token ids, with only the template's special tokens special
    (unless `allow_special_tokens_in_content`)."""

    def __init__(self, tokenizer: Tokenizer, *,
                 allow_special_tokens_in_content: bool = False) -> None:
        self._tokenizer = tokenizer
        self._allow = allow_special_tokens_in_content
        self._special_ids = {tokenizer.decode([i], skip_special_tokens=False): i
                             for i in tokenizer.all_special_ids}
        self._special_ids.pop("", None)
        # Longest first, so the leftmost match is also the longest, as the tokenizer's.
        names = sorted(self._special_ids, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, names))) if names else None

    def encode(self, template: ChatTemplate, prompt: ChatPrompt) -> list[int]:
        parts = template.parts(prompt)
        text = "".join(p.text for p in parts)
        spelled = self._specials is not None and any(
            self._specials.search(m["content"]) for m in prompt.messages)
        if self._allow or not spelled:
            return self._tokenizer.encode_releasing_gil(text, add_special_tokens=False)
        if not any(p.content for p in parts):  # parts() could not find the content
            raise InvalidRequest(
                "a message's content spells a special token, and this model's chat "
                "template rewrites content, so it cannot be kept as plain text: remove "
                "the special token text (or start tandem-router with "
                "--allow-special-tokens-in-content)", "messages")
        assert self._specials is not None
        ids: list[int] = []
        pending: list[str] = []  # text since the last template special token

        def flush() -> None:
            if any(pending):
                ids.extend(self._tokenizer.encode_as_text("".join(pending)))
            pending.clear()

        for part in parts:
            if part.content:
                pending.append(part.text)
                continue
            start = 0
            for m in self._specials.finditer(part.text):
                pending.append(part.text[start:m.start()])
                flush()
                ids.append(self._special_ids[m.group()])
                start = m.end()
            pending.append(part.text[start:])
        flush()
        return ids


def _cut_after_final(text: str, final: str) -> str:
    """HF's continue_final_message for a template that rewrites content: the prompt up
    to the last occurrence of the final message's (stripped) content."""
    needle = final.strip()
    at = text.rfind(needle)
    if not needle or at < 0:
        raise InvalidRequest("continue_final_message: the chat template does not write the "
                             "final message's content as given", "messages")
    return text[:at + len(needle)]


class _TemplateRefused(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRefused(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
