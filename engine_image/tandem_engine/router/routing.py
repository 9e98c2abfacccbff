"""Which engine serves a request: weight version and LoRA adapter first, then load,
prefix affinity and adapter affinity.

Pure functions over `EngineView` snapshots, so every rule is tested without sockets.

* Version: an engine serves only while it runs the pool's *serving version*, the
  newest weight version that has at least one alive RUNNING engine. During a refit
  some engines run the old version and some the new; new requests go to the newest
  version as soon as one of its engines runs, and a request that already has tokens is
  only ever continued on its own version (`eligible(..., version=...)`).
* Load: what an engine has queued (the larger of what it last reported and what this
  router has in flight there, since reports arrive only every heartbeat), waiting
  requests counted again (they have not started), and KV usage.
* Affinity: this router remembers, per engine, the block hashes of the prompts it
  sent there (`PrefixIndex`, bounded LRU). The engine with the longest cached prefix
  wins unless it is much more loaded: a fully cached prompt is worth
  `affinity_weight` queued requests.
* Adapters: a request under a LoRA adapter goes only to engines that serve it (at the
  version its tokens so far were made with, once there are any: `adapter_identity`),
  and an engine with the adapter already on its device (its heartbeat's
  `resident_loras`) is worth `lora_weight` queued requests more: elsewhere the adapter
  must be copied into a device slot first, or the request waits for a free one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem_engine.lifecycle import LEAVING_STATES, EngineState

RUNNING = EngineState.RUNNING  # the one state an engine takes new requests in


@dataclass(frozen=True)
class EngineView:
    """A snapshot of one engine as routing sees it."""

    key: str  # the engine's address, unique in the pool
    alive: bool  # handshake done and heartbeats on time
    state: str  # an EngineState name
    weight_version: str
    weight_epoch: int
    num_running: int
    num_waiting: int
    kv_usage: float
    inflight: int  # requests this router has in flight there
    block_size: int
    max_model_len: int
    draining: bool = False  # refusing new requests (a drain, a refit's verification)
    # LoRA adapters as identities "name@version": served, and on the device now.
    loras: frozenset[str] = frozenset()
    resident_loras: frozenset[str] = frozenset()
    # Its prefix cache as this router indexes it from its KV events (kv_index.py).
    kv_index_blocks: int = 0
    kv_synced: bool = False
    kv_lag: float = 0.0  # seconds its last batch took to arrive
    kv_resyncs: tuple[tuple[str, int], ...] = ()  # (reason, count)

    @property
    def serving(self) -> bool:
        return self.alive and self.state == RUNNING and not self.draining

    @property
    def coming_back(self) -> bool:
        """Alive but not serving for now (paused, suspended, refitting, verifying): new
        requests may wait for it rather than fail."""
        return self.alive and not self.serving and self.state not in LEAVING_STATES


@dataclass(frozen=True)
class RoutingWeights:
    affinity_weight: float = 4.0  # a fully cached prompt is worth this many queued requests
    waiting_weight: float = 1.0  # a waiting request counts this much on top of queued
    kv_weight: float = 4.0  # a full KV pool counts as this many queued requests
    lora_weight: float = 2.0  # the request's adapter on the device is worth this many


DEFAULT_WEIGHTS = RoutingWeights()


def serving_version(engines: Iterable[EngineView]) -> str | None:
    """The newest weight version with at least one alive RUNNING engine, or None.

    Newest = the highest weight epoch among the version's serving engines (every refit
    bumps an engine's epoch); ties go to the version with more serving engines, then to
    the larger version string, so every router picks the same one."""
    epochs: dict[str, int] = {}
    counts: dict[str, int] = {}
    for e in engines:
        if e.serving:
            epochs[e.weight_version] = max(epochs.get(e.weight_version, -1), e.weight_epoch)
            counts[e.weight_version] = counts.get(e.weight_version, 0) + 1
    if not epochs:
        return None
    return max(epochs, key=lambda v: (epochs[v], counts[v], v))


def retired(engines: Iterable[EngineView], version: str) -> bool:
    """Whether `version` is gone for good while another one serves: no alive engine runs
    it in any state short of leaving (a refit moved its last one on), so a request with
    tokens of it continues on the serving version by recompute rather than wait. An
    engine that died on it is not waited for: it comes back on the fleet's current
    weights (`tandem serve` restarts it on the newest refitted ones, a pod loads its
    pool's spec)."""
    engines = list(engines)
    if any(e.alive and e.weight_version == version and e.state not in LEAVING_STATES
           for e in engines):
        return False
    return serving_version(engines) not in (None, version)


def adapter_name(adapter: str) -> str:
    """The name of an adapter given by name or by identity ("name@version": names hold
    no "@", `lora_request.ADAPTER_NAME`)."""
    return adapter.partition("@")[0]


def adapter_identity(e: EngineView, adapter: str) -> str | None:
    """The identity under which `e` serves `adapter` (a name: at whatever version it
    serves; an identity: that one only), or None when it does not."""
    if "@" in adapter:
        return adapter if adapter in e.loras else None
    return next((i for i in sorted(e.loras) if adapter_name(i) == adapter), None)


def served_adapters(engines: Iterable[EngineView]) -> dict[str, list[str]]:
    """Each adapter name alive engines serve, with its identities, the most served
    first (then by identity): what a request's `model` may name, and `/v1/models`."""
    counts: dict[str, int] = {}
    for e in engines:
        if e.alive:
            for identity in e.loras:
                counts[identity] = counts.get(identity, 0) + 1
    names: dict[str, list[str]] = {}
    for identity in sorted(counts, key=lambda i: (-counts[i], i)):
        names.setdefault(adapter_name(identity), []).append(identity)
    return dict(sorted(names.items()))


def eligible(engines: Iterable[EngineView], version: str | None = None,
             exclude: Iterable[str] = (), adapter: str | None = None) -> list[EngineView]:
    """Alive RUNNING engines of `version` (default: the serving version), minus `exclude`,
    serving `adapter` (a name or an identity; None: the base model, which all serve)."""
    engines = list(engines)
    version = version if version is not None else serving_version(engines)
    skip = set(exclude)
    return [e for e in engines
            if e.serving and e.weight_version == version and e.key not in skip
            and (adapter is None or adapter_identity(e, adapter) is not None)]


def load_cost(e: EngineView, w: RoutingWeights = DEFAULT_WEIGHTS) -> float:
    queued = max(e.num_running + e.num_waiting, e.inflight)
    return queued + w.waiting_weight * e.num_waiting + w.kv_weight * e.kv_usage


def choose(candidates: Sequence[EngineView], cached_fraction: dict[str, float],
           w: RoutingWeights = DEFAULT_WEIGHTS, tie_break: int = 0,
           adapter: str | None = None) -> EngineView | None:
    """The best candidate: affinity bonuses minus load cost, highest wins.

    `cached_fraction[key]` is the share (0..1) of the prompt's full blocks the engine is
    believed to hold as a cached prefix; an engine with the request's `adapter` (name or
    identity) on its device gets `lora_weight` more. Equal scores rotate with
    `tie_break` (a counter the caller advances), so idle engines share the work."""
    if not candidates:
        return None

    def resident(e: EngineView) -> bool:
        identity = adapter_identity(e, adapter) if adapter is not None else None
        return identity is not None and identity in e.resident_loras

    def score(e: EngineView) -> float:
        return (w.affinity_weight * cached_fraction.get(e.key, 0.0)
                + (w.lora_weight if resident(e) else 0.0) - load_cost(e, w))

    best = max(score(e) for e in candidates)
    top = [e for e in candidates if score(e) >= best - 1e-9]
    return top[tie_break % len(top)]


class PrefixIndex:
    """The block hashes this router sent to one engine, least recently used first, each
    with when it was last sent.

    Chained hashes mean a block's hash stands for its whole prefix, so a prompt's cached
    prefix is its leading run of hashes present here. Bounded: the engine evicts too,
    so an old entry is a guess either way (exact routing reads the engine's own events,
    and this only for what was sent `within` a few seconds)."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"prefix index capacity {capacity} must be >= 1")
        self.capacity = capacity
        self._hashes: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: Sequence[int], within: float | None = None) -> int:
        """How many leading `hashes` are present (sent in the last `within` seconds)."""
        since = None if within is None else time.monotonic() - within
        n = 0
        for h in hashes:
            sent = self._hashes.get(h)
            if sent is None or (since is not None and sent < since):
                break
            n += 1
        return n

    def add(self, hashes: Iterable[int]) -> None:
        now = time.monotonic()
        for h in hashes:
            self._hashes[h] = now
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()
