"""Validate and load checkpoints: HuggingFace-format folders and GGUF files.

A checkpoint folder holds config.json and either model.safetensors or a
sharded model.safetensors.index.json with its shards; a path ending in .gguf is a
llama.cpp GGUF file, validated and dequantized by `model/gguf.py` under the same rules
(everything checked before any tensor is read, the same refit shape check). Loading at startup and
an in-place refit later both go through `validate_checkpoint` first: it reads
only the safetensors headers (names, shapes, dtypes; no tensor data) and
compares them with what `ModelConfig.expected_tensors()` says the config
needs, so a bad checkpoint is rejected before any parameter is touched.
Loading then checks that every weight is finite (a NaN or Inf weight never goes live; the
cost is measured in benchmarks/weights_check.py) before it returns anything.
Every failure is a `CheckpointError` that names the file, the tensor and what
was expected. A caller that shows how far a load is (the engine process, while a
multi-GB checkpoint loads) passes a `progress` callback; the loader itself logs nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tandem_engine.config import QUANTIZATION_CHOICES, normalize_dtype
from tandem_engine.errors import CheckpointError, list_problems, path_problem
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.gguf import GGUFCheckpoint, read_gguf_checkpoint
from tandem_engine.model.quant import QuantizedWeight, quantize, quantized_names
from tandem_engine.weights import is_gguf_path

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype codes a checkpoint may store weights in; they are converted on load.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_PROBLEMS_SHOWN = 10


@dataclass(frozen=True)
class TensorHeader:
    """What a safetensors header says about one tensor."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors code: F32, BF16, ...


@dataclass(frozen=True)
class LoadProgress:
    """How far a checkpoint load is: bytes of tensor data (as stored) and files read.

    The first report (nothing done yet) comes once the checkpoint is validated, so the
    totals are known before any tensor data is read."""

    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int


LoadProgressCallback = Callable[[LoadProgress], None]


class _ProgressCounter:
    """Counts tensors and files as they are read and reports after each of them."""

    def __init__(self, report: LoadProgressCallback | None, bytes_total: int,
                 files_total: int) -> None:
        self._report, self._bytes_total, self._files_total = report, bytes_total, files_total
        self._bytes_done = self._files_done = 0
        self._send()

    def tensor_read(self, nbytes: int) -> None:
        self._bytes_done += nbytes
        self._send()

    def file_read(self) -> None:
        self._files_done += 1
        self._send()

    def _send(self) -> None:
        if self._report is not None:
            self._report(LoadProgress(self._bytes_done, self._bytes_total,
                                      self._files_done, self._files_total))


@dataclass(frozen=True)
class _Manifest:
    folder: Path
    config: ModelConfig
    tensors: dict[str, TensorHeader]  # exactly config.expected_tensors(), validated


def validate_checkpoint(path: str | Path, reference: ModelConfig | None = None) -> ModelConfig:
    """Check a checkpoint folder or GGUF file without reading tensor data; return its config.

    With `reference` (the running model's config), the checkpoint must also have
    the same shape fields, as an in-place refit requires."""
    if is_gguf_path(path):
        return _inspect_gguf(Path(path), reference).config
    return _inspect(Path(path), reference).config


