"""Tokenization for the engine and the router, straight from a checkpoint's tokenizer.json.

The engine never imports transformers: `Tokenizer` wraps the `tokenizers`
library and reads the few facts transformers would take from the side files
(EOS/BOS ids, the chat template). `IncrementalDetokenizer` turns a stream of
generated ids into text pieces for streaming. Byte-level BPE can split one
character (an emoji, a CJK ideograph) across several tokens, so it holds text
back until the character is complete, and it decodes only a short window of
recent tokens so each step costs the same however long the output grows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from tandem_engine.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, and its special token ids."""

    def __init__(
        self,
        backend: _Backend,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        eos_token: str | None = None,
        bos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        # The token strings, for chat templates that mention {{ bos_token }}.
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.chat_template = chat_template
        self.all_special_ids: tuple[int, ...] = tuple(
            sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, plus tokenizer_config.json, generation_config.json and
        config.json when present.

        EOS ids come from generation_config.json (an id or a list), else config.json,
        else the `eos_token` string of tokenizer_config.json."""
        folder = Path(path)
        file = folder / TOKENIZER_FILE
        if not file.is_file():
            raise CheckpointError(
                f"{file}: missing; the engine needs the fast-tokenizer file tokenizer.json "
                "(models with only a sentencepiece tokenizer.model must be converted first)"
            )
        try:
            backend = _Backend.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises bare Exception
            raise CheckpointError(f"{file}: not a valid tokenizer.json ({exc})") from exc

        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        eos_token = _token_content(tok_config.get("eos_token"))
        bos_token = _token_content(tok_config.get("bos_token"))

        eos_ids = _ids(gen_config.get("eos_token_id")) or _ids(model_config.get("eos_token_id"))
        if not eos_ids and eos_token is not None:
            eos_id = backend.token_to_id(eos_token)
            eos_ids = (eos_id,) if eos_id is not None else ()
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        if bos_id is None:
            bos_ids = _ids(gen_config.get("bos_token_id")) or _ids(model_config.get("bos_token_id"))
            bos_id = bos_ids[0] if bos_ids else None

        template = tok_config.get("chat_template")
        if isinstance(template, list):  # some checkpoints ship named templates
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = folder / CHAT_TEMPLATE_FILE  # where recent transformers save it
        if template is None and jinja.is_file():
            try:
                template = jinja.read_text(encoding="utf-8")
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{jinja}: cannot read the chat template ({exc})") from exc
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            eos_token=eos_token,
            bos_token=bos_token,
            chat_template=template if isinstance(template, str) else None,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's
        embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns generated ids into text one id at a time.

    Two offsets into the ids bound the work per step: text is final up to
    `_read`, and `_prefix` is where the window decoded each step starts. The
    tokens in [_prefix, _read) are decoded along with the new ones, so
    decoders that treat the first token specially (a stripped leading space)
    give the same text as a full decode. New text is emitted only when the
    decoded window does not end in U+FFFD, i.e. when no character is still
    waiting for its remaining bytes.

    Invariant: "".join(all push() results) + flush() == tokenizer.decode(ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""  # decode(ids[_prefix:_read]), cached between emissions
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completed (often "", never a
        partial character)."""
        self._ids.append(token_id)
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(self._prefix_text) or window.endswith(_REPLACEMENT):
            return ""
        return self._emit(window)

    def flush(self) -> str:
        """At the end of a sequence: return whatever is held back (a character whose
        bytes never completed comes out as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        window = self._decode(self._ids[self._prefix :])
        return self._emit(window) if len(window) > len(self._prefix_text) else ""

    def _emit(self, window: str) -> str:
        new = window[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        self._pieces.append(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def _read_json(file: Path) -> dict[str, Any]:
    """A side file's JSON object; {} when the file is absent."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()
