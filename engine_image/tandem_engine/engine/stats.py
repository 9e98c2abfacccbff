"""Immutable views of an engine that other threads may read without its lock.

The engine publishes a fresh `EngineStats` at the end of every step and every call
that changes what it reports (one attribute assignment, so a reader sees one whole
snapshot, never a half-updated one). The process layer (heartbeats, `/v1/state`,
`/metrics`, the KV progress thread) reads only these.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem_engine.lifecycle import EngineState
from tandem_engine.weights import WeightIdentity


@dataclass(frozen=True)
class StepTiming:
    num_running: int
    num_prefill_tokens: int
    num_decode_tokens: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    postprocess_s: float
    # Of sample_s: computing structured-outputs token masks (0 without constrained rows).
    grammar_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (self.schedule_s + self.prepare_s + self.forward_s + self.sample_s
                + self.postprocess_s)


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    cached_blocks: int = 0


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding totals (engine/speculative.py)."""

    num_drafts: int = 0  # decode steps that verified proposals
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose proposal i was accepted
    proposed_per_position: tuple[int, ...] = ()  # [i]: drafts that had a proposal i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class LoRAStats:
    """The LoRA adapters of an engine started with --enable-lora (engine/loras.py)."""

    served: tuple[str, ...] = ()  # identities (name@version) a request may name
    resident: tuple[str, ...] = ()  # identities on the device now
    running: tuple[str, ...] = ()  # names of the running requests' adapters, sorted
    waiting: tuple[str, ...] = ()  # names of the waiting requests' adapters, sorted
    max_loras: int = 0  # device slots
    loads: int = 0  # adapters copied into a device slot
    evictions: int = 0  # adapters whose slot another took
    hits: int = 0  # requests whose adapter was already in a slot


@dataclass(frozen=True)
class EngineStats:
    state: EngineState
    weights: WeightIdentity
    num_running: int
    num_waiting: int
    num_pulling: int  # handed-over requests whose KV is being pulled
    kv_usage: float  # 0..1 of the KV pool in use
    num_pinned_blocks: int  # KV kept for decode engines' pulls
    num_quarantined_blocks: int  # KV a pull of unknown state may still write (kept unused)
    block_size: int
    max_model_len: int
    vocab_size: int
    prefix_cache: PrefixCacheStats
    num_preemptions: int
    num_pull_fallbacks: int  # handed-over requests recomputed here
    speculative: SpecDecodeStats | None = None  # None when speculative decoding is off
    weight_bytes: int = 0  # the serving weights on the device
    kv_cache_bytes: int = 0  # the KV pool (0 while it is released: suspended)
    kv_cache_dtype: str = ""  # its elements (--kv-cache-dtype resolved)
    # Peak weight memory during the last refit (None: none yet): old + new, or with
    # low_memory 1x the weights plus one tensor.
    last_refit_peak_bytes: int | None = None
    lora: LoRAStats | None = None  # None when LoRA is off (no --enable-lora)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.num_running + self.num_waiting + self.num_pulling > 0
