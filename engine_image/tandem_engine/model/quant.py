"""Weight-only quantized projections: int8 per output channel and int4 in groups of 32.

A projection's weight is held as integers and scales (`QuantizedWeight`) and multiplied
by torch's own weight-only kernels, activations in bfloat16 and sums in float32:

* int8: `torch._weight_int8pack_mm` (CPU), one symmetric scale per output channel:
  w = q * scale, q in -128..127. On CUDA the int8 weight is multiplied as
  (x @ q^T) * scale, converting q to the activations' dtype per call.
* int4: `torch._weight_int4pack_mm_for_cpu` (CPU) and `torch._weight_int4pack_mm`
  (CUDA, tinygemm), an asymmetric scale and zero per group of 32 input columns:
  w = (q - 8) * scale + zero, q in 0..15.

Both torch CPU kernels run 2-10x faster with bfloat16 activations than with float32 ones
(float32 takes a scalar path), so a float32 engine hands them its activations rounded to
bfloat16 and gets float32 back. With the native kernels (`--kernels auto|native` on CPU,
float32 engines) the projections run `csrc/quant_matvec.cpp` instead: activations rounded
to int8 per group of 32 and byte multiply-adds, as llama.cpp does, int4 weights
interleaved by 16 output rows (`_pack_native`), at every step size: prefill chunks and
large batches too (each pass over a weight block serves 4 activation rows). int4 scales
and minimums are float16 there, as a GGUF's. A decode step of such a model runs as one
native call (model/fused_decode.py). Measured on the SmolLM2 GGUF, 2 threads, in process
(Zen 5): a 1536x576 int4 projection takes 36 us at batch 1 with the row-by-row AVX-512
kernel and 7 us interleaved; at 512 rows 0.92 ms with one int8 term per activation and
1.52 ms with two (see `one_term_activations`: steps take one), where the float32 matmul of the
dequantized weight takes 4.4 ms; int8 weights at 512 rows 2.7 ms (one term). The 30
layers take 3.1 ms a token fused, 7.1 eagerly (docs/benchmarks.md).

torchao's int8/int4 weight-only layouts call the same aten kernels; this module needs
no extra package. The scales and zeros are held in the activations' dtype, as the kernels
take them (bfloat16: a GGUF's float16 scales lose three mantissa bits).

`plan_for` says which scheme each tensor gets (`Scheme`); a GGUF's blocks become one
without dequantizing where the scheme holds them exactly (model/gguf_blocks.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tandem_engine.errors import CheckpointError

INT4_GROUP = 32  # input columns per int4 scale and zero (a GGUF block)
NATIVE_BLOCK_ROWS = 16  # int4 output rows the native kernels interleave (one per vector lane)
_INT4_MID = 8  # the kernels' zero point: w = (q - 8) * scale + zero
_COMPUTE_DTYPE = torch.bfloat16  # what the CPU kernels are fast in

Kind = Literal["int8", "int4"]

_rounding = threading.local()  # one_term: see `one_term_activations`


@contextlib.contextmanager
def one_term_activations(on: bool = True) -> Iterator[None]:
    """Within (on this thread, where `on`): the native kernels round activations to one
    int8 term per group of 32, as llama.cpp and the fused decode step do; otherwise to two
    (the first's remainder on its own scale, ~14 bits), at twice the multiply-adds. The
    runner asks for one term in every step, prefill chunks included: on SmolLM2's GGUF
    (12 windows of 256 tokens, float16 KV cache) perplexity is +0.37% over the dequantized
    float32 model with one term and +0.09% with two, within the 1% the engine holds
    quantized weights to, and prefill's int4 projections take half the time (the
    64-request benchmark's prefill steps: 12.7-14.1 s -> 11.2-11.4 s in process).
    Two terms stay the default outside a runner's step (a QuantLinear called directly)."""
    before = getattr(_rounding, "one_term", False)
    _rounding.one_term = on
    try:
        yield
    finally:
        _rounding.one_term = before


@dataclass(frozen=True)
class Scheme:
    """How one weight is held: `kind`, its group size (int4) and where it came from
    (`source`: the GGUF type, or "quantized at load")."""

    kind: Kind
    source: str

    @property
    def group_size(self) -> int | None:
        return INT4_GROUP if self.kind == "int4" else None

    def describe(self) -> str:
        group = "" if self.group_size is None else f", groups of {self.group_size}"
        return f"{self.kind}{group} (from {self.source})"


@dataclass
class QuantizedWeight:
    """One weight [out, in] as integers and float32 scales (and zeros for int4), before
    a device packs it. int8: `values` int8, `scales` [out]; int4: `values` uint8 in
    0..15, `scales` and `zeros` [out, in / 32]."""

    scheme: Scheme
    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.values.shape[0]), int(self.values.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these integers stand for."""
        if self.scheme.kind == "int8":
            return self.values.to(torch.float32) * self.scales[:, None]
        assert self.zeros is not None
        q = self.values.to(torch.float32).unflatten(1, (-1, INT4_GROUP)) - _INT4_MID
        return (q * self.scales[..., None] + self.zeros[..., None]).flatten(1)

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows in `order` (scales follow their rows)."""
        return QuantizedWeight(self.scheme, self.values[order].contiguous(),
                               self.scales[order].contiguous(),
                               None if self.zeros is None else self.zeros[order].contiguous())


def quantize_int8(weight: torch.Tensor, source: str = "quantized at load") -> QuantizedWeight:
    """Symmetric int8, one scale per output row: scale = max|w| / 127."""
    w = weight.to(torch.float32)
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    values = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return QuantizedWeight(Scheme("int8", source), values, scales)


def quantize_int4(weight: torch.Tensor, source: str = "quantized at load") -> QuantizedWeight:
    """Asymmetric int4 in groups of 32 input columns: each group's min..max in 16 steps."""
    in_features = weight.shape[1]
    if in_features % INT4_GROUP:
        raise ValueError(f"int4 needs the input size to be a multiple of {INT4_GROUP}, "
                         f"not {in_features}: use int8")
    w = weight.to(torch.float32).unflatten(1, (-1, INT4_GROUP))
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = ((high - low) / 15.0).clamp(min=1e-12)
    values = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15)
    return QuantizedWeight(Scheme("int4", source), values.to(torch.uint8).flatten(1),
                           scales, low + _INT4_MID * scales)


