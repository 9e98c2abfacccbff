"""GGUF checkpoints: the loader, its refusals, refit, the HF export, and the tokenizer.

Most tests write tiny GGUF files from the tiny demo checkpoint with `gguf.GGUFWriter`,
the way llama.cpp's convert_hf_to_gguf.py does (q/k rows permuted, Llama 3 RoPE scaling
as a rope_freqs tensor, 1-D tensors kept in F32), so loading them really undoes the
converter. The SmolLM2 tests use the real GGUF (conftest's `smollm2_gguf`, pulled once per
machine; skipped when it cannot be pulled).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as QType
from safetensors.torch import load_file
from tandem_engine.cli.demo_model import write_demo_model
from tandem_engine.engine.llm import LLM
from tandem_engine.errors import CheckpointError
from tandem_engine.model.checkpoint import load_checkpoint, validate_checkpoint
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.gguf import export_hf_folder, gguf_tensor_name, llama3_rope_scaling
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import checkpoint_path, checkpoint_problem

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def main():\n"]
Meta = dict[str, Any]


# ---- writing GGUF files as llama.cpp's converter does -------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (applied to q_proj and k_proj)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(hf: dict[str, Any]) -> np.ndarray:
    """The rope_freqs factors convert_hf_to_gguf.py stores for Llama 3 RoPE scaling. (It
    reads original_max_position_embeddings from the top level, defaulting to 8192, which is
    right for Llama 3.x; the demo keeps it in rope_scaling, so that is used here.)"""
    scaling = hf["rope_scaling"]
    dim = hf["hidden_size"] // hf["num_attention_heads"]
    freqs = 1.0 / (hf["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_metadata(folder: Path) -> Meta:
    """What the converter writes for an HF checkpoint folder: {key: value}, with None to
    leave a key out (tests edit this before writing)."""
    hf = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {
        "general.architecture": "llama",
        "llama.block_count": hf["num_hidden_layers"],
        "llama.context_length": hf["max_position_embeddings"],
        "llama.embedding_length": hf["hidden_size"],
        "llama.feed_forward_length": hf["intermediate_size"],
        "llama.attention.head_count": hf["num_attention_heads"],
        "llama.attention.head_count_kv": hf["num_key_value_heads"],
        "llama.rope.freq_base": hf["rope_theta"],
        "llama.attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "llama.rope.dimension_count": hf["hidden_size"] // hf["num_attention_heads"],
        "llama.vocab_size": hf["vocab_size"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",  # the demo tokenizer's split
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if i in special else 1 for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab.get(tok_config["bos_token"]),
        "tokenizer.ggml.eos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.eot_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.add_bos_token": True if tok_config["bos_token"] else None,
        "tokenizer.chat_template": tok_config["chat_template"],
    }


def gguf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The folder's tensors under GGUF names, q/k permuted, plus rope_freqs."""
    hf = json.loads((folder / "config.json").read_text())
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    out = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        w = tensor.numpy()
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, heads, heads)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, heads, kv_heads)
        out[gguf_tensor_name(name)] = w
    if (hf.get("rope_scaling") or {}).get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_freqs(hf)
    return out


_ADDERS = {str: "add_string", bool: "add_bool", float: "add_float32", int: "add_uint32"}


