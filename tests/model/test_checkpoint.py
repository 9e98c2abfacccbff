"""Checkpoint validation and loading: round trips, shards, and every error message."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tandem_engine.cli.demo_model import demo_weights
from tandem_engine.errors import CheckpointError
from tandem_engine.model.checkpoint import (
    INDEX_NAME,
    WEIGHTS_NAME,
    load_checkpoint,
    validate_checkpoint,
)
from tandem_engine.model.family import ModelConfig
from tandem_engine.weights import checkpoint_problem

SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
UP_PROJ = "model.layers.1.mlp.up_proj.weight"


def copy_with(
    src: Path, dst: Path, mutate: Callable[[dict[str, torch.Tensor]], None] | None = None
) -> Path:
    """A copy of checkpoint `src` whose tensors went through `mutate`."""
    dst.mkdir(parents=True)
    for name in SIDE_FILES:
        shutil.copy(src / name, dst / name)
    tensors = load_file(src / WEIGHTS_NAME)
    if mutate is not None:
        mutate(tensors)
    save_file(tensors, dst / WEIGHTS_NAME)
    return dst


def write_sharded(src: Path, dst: Path, num_shards: int = 3) -> Path:
    """A copy of `src` split over several shards with an index, as transformers writes."""
    dst.mkdir(parents=True)
    for name in SIDE_FILES:
        shutil.copy(src / name, dst / name)
    tensors = load_file(src / WEIGHTS_NAME)
    names = sorted(tensors)
    weight_map = {}
    for k in range(num_shards):
        shard = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::num_shards]}
        save_file(part, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (dst / INDEX_NAME).write_text(json.dumps(index))
    return dst


def message(exc: pytest.ExceptionInfo[CheckpointError]) -> str:
    return str(exc.value)


# --- loading ---------------------------------------------------------------------------


def test_load_returns_exactly_the_written_tensors(tiny_model: Path) -> None:
    config, tensors = load_checkpoint(tiny_model)
    assert config == ModelConfig.from_dir(tiny_model)
    assert set(tensors) == set(config.expected_tensors())
    written = demo_weights(config, seed=0)
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, written[name]), name


def test_load_converts_dtype(tiny_qwen3: Path) -> None:
    _, tensors = load_checkpoint(tiny_qwen3, dtype="bfloat16")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    _, tensors = load_checkpoint(tiny_qwen3, dtype="fp16")
    assert {t.dtype for t in tensors.values()} == {torch.float16}
    with pytest.raises(CheckpointError, match=r"'int8'.*float32"):
        load_checkpoint(tiny_qwen3, dtype="int8")


def test_sharded_checkpoint_loads_like_single_file(tiny_model: Path, tmp_path: Path) -> None:
    sharded = write_sharded(tiny_model, tmp_path / "sharded")
    assert validate_checkpoint(sharded) == validate_checkpoint(tiny_model)
    _, expected = load_checkpoint(tiny_model)
    _, got = load_checkpoint(sharded)
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_tied_checkpoint_ignores_stored_lm_head_and_rope_buffers(
    tiny_qwen2: Path, tmp_path: Path
) -> None:
    def add_extras(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    path = copy_with(tiny_qwen2, tmp_path / "extras", add_extras)
    config, tensors = load_checkpoint(path)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in tensors
    assert not any(name.endswith("inv_freq") for name in tensors)


# --- errors: tensors -------------------------------------------------------------------


def test_missing_tensor_names_tensor_shape_and_file(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy_with(tiny_llama, tmp_path / "ckpt", lambda t: t.pop(UP_PROJ))
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    text = message(exc)
    assert UP_PROJ in text and "missing" in text
    assert "(192, 64)" in text
    assert str(path / WEIGHTS_NAME) in text


def test_missing_tensor_in_sharded_checkpoint_names_the_index(
    tiny_llama: Path, tmp_path: Path
) -> None:
    path = write_sharded(tiny_llama, tmp_path / "sharded")
    index = json.loads((path / INDEX_NAME).read_text())
    shard = index["weight_map"].pop(UP_PROJ)
    tensors = load_file(path / shard)
    del tensors[UP_PROJ]
    save_file(tensors, path / shard)
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    assert UP_PROJ in message(exc) and str(path / INDEX_NAME) in message(exc)
    assert "(192, 64)" in message(exc)


def test_wrong_shape_names_file_tensor_and_both_shapes(tiny_llama: Path, tmp_path: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[UP_PROJ] = torch.zeros(100, 64)

    path = copy_with(tiny_llama, tmp_path / "ckpt", shrink)
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    text = message(exc)
    assert str(path / WEIGHTS_NAME) in text and UP_PROJ in text
    assert "(100, 64)" in text and "expected (192, 64)" in text


def test_unexpected_tensor_is_named(tiny_qwen3: Path, tmp_path: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
        t["model.layers.7.mlp.up_proj.weight"] = torch.zeros(3)

    path = copy_with(tiny_qwen3, tmp_path / "ckpt", add)
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    text = message(exc)
    assert "unexpected tensor 'model.layers.0.self_attn.extra.weight'" in text
    assert "model.layers.7.mlp.up_proj.weight" in text
    assert "num_hidden_layers=2" in text
    assert str(path / WEIGHTS_NAME) in text


def test_untied_lm_head_is_required(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy_with(tiny_llama, tmp_path / "ckpt", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight'.*\(2048, 64\)"):
        validate_checkpoint(path)


def test_integer_tensor_is_rejected(tiny_qwen2: Path, tmp_path: Path) -> None:
    name = "model.norm.weight"

    def to_int(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].to(torch.int64)

    path = copy_with(tiny_qwen2, tmp_path / "ckpt", to_int)
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    text = message(exc)
    assert name in text and "I64" in text and "floating-point" in text
    assert str(path / WEIGHTS_NAME) in text


def test_bf16_checkpoint_is_accepted_and_converted(tiny_qwen2: Path, tmp_path: Path) -> None:
    def to_bf16(t: dict[str, torch.Tensor]) -> None:
        for name in t:
            t[name] = t[name].to(torch.bfloat16)

    path = copy_with(tiny_qwen2, tmp_path / "ckpt", to_bf16)
    _, tensors = load_checkpoint(path, dtype="float32")
    assert {t.dtype for t in tensors.values()} == {torch.float32}


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_is_a_checkpoint_error(tiny_llama: Path, tmp_path: Path, damage: str) -> None:
    path = copy_with(tiny_llama, tmp_path / "ckpt")
    file = path / WEIGHTS_NAME
    data = file.read_bytes()
    file.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00\xff" * 64,
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    assert str(file) in message(exc) and "safetensors" in message(exc)


# --- errors: folder layout -------------------------------------------------------------


def test_no_weights_names_folder_and_files_looked_for(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy_with(tiny_llama, tmp_path / "ckpt")
    (path / WEIGHTS_NAME).rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    text = message(exc)
    assert str(path) in text and WEIGHTS_NAME in text and INDEX_NAME in text
    assert "pytorch_model.bin" in text


def test_missing_folder_and_missing_config(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_checkpoint(tmp_path / "nowhere")
    path = copy_with(tiny_llama, tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        validate_checkpoint(path)


def test_index_naming_a_missing_shard_names_both_files(tiny_qwen2: Path, tmp_path: Path) -> None:
    path = write_sharded(tiny_qwen2, tmp_path / "sharded")
    shard = path / "model-00002-of-00003.safetensors"
    shard.unlink()
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    assert str(path / INDEX_NAME) in message(exc) and str(shard) in message(exc)


def test_index_pointing_at_wrong_shard(tiny_qwen2: Path, tmp_path: Path) -> None:
    path = write_sharded(tiny_qwen2, tmp_path / "sharded")
    index = json.loads((path / INDEX_NAME).read_text())
    name = "model.norm.weight"
    current = index["weight_map"][name]
    other = next(s for s in set(index["weight_map"].values()) if s != current)
    index["weight_map"][name] = other
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(path)
    assert name in message(exc) and other in message(exc) and INDEX_NAME in message(exc)


def test_tensor_in_two_shards(tiny_qwen2: Path, tmp_path: Path) -> None:
    path = write_sharded(tiny_qwen2, tmp_path / "sharded", num_shards=2)
    first = path / "model-00001-of-00002.safetensors"
    second = path / "model-00002-of-00002.safetensors"
    tensors = load_file(second)
    tensors["model.embed_tokens.weight"] = load_file(first)["model.embed_tokens.weight"]
    save_file(tensors, second)
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight'.*exactly one shard"):
        validate_checkpoint(path)


def test_bad_index_json(tiny_qwen2: Path, tmp_path: Path) -> None:
    path = write_sharded(tiny_qwen2, tmp_path / "sharded")
    (path / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        validate_checkpoint(path)
    (path / INDEX_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        validate_checkpoint(path)


# --- refit: reference config -----------------------------------------------------------


def test_reference_with_same_shape_passes(tiny_llama: Path) -> None:
    running = ModelConfig.from_dir(tiny_llama)
    other_eps = dataclasses.replace(running, rms_norm_eps=1e-6)  # not a shape field
    assert validate_checkpoint(tiny_llama, reference=other_eps) == running


def test_reference_mismatch_names_field_and_both_values(tiny_llama: Path) -> None:
    running = dataclasses.replace(ModelConfig.from_dir(tiny_llama), num_layers=3, hidden_size=96)
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(tiny_llama, reference=running)
    text = message(exc)
    assert "num_layers: running model has 3, new checkpoint has 2" in text
    assert "hidden_size: running model has 96, new checkpoint has 64" in text
    assert str(tiny_llama / "config.json") in text


def test_reference_of_another_architecture(tiny_llama: Path, tiny_qwen2: Path) -> None:
    with pytest.raises(CheckpointError, match="architecture: running model has 'Qwen2ForCausalLM'"):
        load_checkpoint(tiny_llama, reference=ModelConfig.from_dir(tiny_qwen2))


# --- config.json spellings -------------------------------------------------------------


def to_transformers_5(raw: dict) -> dict:
    """The transformers 5.x spelling of a 4.x config.json."""
    out = dict(raw)
    rope = dict(out.pop("rope_scaling", None) or {"rope_type": "default"})
    rope["rope_theta"] = out.pop("rope_theta")
    out["rope_parameters"] = rope
    out["dtype"] = out.pop("torch_dtype")
    return out


def test_v4_and_v5_config_spellings_parse_equal(tiny_model: Path) -> None:
    raw = json.loads((tiny_model / "config.json").read_text())
    assert "rope_theta" in raw and "torch_dtype" in raw
    v5 = to_transformers_5(raw)
    assert "rope_theta" not in v5 and "torch_dtype" not in v5
    assert ModelConfig.from_hf_dict(v5) == ModelConfig.from_hf_dict(raw)


def test_config_saved_by_transformers_5_parses_equal(tiny_model: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.from_pretrained(tiny_model).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert "rope_parameters" in saved and "dtype" in saved
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_dir(tiny_model)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a check as another user")
def test_a_checkpoint_this_user_may_not_read_says_permission_not_missing(
        tiny_llama: Path) -> None:
    """As the images' uid 65532 would meet a root-only hostPath: each form of checkpoint
    is reported as unreadable by that uid, never as missing."""
    base = Path(tempfile.mkdtemp(prefix="tandem-perm-"))  # pytest's tmp_path is 0700
    base.chmod(0o755)
    locked = base / "locked"
    locked.mkdir(mode=0o700)
    shutil.copytree(tiny_llama, locked / "model")
    unreadable = base / "open" / "model"
    shutil.copytree(tiny_llama, unreadable)
    unreadable.chmod(0o755)
    for file in unreadable.iterdir():
        file.chmod(0o644)
    (unreadable / "config.json").chmod(0o600)
    gguf = base / "open" / "weights.gguf"
    gguf.write_bytes(b"GGUF")
    gguf.chmod(0o600)
    (base / "open").chmod(0o755)
    paths = [locked / "model", unreadable, gguf]
    try:
        lines = _as_user(65532, lambda: [line for path in paths for line in (
            _load_error(path), str(checkpoint_problem(path)))])
    finally:
        shutil.rmtree(base)
    stdout = "\n".join(lines)
    assert len(lines) == 6, stdout
    assert "does not exist" not in stdout
    assert "cannot be reached by this process (uid 65532): permission denied" in lines[0]
    assert "cannot be reached by this process (uid 65532)" in lines[1]
    assert f"{unreadable / 'config.json'} is not readable by this process" in lines[2]
    assert f"{gguf} is not readable by this process (uid 65532)" in lines[4]
    assert lines[5].endswith("is not readable by this process (uid 65532); make it "
                             "readable to that user (chmod, or the pod's "
                             "securityContext.fsGroup)")


def _load_error(path: Path) -> str:
    try:
        load_checkpoint(path)
    except CheckpointError as exc:
        return str(exc).splitlines()[0]
    return "loaded"


def _as_user(uid: int, check: Callable[[], list[str]]) -> list[str]:
    """`check()` run in a forked child that has dropped to `uid` (the interpreter lives
    under /root, which another user could not start)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, run, report, exit without cleanup
        try:
            os.close(read)
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, "\n".join(check()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out.splitlines()