def quantize(weight: torch.Tensor, kind: Kind, source: str = "quantized at load"
             ) -> QuantizedWeight:
    return quantize_int8(weight, source) if kind == "int8" else quantize_int4(weight, source)


# ---- which tensors are quantized ------------------------------------------------------------


def quantized_names(model: nn.Module) -> tuple[set[str], str | None]:
    """The weights a quantization applies to in `model` (built on the meta device is
    enough): every nn.Linear's (the decoder's projections and an untied LM head), and
    the input embedding's name when it doubles as the head (tied), which is held as
    int8 rows whatever the kind (a lookup reads one row; the head reads them all)."""
    linears = {f"{name}.weight" for name, module in model.named_modules()
               if isinstance(module, nn.Linear)}
    tied = None
    if getattr(model.config, "tie_word_embeddings", False):
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding):
                tied = f"{name}.weight"
                break
    return linears, tied


# ---- the modules ----------------------------------------------------------------------------


def _int4_kernel_tiles(in_features: int) -> int:
    """tinygemm's inner K tiles for CUDA: the largest of 8, 4, 2 dividing in/16."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 on CUDA needs the input size to be a multiple of 32, "
                     f"not {in_features}: use int8")


class QuantLinear(nn.Module):
    """A bias-optional Linear whose weight is a `QuantizedWeight`, packed for its device.

    The output has the input's dtype; `load_weight` repacks in place (a refit) and
    refuses a weight of another scheme or shape."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None,
                 device: torch.device, dtype: torch.dtype, native: ModuleType | None = None
                 ) -> None:
        super().__init__()
        self.scheme = weight.scheme
        self.packed_shape = weight.shape
        self.device, self.dtype = device, dtype
        # The native kernels (csrc/quant_matvec.cpp) for float32 activations on CPU.
        self.native = native if (device.type == "cpu" and dtype == torch.float32) else None
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self._pack(weight)

    def _pack(self, weight: QuantizedWeight) -> None:
        if self.native is not None:
            self._pack_native(weight)
            return
        cuda = self.device.type == "cuda"
        scale_dtype = torch.bfloat16 if (cuda or self.device.type == "cpu") else self.dtype
        if self.scheme.kind == "int8":
            self.packed = weight.values.to(self.device).contiguous()
            self.packed_scales = weight.scales.to(device=self.device, dtype=scale_dtype)
            return
        assert weight.zeros is not None
        values = weight.values
        if cuda:
            pairs = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8).to(self.device)
            self.packed = torch._convert_weight_to_int4pack(
                pairs, _int4_kernel_tiles(self.packed_shape[1]))
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(
                values.to(torch.int32).contiguous(), 1)
        # [in / 32, out, 2]: each group's scale and zero, as the kernels take them.
        both = torch.stack((weight.scales, weight.zeros), dim=-1).transpose(0, 1)
        self.packed_scales = both.to(device=self.device, dtype=scale_dtype).contiguous()

    def _pack_native(self, weight: QuantizedWeight) -> None:
        """int8: the values and float32 scales as they are. int4: interleaved by 16 output
        rows for the kernels' vector lanes (csrc/quant_matvec.cpp: block b, group g is 256
        bytes, chunk c holding each row's columns 4c..4c+3 in low nibbles and 16+4c..
        16+4c+3 in high ones), the rows padded to a multiple of 16 with zeros; scales and
        minimums (w = q * scale + minimum) float16 [N/16, K/32, 16], as a GGUF Q4 block's
        (exact for Q4_0/Q4_1; rounded for Q4_K's products and at-load quantization)."""
        if self.scheme.kind == "int8":
            self.packed = weight.values.contiguous()
            self.packed_scales = weight.scales.to(torch.float32).contiguous()
            self.packed_mins: torch.Tensor | None = None
            return
        assert weight.zeros is not None
        n, k = weight.shape
        pad = -n % NATIVE_BLOCK_ROWS
        values = F.pad(weight.values, (0, 0, 0, pad))
        mins = F.pad(weight.zeros - _INT4_MID * weight.scales, (0, 0, 0, pad))
        scales = F.pad(weight.scales, (0, 0, 0, pad))
        blocks, groups, half = (n + pad) // NATIVE_BLOCK_ROWS, k // INT4_GROUP, INT4_GROUP // 2
        v = values.view(blocks, NATIVE_BLOCK_ROWS, groups, INT4_GROUP)
        nibbles = v[..., :half] | (v[..., half:] << 4)  # [b, row, g, 16]: columns i, 16 + i
        self.packed = (nibbles.view(blocks, NATIVE_BLOCK_ROWS, groups, 4, 4)
                       .permute(0, 2, 3, 1, 4).reshape(blocks, groups * 256).contiguous())
        self.packed_scales = (scales.view(blocks, NATIVE_BLOCK_ROWS, groups).transpose(1, 2)
                              .to(torch.float16).contiguous())
        self.packed_mins = (mins.view(blocks, NATIVE_BLOCK_ROWS, groups).transpose(1, 2)
                            .to(torch.float16).contiguous())

    def load_weight(self, weight: QuantizedWeight) -> None:
        """Pack `weight` in place of the current one (same scheme and shape)."""
        if weight.scheme.kind != self.scheme.kind or weight.shape != self.packed_shape:
            raise ValueError(f"a {weight.scheme.describe()} weight of {weight.shape} cannot "
                             f"replace the running {self.scheme.describe()} one of "
                             f"{self.packed_shape}")
        self._pack(weight)
        self.scheme = weight.scheme

    def weight_nbytes(self) -> int:
        total = self.packed.numel() * self.packed.element_size()
        total += self.packed_scales.numel() * self.packed_scales.element_size()
        zeros = getattr(self, "packed_mins", None)
        if zeros is not None:
            total += zeros.numel() * zeros.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.native is not None:
            rows = rows.contiguous()
            precise = not getattr(_rounding, "one_term", False)
            out = (self.native.int8_matvec(rows, self.packed, self.packed_scales, precise)
                   if self.scheme.kind == "int8" else
                   self.native.int4_matvec(rows, self.packed, self.packed_scales,
                                           self.packed_mins, self.packed_shape[0], precise))
        elif self.scheme.kind == "int8":
            if self.device.type == "cuda":
                out = F.linear(rows, self.packed.to(rows.dtype)) * self.packed_scales.to(
                    rows.dtype)
            else:
                out = torch._weight_int8pack_mm(rows.to(_COMPUTE_DTYPE), self.packed,
                                                self.packed_scales)
        elif self.device.type == "cuda":
            out = torch._weight_int4pack_mm(rows.to(_COMPUTE_DTYPE), self.packed, INT4_GROUP,
                                            self.packed_scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(rows.to(_COMPUTE_DTYPE), self.packed,
                                                    INT4_GROUP, self.packed_scales)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.packed_shape[0])

    def extra_repr(self) -> str:
        return (f"in_features={self.packed_shape[1]}, out_features={self.packed_shape[0]}, "
                f"{self.scheme.describe()}")