def load_checkpoint(
    path: str | Path, dtype: str | None = None, *, reference: ModelConfig | None = None,
    check_finite: bool = True, progress: LoadProgressCallback | None = None,
    quantization: str = "none",
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """Validate, then load every tensor the config needs, converted to `dtype`
    (float32, bfloat16 or float16; default: the checkpoint's dtype from config.json,
    float32 for a GGUF file, whose quantized tensors are dequantized), and check that every
    value is finite (`check_finite=False` only for the benchmark that measures its cost).

    With tied embeddings no `lm_head.weight` is returned, even if the file holds one.
    With `num_mtp_heads` in config.json the multi-token-prediction heads (`mtp.*`,
    model/mtp.py) are returned too: `take_mtp_heads` splits them off before the model
    is built. A GGUF file holds no heads.
    `progress`, when given, is called with a `LoadProgress` once the checkpoint is
    validated, after every tensor and after every file (the finiteness check follows the
    last report).
    `quantization` (the engine's `--quantization`, config.QUANTIZATION_CHOICES) returns
    the projections' weights (and a tied embedding's) as `QuantizedWeight`s: under auto
    a GGUF's quantized tensors stay quantized (model/gguf_blocks.py) and an HF
    checkpoint stays dense; int8 and int4 quantize every projection (model/quant.py)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization {quantization!r}: use one of "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    config, tensors = _load(path, dtype, reference, progress, quantization)
    if check_finite:
        _check_finite(path, tensors)
    return config, tensors


def quantization_targets(config: ModelConfig) -> tuple[set[str], str | None]:
    """The tensor names a quantization applies to in `config`'s model (its Linears'
    weights) and the tied embedding's name (None when untied): model/quant.py."""
    with torch.device("meta"):
        model = config.family.model_class()(config)
    return quantized_names(model)


