"""The weights an engine serves: what they are called, what they hold, and their swap.

A refit names the new weights by URI, version and epoch (`WeightIdentity`). The epoch
salts prefix-cache hashes (`block_salt`), so KV computed by old weights can never be
matched after a refit. The swap validates everything before any parameter changes —
the checkpoint against the running model (`load_checkpoint(..., reference=...)`), the
mtp heads and a draft checkpoint (`Speculation.prepare_refit`) — so on any error the
old weights keep serving. `low_memory` streams the new tensors into the serving ones
one at a time (device peak: 1x the weights plus one tensor, instead of old + new); the
last refit's peak and the serving weights' bytes are read here for the engine's stats.

Not thread-safe by itself: `LLMEngine.apply_refit` calls it under the engine lock, in
a refit state only, and publishes after.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tandem_engine.admin_wire import RefitRequest
from tandem_engine.core.kv.hashing import block_salt
from tandem_engine.core.request import Request
from tandem_engine.engine.speculation import Speculation
from tandem_engine.lifecycle import REFIT_STATES, EngineState, EngineStateError
from tandem_engine.model.checkpoint import load_checkpoint
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.runner import ModelRunner
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import WeightIdentity


def refit_request(source: str | Path, version: str | None, epoch: int | None,
                  uri: str | None, low_memory: bool, draft: str | Path | None
                  ) -> RefitRequest:
    """The `RefitRequest` of an in-process refit to checkpoint `source` (a folder or a
    GGUF file) under `version` (default: the path), named `uri` (default: its file://
    URI), with the draft checkpoint `draft`."""
    return RefitRequest(
        uri=uri or Path(source).resolve().as_uri(), version=version or str(source),
        epoch=epoch, low_memory=low_memory,
        draft_uri=None if draft is None else Path(draft).resolve().as_uri())


class ServingWeights:
    """The identity and bytes of the weights serving now, and their swap by a refit."""

    def __init__(self, runner: ModelRunner, speculation: Speculation,
                 tokenizer: Tokenizer) -> None:
        self.runner = runner
        self.speculation = speculation
        self.tokenizer = tokenizer
        self.identity = WeightIdentity(uri="", version="initial", epoch=0)
        self.bytes = runner.weight_bytes  # changes only with a refit

    @property
    def last_refit_peak_bytes(self) -> int | None:
        return self.runner.last_refit_peak_bytes

    def name(self, identity: WeightIdentity) -> None:
        """Name the weights serving now (the checkpoint loaded at start, under the version
        and epoch its fleet knows it by)."""
        self.identity = identity

    def swap(self, state: EngineState, request: RefitRequest, checkpoint: str | Path,
             draft: str | Path | None, served: ModelConfig, waiting: Iterable[Request]
             ) -> ModelConfig:
        """Swap in the weights `request` names, read from `checkpoint`, for the running
        model's `served` config; returns the new weights' config. The epoch becomes
        `request.epoch` when given (a fleet numbers its refits pool-wide), else the
        current one + 1; `waiting` requests holding no KV yet are re-salted with it."""
        if state not in REFIT_STATES:
            raise EngineStateError(
                f"refit is not allowed in state {state}; allowed in "
                f"{', '.join(sorted(str(s) for s in REFIT_STATES))}: pause first")
        self.speculation.check_refit_draft(draft)
        dtype = str(self.runner.dtype).removeprefix("torch.")
        config, tensors = load_checkpoint(checkpoint, dtype, reference=served,
                                          quantization=self.runner.quantization)
        swap_speculation = self.speculation.prepare_refit(config, tensors, checkpoint,
                                                          draft, self.tokenizer, dtype)
        self.runner.load_weights(tensors, low_memory=request.low_memory)
        swap_speculation()
        self.bytes = self.runner.weight_bytes
        epoch = self.identity.epoch + 1 if request.epoch is None else request.epoch
        self.identity = WeightIdentity(request.uri, request.version or request.uri, epoch)
        # Requests holding no KV yet compute everything under the new weights; the ones
        # with KV keep their salt (their leading blocks are old-weight KV).
        for queued in waiting:
            if queued.num_computed_tokens == 0:
                queued.resalt(block_salt(epoch, queued.cache_salt, queued.lora
                                         and queued.lora.identity))
        return config
