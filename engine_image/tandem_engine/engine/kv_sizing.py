"""How many KV blocks an engine gets, decided once at start.

A pool of `num_blocks`, or of `kv_cache_memory_bytes` (512 MiB on CPU when neither is
given), is sized from the model's geometry alone (`runner.num_kv_blocks`). On CUDA with
neither, as vLLM's `--gpu-memory-utilization`: the weights are loaded beside a small
scratch pool, one forward at the largest step is profiled (`model/device`), and the pool
gets `utilization x total - (weights + activation peak + memory outside torch)`, the
draft model's weights and its pool of as many blocks included; a start where one
`model_context` request would not fit is refused. That runner, already loaded, is the
engine's (`resize_kv` swaps its scratch pool for the sized one).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from tandem_engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from tandem_engine.engine.draft_model import DraftCheckpoint, draft_kv_blocks
from tandem_engine.model.device import profile_step_blocks, profile_step_memory
from tandem_engine.model.runner import ModelRunner, kv_sized_by_memory_fraction, num_kv_blocks

if TYPE_CHECKING:
    from tandem_engine.engine.draft_model import ModelConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KVSizing:
    num_blocks: int
    runner: ModelRunner | None  # loaded while sizing by memory fraction, else None


def size_kv_pool(model_config: ModelConfig, engine_config: EngineConfig,
                 tensors: dict[str, torch.Tensor], kv_dtype: str, model_context: int,
                 draft: DraftCheckpoint | None) -> KVSizing:
    """The engine's KV blocks of `kv_dtype` (and, sized by memory fraction, its loaded
    runner)."""
    if not kv_sized_by_memory_fraction(engine_config):
        if engine_config.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
            sized = (engine_config.num_blocks, engine_config.kv_cache_memory_bytes)
            log.warning("gpu_memory_utilization=%s is ignored: %s",
                        engine_config.gpu_memory_utilization,
                        "the KV pool is sized by num_blocks or kv_cache_memory_bytes"
                        if sized != (None, None)
                        else "it sizes a CUDA engine's memory, and this one runs on the CPU")
        return KVSizing(num_kv_blocks(model_config, engine_config, kv_dtype), None)
    runner = ModelRunner(model_config, engine_config, tensors,
                         profile_step_blocks(engine_config), model_context)
    profile = profile_step_memory(runner, engine_config)
    if draft is not None:  # the draft's weights and a pool of as many blocks
        profile = dataclasses.replace(profile, weights=profile.weights + draft.weight_bytes)
    num_blocks = num_kv_blocks(model_config, engine_config, kv_dtype, profile, model_context)
    if draft is not None:
        num_blocks = draft_kv_blocks(num_blocks, model_config, draft.config)
    runner.resize_kv(num_blocks)
    log.info("KV cache sized by gpu_memory_utilization=%s: %d blocks (%.2f GiB)",
             engine_config.gpu_memory_utilization, num_blocks, runner.kv_bytes / 2**30)
    return KVSizing(num_blocks, runner)
