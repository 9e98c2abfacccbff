"""Tandem engine: paged KV cache, continuous batching, chunked prefill."""

from __future__ import annotations

from tandem_engine.config import SpeculativeConfig
from tandem_engine.errors import CheckpointError, RequestRejected, TandemError
from tandem_engine.lifecycle import EngineState, EngineStateError, KVMode
from tandem_engine.sampling_params import SamplingParams

__all__ = ["LLM", "CheckpointError", "EngineState", "EngineStateError", "KVMode",
           "RequestRejected", "SamplingParams", "SpeculativeConfig", "TandemError"]


def __getattr__(name: str):
    # LLM pulls in torch; keep `import tandem_engine` light for tools that only need params.
    if name == "LLM":
        from tandem_engine.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tandem_engine' has no attribute {name!r}")
