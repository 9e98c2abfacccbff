"""What a GGUF file says: its metadata and its tensor directory, read without torch.

A GGUF file (llama.cpp's format) is one file holding a model's hyperparameters, its
tokenizer and its tensors, usually quantized. Two owners read it: the tokenizer (the
router loads it and never imports torch) and `model/gguf.py` (the weights). Both open it
here, so the checks every reader needs exist once: the magic, a truncated or corrupt file,
the byte order, and typed metadata access whose errors name the file and the key. Tensor
data stay memory-mapped; nothing is dequantized here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from tandem_engine.errors import CheckpointError, path_problem

GGUF_MAGIC = b"GGUF"
_INTS = frozenset({GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16,
                   GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT32,
                   GGUFValueType.UINT64, GGUFValueType.INT64})
_FLOATS = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_REQUIRED = object()
_REFETCH = "download or copy it again"


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor directory; `data` is the memory-mapped raw data."""

    name: str
    qtype: GGMLQuantizationType
    # Row-major (PyTorch) order. GGUF lists dimensions innermost first; this is reversed.
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def block_size(self) -> int:
        """Elements per quantization block (1 for plain float types)."""
        return GGML_QUANT_SIZES[self.qtype][0]


class GGUFFile:
    """An open GGUF file: typed metadata getters and the tensors by name.

    Every getter raises `CheckpointError` naming the file and the key (a required key
    that is absent, a value of the wrong type); `missing(key, why)` is the error for an
    absent key that says what the value is needed for."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._fields = reader.fields
        self.tensors: dict[str, GGUFTensor] = {
            t.name: GGUFTensor(t.name, t.tensor_type,
                               tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
            for t in reader.tensors
        }

    def has(self, key: str) -> bool:
        return key in self._fields

    def string(self, key: str, default: Any = _REQUIRED) -> str:
        return self._scalar(key, default, (GGUFValueType.STRING,), "a string")

    def integer(self, key: str, default: Any = _REQUIRED) -> int:
        return int(self._scalar(key, default, _INTS, "an integer"))

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        return float(self._scalar(key, default, _FLOATS | _INTS, "a number"))

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        return bool(self._scalar(key, default, (GGUFValueType.BOOL,), "a boolean"))

    def strings(self, key: str, default: Any = _REQUIRED) -> list[str]:
        return self._array(key, default, (GGUFValueType.STRING,), "strings")

    def integers(self, key: str, default: Any = _REQUIRED) -> list[int]:
        return [int(v) for v in self._array(key, default, _INTS, "integers")]

    def missing(self, key: str, why: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: metadata key {key!r} is missing; it is needed for {why}. The file "
            "was written by an incomplete or old converter: convert the model again with a "
            "recent llama.cpp (convert_hf_to_gguf.py)")

    def _field(self, key: str, default: Any) -> Any:
        field = self._fields.get(key)
        if field is None and default is _REQUIRED:
            raise self.missing(key, "this model")
        return field

    def _scalar(self, key: str, default: Any, types: Any, what: str) -> Any:
        field = self._field(key, default)
        if field is None:
            return default
        if len(field.types) != 1 or field.types[0] not in types:
            raise self._wrong_type(key, field, what)
        try:
            return field.contents()
        except (ValueError, IndexError) as exc:  # a string that is not UTF-8, a short read
            raise CheckpointError(f"{self.path}: metadata key {key!r} cannot be read ({exc}); "
                                  f"the file is corrupt: {_REFETCH}") from exc

    def _array(self, key: str, default: Any, types: Any, what: str) -> list[Any]:
        field = self._field(key, default)
        if field is None:
            return default
        if field.types[0] != GGUFValueType.ARRAY or (field.data and (
                len(field.types) != 2 or field.types[1] not in types)):
            raise self._wrong_type(key, field, f"an array of {what}")
        try:
            return field.contents()
        except (ValueError, IndexError) as exc:
            raise CheckpointError(f"{self.path}: metadata key {key!r} cannot be read ({exc}); "
                                  f"the file is corrupt: {_REFETCH}") from exc

    def _wrong_type(self, key: str, field: Any, what: str) -> CheckpointError:
        got = "/".join(t.name for t in field.types)
        return CheckpointError(f"{self.path}: metadata key {key!r} holds {got}, expected "
                               f"{what}; the file was not written by llama.cpp's converter")


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and parse a GGUF file's header (metadata and tensor directory).

    A missing file, another format, a truncated or corrupt file, or a big-endian file
    raises CheckpointError naming the file and what to do."""
    file = Path(path)
    if (what := path_problem(file, "file")) is not None:
        raise CheckpointError(f"GGUF file {file} {what}; give the path of a .gguf file "
                              "(or a HuggingFace checkpoint folder)")
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc.strerror or exc})") from exc
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            f"{file}: not a GGUF file (it starts with {magic!r}, a GGUF file with "
            f"{GGUF_MAGIC!r}); a file named .gguf must be in llama.cpp's GGUF format")
    try:
        reader = GGUFReader(file, "r")
    except (ValueError, KeyError, IndexError, TypeError, OverflowError) as exc:
        raise CheckpointError(_unreadable(file, size, exc)) from exc
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc.strerror or exc})") from exc
    if reader.byte_order != "I":
        raise CheckpointError(f"{file}: a big-endian GGUF file; Tandem reads little-endian "
                              "GGUF files (the default of llama.cpp's converter)")
    return GGUFFile(file, reader)


def _unreadable(file: Path, size: int, exc: Exception) -> str:
    text = str(exc)
    if "GGMLQuantizationType" in text:  # a tensor type number this gguf library does not know
        return (f"{file}: a tensor has an unknown ggml type ({text}); the file needs a newer "
                "reader than Tandem has, or is corrupt: re-quantize it to Q8_0, Q4_0 or F16, "
                f"or {_REFETCH}")
    if "version" in text:
        return f"{file}: {text}; convert the model again with a recent llama.cpp"
    return (f"{file}: cannot parse the GGUF header or tensor data ({type(exc).__name__}: "
            f"{text}); at {size} bytes the file is truncated or corrupt (an interrupted "
            f"download or copy): {_REFETCH}")
