"""The model runner: owns the device tensors (weights, KV pool, RoPE tables) and runs a step.

It turns a `SchedulerOutput` into flat input tensors and attention metadata, runs the
forward pass, and returns the logits of the rows that sample a token (with
speculative decoding, every position of a chunk with a draft: its last token's and one
per proposal). `forward_runs` runs token runs that are no request's tokens yet (a
draft model's proposals) and returns their last positions' logits. It knows nothing of
queues or stop conditions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

from tandem_engine.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig, normalize_dtype
from tandem_engine.core.request import Request
from tandem_engine.core.scheduler import SchedulerOutput
from tandem_engine.model.attention import AttentionMetadata, GatherBuffers, build_metadata
from tandem_engine.model.cuda_graphs import DecodeGraphs, DecodeInputs, bucket_for, capture_sizes
from tandem_engine.model.device import MemoryProfile, auto_dtype
from tandem_engine.model.family import Family, ModelConfig
from tandem_engine.model.flex_attention import FlexPagedAttention, kernel_options
from tandem_engine.model.fused_decode import FusedDecode
from tandem_engine.model.host_memory import (
    advise_huge_pages,
    keep_freed_memory,
    release_freed_memory,
)
from tandem_engine.model.layers import (
    DecoderModel,
    build_model,
    pack_linears,
    pack_norms,
    packing_supported,
    stream_weights,
)
from tandem_engine.model.lora import LoRASlots
from tandem_engine.model.native import NativeKernelUnavailable, paged_decode_kernel
from tandem_engine.model.quant import (
    QuantizedWeight,
    check_same_schemes,
    one_term_activations,
    schemes,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Steps with prefill chunks of at most this many rows (prompt tokens and decodes together)
# run in the fused stack (`ModelRunner._prefills_as_rows`); longer ones eagerly.
FUSED_PREFILL_ROWS = 32


def _quantized(tensors: dict[str, torch.Tensor | QuantizedWeight] | None) -> bool:
    return any(isinstance(t, QuantizedWeight) for t in (tensors or {}).values())


def resolve_dtype(model_config: ModelConfig, engine_config: EngineConfig,
                  tensors: dict[str, torch.Tensor | QuantizedWeight] | None = None) -> str:
    """The engine's dtype; `--dtype auto` also depends on whether `tensors` (the loaded
    checkpoint) hold quantized weights (model/device.auto_dtype)."""
    if engine_config.dtype == "auto":
        return auto_dtype(torch.device(engine_config.device).type, model_config.dtype,
                          quantized=_quantized(tensors))
    return normalize_dtype(engine_config.dtype, "engine option", "dtype")


def resolve_kv_cache_dtype(engine_config: EngineConfig, dtype: str,
                           tensors: dict[str, torch.Tensor | QuantizedWeight] | None = None,
                           ) -> str:
    """The KV pool's dtype. `--kv-cache-dtype auto`: float16 on a CPU serving quantized
    weights with float32 activations (llama.cpp's default cache: half the bytes a token,
    and decode attention is bound by reading them; 1.17-1.20x the 64-request benchmark's
    tokens/s in process, docs/benchmarks.md), else the engine's dtype (vLLM's rule).
    Keys and values are rounded as they are stored and widened as attention reads them.
    `dtype`: the engine's, resolved (`resolve_dtype`)."""
    if engine_config.kv_cache_dtype != "auto":
        return normalize_dtype(engine_config.kv_cache_dtype, "engine option", "kv_cache_dtype")
    if (torch.device(engine_config.device).type == "cpu" and dtype == "float32"
            and _quantized(tensors)):
        return "float16"
    return dtype


def kv_sized_by_memory_fraction(engine_config: EngineConfig) -> bool:
    """Whether the pool takes what `gpu_memory_utilization` leaves (CUDA, no explicit size):
    then `num_kv_blocks` needs a `MemoryProfile` of the loaded model."""
    return (torch.device(engine_config.device).type == "cuda"
            and engine_config.num_blocks is None and engine_config.kv_cache_memory_bytes is None)