def _load(path: str | Path, dtype: str | None, reference: ModelConfig | None,
          progress: LoadProgressCallback | None, quantization: str,
          ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    wanted = normalize_dtype(dtype, "load_checkpoint", "dtype") if dtype else None
    if is_gguf_path(path):
        gguf = _inspect_gguf(Path(path), reference)
        counter = _ProgressCounter(progress, gguf.data_bytes, 1)
        targets = (None if quantization == "none"
                   else quantization_targets(gguf.config))
        gguf_tensors = gguf.load_tensors(_TORCH_DTYPES[wanted or gguf.config.dtype],
                                         on_tensor=counter.tensor_read,
                                         quantization=quantization, targets=targets)
        counter.file_read()
        return gguf.config, gguf_tensors
    manifest = _inspect(Path(path), reference)
    target = _TORCH_DTYPES[wanted or manifest.config.dtype]
    by_file: dict[Path, list[TensorHeader]] = {}
    for header in manifest.tensors.values():
        by_file.setdefault(header.file, []).append(header)
    counter = _ProgressCounter(progress, sum(map(_data_bytes, manifest.tensors.values())),
                               len(by_file))
    out: dict[str, torch.Tensor] = {}
    for file, headers in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for header in headers:
                    out[header.name] = f.get_tensor(header.name).to(target)
                    counter.tensor_read(_data_bytes(header))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{file}: cannot read tensor data ({exc})") from exc
        counter.file_read()
    if quantization in ("int8", "int4"):
        return manifest.config, _quantized(out, quantization_targets(manifest.config),
                                           quantization)
    return manifest.config, out


def _quantized(tensors: dict[str, torch.Tensor], targets: tuple[set[str], str | None],
               kind: str) -> dict[str, torch.Tensor | QuantizedWeight]:
    """`tensors` with the targets' weights quantized to `kind` (a tied embedding to int8
    rows), one at a time."""
    linears, tied = targets
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name in list(tensors):
        tensor = tensors.pop(name)
        if name == tied:
            out[name] = quantize(tensor, "int8")
        elif name in linears:
            out[name] = quantize(tensor, "int4" if kind == "int4" else "int8")
        else:
            out[name] = tensor
    return out


def _data_bytes(header: TensorHeader) -> int:
    """Bytes of the tensor's data as stored (the dtype is one of FLOAT_DTYPES, validated)."""
    return math.prod(header.shape) * _DTYPE_BYTES[header.dtype]


def _check_finite(path: str | Path, tensors: dict[str, torch.Tensor | QuantizedWeight]
                  ) -> None:
    """Every weight is a finite number: a NaN or an Inf (a diverged training step, a bad
    conversion) would make every answer garbage while the shapes all look right. A
    quantized weight's integers are finite; its scales (and zeros) are checked."""
    problems = []
    for name, tensor in _float_parts(tensors):
        if tensor.numel() == 0:
            continue
        # min and max propagate NaN and show an Inf: one fast reduction (isfinite is
        # several times slower on CPU), and the exact count only for a bad tensor.
        low, high = torch.aminmax(tensor)
        if math.isfinite(low) and math.isfinite(high):
            continue
        bad = tensor.numel() - int(torch.isfinite(tensor).sum())
        problems.append(f"{name}: {bad} of {tensor.numel()} values are NaN or Inf")
    if problems:
        raise CheckpointError(
            f"{path}: weights that are not finite numbers (a NaN or Inf weight makes every "
            f"answer garbage):{list_problems(problems, _MAX_PROBLEMS_SHOWN)}\n"
            "Fix: export the checkpoint again from finite weights (check the training step "
            "that wrote it)")


def _float_parts(tensors: dict[str, torch.Tensor | QuantizedWeight]
                 ) -> list[tuple[str, torch.Tensor]]:
    parts: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors.items():
        if isinstance(tensor, QuantizedWeight):
            parts.append((f"{name} (scales)", tensor.scales))
            if tensor.zeros is not None:
                parts.append((f"{name} (zeros)", tensor.zeros))
        else:
            parts.append((name, tensor))
    return parts


def _inspect(folder: Path, reference: ModelConfig | None) -> _Manifest:
    if (what := path_problem(folder, "folder")) is not None:
        raise CheckpointError(
            f"checkpoint folder {folder} {what}; expected a folder with config.json and "
            f"{WEIGHTS_NAME} (or {INDEX_NAME} with its shards)"
        )
    config = ModelConfig.from_dir(folder)
    if reference is not None:
        _check_same_shape(folder / "config.json", config, reference)
    found, index_map = _read_headers(folder)
    _check_tensors(folder, config, found, index_map)
    required, optional = config.mtp_tensors()
    wanted = [*config.expected_tensors(), *required, *(n for n in optional if n in found)]
    return _Manifest(folder, config, {name: found[name] for name in wanted})


def _inspect_gguf(file: Path, reference: ModelConfig | None) -> GGUFCheckpoint:
    checkpoint = read_gguf_checkpoint(file)
    if reference is not None:
        _check_same_shape(file, checkpoint.config, reference)
    return checkpoint


def _check_same_shape(config_file: Path, new: ModelConfig, running: ModelConfig) -> None:
    new_fields, running_fields = new.shape_fields(), running.shape_fields()
    diffs = [
        f"{key}: running model has {running_fields[key]!r}, new checkpoint has {new_fields[key]!r}"
        for key in running_fields
        if new_fields.get(key) != running_fields[key]
    ]
    if diffs:
        raise CheckpointError(
            f"{config_file}: the new checkpoint does not have the running model's shape, "
            "so its weights cannot replace the running ones:\n  - " + "\n  - ".join(diffs)
        )


def _read_headers(folder: Path) -> tuple[dict[str, TensorHeader], dict[str, str] | None]:
    """All tensor headers of the checkpoint, and the index's weight_map when sharded.

    Like transformers, a single model.safetensors wins over an index next to it."""
    single, index = folder / WEIGHTS_NAME, folder / INDEX_NAME
    if single.exists():
        return _file_headers(single), None
    if not index.exists():
        raise CheckpointError(_no_weights_message(folder))
    weight_map = _read_index(index)
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (folder / shard).is_file():
            first = next(name for name, s in weight_map.items() if s == shard)
            raise CheckpointError(
                f"{index}: names shard {shard!r} (holding {first!r} and others), but "
                f"{folder / shard} does not exist"
            )
    found: dict[str, TensorHeader] = {}
    for shard in shards:
        for name, header in _file_headers(folder / shard).items():
            if name in found:
                raise CheckpointError(
                    f"{header.file}: tensor {name!r} is also in {found[name].file}; "
                    "each tensor must be stored in exactly one shard"
                )
            found[name] = header
    for name, shard in weight_map.items():
        header = found.get(name)
        if header is None or header.file != folder / shard:
            actual = "" if header is None else f" (it is in {header.file.name})"
            raise CheckpointError(
                f"{index}: weight_map says tensor {name!r} is in {shard!r}, but "
                f"{folder / shard} does not contain it{actual}"
            )
    return found, weight_map


def _read_index(index: Path) -> dict[str, str]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index}: not valid JSON ({exc})") from exc
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index}: expected a JSON object with \"weight_map\": {{tensor name: shard file}}"
        )
    return weight_map