def write_gguf(path: Path, meta: Meta, tensors: dict[str, np.ndarray],
               qtype: QType = QType.F32,
               raw: dict[str, tuple[QType, np.ndarray]] | None = None) -> Path:
    """Write a GGUF file: 2-D tensors in `qtype`, 1-D ones in F32, and the tensors named in
    `raw` as the given block bytes of the given type (the writer cannot quantize to K or
    IQ types)."""
    writer = gguf.GGUFWriter(str(path), meta["general.architecture"])
    for key, value in meta.items():
        if value is None or key == "general.architecture":
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            getattr(writer, _ADDERS[type(value)])(key, value)
    for name, array in tensors.items():
        kind = qtype if array.ndim == 2 else QType.F32
        data = array.astype(np.float32)
        if name in (raw or {}):
            raw_type, blocks = raw[name]
            writer.add_tensor(name, blocks, raw_dtype=raw_type)
        elif kind == QType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif kind == QType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_of(folder: Path, path: Path, qtype: QType = QType.F32,
            edit: Callable[[Meta, dict[str, np.ndarray]], None] | None = None) -> Path:
    meta, tensors = gguf_metadata(folder), gguf_tensors(folder)
    if edit is not None:
        edit(meta, tensors)
    return write_gguf(path, meta, tensors, qtype)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_of(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def error(path: Path) -> str:
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    return str(exc.value)


# ---- loading ------------------------------------------------------------------------------

def test_f32_gguf_holds_exactly_the_folder_model(tiny_llama: Path, tiny_gguf: Path) -> None:
    config, tensors = load_checkpoint(tiny_gguf)
    folder_config, expected = load_checkpoint(tiny_llama)
    # The GGUF also names <|im_end|> as end-of-turn, which generation_config.json lists too.
    assert config.eos_token_ids == (0, 2)
    assert dataclasses.replace(config, eos_token_ids=folder_config.eos_token_ids) == folder_config
    assert config.rope.kind == "llama3"  # recovered from rope_freqs
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name  # q/k un-permuted exactly


def test_f32_gguf_generates_the_folder_tokens(tiny_llama: Path, tiny_gguf: Path) -> None:
    expected = LLM(tiny_llama, kernels="torch").generate(PROMPTS, GREEDY)
    llm = LLM(tiny_gguf, kernels="torch")
    assert llm.tokenizer.eos_token_ids == (0, 2)
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert tokens(got) == tokens(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q5_1],
                         ids=lambda q: q.name)