def num_kv_blocks(model_config: ModelConfig, engine_config: EngineConfig, dtype: str,
                  profile: MemoryProfile | None = None, max_model_len: int = 0) -> int:
    """Blocks in the pool: the explicit count; else as many as kv_cache_memory_bytes holds
    (DEFAULT_KV_CACHE_MEMORY_BYTES when unset, on CPU); else, sized by memory fraction,
    as many as `kv_blocks_in_memory_fraction` finds room for."""
    if engine_config.num_blocks is not None:
        return engine_config.num_blocks
    per_block = engine_config.block_size * model_config.kv_bytes_per_token(
        DTYPES[dtype].itemsize)
    if engine_config.kv_cache_memory_bytes is None and profile is not None:
        return kv_blocks_in_memory_fraction(
            profile, engine_config.gpu_memory_utilization, per_block,
            blocks_needed=-(-max_model_len // engine_config.block_size),
            max_model_len=max_model_len)
    budget = engine_config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"engine option kv_cache_memory_bytes={budget} holds "
            f"no KV block; one block needs {per_block} bytes: raise the budget or set num_blocks"
        )
    return blocks


def kv_blocks_in_memory_fraction(profile: MemoryProfile, utilization: float, per_block: int,
                                 blocks_needed: int, max_model_len: int) -> int:
    """KV blocks that fit in `utilization` × the device's memory beside the weights, the
    largest step's activations and what is used outside torch (vLLM's
    --gpu-memory-utilization). Raises ValueError, naming the numbers and the fixes, when
    fewer than `blocks_needed` (one request of `max_model_len` tokens) fit."""
    budget = (int(utilization * profile.total) - profile.weights - profile.activation_peak
              - profile.outside_torch)
    blocks = max(0, budget) // per_block
    if blocks < blocks_needed:
        gib = 1 << 30
        raise ValueError(
            f"the KV cache does not fit: gpu_memory_utilization={utilization} of the device's "
            f"{profile.total / gib:.2f} GiB leaves {budget / gib:.2f} GiB after the weights "
            f"({profile.weights / gib:.2f} GiB), the largest step's activations "
            f"({profile.activation_peak / gib:.2f} GiB) and memory outside torch "
            f"({profile.outside_torch / gib:.2f} GiB): {blocks} KV blocks of {per_block} "
            f"bytes, but one request of max_model_len={max_model_len} tokens needs "
            f"{blocks_needed}. Raise --gpu-memory-utilization, lower --max-model-len (or "
            "--max-num-batched-tokens), or give --num-blocks or --kv-cache-memory-bytes")
    return blocks


def uses_flex(choice: str, device: torch.device, block_size: int,
              family: Family | None = None) -> bool:
    """Whether attention runs on torch's flex_attention: `flex`, and `auto` on CUDA when
    the block size suits its kernel (a multiple of 16; else the torch gather path) and
    the model `family` (None: any whose attention flex runs) runs on flex's masks."""
    on_flex = family is None or family.flex_attention
    if choice == "flex":
        if not on_flex:
            raise ValueError(f"engine option kernels='flex' cannot run {family.name} models "
                             "(their attention needs masks the flex backend does not "
                             "build): use 'auto' or 'torch'")
        kernel_options(block_size, device)  # a clear error for a block size it cannot run
        return True
    return choice == "auto" and device.type == "cuda" and block_size % 16 == 0 and on_flex


def _decode_backend(choice: str, device: torch.device) -> ModuleType | None:
    """The native decode kernel when chosen (or when `auto` on CPU and it builds).
    With it, float32 projections also use oneDNN's prepacked matmul."""
    if choice in ("torch", "flex") or (choice == "auto" and device.type != "cpu"):
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


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights, packed and quantized projections included."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    counted: set[str] = set()  # modules inside one already counted
    for name, module in model.named_modules():
        if name in counted or not hasattr(module, "weight_nbytes"):
            continue
        total += module.weight_nbytes()
        counted.update(f"{name}.{inner}" for inner, _ in module.named_modules() if inner)
    return total


