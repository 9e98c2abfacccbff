"""Which LoRA adapters an engine serves, which are on the device, and which request uses
which slot.

Three levels, each bounded:

* **known** (`load`, `unload`, `--lora-modules`): name -> `LoRARequest` (its path and
  version). A request names one of them; any other name is refused. Unloading stops new
  requests; the ones already using it finish with its weights.
* **host cache**: the last `max_cpu_loras` adapters read from disk (`model.lora
  .read_adapter`), least recently used out first; an adapter evicted here is read again
  when next needed.
* **device slots**: `max_loras` adapters in `model.lora.LoRASlots`. Before every schedule
  `assign` gives each waiting request its adapter's slot: the slot already holding it, a
  free one, or one whose adapter no unfinished request holds (least recently used). When
  every slot is held, the request waits (`Request.lora_pending`, which the scheduler
  passes over) until a request holding one finishes.

An adapter's identity is its name and version (`LoRARequest.identity`): it salts the
request's prefix-cache chain, so KV never crosses adapters, nor versions of one.

Not thread-safe by itself: `LLMEngine` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tandem_engine.core.request import Request
from tandem_engine.errors import CheckpointError, RequestRejected
from tandem_engine.lora_request import LoRARequest
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.lora import LoRAAdapter, LoRASlots, read_adapter


class LoRAManager:
    def __init__(self, config: ModelConfig, slots: LoRASlots | None, max_cpu_loras: int,
                 max_rank: int) -> None:
        """`slots` None: LoRA is off (the engine was started without --enable-lora)."""
        self.config, self.slots = config, slots
        self.max_cpu_loras, self.max_rank = max_cpu_loras, max_rank
        self.known: dict[str, LoRARequest] = {}
        self._cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._resident: OrderedDict[str, int] = OrderedDict()  # identity -> slot, LRU first
        self.loads = self.evictions = self.hits = 0  # device slot loads, evictions, hits

    @property
    def enabled(self) -> bool:
        return self.slots is not None

    # ---- what the engine serves -------------------------------------------------------------

    def load(self, lora: LoRARequest) -> None:
        """Serve `lora` under its name (read and checked now: CheckpointError). A name
        already served at another version or path is replaced."""
        if self.slots is None:
            raise RequestRejected("LoRA adapters are off on this engine: start it with "
                                  "--enable-lora (and --max-loras, --max-lora-rank)")
        old = self.known.get(lora.lora_name)
        if old is not None and old.identity == lora.identity and old != lora:
            raise RequestRejected(
                f"LoRA adapter {lora.identity} is already loaded from {old.lora_path}: a new "
                f"path ({lora.lora_path}) needs a new version (NAME@VERSION), or unload it "
                "first")
        adapter = read_adapter(lora.lora_name, lora.lora_path, self.config, self.max_rank)
        if old is not None:
            self._forget(old)
        self.known[lora.lora_name] = lora
        self._cache_put(lora, adapter)

    def unload(self, name: str) -> bool:
        """Stop serving `name` (False: not served). Requests already using it finish."""
        lora = self.known.pop(name, None)
        if lora is None:
            return False
        self._forget(lora)
        return True

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request names (None: the base model); RequestRejected when this
        engine does not serve it."""
        if name is None:
            return None
        lora = self.known.get(name)
        if lora is None:
            served = ", ".join(sorted(self.known)) or "none"
            raise RequestRejected(f"LoRA adapter {name!r} is not loaded on this engine "
                                  f"(loaded: {served}); load it first")
        return lora

    def _forget(self, lora: LoRARequest) -> None:
        """Out of the host cache. Its slot, if it has one, stays until no request holds it
        and another adapter needs it (requests still using it keep its weights)."""
        self._cache.pop(lora.identity, None)

    def _cache_put(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        self._cache[lora.identity] = adapter
        self._cache.move_to_end(lora.identity)
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self._cache.get(lora.identity)
        if adapter is None:  # evicted from the host cache: read again
            try:
                adapter = read_adapter(lora.lora_name, lora.lora_path, self.config,
                                       self.max_rank)
            except CheckpointError as exc:
                raise RequestRejected(str(exc)) from None
        self._cache_put(lora, adapter)
        return adapter

    # ---- slots ------------------------------------------------------------------------------

    def assign(self, waiting: Iterable[Request], unfinished: Iterable[Request]) -> None:
        """Give each waiting request with an adapter its slot, or mark it pending."""
        if self.slots is None:
            return
        held = {r.lora_slot for r in unfinished if r.lora is not None and r.lora_slot >= 0}
        for request in waiting:
            lora = request.lora
            if lora is None or (request.lora_slot >= 0 and not request.lora_pending):
                continue
            slot = self._resident.get(lora.identity)
            if slot is not None:
                self._resident.move_to_end(lora.identity)
                self.hits += 1
            else:
                slot = self._free_slot(held)
                if slot is None:
                    request.lora_pending = True
                    continue
                self.slots.load(slot, self._adapter(lora))
                self._resident[lora.identity] = slot
                self.loads += 1
            request.lora_slot, request.lora_pending = slot, False
            held.add(slot)

    def _free_slot(self, held: set[int]) -> int | None:
        assert self.slots is not None
        used = set(self._resident.values())
        for slot in range(self.slots.num_slots):
            if slot not in used:
                return slot
        for identity, slot in self._resident.items():  # least recently used first
            if slot not in held:
                del self._resident[identity]
                self.evictions += 1
                return slot
        return None

    def resident(self) -> list[str]:
        """The identities on the device now."""
        return list(self._resident)
