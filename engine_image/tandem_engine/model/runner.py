"""The model runner: owns the device tensors (weights, KV pool, RoPE tables) and runs a step.

It turns a `SchedulerOutput` into flat input tensors and attention metadata, runs the
forward pass, and returns the logits of the rows that sample a token. It knows nothing
of queues or stop conditions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType

import torch

from tandem_engine.config import EngineConfig, ModelConfig, normalize_dtype
from tandem_engine.core.request import Request
from tandem_engine.core.scheduler import SchedulerOutput
from tandem_engine.model.attention import AttentionMetadata, GatherBuffers, build_metadata
from tandem_engine.model.host_memory import keep_freed_memory
from tandem_engine.model.llama import (
    CausalLM,
    RotaryEmbedding,
    build_model,
    pack_linears,
    packing_supported,
)
from tandem_engine.model.native import NativeKernelUnavailable, paged_decode_kernel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(model_config: ModelConfig, engine_config: EngineConfig) -> str:
    if engine_config.dtype == "auto":
        return model_config.dtype
    return normalize_dtype(engine_config.dtype, "engine option", "dtype")


def num_kv_blocks(model_config: ModelConfig, engine_config: EngineConfig, dtype: str) -> int:
    """Blocks in the pool: the explicit count, or as many as the memory budget holds."""
    if engine_config.num_blocks is not None:
        return engine_config.num_blocks
    per_block = engine_config.block_size * model_config.kv_bytes_per_token(
        DTYPES[dtype].itemsize)
    blocks = engine_config.kv_cache_memory_bytes // per_block
    if blocks < 1:
        raise ValueError(
            f"engine option kv_cache_memory_bytes={engine_config.kv_cache_memory_bytes} holds "
            f"no KV block; one block needs {per_block} bytes: raise the budget or set num_blocks"
        )
    return blocks


def _decode_backend(choice: str, device: torch.device) -> ModuleType | None:
    """The native decode kernel when chosen (or when `auto` on CPU and it builds).
    With it, float32 projections also use oneDNN's prepacked matmul."""
    if choice == "torch" or (choice == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise ValueError(f"engine option kernels='native' runs on CPU only, not "
                         f"{device.type}: use 'auto' or 'torch'")
    try:
        return paged_decode_kernel()
    except NativeKernelUnavailable as exc:
        if choice == "native":
            raise
        log.warning("%s; using plain torch kernels", exc)
        return None


@dataclass
class PreparedStep:
    """A step's inputs, laid out decodes first, ready for the forward pass."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] rows whose logits are sampled
    requests: list[Request]  # the request of each sample row
    # Requests that want prompt logprobs: (request, first prompt position predicted,
    # the rows whose logits predict it and the positions after it).
    prompt_rows: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class StepBatch:
    """What a forward pass produced: the logits of the sampling rows and their requests."""

    logits: torch.Tensor  # [N, vocab] float32
    requests: list[Request]
    # (request, first prompt position predicted, [n, vocab] logits) per prompt_rows entry
    prompt_logits: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 tensors: dict[str, torch.Tensor], num_blocks: int, max_model_len: int) -> None:
        self.config = model_config
        self.device = torch.device(engine_config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = DTYPES[resolve_dtype(model_config, engine_config)]
        self.block_size = engine_config.block_size
        self.rope = RotaryEmbedding(model_config.rope, model_config.head_dim, max_model_len,
                                    self.device, self.dtype)
        self.kv_shape = (model_config.num_layers, 2, num_blocks, self.block_size,
                         model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache: torch.Tensor | None = None
        self._host_kv: torch.Tensor | None = None
        self.allocate_kv()
        self.gather_buffers = GatherBuffers()
        self.native = _decode_backend(engine_config.kernels, self.device)
        self.kernels = "torch" if self.native is None else "native"
        self.model: CausalLM
        self.load_weights(tensors)

    # ---- weights and KV memory (the engine's lifecycle calls these) ------------------------

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Swap in new, already validated weights. Takes ownership of `tensors` (emptied).

        The new model is built beside the old one and swapped in one assignment, so a
        failure leaves the old weights serving. Peak memory: old + new model until the
        swap (packing converts the new projections one at a time); then one model."""
        state = {k: v.to(self.dtype) for k, v in tensors.items()}
        tensors.clear()
        model = build_model(self.config, state, self.device)
        state.clear()
        if self.native is not None and packing_supported(self.dtype, self.device):
            pack_linears(model)
        self.model = model

    @property
    def kv_bytes(self) -> int:
        n = 1
        for d in self.kv_shape:
            n *= d
        return n * self.dtype.itemsize

    def allocate_kv(self) -> None:
        self.kv_cache = torch.zeros(self.kv_shape, dtype=self.dtype, device=self.device)

    def free_kv(self) -> int:
        """Release the KV pool's storage (contents lost); return the bytes released."""
        released = self.kv_bytes if self.kv_cache is not None else 0
        self.kv_cache = None
        self.gather_buffers = GatherBuffers()
        return released

    def offload_kv(self) -> int:
        """Copy the KV pool to host memory and release its storage."""
        assert self.kv_cache is not None
        host = torch.empty(self.kv_shape, dtype=self.dtype, device="cpu",
                           pin_memory=self.device.type == "cuda")
        host.copy_(self.kv_cache)
        self._host_kv = host
        return self.free_kv()

    def restore_kv(self) -> None:
        """Bring an offloaded KV pool back, contents intact."""
        assert self._host_kv is not None, "restore_kv without offload_kv"
        self.kv_cache = self._host_kv.to(self.device, copy=self.device.type != "cpu")
        self._host_kv = None

    def prepare(self, scheduled: SchedulerOutput) -> PreparedStep:
        bs = self.block_size
        decodes = [c for c in scheduled.chunks if c.num_tokens == 1]
        prefills = [c for c in scheduled.chunks if c.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        prompt_rows: list[tuple[Request, int, torch.Tensor]] = []
        for chunk in decodes + prefills:
            end = chunk.start + chunk.num_tokens
            table = chunk.block_table
            if chunk.request.wants_prompt_logprobs:
                # Position p's logits predict token p + 1: the prompt tokens not yet
                # scored whose predecessor is in this chunk.
                first = max(chunk.start + 1, len(chunk.request.prompt_logprobs))
                last = min(end, chunk.request.num_prompt_tokens - 1)
                if first <= last:
                    rows = range(len(input_ids) + first - 1 - chunk.start,
                                 len(input_ids) + last - chunk.start)
                    prompt_rows.append((chunk.request, first, torch.tensor(
                        rows, dtype=torch.long, device=self.device)))
            input_ids.extend(chunk.request.token_ids[chunk.start:end])
            positions.extend(range(chunk.start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, end))
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(chunk.request)
        meta = build_metadata(
            decode_tables=[c.block_table for c in decodes],
            decode_ctx_lens=[c.start + 1 for c in decodes],
            prefill_specs=[(c.start, c.num_tokens, c.block_table) for c in prefills],
            slot_mapping=slots, block_size=bs, device=self.device, buffers=self.gather_buffers,
            native=self.native)
        dev = self.device
        return PreparedStep(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            requests=sample_requests,
            prompt_rows=prompt_rows,
        )

    @torch.inference_mode()
    def forward(self, step: PreparedStep) -> StepBatch:
        assert self.kv_cache is not None, "forward while the KV pool is released"
        cos, sin = self.rope.lookup(step.positions)
        hidden = self.model(step.input_ids, cos, sin, self.kv_cache, step.meta)
        logits = self.model.compute_logits(hidden.index_select(0, step.sample_rows))
        prompt_logits = [(request, first, self.model.compute_logits(hidden.index_select(0, rows)))
                         for request, first, rows in step.prompt_rows]
        return StepBatch(logits, step.requests, prompt_logits)