@dataclass
class PreparedStep:
    """A step's inputs, laid out decodes first, ready for the forward pass."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata | None  # None for a step replayed by a CUDA graph
    sample_rows: torch.Tensor  # [R] rows whose logits are sampled, 1 + len(draft) a request
    requests: list[Request]  # the requests that sample, in row order
    drafts: list[tuple[int, ...]]  # the proposals each of them verifies (mostly ())
    # Requests that want prompt logprobs: (request, first prompt position predicted,
    # the rows whose logits predict it and the positions after it).
    prompt_rows: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)
    graph: DecodeInputs | None = None  # a decode-only step that a CUDA graph runs
    # LoRA: each token's adapter slot (-1: the base model); None when no token has one
    # (the step then runs exactly as without LoRA: fused, or from a CUDA graph).
    lora_slots: list[int] | None = None


@dataclass
class StepBatch:
    """What a forward pass produced: the logits of the sampling rows and their requests."""

    logits: torch.Tensor  # [R, vocab] float32: 1 + len(draft) rows per request, in order
    requests: list[Request]
    drafts: list[tuple[int, ...]]  # per request: the proposals its rows after the first verify
    # (request, first prompt position predicted, [n, vocab] logits) per prompt_rows entry
    prompt_logits: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)
    # [R, hidden] final-normed hidden states of the sampling rows, only when the runner's
    # `capture_hidden` is on (the mtp proposer's heads start from them)
    hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 tensors: dict[str, torch.Tensor], num_blocks: int, max_model_len: int) -> None:
        self.config = model_config
        self.device = torch.device(engine_config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        dtype = resolve_dtype(model_config, engine_config, tensors)
        self.dtype = DTYPES[dtype]
        self.kv_dtype = DTYPES[resolve_kv_cache_dtype(engine_config, dtype, tensors)]
        self.quantization = engine_config.quantization  # a refit loads under it too
        self.block_size = engine_config.block_size
        self.kv_shape = (model_config.num_layers, 2, num_blocks, self.block_size,
                         model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache: torch.Tensor | None = None
        # Decode steps replayed from CUDA graphs: CUDA with the flex backend, unless the
        # engine option `cuda_graphs` is off (its shapes and addresses must be static).
        self.graphs: DecodeGraphs | None = None
        self.last_refit_peak_bytes: int | None = None  # see load_weights
        self._host_kv: torch.Tensor | None = None
        self.allocate_kv()
        self.gather_buffers = GatherBuffers()
        self.native = _decode_backend(engine_config.kernels, self.device)
        self.kernels = "torch" if self.native is None else "native"
        self._flex: FlexPagedAttention | None = None  # built for the pool's size on first use
        if uses_flex(engine_config.kernels, self.device, self.block_size,
                     family=model_config.family):
            self.kernels = "flex"
            if self.device.type == "cuda" and engine_config.cuda_graphs:
                self.graphs = DecodeGraphs(capture_sizes(engine_config.max_num_seqs),
                                           self.device)
        self._max_model_len, self._max_num_seqs = max_model_len, engine_config.max_num_seqs
        # Return the sampling rows' hidden states (`StepBatch.hidden`; speculative method
        # mtp). Steps then run eagerly: a captured CUDA graph returns logits only.
        self.capture_hidden = False
        self.model: DecoderModel
        # Decode-only steps of a few rows in one native call (model/fused_decode.py),
        # built for each load of the weights; None where it does not apply.
        self.fused: FusedDecode | None = None
        # LoRA adapters' device slots (model/lora.py), hooked onto every loaded model.
        self.lora = LoRASlots(model_config, engine_config.max_loras,
                              engine_config.max_lora_rank, self.dtype, self.device) \
            if engine_config.enable_lora else None
        self.load_weights(tensors)

    # ---- weights and KV memory (the engine's lifecycle calls these) ------------------------

    def load_weights(self, tensors: dict[str, torch.Tensor], low_memory: bool = False) -> None:
        """Swap in new, already validated weights. Takes ownership of `tensors` (emptied).

        By default the new model is built beside the old one and swapped in one
        assignment, so a failure leaves the old weights serving. Peak memory: old + new
        model until the swap (packing converts the new projections one at a time).
        `low_memory` (a refit only) streams the tensors into the serving model one at a
        time instead: peak 1x the weights plus one tensor, but a failure midway leaves
        mixed weights. `last_refit_peak_bytes` is the peak of weight memory during the last
        load (the start's or a refit's): measured by the CUDA allocator on CUDA (weights
        plus any temporaries), counted on CPU."""
        old = getattr(self, "model", None)
        if old is None:
            low_memory = False
        else:
            check_same_schemes(schemes(old), tensors)
        old_bytes = 0 if old is None else _weight_bytes(old)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            baseline = torch.cuda.memory_allocated(self.device) - old_bytes
        if low_memory:
            staged = stream_weights(old, tensors, self.dtype)
            peak = old_bytes + staged
        else:
            state = {k: v if isinstance(v, QuantizedWeight) else v.to(self.dtype)
                     for k, v in tensors.items()}
            tensors.clear()
            model = build_model(self.config, state, self.device, self._max_model_len,
                                self.dtype, self.native)
            state.clear()
            if self.native is not None and packing_supported(self.dtype, self.device):
                pack_linears(model)
            if self.native is not None and self.dtype == torch.float32:
                pack_norms(model, self.native)
            peak = old_bytes + _weight_bytes(model)
            self.model = model
            del old
            if self.graphs is not None:
                self.graphs.clear()  # they replay over the old parameters' addresses
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - baseline
            torch.cuda.empty_cache()
        else:
            release_freed_memory()  # the load's temporaries
        self.last_refit_peak_bytes = peak
        # Its references are to the packed weights just replaced (also when streamed).
        self.fused = FusedDecode.build(self.model, self.native)
        if self.lora is not None:  # hooks belong to the modules of the model just built
            self.lora.attach(self.model)

    @property
    def weight_bytes(self) -> int:
        """Bytes the serving weights take (packed projections included)."""
        return _weight_bytes(self.model)

    @property
    def kv_bytes(self) -> int:
        n = 1
        for d in self.kv_shape:
            n *= d
        return n * self.kv_dtype.itemsize

    def allocate_kv(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()  # a new pool: graphs captured over the old one are stale
        pool = torch.empty(self.kv_shape, dtype=self.kv_dtype, device=self.device)
        advise_huge_pages(pool)  # before the first touch (zeroing): then it applies
        self.kv_cache = pool.zero_()

    def resize_kv(self, num_blocks: int) -> None:
        """Replace the KV pool (contents lost) by one of `num_blocks` blocks: the sizing by
        memory fraction swaps the profiling step's scratch pool for the sized one."""
        self.free_kv()
        self.kv_shape = (*self.kv_shape[:2], num_blocks, *self.kv_shape[3:])
        self.allocate_kv()

    def free_kv(self) -> int:
        """Release the KV pool's storage (contents lost); return the bytes released. On
        CUDA the memory goes back to the driver, for other processes to use."""
        released = self.kv_bytes if self.kv_cache is not None else 0
        self.kv_cache = None
        self.gather_buffers = GatherBuffers()
        if self.graphs is not None:
            self.graphs.clear()  # they replay over the old pool's address
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return released

    def offload_kv(self) -> int:
        """Copy the KV pool to host memory (pinned on CUDA: a DMA copy at full link speed)
        and release its device storage; return the bytes released."""
        if self.kv_cache is None:
            raise RuntimeError("offload_kv: the KV pool is already released")
        cuda = self.device.type == "cuda"
        host = torch.empty(self.kv_shape, dtype=self.kv_dtype, device="cpu", pin_memory=cuda)
        host.copy_(self.kv_cache, non_blocking=cuda)
        if cuda:  # the copy must have landed before the device storage is freed
            torch.cuda.synchronize(self.device)
        self._host_kv = host
        return self.free_kv()

    def restore_kv(self) -> None:
        """Bring an offloaded KV pool back, contents intact (on CPU the host copy itself
        becomes the pool)."""
        if self._host_kv is None:
            raise RuntimeError("restore_kv without offload_kv")
        if self.device.type == "cuda":
            pool = torch.empty(self.kv_shape, dtype=self.kv_dtype, device=self.device)
            pool.copy_(self._host_kv, non_blocking=True)
            torch.cuda.synchronize(self.device)
            self.kv_cache = pool
        else:
            self.kv_cache = self._host_kv.to(self.device)
        self._host_kv = None

    def _flex_backend(self) -> FlexPagedAttention:
        """The flex attention backend, sized for the pool as it is now (a resize of the
        pool makes a new one)."""
        if self._flex is None or self._flex.num_blocks != self.kv_shape[2]:
            self._flex = FlexPagedAttention(self.kv_shape[2], self.block_size,
                                            self._max_model_len, self._max_num_seqs,
                                            self.device)
        return self._flex

    def prepare(self, scheduled: SchedulerOutput) -> PreparedStep:
        bs = self.block_size
        decodes = [c for c in scheduled.chunks if c.num_tokens == 1]
        prefills = [c for c in scheduled.chunks if c.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        sample_drafts: list[tuple[int, ...]] = []
        prompt_rows: list[tuple[Request, int, torch.Tensor]] = []
        lora_slots: list[int] | None = None
        if self.lora is not None and any(c.request.lora_slot >= 0 for c in scheduled.chunks):
            lora_slots = [c.request.lora_slot for c in decodes + prefills
                          for _ in range(c.num_tokens)]
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
            draft = chunk.draft
            input_ids.extend(chunk.request.token_ids[chunk.start:end - len(draft)])
            input_ids.extend(draft)
            positions.extend(range(chunk.start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, end))
            if chunk.samples:
                # The same per-row logits the prompt-logprobs rows use: the last position
                # samples, and with a draft so does each position before a proposal.
                sample_rows.extend(range(len(input_ids) - 1 - len(draft), len(input_ids)))
                sample_requests.append(chunk.request)
                sample_drafts.append(draft)
        dev = self.device
        if (self.graphs is not None and not prefills and not prompt_rows
                and not self.capture_hidden and lora_slots is None
                and bucket_for(len(decodes), self.graphs.sizes) is not None):
            return PreparedStep(
                input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
                positions=torch.tensor(positions, dtype=torch.long, device=dev), meta=None,
                sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
                requests=sample_requests, drafts=sample_drafts, graph=DecodeInputs(
                    input_ids, positions, slots, [c.block_table for c in decodes],
                    [c.start + 1 for c in decodes]))
        decode_tables = [c.block_table for c in decodes]
        decode_lens = [c.start + 1 for c in decodes]
        if self._prefills_as_rows(prefills, len(input_ids), lora_slots):
            # Each prefill position as a row of its own that attends to its position and
            # those before it: the fused stack writes every row's keys and values of a
            # layer before any row's attention, so this is causal attention over the
            # chunk and its cached prefix, with no eager step's fixed cost.
            for c in prefills:
                decode_tables += [c.block_table] * c.num_tokens
                decode_lens += range(c.start + 1, c.start + c.num_tokens + 1)
            prefills = []
        meta = build_metadata(
            decode_tables=decode_tables,
            decode_ctx_lens=decode_lens,
            prefill_specs=[(c.start, c.num_tokens, c.block_table) for c in prefills],
            slot_mapping=slots, block_size=bs, device=self.device, buffers=self.gather_buffers,
            native=self.native)
        if self.kernels == "flex":
            meta.flex = self._flex_backend().prepare(
                [c.block_table for c in decodes], [c.start + 1 for c in decodes],
                [(c.start, c.num_tokens, c.block_table) for c in prefills])
        return PreparedStep(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            requests=sample_requests,
            drafts=sample_drafts,
            prompt_rows=prompt_rows,
            lora_slots=lora_slots,
        )

    def _prefills_as_rows(self, prefills: Sequence, rows: int,
                          lora_slots: list[int] | None) -> bool:
        """Whether this step's prefill chunks run in the fused stack as rows (a step of at
        most FUSED_PREFILL_ROWS rows, without adapters, where the stack applies). On a CPU
        an eager step costs about 10 ms beyond its arithmetic (SmolLM2: ~600 torch calls),
        more than a short prompt's whole prefill in the stack."""
        return (bool(prefills) and self.fused is not None and self.kernels == "native"
                and lora_slots is None and rows <= FUSED_PREFILL_ROWS)

    @torch.inference_mode()
    def forward(self, step: PreparedStep) -> StepBatch:
        assert self.kv_cache is not None, "forward while the KV pool is released"
        if step.graph is not None:
            assert self.graphs is not None
            logits = self.graphs.run(step.graph, self.model, self.kv_cache,
                                     self._flex_backend())
            assert logits is not None, "prepare() chose a graph that holds the step"
            return StepBatch(logits.index_select(0, step.sample_rows), step.requests,
                             step.drafts)
        assert step.meta is not None
        # The fused stack has no LoRA hooks: a step with adapters runs eagerly.
        fused = self.fused if self.fused is not None and FusedDecode.takes(step.meta) \
            and step.lora_slots is None else None
        run = fused or self.model
        if step.lora_slots is not None:
            assert self.lora is not None
            self.lora.activate(step.lora_slots)
        try:
            with one_term_activations():  # prefill chunks too (quant.one_term_activations)
                hidden = run(step.input_ids, step.positions, self.kv_cache, step.meta)
        finally:
            if self.lora is not None:
                self.lora.deactivate()
        with one_term_activations():
            sampled = hidden.index_select(0, step.sample_rows)
            logits = run.logits(sampled)
        prompt_logits = [(request, first, self.model.logits(hidden.index_select(0, rows)))
                         for request, first, rows in step.prompt_rows]
        return StepBatch(logits, step.requests, step.drafts, prompt_logits,
                         sampled if self.capture_hidden else None)

    # ---- token runs that are no request's tokens (a draft model's proposals) ---------------

    @torch.inference_mode()
    def forward_runs(self, runs: Sequence[TokenRun]) -> torch.Tensor:
        """Run each `TokenRun` through the model, writing its KV into its blocks' slots;
        return the logits of each run's last position, [len(runs), vocab] float32, in
        `runs` order. `prepare` reads tokens from the requests themselves, but a draft
        model's proposals are in no request's token_ids yet. Never a CUDA graph."""
        assert self.kv_cache is not None, "forward_runs while the KV pool is released"
        bs = self.block_size
        # Single tokens are laid out first, as decodes; longer runs after them.
        order = sorted(range(len(runs)), key=lambda i: len(runs[i].token_ids) > 1)
        decodes = [runs[i] for i in order if len(runs[i].token_ids) == 1]
        prefills = [runs[i] for i in order if len(runs[i].token_ids) > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows = [0] * len(runs)
        for i in order:
            run = runs[i]
            end = run.start + len(run.token_ids)
            input_ids.extend(run.token_ids)
            positions.extend(range(run.start, end))
            slots.extend(run.block_table[p // bs] * bs + p % bs for p in range(run.start, end))
            last_rows[i] = len(input_ids) - 1
        decode_tables = [r.block_table for r in decodes]
        decode_lens = [r.start + 1 for r in decodes]
        prefill_specs = [(r.start, len(r.token_ids), r.block_table) for r in prefills]
        meta = build_metadata(decode_tables=decode_tables, decode_ctx_lens=decode_lens,
                              prefill_specs=prefill_specs, slot_mapping=slots, block_size=bs,
                              device=self.device, buffers=self.gather_buffers,
                              native=self.native)
        if self.kernels == "flex":
            meta.flex = self._flex_backend().prepare(decode_tables, decode_lens, prefill_specs)
        dev = self.device
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            self.kv_cache, meta)
        rows = torch.tensor(last_rows, dtype=torch.long, device=dev)
        return self.model.logits(hidden.index_select(0, rows))


@dataclass(frozen=True)
class TokenRun:
    """Tokens at positions start.. of one sequence whose KV lives in `block_table`
    (which covers every position up to the run's end); the positions before `start` are
    in the cache already."""

    token_ids: Sequence[int]
    start: int
    block_table: list[int]
