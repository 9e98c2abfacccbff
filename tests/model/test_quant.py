"""Weight-only quantized projections (model/quant.py, model/gguf_blocks.py): every GGUF
type the engine keeps quantized, and an HF weight quantized at load, against the float32
weight they stand for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tandem_engine.errors import CheckpointError
from tandem_engine.gguf_file import GGUFTensor
from tandem_engine.model.gguf_blocks import as_quantized, auto_kind
from tandem_engine.model.quant import (
    QuantEmbedding,
    QuantLinear,
    Scheme,
    check_same_schemes,
    one_term_activations,
    quantize_int4,
    quantize_int8,
)

Q = GGMLQuantizationType
CPU = torch.device("cpu")
ROWS, COLS = 96, 512
# torch's kernels take bfloat16 activations (8 bits of mantissa), the native ones int8 in
# groups of 32: either way about 0.5-0.6% of the output's norm (measured), 1.2% at most.
KERNEL_TOL = 0.012


def _gguf_tensor(qtype: GGMLQuantizationType, seed: int = 0) -> GGUFTensor:
    """A [ROWS, COLS] tensor of `qtype`: quantized from random floats where gguf-py can
    quantize it, else random blocks (every byte pattern is a valid block) with small
    finite float16 scales."""
    rng = np.random.default_rng(seed)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    try:
        raw = quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    except NotImplementedError:
        raw = rng.integers(0, 256, (ROWS, COLS // block * block_bytes), dtype=np.uint8)
        blocks = raw.reshape(-1, block_bytes)
        halves = rng.uniform(0.002, 0.02, (len(blocks), 2)).astype(np.float16)
        if qtype == Q.Q6_K:  # its one float16 scale is the block's last two bytes
            blocks[:, -2:] = halves[:, :1].view(np.uint8)
        else:  # Q4_K, Q5_K: d and dmin lead the block
            blocks[:, :4] = halves.view(np.uint8)
    return GGUFTensor("blk.0.attn_q.weight", qtype, (ROWS, COLS), raw)


def _dense(tensor: GGUFTensor) -> torch.Tensor:
    values = dequantize(tensor.data, tensor.qtype).reshape(tensor.shape)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _relative_error(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out - want).norm() / want.norm())


@pytest.fixture(scope="module", params=["torch", "native"])
def kernels(request: pytest.FixtureRequest) -> object:
    """None: torch's kernels (bfloat16 activations); else the native module (int8-rounded
    activations in groups of 32, csrc/quant_matvec.cpp)."""
    if request.param == "torch":
        return None
    from tandem_engine.model.native import NativeKernelUnavailable, paged_decode_kernel

    try:
        return paged_decode_kernel()
    except NativeKernelUnavailable as exc:  # no compiler: the engine uses torch's kernels
        pytest.skip(str(exc))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 7, 40, 300])  # a decode batch, a prefill chunk
def test_every_gguf_type_multiplies_as_its_dequantized_weight(qtype: GGMLQuantizationType,
                                                              rows: int, kernels) -> None:
    tensor = _gguf_tensor(qtype)
    dense = _dense(tensor)
    kind = auto_kind(qtype)
    assert kind == ("int4" if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else "int8")
    weight = as_quantized(tensor, kind)
    assert weight.scheme == Scheme(kind, qtype.name)
    held = weight.dequantize()
    if kind == "int4":  # the 4-bit blocks are held exactly
        torch.testing.assert_close(held, dense, rtol=0, atol=1e-6)
    else:  # requantized to int8 rows: within half a step of the row's int8 scale
        step = dense.abs().amax(dim=1, keepdim=True) / 127
        assert bool(((held - dense).abs() <= step / 2 * (1 + 1e-5)).all())
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(ROWS)
    layer = QuantLinear(weight, bias, CPU, torch.float32, kernels)
    assert (layer.native is not None) == (kernels is not None)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, ROWS)
    assert _relative_error(out, x @ held.T + bias) < KERNEL_TOL
    # and against the file's own float32 weight (int8: plus the requantization's error)
    assert _relative_error(out, x @ dense.T + bias) < (KERNEL_TOL if kind == "int4" else 0.02)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_float_weight_quantized_at_load_stays_close(kind: str, kernels) -> None:
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(2))
    weight = quantize_int8(w) if kind == "int8" else quantize_int4(w)
    # int8: half a step of max|row| / 127; int4: half a step of each group's range / 15
    bound = 0.02 if kind == "int8" else 0.1
    assert _relative_error(weight.dequantize(), w) < bound
    x = torch.randn(3, COLS, dtype=torch.bfloat16)
    out = QuantLinear(weight, None, CPU, torch.bfloat16, kernels)(x)  # bf16: torch's
    assert out.dtype == torch.bfloat16
    assert _relative_error(out.float(), x.float() @ weight.dequantize().T) < KERNEL_TOL
    x32 = x.float()[:, None].expand(3, 6, COLS)  # any leading dims
    out32 = QuantLinear(weight, None, CPU, torch.float32, kernels)(x32)
    assert out32.shape == (3, 6, ROWS)
    assert _relative_error(out32, x32 @ weight.dequantize().T) < KERNEL_TOL


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_activations_round_to_two_terms_by_default_and_to_one_in_steps(kind: str) -> None:
    """The native kernels round activations to int8 per group of 32: in two terms (the
    remainder on its own scale) by default, and in one term within the runner's steps
    (`one_term_activations`), as llama.cpp does. Two terms come out an order of magnitude
    closer to the float32 matmul of the same weight."""
    from tandem_engine.model.native import NativeKernelUnavailable, paged_decode_kernel

    try:
        native = paged_decode_kernel()
    except NativeKernelUnavailable as exc:
        pytest.skip(str(exc))
    g = torch.Generator().manual_seed(4)
    w = torch.randn(ROWS, COLS, generator=g)
    weight = quantize_int8(w) if kind == "int8" else quantize_int4(w)
    layer = QuantLinear(weight, None, CPU, torch.float32, native)
    x = torch.randn(64, COLS, generator=g)
    x[:, 5] *= 30  # an outlier channel, as real hidden states have
    want = x @ weight.dequantize().T  # (int4's native scales are float16: a floor)
    two = _relative_error(layer(x), want)
    with one_term_activations():
        one = _relative_error(layer(x), want)
    assert one < 0.05
    assert two < one / 4, (one, two)


def test_int4_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match=r"multiple of 32.*use int8"):
        quantize_int4(torch.randn(4, 40))


def test_an_embedding_is_looked_up_and_projects_with_its_int8_rows(kernels) -> None:
    table = torch.randn(50, 64)
    weight = quantize_int8(table)
    embedding = QuantEmbedding(weight, CPU, torch.float32, kernels)
    ids = torch.tensor([0, 7, 49, 7])
    torch.testing.assert_close(embedding(ids), weight.dequantize()[ids])
    hidden = torch.randn(2, 64)
    assert _relative_error(embedding.project(hidden), hidden @ weight.dequantize().T) < KERNEL_TOL


def test_a_weight_of_another_scheme_or_shape_is_refused_in_place(kernels) -> None:
    layer = QuantLinear(quantize_int4(torch.randn(ROWS, COLS)), None, CPU, torch.float32,
                        kernels)
    with pytest.raises(ValueError, match=r"int8 .* cannot replace the running int4"):
        layer.load_weight(quantize_int8(torch.randn(ROWS, COLS)))
    with pytest.raises(ValueError, match=r"\(96, 256\).*\(96, 512\)"):
        layer.load_weight(quantize_int4(torch.randn(ROWS, 256)))
    new = torch.randn(ROWS, COLS)
    layer.load_weight(quantize_int4(new))
    x = torch.randn(2, COLS)
    assert _relative_error(layer(x), x @ new.T) < 0.1


def test_a_refit_that_would_change_a_weights_kind_is_refused_naming_it() -> None:
    running = {"model.layers.0.self_attn.q_proj.weight": Scheme("int4", "Q4_1")}
    same = {"model.layers.0.self_attn.q_proj.weight": quantize_int4(torch.randn(8, 32))}
    check_same_schemes(running, same)
    dense = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 32)}
    with pytest.raises(CheckpointError, match=r"q_proj.weight: running int4, groups of 32 "
                       r"\(from Q4_1\), new checkpoint dense.*--quantization"):
        check_same_schemes(running, dense)
    with pytest.raises(CheckpointError, match="running dense, new checkpoint int8"):
        check_same_schemes({}, {"lm_head.weight": quantize_int8(torch.randn(8, 32))})


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN runs bfloat16 in hardware only with AVX-512 BF16 or AMX")
def test_bfloat16_projections_are_prepacked_and_multiply_as_the_plain_matmul() -> None:
    from tandem_engine.model.layers import PackedLinear, packing_supported

    assert packing_supported(torch.bfloat16, CPU)
    linear = torch.nn.Linear(COLS, ROWS).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(5, COLS, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert _relative_error(packed(x).float(), want) < KERNEL_TOL
