"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode step of a small model on a GPU is bound by kernel launches (a few hundred per
step), not by the GPU; replaying a captured graph launches them all at once. Graphs
have fixed shapes and fixed addresses, so:

* a step of `n` decodes runs the graph of the smallest bucket >= n (`bucket_for`); a
  step with prefill chunks, prompt logprobs, or more decodes than the largest bucket
  runs eagerly (admission never depends on the buckets);
* the step's inputs are padded to the bucket (`DecodeInputs.padded`) by repeating the
  first decode: a padding row computes exactly what row 0 computes and writes the same
  key and value into row 0's slot, so it changes no KV; its logits are sliced off;
* the inputs are copied into the graph's static tensors before each replay; the
  attention mask (flex backend only: the gather path's shapes vary per step) lives in
  static tensors too (`FlexPagedAttention.prepare_decodes_into`);
* a new KV pool or new parameter tensors (offload, resize, refit built beside) make
  every graph stale: the runner calls `clear()` and graphs are captured again on use.
  A streamed refit writes the parameters in place, so graphs survive it.

Only the pure parts (`capture_sizes`, `bucket_for`, `DecodeInputs`) run on CPU; the
capture itself needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem_engine.model.attention import AttentionMetadata, GatherBuffers
from tandem_engine.model.flex_attention import FlexPagedAttention, MaskBlocks
from tandem_engine.model.layers import DecoderModel

MAX_CAPTURED_BATCH = 256  # larger decode batches are throughput-bound: run them eagerly


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to the engine's
    `max_num_seqs` (at most MAX_CAPTURED_BATCH), which is always one of them."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be at least 1")
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return tuple(sorted(sizes))


def bucket_for(num_decodes: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `num_decodes` rows; None when none does
    (the step runs eagerly)."""
    if num_decodes < 1:
        raise ValueError(f"a decode step needs at least one row, got {num_decodes}")
    return next((s for s in sizes if s >= num_decodes), None)


@dataclass(frozen=True)
class DecodeInputs:
    """A decode-only step's inputs, one row per request."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # where each row's new key and value are written
    tables: list[list[int]]  # block table of each request
    ctx_lens: list[int]  # tokens of KV each row attends over, its own included

    def __len__(self) -> int:
        return len(self.input_ids)

    def padded(self, size: int) -> DecodeInputs:
        """The same step with `size` rows, the extra ones copies of row 0."""
        extra = size - len(self)
        if extra < 0:
            raise ValueError(f"cannot pad {len(self)} rows to {size}")
        return DecodeInputs(*(rows + rows[:1] * extra for rows in (
            self.input_ids, self.positions, self.slots, self.tables, self.ctx_lens)))


class _Captured:
    """One bucket's graph and the static tensors it reads and writes."""

    def __init__(self, size: int, flex: FlexPagedAttention, device: torch.device) -> None:
        self.size = size
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.zeros(size, dtype=torch.long, device=device)
        self.mask: MaskBlocks = flex.static_decodes(size)
        self.meta: AttentionMetadata | None = None
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, inputs: DecodeInputs, flex: FlexPagedAttention) -> None:
        for dst, src in ((self.input_ids, inputs.input_ids), (self.positions, inputs.positions),
                         (self.slots, inputs.slots)):
            dst.copy_(torch.tensor(src, dtype=torch.long))
        step = flex.prepare_decodes_into(self.mask, inputs.tables, inputs.ctx_lens)
        if self.meta is None:
            self.meta = AttentionMetadata(
                slot_mapping=self.slots, num_decodes=self.size, decode_blocks=None,
                decode_lens=None, decode_mask=None, prefills=[], buffers=GatherBuffers(),
                flex=step)

    def forward(self, model: DecoderModel, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self.meta is not None, "load() before forward()"
        return model.logits(model(self.input_ids, self.positions, kv_cache, self.meta))


class DecodeGraphs:
    """The captured decode graphs of one runner (CUDA only)."""

    def __init__(self, sizes: tuple[int, ...], device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.sizes, self.device = sizes, device
        self._graphs: dict[int, _Captured] = {}
        self._pool: tuple[int, int] | None = None  # memory pool shared by every graph

    def clear(self) -> None:
        """Forget every graph (the pool or the parameters moved)."""
        self._graphs.clear()
        self._pool = None

    def run(self, inputs: DecodeInputs, model: DecoderModel, kv_cache: torch.Tensor,
            flex: FlexPagedAttention) -> torch.Tensor | None:
        """The step's logits [n, vocab] (a view into the graph's output: use it before the
        next replay), or None when no bucket holds the step."""
        size = bucket_for(len(inputs), self.sizes)
        if size is None:
            return None
        padded = inputs.padded(size)
        captured = self._graphs.get(size)
        if captured is None:
            captured = self._capture(size, padded, model, kv_cache, flex)
        else:
            captured.load(padded, flex)
        assert captured.graph is not None and captured.logits is not None
        captured.graph.replay()
        return captured.logits[:len(inputs)]

    def _capture(self, size: int, padded: DecodeInputs, model: DecoderModel,
                 kv_cache: torch.Tensor, flex: FlexPagedAttention) -> _Captured:
        captured = _Captured(size, flex, self.device)
        captured.load(padded, flex)
        # Warm up on a side stream (compiles flex attention, sets up cuBLAS) with the
        # real step's inputs: its KV writes are the same bytes the replay writes.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                captured.forward(model, kv_cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the KV transfer agent's threads may touch CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            captured.logits = captured.forward(model, kv_cache)
        self._pool = graph.pool()
        captured.graph = graph
        self._graphs[size] = captured
        return captured
