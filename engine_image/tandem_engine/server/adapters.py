"""The LoRA adapters of an engine process: preloaded from `--lora-modules`, loaded and
unloaded at run time by the admin API (vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`) and by routers (LORA_LOAD and LORA_UNLOAD over ZMQ, which
`tandem-router` sends for the same two calls), under one set of rules.

A path given at run time is read only inside the weights roots (`--weights-root`, the
refit rule: `WeightsRoots.admit_adapter`), since whoever holds the admin token or the
router's key could otherwise make the engine read any folder it can see; `--lora-modules`
are the engine's own start-up arguments and are read where they point. Every refusal
is an `AdapterCallError` carrying the HTTP status its caller answers: 400 for a bad
adapter, name, version or path, or an engine without `--enable-lora`; 404 for unloading
a name the engine does not serve. Loading a name again at the same version and path
reads it again and succeeds, so a router may repeat a call that timed out.

The engine does the work under its lock (`LLMEngine.load_lora`): a call waits for the
step in progress. Callers tell the routers about the change afterwards (the worker's
state announcement), so they route by it at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tandem_engine import protocol as p
from tandem_engine.errors import CheckpointError, RequestRejected
from tandem_engine.lora_request import LoRARequest, parse_lora_module
from tandem_engine.server.weights_roots import AdapterPathRefused, WeightsRoots

if TYPE_CHECKING:  # the engine process imports torch only once it loads the model
    from tandem_engine.engine.llm_engine import LLMEngine


class AdapterCallError(Exception):
    """A load or unload refused: `status` is the HTTP status to answer, the message
    names the problem."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def lora_modules(specs: Sequence[str] | None, enable_lora: bool) -> list[LoRARequest]:
    """The adapters `--lora-modules` names, checked before the model loads (ValueError
    naming the entry: a bad spelling, a name given twice, or LoRA off)."""
    loras = [parse_lora_module(spec) for spec in specs or ()]
    if loras and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (and --max-loras, "
                         "--max-lora-rank to fit the adapters)")
    names = [lora.lora_name for lora in loras]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(twice)} more than once: give "
                         "each adapter one NAME[@VERSION]=PATH")
    return loras


class EngineAdapters:
    def __init__(self, engine: LLMEngine, weights_roots: WeightsRoots | None = None) -> None:
        """`weights_roots`: where run-time loads may read (None: anywhere, for in-process
        use; the engine process always passes its `--weights-root`)."""
        self.engine = engine
        self.weights_roots = weights_roots

    def preload(self, loras: Sequence[LoRARequest]) -> None:
        """Serve the `--lora-modules` adapters; ValueError naming the first that cannot
        be loaded (the engine process then exits before it serves)."""
        for lora in loras:
            try:  # by its absolute path: a later load of the same folder is the same adapter
                self.engine.load_lora(LoRARequest(lora.lora_name,
                                                  str(Path(lora.lora_path).resolve()),
                                                  lora.lora_version))
            except (CheckpointError, RequestRejected) as exc:
                raise ValueError(f"--lora-modules {lora.lora_name}@{lora.lora_version}="
                                 f"{lora.lora_path}: {exc}") from None

    def load(self, name: str, path: str, version: str = "1") -> str:
        """Serve the adapter at `path` under `name` at `version`; the success message
        (vLLM's words), or AdapterCallError."""
        try:
            LoRARequest(name, path, version)  # the name and version, before the path
            if self.weights_roots is not None:
                path = str(self.weights_roots.admit_adapter(path))
            self.engine.load_lora(LoRARequest(name, path, version))
        except (CheckpointError, RequestRejected, AdapterPathRefused) as exc:
            raise AdapterCallError(400, f"LoRA adapter {name!r} not loaded: {exc}") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """Stop serving `name` (requests under it finish); the success message, or
        AdapterCallError 404 when it is not served."""
        if not self.engine.unload_lora(name):
            served = self.engine.stats.lora
            names = sorted(i.partition("@")[0] for i in served.served) if served else []
            raise AdapterCallError(404, f"The lora adapter '{name}' cannot be found: this "
                                        f"engine serves {', '.join(names) or 'none'}")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def reply(self, call: p.LoadLoRA | p.UnloadLoRA) -> tuple[int, str]:
        """A router's call, done: (HTTP status, message) for its LORA_REPLY."""
        try:
            if isinstance(call, p.LoadLoRA):
                return 200, self.load(call.name, call.path, call.version)
            return 200, self.unload(call.name)
        except AdapterCallError as exc:
            return exc.status, exc.message
