"""What a GGUF file says: its metadata and its tensor directory, read without torch.

A GGUF file (llama.cpp's format) is one file holding a model's hyperparameters, its
tokenizer and its tensors, usually quantized. Two owners read it: the tokenizer (the
router loads it and never imports torch) and `model/gguf.py` (the weights). Both open it
here, so the checks every reader needs exist once: the magic, a truncated or corrupt file,
the byte order, and typed metadata access whose errors name the file and the key. Tensor
data stay memory-mapped; nothing is dequantized here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from tandem_engine.errors import CheckpointError, path_problem

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_INTS = frozenset({GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16,
                   GGUFValueType.INT16, GGUFValueType.UINT32, GGUFValueType.INT32,
                   GGUFValueType.UINT64, GGUFValueType.INT64})
_FLOATS = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_REQUIRED = object()
_REFETCH = "download or copy it again"
# Little-endian struct formats of the fixed-size metadata value types.
_SCALAR_FORMATS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
                   GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
                   GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
                   GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
                   GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
                   GGUFValueType.BOOL: "<?"}
# Tensor types whose data are plain numbers: memory-mapped with their own dtype and shape.
# Every other (quantized) type is mapped as bytes, a row of blocks per row.
_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class _Field:
    """One metadata value: its types (`ARRAY` then the item type for arrays) and the value,
    strings kept as bytes until read (a string that is not UTF-8 is an error of its key)."""

    types: tuple[GGUFValueType, ...]
    value: Any

    def contents(self) -> Any:
        if self.types[0] == GGUFValueType.STRING:
            return self.value.decode("utf-8")
        if self.types[0] == GGUFValueType.ARRAY and len(self.types) == 2 \
                and self.types[1] == GGUFValueType.STRING:
            return [item.decode("utf-8") for item in self.value]
        if isinstance(self.value, np.ndarray):
            return self.value.tolist()
        return self.value


class _Header:
    """A cursor over the file's bytes that parses the header: metadata, then the tensor
    directory. Reads past the end raise ValueError ("truncated")."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0

    def take(self, size: int) -> memoryview:
        end = self.offset + size
        if size < 0 or end > len(self.data):
            raise ValueError(f"the header ends past the end of the file (at byte {end})")
        chunk = self.data[self.offset:end]
        self.offset = end
        return chunk

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return bytes(self.take(self.unpack("<Q")))

    def value(self, kind: GGUFValueType) -> _Field:
        if kind == GGUFValueType.STRING:
            return _Field((kind,), self.string())
        if kind in _SCALAR_FORMATS:
            return _Field((kind,), self.unpack(_SCALAR_FORMATS[kind]))
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {int(kind)}")
        item = GGUFValueType(self.unpack("<I"))
        count = self.unpack("<Q")
        if item == GGUFValueType.STRING:  # the vocabulary: tens of thousands of strings
            return _Field((kind, item), [self.string() for _ in range(count)])
        if item in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item]
            width = struct.calcsize(fmt)
            values = np.frombuffer(self.take(width * count), dtype=np.dtype(fmt), count=count)
            return _Field((kind, item), values)
        raise ValueError(f"an array of {item.name} values (nested arrays are not read)")

    def metadata(self, count: int) -> dict[str, _Field]:
        fields: dict[str, _Field] = {}
        for _ in range(count):
            key = self.string().decode("utf-8")
            fields[key] = self.value(GGUFValueType(self.unpack("<I")))
        return fields


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

    def __init__(self, path: Path, fields: dict[str, _Field],
                 tensors: dict[str, GGUFTensor]) -> None:
        self.path = path
        self._fields = fields
        self.tensors = tensors

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
        if field.types[0] != GGUFValueType.ARRAY or (len(field.value) and (
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
        mapped = np.memmap(file, mode="r")
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc.strerror or exc})") from exc
    try:
        fields, tensors = _parse(mapped)
    except _BigEndian:
        raise CheckpointError(f"{file}: a big-endian GGUF file; Tandem reads little-endian "
                              "GGUF files (the default of llama.cpp's converter)") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError,
            struct.error) as exc:
        raise CheckpointError(_unreadable(file, size, exc)) from exc
    return GGUFFile(file, fields, tensors)


class _BigEndian(Exception):
    pass


def _parse(mapped: np.memmap) -> tuple[dict[str, _Field], dict[str, GGUFTensor]]:
    """The metadata and the tensor directory of a mapped GGUF file (after its magic); each
    tensor's data a view of `mapped`, nothing copied."""
    header = _Header(memoryview(mapped))
    header.take(len(GGUF_MAGIC))
    version = header.unpack("<I")
    if version & 0xFFFF == 0 and version != 0:
        raise _BigEndian  # a small version number written the other way round
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"the file is GGUF version {version}; Tandem reads versions "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    tensor_count, kv_count = header.unpack("<Q"), header.unpack("<Q")
    fields = header.metadata(kv_count)
    directory = []
    for _ in range(tensor_count):
        name = header.string().decode("utf-8")
        dims = [header.unpack("<Q") for _ in range(header.unpack("<I"))]
        directory.append((name, dims, GGMLQuantizationType(header.unpack("<I")),
                          header.unpack("<Q")))
    alignment = DEFAULT_ALIGNMENT
    if (align := fields.get("general.alignment")) is not None:
        if align.types != (GGUFValueType.UINT32,) or align.value <= 0 \
                or align.value & (align.value - 1):
            raise ValueError("general.alignment is not a power of two (a UINT32)")
        alignment = align.value
    start = -(-header.offset // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, qtype, offset in directory:
        if name in tensors:
            raise ValueError(f"two tensors are named {name!r}")
        shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the innermost first
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        nbytes = elements * block_bytes // block
        begin = start + offset
        if begin + nbytes > len(mapped):
            raise ValueError(f"tensor {name!r}'s data end past the end of the file")
        raw = mapped[begin:begin + nbytes]
        if qtype in _PLAIN_DTYPES:
            data = raw.view(_PLAIN_DTYPES[qtype]).reshape(shape)
        else:
            if not shape or shape[-1] % block:
                raise ValueError(f"tensor {name!r}'s rows ({shape}) are not whole "
                                 f"{qtype.name} blocks of {block}")
            data = raw.reshape((*shape[:-1], shape[-1] // block * block_bytes))
        tensors[name] = GGUFTensor(name, qtype, shape, data)
    return fields, tensors


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