def _file_headers(file: Path) -> dict[str, TensorHeader]:
    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                piece = f.get_slice(name)
                out[name] = TensorHeader(name, file, tuple(piece.get_shape()), piece.get_dtype())
            return out
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({exc}); the file may be truncated "
            "or corrupt, copy it again"
        ) from exc


def _check_tensors(
    folder: Path,
    config: ModelConfig,
    found: dict[str, TensorHeader],
    index_map: dict[str, str] | None,
) -> None:
    mtp_required, mtp_optional = config.mtp_tensors()
    expected = {**config.expected_tensors(), **mtp_required}
    problems: list[str] = []
    for name, shape in {**expected, **mtp_optional}.items():
        header = found.get(name)
        if header is None and name in mtp_optional:
            continue
        if header is None:
            where = folder / WEIGHTS_NAME if index_map is None else folder / INDEX_NAME
            hint = "" if index_map is None else " (not in weight_map or any shard)"
            if name in mtp_required:
                hint += (f" (config.json says num_mtp_heads={config.num_mtp_heads}, "
                         f"mtp_token_input={str(config.mtp_token_input).lower()}: fix "
                         "config.json or add the tensor)")
            problems.append(f"{where}: missing tensor {name!r}{hint}, expected shape {shape}")
        elif header.shape != shape:
            problems.append(
                f"{header.file}: tensor {name!r} has shape {header.shape}, expected {shape}"
            )
        elif header.dtype not in FLOAT_DTYPES:
            problems.append(
                f"{header.file}: tensor {name!r} has dtype {header.dtype}, expected a "
                f"floating-point dtype ({', '.join(FLOAT_DTYPES)})"
            )
    for name, header in found.items():
        if name in expected or name in mtp_optional or _ignored(name, config):
            continue
        hint = ""
        layer = config.family.layer_of(name)
        if layer is not None and layer >= config.num_layers:
            hint = f"; config.json says num_hidden_layers={config.num_layers}"
        elif name.startswith("mtp."):
            hint = (f"; config.json says num_mtp_heads={config.num_mtp_heads}, "
                    f"mtp_token_input={str(config.mtp_token_input).lower()} (heads are "
                    "mtp.{i}.weight, optional mtp.{i}.bias and, with mtp_token_input, "
                    "mtp.{i}.token_weight, i from 0)")
        problems.append(
            f"{header.file}: unexpected tensor {name!r} with shape {header.shape}: not part of "
            f"a {config.architecture} with this config.json{hint}"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} does not match its config.json ({config.architecture}, "
            f"{config.num_layers} layers, hidden_size {config.hidden_size}):"
            + list_problems(problems, _MAX_PROBLEMS_SHOWN))


def _ignored(name: str, config: ModelConfig) -> bool:
    # Old checkpoints save the RoPE frequency buffer; with tied embeddings
    # transformers ignores a stored lm_head and so do we.
    return name.endswith(".rotary_emb.inv_freq") or (
        name == "lm_head.weight" and config.tie_word_embeddings
    )


def _no_weights_message(folder: Path) -> str:
    msg = f"{folder}: no weights found; looked for {WEIGHTS_NAME} and {INDEX_NAME}"
    others = sorted(
        p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")
    )
    if others:
        msg += (
            f"; found {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}: Tandem reads "
            f"safetensors only, as {WEIGHTS_NAME} or as shards listed in {INDEX_NAME}"
        )
    return msg
