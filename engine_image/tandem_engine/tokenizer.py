"""Tokenization for the engine and the router, from a checkpoint's tokenizer.json or a GGUF file.

The engine never imports transformers: `Tokenizer` wraps the `tokenizers`
library and reads the few facts transformers would take from the side files
(EOS/BOS ids, the chat template). A GGUF file has no tokenizer.json: its vocabulary,
merges, token types and special ids are metadata, from which `Tokenizer.from_gguf`
builds the byte-level BPE that transformers builds for that file
(`AutoTokenizer.from_pretrained(folder, gguf_file=...)`). `Tokenizer.from_path` picks
by path; every caller that holds a model path uses it.

`IncrementalDetokenizer` turns a stream of generated ids into text pieces for
streaming. Byte-level BPE can split one character (an emoji, a CJK ideograph) across
several tokens, so it holds text back until the character is complete, and it decodes
only a short window of recent tokens so each step costs the same however long the
output grows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from tandem_engine.errors import CheckpointError
from tandem_engine.gguf_file import GGUFFile, open_gguf
from tandem_engine.weights import is_gguf_path

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_REPLACEMENT = "\ufffd"

# GGUF token types (llama.cpp's llama_token_type): control tokens are special added
# tokens, user-defined ones plain added tokens; both are matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4
# Interoperability constants: the pre-tokenization splits of the byte-level BPE
# vocabularies a GGUF names in tokenizer.ggml.pre, as transformers applies them (Split,
# then ByteLevel without its own regex). None: GPT-2's regex inside ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (also the demo models'): English contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newlines, and whitespace.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# transformers applies GPT-2's regex to "smollm" (llama.cpp splits digits off first; the
# SmolLM vocabulary has no merges across digits, so the two rarely differ) and we follow it.
GGUF_PRE_TOKENIZERS: dict[str, str | None] = {
    "gpt2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}


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
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._text_backend: _Backend | None = None  # encode_as_text's, made on first use
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        # The token strings, for chat templates that mention {{ bos_token }}.
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        self.all_special_ids: tuple[int, ...] = tuple(
            sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a model path: a GGUF file (`from_gguf`) or an HF checkpoint
        folder (`from_dir`)."""
        return cls.from_gguf(path) if is_gguf_path(path) else cls.from_dir(path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the byte-level BPE tokenizer a GGUF file describes (tokenizer.ggml.model
        "gpt2"): vocabulary, merges, control and user-defined tokens, the pre-tokenizer
        named by tokenizer.ggml.pre, BOS/EOS (and end-of-turn) ids, add_bos_token and
        the chat template."""
        file = open_gguf(path)
        backend, tokens = _gguf_backend(file)
        key = "tokenizer.ggml.{}_token_id".format

        def token(kind: str) -> str | None:
            if not file.has(key(kind)):
                return None
            token_id = file.integer(key(kind))
            if not 0 <= token_id < len(tokens):
                raise CheckpointError(
                    f"{file.path}: metadata {key(kind)}={token_id} is not a token id (the "
                    f"vocabulary has {len(tokens)} tokens); the file is mis-converted")
            return backend.id_to_token(token_id)

        # A chat turn may end with an end-of-turn/end-of-message token other than EOS;
        # llama.cpp stops on all of them, and so does the engine.
        eos_ids = tuple(dict.fromkeys(
            file.integer(key(kind)) for kind in ("eos", "eot", "eom") if token(kind)))
        bos_token = token("bos")
        template = file.string("tokenizer.chat_template", None)
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=file.integer(key("bos")) if bos_token is not None else None,
            eos_token=token("eos"),
            bos_token=bos_token,
            pad_token=token("padding"),
            unk_token=token("unknown"),
            chat_template=template,
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

        tok_config = _read_json(folder / TOKENIZER_CONFIG_FILE)
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
            pad_token=_token_content(tok_config.get("pad_token")),
            unk_token=_token_content(tok_config.get("unk_token")),
            chat_template=template if isinstance(template, str) else None,
        )

    def save_pretrained(self, path: str | Path, *, model_max_length: int | None = None) -> None:
        """Write tokenizer.json and tokenizer_config.json into folder `path`, as an HF
        checkpoint holds them (`from_dir` and transformers read them back the same)."""
        folder = Path(path)
        self._backend.save(str(folder / TOKENIZER_FILE))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            config[name] = getattr(self, name)
        config["clean_up_tokenization_spaces"] = False
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's
        embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, but with the GIL released while the tokenizer works (its batch call
        does that; the single one does not), so a caller on a worker thread leaves the
        event loop free: the router tokenizes a long prompt this way."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_as_text(self, text: str) -> list[int]:
        """`encode_releasing_gil` without special tokens: text that spells one (a user
        typing `<|im_start|>`) is tokenized as ordinary text, never as the control token.
        The router encodes chat message content this way (`router.chat`)."""
        if self._text_backend is None:  # a copy that never matches special tokens
            backend = _Backend.from_str(self._backend.to_str())
            backend.encode_special_tokens = True
            self._text_backend = backend
        return self._text_backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar libraries load)."""
        return self._backend.to_str()


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


def _gguf_backend(file: GGUFFile) -> tuple[_Backend, list[str]]:
    """The byte-level BPE of a GGUF file's metadata, built as transformers builds it;
    also the token list (the GGUF's spelling)."""
    kind = file.string("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is not supported; Tandem builds "
            "byte-level BPE tokenizers (\"gpt2\", as Llama 3, SmolLM, Qwen and Mistral Nemo "
            "files have). Give the model's HuggingFace checkpoint folder instead")
    pre = file.string("tokenizer.ggml.pre", None)
    if pre not in GGUF_PRE_TOKENIZERS:
        got = "is missing" if pre is None else f"is {pre!r}"
        raise CheckpointError(
            f"{file.path}: tokenizer.ggml.pre {got}; supported: "
            f"{', '.join(GGUF_PRE_TOKENIZERS)}. Without the right pre-tokenizer text would "
            "be split differently from how the model was trained; convert the model again "
            "with a recent llama.cpp, or give its HuggingFace checkpoint folder")
    tokens = file.strings("tokenizer.ggml.tokens")
    merges = file.strings("tokenizer.ggml.merges")
    types = file.integers("tokenizer.ggml.token_type", [])
    if types and len(types) != len(tokens):
        raise CheckpointError(
            f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens; the file is mis-converted")
    # The file spells tokens in GPT-2's byte alphabet; one spelled otherwise (an added
    # token with a space, say) is respelled byte by byte, as transformers does.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, pair in zip(merges, pairs, strict=True) if len(pair) != 2), None)
    if bad is not None:
        raise CheckpointError(f"{file.path}: tokenizer.ggml.merges holds {bad!r}, not two "
                              "tokens separated by one space; the file is mis-converted")
    try:
        backend = _Backend(models.BPE(vocab=vocab, merges=pairs, dropout=None,
                                      continuing_subword_prefix="", end_of_word_suffix="",
                                      fuse_unk=False))
    except Exception as exc:  # the tokenizers library raises bare Exception
        raise CheckpointError(f"{file.path}: the tokenizer metadata does not make a BPE "
                              f"tokenizer ({exc})") from exc
    split = GGUF_PRE_TOKENIZERS[pre]
    backend.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None
        else pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]))
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel (adding it
    # would grow the vocabulary past the model's); transformers skips those, so do we.
    backend.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and set(t) <= alphabet
    ])
    backend.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and t in vocab
    ])
    backend.post_processor = _bos_eos_template(file, backend)
    return backend, tokens


