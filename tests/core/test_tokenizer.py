"""Tokenizer wrapper and incremental detokenization on the demo byte-level BPE."""

from __future__ import annotations

import json
import shutil
import unicodedata
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tandem_engine.errors import CheckpointError
from tandem_engine.tokenizer import IncrementalDetokenizer, Tokenizer

MIXED = "Hello wörld! Café crème brûlée, 你好，世界 東京のコーヒー 👋🏽 👨‍👩‍👧 🚲🌊 — done."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "config.json")


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen2: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen2)


@pytest.fixture(scope="module")
def llama_tok(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


def copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)
    return dst


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [det.push(i) for i in ids]
    pieces.append(det.flush())
    assert det.text == "".join(pieces)
    return pieces


# --- Tokenizer -------------------------------------------------------------------------


def test_round_trip_with_multibyte_text(qwen_tok: Tokenizer) -> None:
    ids = qwen_tok.encode(MIXED)
    assert qwen_tok.decode(ids) == MIXED
    assert all(0 <= i < qwen_tok.vocab_size for i in ids)


def test_llama_demo_prepends_bos(llama_tok: Tokenizer) -> None:
    assert llama_tok.bos_token_id == 3 and llama_tok.bos_token == "<|begin_of_text|>"
    ids = llama_tok.encode("The river")
    assert ids[0] == llama_tok.bos_token_id
    assert llama_tok.encode("The river", add_special_tokens=False) == ids[1:]
    assert llama_tok.decode(ids) == "The river"
    assert llama_tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>The river"


def test_special_tokens_and_vocab(qwen_tok: Tokenizer) -> None:
    assert qwen_tok.vocab_size == 2048
    assert qwen_tok.all_special_ids == (0, 1, 2, 3)
    assert qwen_tok.id_to_token(2) == "<|im_end|>"
    assert qwen_tok.id_to_token(99999) is None
    assert qwen_tok.bos_token_id is None
    # Special-token text in the input becomes the special id, and decode skips it.
    ids = qwen_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert qwen_tok.decode(ids) == "user\nhi"


def test_chat_template_is_read(qwen_tok: Tokenizer, llama_tok: Tokenizer) -> None:
    assert qwen_tok.chat_template is not None and "<|im_start|>" in qwen_tok.chat_template
    assert llama_tok.chat_template is not None and "bos_token" in llama_tok.chat_template


def test_chat_template_from_jinja_file(tiny_qwen2: Path, tmp_path: Path) -> None:
    path = copy_tokenizer(tiny_qwen2, tmp_path / "tok")
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    del tok_config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert Tokenizer.from_dir(path).chat_template is None
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(path).chat_template == "{{ messages[0]['content'] }}"


def test_eos_ids_come_from_generation_config_then_config_then_tokenizer_config(
    tiny_qwen2: Path, tmp_path: Path
) -> None:
    path = copy_tokenizer(tiny_qwen2, tmp_path / "tok")
    assert Tokenizer.from_dir(path).eos_token_ids == (0, 2)  # generation_config list

    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_dir(path).eos_token_ids == (2,)  # generation_config int

    (path / "generation_config.json").unlink()
    assert Tokenizer.from_dir(path).eos_token_ids == (0,)  # config.json

    config = json.loads((path / "config.json").read_text())
    del config["eos_token_id"]
    (path / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = {"content": "<|im_end|>", "special": True}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert Tokenizer.from_dir(path).eos_token_ids == (2,)  # tokenizer_config string


def test_missing_or_corrupt_files_name_the_file(tiny_qwen2: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(exc.value) and "missing" in str(exc.value)

    path = copy_tokenizer(tiny_qwen2, tmp_path / "tok")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(CheckpointError) as exc:
        Tokenizer.from_dir(path)
    assert str(path / "tokenizer.json") in str(exc.value)

    shutil.copy(tiny_qwen2 / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(CheckpointError) as exc:
        Tokenizer.from_dir(path)
    assert str(path / "tokenizer_config.json") in str(exc.value)


# --- IncrementalDetokenizer ------------------------------------------------------------


def test_incremental_matches_full_decode_and_never_splits_characters(
    qwen_tok: Tokenizer,
) -> None:
    ids = qwen_tok.encode(MIXED)
    pieces = stream(qwen_tok, ids)
    assert "".join(pieces) == MIXED
    assert not any("\ufffd" in p for p in pieces)
    # The emoji and CJK really are split across tokens, so holding back was exercised.
    assert sum(p == "" for p in pieces[:-1]) >= 3


def test_incremental_special_tokens(llama_tok: Tokenizer) -> None:
    ids = llama_tok.encode("<|im_start|>assistant\n你好<|im_end|>")
    assert "".join(stream(llama_tok, ids)) == "assistant\n你好"
    kept = "".join(stream(llama_tok, ids, skip_special_tokens=False))
    assert kept == "<|begin_of_text|><|im_start|>assistant\n你好<|im_end|>"


def test_incremental_decodes_a_bounded_window(qwen_tok: Tokenizer) -> None:
    class CountingTokenizer(Tokenizer):
        longest = 0

        def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
            ids = list(ids)
            CountingTokenizer.longest = max(CountingTokenizer.longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = CountingTokenizer(qwen_tok._backend)
    ids = qwen_tok.encode(MIXED * 40)
    assert len(ids) > 1000
    assert "".join(stream(tok, ids)) == MIXED * 40
    assert CountingTokenizer.longest <= 8


_TEXT_PIECES = st.sampled_from(
    ["the", " river", " café", " naïve", "你好", "世界", "東京", "😊", "👨‍👩‍👧", "👋🏽", " ", "\n",
     "<|im_end|>", "é", "ß", "—", "🍜"]
)
_TEXT = st.lists(st.one_of(_TEXT_PIECES, st.text(max_size=4)), max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_incremental_equals_full_decode_for_any_text(qwen_tok: Tokenizer, text: str) -> None:
    ids = qwen_tok.encode(text)
    # The demo tokenizer normalizes to NFC, as Qwen2 tokenizers do.
    assert qwen_tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    for skip in (True, False):
        pieces = stream(qwen_tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == qwen_tok.decode(ids, skip_special_tokens=skip)
        # Valid text never needs the final flush, unless it ends in U+FFFD itself: that
        # reads as the start of a character still to come, held back until the end.
        if not "".join(pieces).endswith("\ufffd"):
            assert pieces[-1] == ""


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=2047), max_size=40))
def test_incremental_equals_full_decode_for_any_ids(qwen_tok: Tokenizer, ids: list[int]) -> None:
    # Random ids are often invalid UTF-8; with flush() the text still adds up.
    assert "".join(stream(qwen_tok, ids)) == qwen_tok.decode(ids)
