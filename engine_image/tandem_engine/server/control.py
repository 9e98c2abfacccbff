"""Every lifecycle change of an engine process goes through one object.

`EngineControl` is what the admin API (and through it the operator and `tandem
refit`) calls: pause, unpause, suspend, resume, refit, drain, undrain, canary, and
loading and unloading LoRA adapters (server/adapters.py holds their rules). Each
call drives the engine's state machine, keeps what must follow it in step (the KV
transfer agent's registration of a pool that a suspend moves; admission while
draining) and tells every router about the change at once. Callers never need to
know which of the engine, the worker or the handoff owns a transition.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from msgspec import UNSET

from tandem_engine.admin_wire import (
    DeviceStatus,
    EngineStatus,
    LoadLoRAAdapterRequest,
    RefitRequest,
)
from tandem_engine.errors import CheckpointError
from tandem_engine.lifecycle import EngineState, EngineStateError, KVMode
from tandem_engine.model.device import DeviceReport, report_device
from tandem_engine.server.handoff import HandoffStats
from tandem_engine.server.weights_roots import WeightsRoots
from tandem_engine.server.worker import Canary, EngineWorker
from tandem_engine.weights import checkpoint_path, resolve_checkpoint


class ShuttingDown(Exception):
    """The engine is stopping for good (SIGTERM): it cannot admit requests again."""


class EngineControl:
    def __init__(self, worker: EngineWorker, weights_roots: WeightsRoots | None = None,
                 device_probe: Callable[[], DeviceReport] | None = None) -> None:
        """`weights_roots`: where refits may read checkpoints (None: anywhere, for
        in-process use; the engine process always passes its `--weights-root`).
        `device_probe`: what /v1/state and /metrics report of the device (default: the
        engine's device, read when asked)."""
        self.worker = worker
        self.engine = worker.engine
        self.weights_roots = weights_roots
        self.device_probe = device_probe or partial(report_device, worker.engine.device)
        # Refits asked of this engine by outcome: succeeded, refused (bad URI or
        # checkpoint: the old weights still serve), conflict (the state allows none).
        self.refits: dict[str, int] = {"succeeded": 0, "refused": 0, "conflict": 0}

    # ---- the state machine --------------------------------------------------------------

    def pause(self) -> None:
        self.engine.pause()
        self.worker.announce_state()

    def unpause(self) -> None:
        self.engine.unpause()
        self.worker.announce_state()

    def suspend(self, mode: KVMode | str) -> int:
        """Suspend; when the pool tensor goes (offload, recompute) the transfer agent lets
        go of it first. Returns the bytes of KV storage released."""
        released = self.engine.suspend(mode)
        handoff = self.worker.handoff
        if handoff is not None and KVMode(mode) is not KVMode.PERSIST:
            handoff.pool_released()
        self.worker.announce_state()
        return released

    def resume(self) -> None:
        """Resume and register the (new) pool: routers get a fresh WELCOME with the new
        transfer metadata, so decode engines re-add this peer."""
        self.engine.resume()
        handoff = self.worker.handoff
        if handoff is not None and handoff.pool_restored():
            self.worker.welcome_routers()
        self.worker.announce_state()

    def refit(self, request: RefitRequest) -> int:
        """Load the checkpoint `request.uri` names (PAUSED, SUSPENDED or RESUMED), and with
        it the draft checkpoint `request.draft_uri` names (speculative method draft; None
        keeps the engine's draft). Raises WeightsURIError (a ValueError) for a URI naming no
        local checkpoint, RefitPathRefused (a ValueError) for a path outside the weights
        roots or no checkpoint there (either URI: both are checked before anything loads),
        CheckpointError for one that does not fit the running model (the old weights keep
        serving), EngineStateError in any other state."""
        try:
            path = self._admit(request.uri, "refit uri")
            draft = (None if request.draft_uri is None
                     else self._admit(request.draft_uri, "refit draft_uri"))
            epoch = self.engine.apply_refit(request, path, draft)
        except EngineStateError:
            self.refits["conflict"] += 1
            raise
        except (ValueError, CheckpointError):
            self.refits["refused"] += 1
            raise
        self.refits["succeeded"] += 1
        self.worker.announce_state()
        return epoch

    def _admit(self, uri: str, what: str) -> Path:
        """The local checkpoint a refit's `uri` names, inside the weights roots."""
        path = Path(checkpoint_path(uri, what))
        admitted = path if self.weights_roots is None else self.weights_roots.admit(path)
        return resolve_checkpoint(admitted)

    # ---- LoRA adapters --------------------------------------------------------------------

    def load_lora(self, request: LoadLoRAAdapterRequest) -> str:
        """Serve an adapter (vLLM's `POST /v1/load_lora_adapter`); routers hear of it at
        once. AdapterCallError (400) when refused; the success message otherwise."""
        message = self.worker.adapters.load(request.lora_name, request.lora_path,
                                            request.lora_version)
        self.worker.announce_state()
        return message

    def unload_lora(self, name: str) -> str:
        """Stop serving an adapter; AdapterCallError (404) when it is not served."""
        message = self.worker.adapters.unload(name)
        self.worker.announce_state()
        return message

    # ---- admission ------------------------------------------------------------------------

    def drain(self) -> None:
        """Stop admitting new requests (routers place them elsewhere); running ones finish."""
        self.worker.set_draining(True)

    def undrain(self) -> None:
        """Admit new requests again. Raises ShuttingDown after SIGTERM or once the engine
        is unhealthy (its steps keep failing: it needs a restart)."""
        if self.worker.shutting_down:
            raise ShuttingDown(f"engine {self.worker.engine_id} is shutting down; it cannot "
                               "admit new requests again")
        if self.worker.unhealthy:
            raise ShuttingDown(f"engine {self.worker.engine_id} is unhealthy "
                               f"({self.worker.unhealthy}); restart it to serve again")
        self.worker.set_draining(False)

    def canary(self, prompt: str | list[int], max_tokens: int, timeout: float,
               lora_name: str | None = None, lora_version: str | None = None) -> Canary:
        """A short greedy generation no router sees, its prompt scored (a refit's
        verification), under LoRA adapter `lora_name` (at `lora_version`) when given. A text
        prompt is tokenized with the engine's tokenizer."""
        token_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return self.worker.canary(token_ids, max_tokens, timeout, lora_name, lora_version)

    # ---- what it reports ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        w = self.worker
        return w.alive and self.engine.stats.state is EngineState.RUNNING and not w.draining

    def status(self) -> EngineStatus:
        """`GET /v1/state`: one snapshot of the engine and its process."""
        w, stats = self.worker, self.engine.stats
        handoff = (w.handoff.stats if w.handoff is not None else HandoffStats()).as_dict()
        lora = stats.lora
        return EngineStatus(
            engine_id=w.engine_id, incarnation=w.incarnation, role=w.role, model=w.model_name,
            state=stats.state, weight_version=stats.weights.version,
            weight_epoch=stats.weights.epoch, weight_uri=stats.weights.uri,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage, draining=w.draining, unhealthy=w.unhealthy,
            pinned_blocks=stats.num_pinned_blocks,
            quarantined_blocks=stats.num_quarantined_blocks,
            kv_pulls={**handoff, "recomputed": stats.num_pull_fallbacks},
            device=DeviceStatus(**self.device_probe().as_dict()),
            weight_bytes=stats.weight_bytes, kv_cache_bytes=stats.kv_cache_bytes,
            kv_cache_dtype=stats.kv_cache_dtype, last_refit_peak_bytes=stats.last_refit_peak_bytes,
            loras=list(lora.served) if lora is not None else UNSET,
            resident_loras=list(lora.resident) if lora is not None else UNSET,
            cached_blocks=self.engine.kv.pool.num_cached,
            kv_event_seq=self.engine.kv.pool.events.seq)