def test_quantized_gguf_dequantizes_close_to_the_weights(
        tiny_llama: Path, tmp_path: Path, qtype: QType) -> None:
    path = gguf_of(tiny_llama, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    _, tensors = load_checkpoint(path)
    _, expected = load_checkpoint(tiny_llama)
    tolerance = {QType.F16: 1e-3, QType.BF16: 1e-2, QType.Q8_0: 2e-2}.get(qtype, 0.3)
    for name, tensor in expected.items():
        assert tensors[name].dtype == torch.float32
        scale = tensor.abs().max()
        assert (tensors[name] - tensor).abs().max() <= tolerance * scale, name


def test_tokenizer_from_gguf_matches_the_folder_tokenizer(
        tiny_llama: Path, tiny_gguf: Path) -> None:
    folder, ours = Tokenizer.from_path(tiny_llama), Tokenizer.from_path(tiny_gguf)
    texts = ["Hello <|im_start|>user\nhi<|im_end|>\n", "  spaces  and\ttabs\n\n",
             "café 日本 🤗 naïve", "12345 + 678 = 13023", "<|endoftext|>"]
    for text in texts:
        assert ours.encode(text) == folder.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == folder.encode(
            text, add_special_tokens=False)
    ids = folder.encode(texts[0])
    assert ours.decode(ids) == folder.decode(ids)
    assert ours.decode(ids, skip_special_tokens=False) == folder.decode(
        ids, skip_special_tokens=False)
    assert ours.all_special_ids == folder.all_special_ids == (0, 1, 2, 3)
    assert (ours.bos_token_id, ours.bos_token) == (folder.bos_token_id, folder.bos_token)
    assert ours.eos_token_ids == (0, 2) and ours.eos_token == "<|endoftext|>"
    assert ours.chat_template == folder.chat_template


def test_a_gguf_file_is_a_checkpoint_path(tiny_gguf: Path, tmp_path: Path) -> None:
    from tandem_engine.cli.refit import checkpoint_folder

    assert checkpoint_problem(tiny_gguf) is None
    assert checkpoint_problem(tmp_path / "x.gguf") == f"{tmp_path / 'x.gguf'} does not exist"
    assert checkpoint_problem(tmp_path) == f"{tmp_path} has no config.json"
    assert checkpoint_folder(tiny_gguf.as_uri()) == tiny_gguf  # `tandem refit --uri`
    with pytest.raises(ValueError, match=r"x\.gguf does not exist; give a HuggingFace"):
        checkpoint_folder((tmp_path / "x.gguf").as_uri())


def test_q8_0_gguf_generates(tiny_llama: Path, tmp_path: Path) -> None:
    path = gguf_of(tiny_llama, tmp_path / "tiny-q8_0.gguf", QType.Q8_0)
    llm = LLM(path, kernels="torch", dtype="bfloat16")
    out = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
    assert llm.engine.runner.dtype == torch.bfloat16


def test_tied_embeddings_without_output_weight(tiny_qwen2: Path, tmp_path: Path) -> None:
    # The qwen2 demo has tied embeddings; as a Llama GGUF (no biases) it needs none.
    def as_llama(meta: Meta, tensors: dict[str, np.ndarray]) -> None:
        for name in [n for n in tensors if n.endswith(".bias")]:
            del tensors[name]
        assert "output.weight" not in tensors

    path = gguf_of(tiny_qwen2, tmp_path / "tied.gguf", edit=as_llama)
    config, tensors = load_checkpoint(path)
    assert config.tie_word_embeddings and "lm_head.weight" not in tensors
    assert Tokenizer.from_path(path).encode("hi")[0] != 3  # no BOS added
    assert len(tokens(LLM(path, kernels="torch").generate(["Hello"], GREEDY))[0]) == 24


# Where each K-quant block keeps its fp16 scales (random bytes there could be inf/NaN).
_K_SCALES = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


@pytest.mark.parametrize("qtype", list(_K_SCALES), ids=lambda q: q.name)
def test_k_quants_match_transformers_dequantization(
        tiny_llama: Path, tmp_path: Path, qtype: QType) -> None:
    """K-quant rows hold 256 values, more than the tiny model has: a one-layer model with
    hidden size 256 and random (valid) blocks, dequantized by Tandem (gguf's numpy code)
    and by transformers' own torch implementation."""
    reference = pytest.importorskip("transformers.integrations.gguf.dequant")
    meta = gguf_metadata(tiny_llama)
    meta.update({"llama.block_count": 1, "llama.embedding_length": 256,
                 "llama.feed_forward_length": 512, "llama.rope.dimension_count": 64})
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=256,
                         intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=64, max_position_embeddings=1024)
    rng = np.random.default_rng(0)
    tensors, raw = {}, {}
    for name, shape in config.expected_tensors().items():
        tensors[gguf_tensor_name(name)] = np.ones(shape, dtype=np.float32)
        if len(shape) == 2:
            blocks = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(
                shape, qtype), dtype=np.uint8)
            per_block = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
            for offset in _K_SCALES[qtype]:
                per_block[:, offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
            raw[gguf_tensor_name(name)] = (qtype, blocks)
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", meta, tensors, raw=raw)
    _, loaded = load_checkpoint(path)
    for name, tensor in loaded.items():
        if gguf_tensor_name(name) not in raw:
            continue
        expected = reference.dequantize(torch.from_numpy(raw[gguf_tensor_name(name)][1].copy())
                                        .reshape(-1), int(qtype)).reshape(tensor.shape)
        stored = tensor.numpy()  # back in the file's row order, as the converter wrote it
        if ".q_proj." in name:
            stored = llama_cpp_permute(stored, 4, 4)
        elif ".k_proj." in name:
            stored = llama_cpp_permute(stored, 4, 2)
        np.testing.assert_allclose(stored, expected.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_rope_scaling_metadata(tiny_llama: Path, tmp_path: Path) -> None:
    def scaling(kind: str) -> Callable[[Meta, dict[str, np.ndarray]], None]:
        def edit(meta: Meta, tensors: dict[str, np.ndarray]) -> None:
            meta["llama.rope.scaling.type"] = kind
            meta["llama.rope.scaling.factor"] = 2.0
            del tensors["rope_freqs.weight"]
        return edit

    config = validate_checkpoint(gguf_of(tiny_llama, tmp_path / "linear.gguf",
                                         edit=scaling("linear")))
    assert (config.rope.kind, config.rope.factor) == ("linear", 2.0)
    assert "rope.scaling.type='yarn' is not supported" in error(
        gguf_of(tiny_llama, tmp_path / "yarn.gguf", edit=scaling("yarn")))


def test_llama3_rope_parameters_from_factors() -> None:
    # Llama 3.1's parameters, through the factors the converter stores, come back.
    hf = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    params = llama3_rope_scaling(llama3_rope_freqs(hf).astype(np.float64), 500000.0, 128)
    assert params is not None and params["original_max_position_embeddings"] == 8192
    assert params["factor"] == 8.0
    assert params["low_freq_factor"] == pytest.approx(1.0, rel=1e-4)
    assert params["high_freq_factor"] == pytest.approx(4.0, rel=1e-4)
    assert llama3_rope_scaling(np.ones(64), 500000.0, 128) is None
    with pytest.raises(CheckpointError, match="not Llama 3 scaling"):
        llama3_rope_scaling(np.linspace(1.0, 3.0, 64), 500000.0, 128)


# ---- refusals: each names the problem before anything is dequantized -----------------------

def test_wrong_magic(tiny_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    assert "not a GGUF file (it starts with b'GGML'" in error(path)


@pytest.mark.parametrize("keep", [0.7, 0.001])
def test_truncated_file(tiny_gguf: Path, tmp_path: Path, keep: float) -> None:
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    message = error(path)
    assert "truncated or corrupt" in message and str(path) in message


def test_missing_file_and_folder_errors(tmp_path: Path) -> None:
    assert "does not exist" in error(tmp_path / "nowhere.gguf")
    with pytest.raises(CheckpointError, match="does not exist"):
        Tokenizer.from_path(tmp_path / "nowhere.gguf")


def test_unsupported_tensor_type(tiny_llama: Path, tmp_path: Path) -> None:
    name = "blk.1.ffn_up.weight"
    tensors = gguf_tensors(tiny_llama)
    blocks = np.zeros(gguf.quants.quant_shape_to_byte_shape(tensors[name].shape, QType.IQ4_NL),
                      dtype=np.uint8)
    path = write_gguf(tmp_path / "iq4.gguf", gguf_metadata(tiny_llama), tensors,
                      raw={name: (QType.IQ4_NL, blocks)})
    message = error(path)
    assert f"tensor {name!r} has type IQ4_NL" in message
    assert "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1" in message
    assert "llama-quantize" in message


def test_unknown_type_number(tiny_gguf: Path, tmp_path: Path) -> None:
    # Patch the type field of the first tensor's directory entry to a number ggml never had.
    data = bytearray(tiny_gguf.read_bytes())
    reader = gguf.GGUFReader(tiny_gguf)
    first = reader.tensors[0].field
    type_offset = first.offset + sum(int(p.nbytes) for p in first.parts[:4])
    data[type_offset:type_offset + 4] = (250).to_bytes(4, "little")
    path = tmp_path / "type250.gguf"
    path.write_bytes(bytes(data))
    assert "unknown ggml type" in error(path)


def test_big_endian_and_unknown_versions_are_named(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    swapped = tmp_path / "be.gguf"
    swapped.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    assert "a big-endian GGUF file" in error(swapped)
    future = tmp_path / "v9.gguf"
    future.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    message = error(future)
    assert "GGUF version 9" in message and "versions 2, 3" in message


def test_the_header_reads_as_gguf_py_reads_it(tiny_gguf: Path) -> None:
    """Our own header parser (gguf-py's reader takes ~10 s of CPU on a 49k-token
    vocabulary) gives every metadata value and every tensor's mapped data as gguf-py's
    reader does."""
    from tandem_engine.gguf_file import open_gguf

    ours, theirs = open_gguf(tiny_gguf), gguf.GGUFReader(tiny_gguf)
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):  # the reader's own header entries
            assert ours.has(key)
            assert ours._fields[key].contents() == field.contents(), key
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.qtype == tensor.tensor_type and mine.data.dtype == tensor.data.dtype
        assert np.array_equal(mine.data, tensor.data), tensor.name


def test_a_value_that_is_not_utf8_names_its_key(tiny_gguf: Path, tmp_path: Path) -> None:
    from tandem_engine.gguf_file import open_gguf

    data = bytearray(tiny_gguf.read_bytes())
    name = b"general.architecture"
    at = data.index(name) + len(name) + 4 + 8  # past the key, the value type and length
    data[at] = 0xFF  # the first byte of "llama"
    path = tmp_path / "latin1.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"'general\.architecture' cannot be read"):
        open_gguf(path).string("general.architecture")


def test_head_counts_that_do_not_divide(tiny_llama: Path, tmp_path: Path) -> None:
    def edit(meta: Meta, _: dict[str, np.ndarray]) -> None:
        meta["llama.attention.head_count_kv"] = 3

    message = error(gguf_of(tiny_llama, tmp_path / "heads.gguf", edit=edit))
    assert "llama.attention.head_count=4 is not a multiple of" in message
    assert "llama.attention.head_count_kv=3" in message


def test_head_count_that_does_not_match_the_shapes(tiny_llama: Path, tmp_path: Path) -> None:
    def edit(meta: Meta, tensors: dict[str, np.ndarray]) -> None:
        meta["llama.attention.head_count"] = 8  # head dim 8: k_proj would be 2 x 8 rows
        meta["llama.rope.dimension_count"] = None
        del tensors["rope_freqs.weight"]  # (it has one factor per frequency of head dim 16)

    message = error(gguf_of(tiny_llama, tmp_path / "shape.gguf", edit=edit))
    assert "tensor 'blk.0.attn_k.weight' (model.layers.0.self_attn.k_proj.weight) has shape " \
           "(32, 64), expected (16, 64) from the metadata" in message


def test_missing_metadata_key(tiny_llama: Path, tmp_path: Path) -> None:
    def edit(meta: Meta, _: dict[str, np.ndarray]) -> None:
        meta["llama.block_count"] = None

    message = error(gguf_of(tiny_llama, tmp_path / "nokey.gguf", edit=edit))
    assert "metadata key 'llama.block_count' is missing" in message
    assert "convert the model again" in message


def test_missing_and_unexpected_tensors(tiny_llama: Path, tmp_path: Path) -> None:
    def edit(_: Meta, tensors: dict[str, np.ndarray]) -> None:
        del tensors["blk.1.ffn_down.weight"]
        tensors["blk.2.attn_norm.weight"] = tensors["blk.1.attn_norm.weight"]

    message = error(gguf_of(tiny_llama, tmp_path / "tensors.gguf", edit=edit))
    assert "missing tensor 'blk.1.ffn_down.weight' (model.layers.1.mlp.down_proj.weight)" \
        in message
    assert "unexpected tensor 'blk.2.attn_norm.weight'" in message
    assert "block_count=2" in message


def test_other_architecture_and_tokenizer_refused(tiny_llama: Path, tmp_path: Path) -> None:
    def qwen(meta: Meta, _: dict[str, np.ndarray]) -> None:
        meta["general.architecture"] = "qwen2"

    message = error(gguf_of(tiny_llama, tmp_path / "qwen.gguf", edit=qwen))
    assert "general.architecture 'qwen2' is not supported" in message

    def spm(meta: Meta, _: dict[str, np.ndarray]) -> None:
        meta["tokenizer.ggml.model"] = "llama"

    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.model 'llama' is not supported"):
        Tokenizer.from_path(gguf_of(tiny_llama, tmp_path / "spm.gguf", edit=spm))

    def unknown_pre(meta: Meta, _: dict[str, np.ndarray]) -> None:
        meta["tokenizer.ggml.pre"] = "mystery"

    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.pre is 'mystery'; supported"):
        Tokenizer.from_path(gguf_of(tiny_llama, tmp_path / "pre.gguf", edit=unknown_pre))


# ---- refit --------------------------------------------------------------------------------------

def test_refit_from_gguf_and_a_bad_gguf_changes_nothing(
        tiny_llama: Path, tmp_path: Path) -> None:
    other = write_demo_model(tmp_path / "seed1", seed=1)
    good = gguf_of(other, tmp_path / "seed1.gguf", QType.F32)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[:-4096])
    llm = LLM(tiny_llama, kernels="torch")
    before = tokens(llm.generate(PROMPTS, GREEDY))

    llm.pause()
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        llm.refit(bad, version="bad")
    llm.unpause()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before
    assert llm.engine.weight_epoch == 0

    llm.pause()
    uri = good.resolve().as_uri()
    assert llm.refit(checkpoint_path(uri), version="v2") == 1
    llm.unpause()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(
        LLM(other, kernels="torch").generate(PROMPTS, GREEDY))


def test_refit_to_a_gguf_of_another_shape_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    def three_layers(meta: Meta, tensors: dict[str, np.ndarray]) -> None:
        meta["llama.block_count"] = 3
        for name in [n for n in tensors if n.startswith("blk.1.")]:
            tensors[name.replace("blk.1.", "blk.2.")] = tensors[name]

    path = gguf_of(tiny_llama, tmp_path / "deeper.gguf", edit=three_layers)
    assert validate_checkpoint(path).num_layers == 3
    with pytest.raises(CheckpointError, match="num_layers: running model has 2, new "
                                              "checkpoint has 3"):
        validate_checkpoint(path, reference=ModelConfig.from_dir(tiny_llama))


# ---- export to an HF folder --------------------------------------------------------------------

def test_export_hf_folder(tiny_llama: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    out = export_hf_folder(tiny_gguf, tmp_path / "hf", dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    original = json.loads((tiny_llama / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    scaling, expected = config["rope_scaling"], original["rope_scaling"]
    assert scaling["rope_type"] == "llama3"
    assert scaling["original_max_position_embeddings"] == 256
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert scaling[key] == pytest.approx(expected[key], rel=1e-5)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|endoftext|>"
    assert tok_config["chat_template"].startswith("{{- bos_token }}")
    assert tokens(LLM(out, kernels="torch").generate(PROMPTS, GREEDY)) == \
        tokens(LLM(tiny_llama, kernels="torch").generate(PROMPTS, GREEDY))


def test_export_tied_model_has_no_lm_head(tiny_qwen2: Path, tmp_path: Path) -> None:
    def as_llama(meta: Meta, tensors: dict[str, np.ndarray]) -> None:
        for name in [n for n in tensors if n.endswith(".bias")]:
            del tensors[name]

    path = gguf_of(tiny_qwen2, tmp_path / "tied.gguf", QType.Q8_0, edit=as_llama)
    out = export_hf_folder(path, tmp_path / "hf", dtype="bfloat16")
    weights = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["torch_dtype"] == "bfloat16"


# ---- the real model: tokenizer parity with transformers ---------------------------------------

PARITY_TEXTS = [
    "Hello world",
    "The capital of France is Paris. It has 2,148,271 inhabitants (2020).",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "  leading spaces,   runs of   spaces, trailing  ",
    "Numbers: 3.14159, 1e-9, 0x1F, 42nd, 1,000,000 and  7",
    "héllo wörld, naïve café; 日本語のテキスト; emoji 🤗🚀 and ZWJ 👩‍💻",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|endoftext|><repo_name>tandem<file_sep>main.py",
    "don't won't it's we'll I'd they've",
    "\n\n\nnewlines\r\nand tabs\t\tend",
    "",
]


def test_tokenizer_matches_transformers_on_smollm2(smollm2_gguf: Path) -> None:
    pytest.importorskip("transformers")
    from reference import hf_tokenizer_from_gguf

    reference = hf_tokenizer_from_gguf(smollm2_gguf)
    ours = Tokenizer.from_path(smollm2_gguf)
    for text in PARITY_TEXTS:
        expected = reference(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected)
    assert ours.eos_token_ids == (2,) and ours.eos_token == "<|im_end|>"
    assert ours.id_to_token(2) == "<|im_end|>" and ours.bos_token_id == 1
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template
    assert ours.all_special_ids == tuple(range(17))
    assert ours.vocab_size == 49152


def test_smollm2_config(smollm2_gguf: Path) -> None:
    config = validate_checkpoint(smollm2_gguf)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and config.rope.theta == 100000.0
    assert config.rms_norm_eps == 1e-5 and config.eos_token_ids == (2,)