def _bos_eos_template(file: GGUFFile, backend: _Backend) -> processors.TemplateProcessing:
    """What encode(add_special_tokens=True) adds: BOS and/or EOS as the file's
    add_bos_token/add_eos_token say (absent: neither, as transformers reads a BPE file)."""
    specials: list[tuple[str, int]] = []
    single, pair = "$A:0", "$B:1"
    for kind, first in (("bos", True), ("eos", False)):
        if not file.flag(f"tokenizer.ggml.add_{kind}_token", False):
            continue
        key = f"tokenizer.ggml.{kind}_token_id"
        if not file.has(key):
            raise file.missing(key, f"tokenizer.ggml.add_{kind}_token=true")
        token_id = file.integer(key)
        token = backend.id_to_token(token_id)
        if token is None:
            raise CheckpointError(f"{file.path}: metadata {key}={token_id} is not a token id")
        specials.append((token, token_id))
        single = f"{token}:0 {single}" if first else f"{single} {token}:0"
        pair = f"{token}:1 {pair}" if first else f"{pair} {token}:1"
    return processors.TemplateProcessing(single=single, pair=f"{single} {pair}",
                                         special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character (printable Latin-1
    bytes as themselves, the rest shifted up past 255)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    out, shift = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shift)
            shift += 1
    return out


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
