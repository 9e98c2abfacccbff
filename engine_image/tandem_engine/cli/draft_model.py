"""`tandem draft-model TARGET OUT --layers K`: a draft model for speculative decoding cut
from the served model itself.

The draft is the target's first K decoder layers with its embedding, final norm and
output head: an early exit of the target. It shares the target's tokenizer by
construction, needs no training and no download, and its greedy tokens often agree
with the target's where the next token is easy, which is where speculation pays. It is
written as a HuggingFace-format folder (config.json with num_hidden_layers=K,
model.safetensors, the tokenizer files) that the engine (`--speculative-model OUT`) and
transformers load. TARGET is a checkpoint folder or a GGUF file (dequantized: the
draft's weights are float32 then).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem_engine.errors import CheckpointError
from tandem_engine.model.checkpoint import load_checkpoint
from tandem_engine.model.family import Family
from tandem_engine.model.gguf import read_gguf_checkpoint
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import checkpoint_problem, is_gguf_path

# The files of a checkpoint folder that describe its tokenizer, copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "vocab.json",
                   "merges.txt", "tokenizer.model")


def write_draft_model(target: str | Path, out: str | Path, layers: int) -> Path:
    """Write the draft made of `target`'s first `layers` decoder layers into folder `out`
    (created if needed; its files are overwritten) and return it. ValueError when
    `layers` is not between 1 and the target's layer count - 1, or `out` is the target."""
    source, folder = Path(target), Path(out)
    if (problem := checkpoint_problem(source)) is not None:
        raise CheckpointError(f"draft-model TARGET: {problem}; give the served model's "
                              "checkpoint folder or GGUF file")
    if folder.resolve() == source.resolve():
        raise ValueError(f"draft-model OUT {folder} is the target itself: give a new folder")
    if is_gguf_path(source):
        gguf = read_gguf_checkpoint(source)
        hf_config, total = dict(gguf.hf_config), gguf.config.num_layers
        _check_layers(layers, total, source)
        # Only the kept tensors are dequantized.
        kept = dataclasses.replace(gguf, tensors={
            name: t for name, t in gguf.tensors.items()
            if _kept(name, layers, gguf.config.family)})
        tensors = kept.load_tensors(torch.float32)
    else:
        hf_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        config, tensors = load_checkpoint(source)
        total = config.num_layers
        _check_layers(layers, total, source)
        tensors = {name: t for name, t in tensors.items()
                   if _kept(name, layers, config.family)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "config.json", _draft_config(hf_config, layers))
    if is_gguf_path(source):
        Tokenizer.from_gguf(source).save_pretrained(
            folder, model_max_length=hf_config["max_position_embeddings"])
        _write_json(folder / "generation_config.json", {
            k: hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config})
    else:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
    return folder


def _check_layers(layers: int, total: int, source: Path) -> None:
    if not 1 <= layers < total:
        raise ValueError(f"draft-model --layers {layers}: the target {source} has {total} "
                         f"decoder layers, so a draft keeps 1 to {total - 1} of them (fewer "
                         "is faster, more agrees with the target more often)")


def _kept(name: str, layers: int, family: Family) -> bool:
    """Whether tensor `name` belongs to the draft: every tensor outside the decoder
    layers (embedding, final norm, head), and those of the first `layers` layers."""
    layer = family.layer_of(name)
    return layer is None or layer < layers


def _draft_config(hf_config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The target's config.json with `layers` decoder layers (and the per-layer lists
    that transformers reads cut to match)."""
    config = {**hf_config, "num_hidden_layers": layers}
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], layers)
    return config


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