class QuantEmbedding(nn.Module):
    """An input embedding held as int8 rows (one scale per token), also serving as the
    tied output head: `project` multiplies by every row with the int8 kernel."""

    def __init__(self, weight: QuantizedWeight, device: torch.device,
                 dtype: torch.dtype, native: ModuleType | None = None) -> None:
        super().__init__()
        if weight.scheme.kind != "int8":
            raise ValueError("an embedding is held as int8 rows; quantize it with "
                             "quantize_int8")
        self.head = QuantLinear(weight, None, device, dtype, native)
        self.scheme = weight.scheme
        self.row_scales = weight.scales.to(device=device, dtype=dtype)

    @property
    def packed_shape(self) -> tuple[int, int]:
        return self.head.packed_shape

    def load_weight(self, weight: QuantizedWeight) -> None:
        self.head.load_weight(weight)
        self.scheme = weight.scheme
        self.row_scales = weight.scales.to(device=self.row_scales.device,
                                           dtype=self.row_scales.dtype)

    def weight_nbytes(self) -> int:
        return self.head.weight_nbytes() + self.row_scales.numel() * self.row_scales.element_size()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head.packed[input_ids].to(self.row_scales.dtype) * self.row_scales[
            input_ids].unsqueeze(-1)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def install(model: nn.Module, weights: dict[str, QuantizedWeight],
            biases: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
            native: ModuleType | None = None) -> None:
    """Swap the modules whose weights are in `weights` (nn.Linear, nn.Embedding) for
    their quantized forms, in place. `biases` holds those Linears' biases (their
    modules are still on the meta device). `native`: the native kernel module, used for
    float32 activations on CPU."""
    modules = dict(model.named_modules())
    for name, weight in weights.items():
        owner_name, _, leaf = name.removesuffix(".weight").rpartition(".")
        owner = modules[owner_name] if owner_name else model
        child = getattr(owner, leaf)
        if isinstance(child, nn.Embedding):
            replacement: nn.Module = QuantEmbedding(weight, device, dtype, native)
        elif isinstance(child, nn.Linear):
            bias = biases.get(name.removesuffix("weight") + "bias")
            replacement = QuantLinear(weight, bias, device, dtype, native)
        else:
            raise ValueError(f"{name}: only Linear and Embedding weights are quantized, not "
                             f"{type(child).__name__}")
        setattr(owner, leaf, replacement)


