"""GGUF quantized blocks as the engine's int8/int4 weights (model/quant.py), without
going through float32 where the engine's scheme holds the block exactly.

* Q4_0, Q4_1 and Q4_K are 4-bit values with one scale (and Q4_1, Q4_K: one offset) per
  32 weights: exactly int4 in groups of 32 (w = (q - 8) * scale + zero). Q4_0: w =
  d * (q - 8); Q4_1: w = d * q + m; Q4_K: 256-weight super-blocks of eight 32-weight
  sub-blocks with 6-bit scales and mins, w = d * sc * q - dmin * mn.
* Q8_0, Q5_0, Q5_1, Q5_K and Q6_K have no int4 form and int8 holds one scale per row,
  not per block: they are dequantized and quantized again to int8 per row (a Q8_0 block
  keeps its 8 bits, but the row's largest block sets the step of every block). Their
  perplexity is measured against the dequantized model (docs/benchmarks.md).

`as_quantized(tensor, kind)` turns one GGUF tensor into the scheme `kind` asks for;
`scheme_of(qtype, kind)` says which scheme that is without reading data.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from tandem_engine.gguf_file import GGUFTensor
from tandem_engine.model.quant import Kind, QuantizedWeight, Scheme, quantize

_Q = GGMLQuantizationType
EXACT_INT4 = (_Q.Q4_0, _Q.Q4_1, _Q.Q4_K)  # held as int4 exactly (scales rounded to bf16)
INT8_TYPES = (_Q.Q8_0, _Q.Q5_0, _Q.Q5_1, _Q.Q5_K, _Q.Q6_K)  # requantized to int8 rows
QUANTIZED_TYPES = EXACT_INT4 + INT8_TYPES


def auto_kind(qtype: GGMLQuantizationType) -> Kind | None:
    """What `--quantization auto` keeps a GGUF tensor of `qtype` as: int4 for the 4-bit
    types, int8 for the other quantized ones, dense (None) for F32/F16/BF16."""
    if qtype in EXACT_INT4:
        return "int4"
    if qtype in INT8_TYPES:
        return "int8"
    return None


def scheme_of(qtype: GGMLQuantizationType, kind: Kind) -> Scheme:
    return Scheme(kind, qtype.name)


def as_quantized(tensor: GGUFTensor, kind: Kind) -> QuantizedWeight:
    """`tensor` (a 2-D GGUF weight) as a `QuantizedWeight` of `kind`: straight from its
    blocks when the scheme holds them, else dequantized and quantized again."""
    if kind == "int4" and tensor.qtype in EXACT_INT4:
        rows = tensor.shape[0]
        blocks = np.ascontiguousarray(tensor.data).reshape(-1, _BLOCK_BYTES[tensor.qtype])
        values, scales, zeros = _DECODERS[tensor.qtype](blocks)
        return QuantizedWeight(
            scheme_of(tensor.qtype, kind),
            torch.from_numpy(values.reshape(rows, -1)),
            torch.from_numpy(scales.reshape(rows, -1)),
            torch.from_numpy(zeros.reshape(rows, -1)))
    dense = dequantize(tensor.data, tensor.qtype).reshape(tensor.shape)
    return quantize(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), kind,
                    tensor.qtype.name)


_BLOCK_BYTES = {_Q.Q4_0: 18, _Q.Q4_1: 20, _Q.Q4_K: 144}
_MID = 8.0  # int4's zero point


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: the low nibbles are weights 0..15, the high 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, :2])  # [n, 1]
    return _nibbles(blocks[:, 2:]), d, np.zeros_like(d)  # w = d * (q - 8)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:]), d, m + _MID * d  # w = d * q + m


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].astype(np.uint8)  # eight 6-bit scales and mins
    qs = blocks[:, 16:]  # [n, 128]
    low, high = packed[:, :4], packed[:, 4:8]
    extra = packed[:, 8:12]
    sc = np.concatenate((low & 63, (extra & 0x0F) | ((low >> 6) << 4)), axis=1)
    mn = np.concatenate((high & 63, (extra >> 4) | ((high >> 6) << 4)), axis=1)
    # Each 64 weights: 32 low nibbles (sub-block 2j), then the same bytes' high nibbles.
    chunks = qs.reshape(-1, 4, 32)
    values = np.stack((chunks & 0x0F, chunks >> 4), axis=2).reshape(-1, 8, 32)
    scales = d * sc.astype(np.float32)
    offsets = -dmin * mn.astype(np.float32)
    return (values.reshape(len(blocks), 256), scales.reshape(-1, 8),
            (offsets + _MID * scales).reshape(-1, 8))


_DECODERS = {_Q.Q4_0: _q4_0, _Q.Q4_1: _q4_1, _Q.Q4_K: _q4_k}