def schemes(model: nn.Module) -> dict[str, Scheme]:
    """The scheme of every quantized weight in `model`, by its checkpoint name."""
    modules = dict(model.named_modules())
    inner = {f"{name}.head" for name, m in modules.items() if isinstance(m, QuantEmbedding)}
    return {f"{name}.weight": module.scheme for name, module in modules.items()
            if isinstance(module, QuantLinear | QuantEmbedding) and name not in inner}


def check_same_schemes(running: dict[str, Scheme], new: dict[str, QuantizedWeight | object]
                       ) -> None:
    """A refit keeps every weight's kind: the new checkpoint, loaded under the engine's
    quantization, must hold the running model's quantized weights as the same kind and
    its dense ones dense. CheckpointError naming the first differences and the fix."""
    problems = []
    for name in sorted(set(running) | {n for n, v in new.items()
                                       if isinstance(v, QuantizedWeight)}):
        old = running.get(name)
        value = new.get(name)
        now = value.scheme if isinstance(value, QuantizedWeight) else None
        if (old is None) != (now is None) or (old and now and old.kind != now.kind):
            problems.append(f"{name}: running {old.describe() if old else 'dense'}, new "
                            f"checkpoint {now.describe() if now else 'dense'}")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more"
                                           if len(problems) > 3 else "")
        raise CheckpointError(
            "the new checkpoint's weights would be held differently from the running ones "
            f"(a refit keeps each weight's precision and memory): {shown}. Give a "
            "checkpoint quantized as the running one (the same GGUF types, or an HF "
            "checkpoint, which the engine quantizes as it runs), or restart the engines "
            "with the --quantization the new checkpoint needs")
