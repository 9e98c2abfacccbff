"""Which engine (or prefill/decode pair) serves a choice, and what the router remembers
of the prefixes it sent where.

`EnginePicker` is the router's one owner of routing state: the engine pool it reads
views from and, per engine, what it knows of the engine's prefix cache. Exact routing
(`--prefix-routing exact`, the default) reads each engine's `kv_index`, built from the
engine's own KV events (`kv_index.py`): what the engine holds, evictions and other
routers' traffic included; the blocks this router sent in the last `RECENT_S` seconds
count too (a burst of one prefix lands together before the engine's events for the
first arrive). Approximate routing (`approximate`, the earlier behaviour, kept to compare)
reads only a `PrefixIndex` of the block hashes this router sent there, which an engine
that restarted, refit or left the pool clears. The scoring rules themselves are the pure
functions of `routing.py`.

A request's `prompt_cache_key` (OpenAI's) is an affinity hint: the engine that last
served the key counts as holding the whole prompt, weighed against its load like any
cached prefix. In a disaggregated pool, a decode engine that already holds every full
block of the prompt takes the request itself, skipping the prefill engine and the KV
transfer (`bypass`, "P/D bypass").

It also owns waiting for an engine: `wait_until_serving` while the whole pool is only
away for now (a refit's window), `wait_for_version` while a choice that has tokens
looks for an engine of their weight version.

A request under a LoRA adapter (`adapter`: its name, or once it has tokens the identity
"name@version" they were made with) is offered only engines that serve it, scored with
the adapter's affinity too (`routing.choose`), and a disaggregated one only a prefill
and a decode engine that serve it at the same version. Its prefix hashes are salted with
the adapter's identity as each engine salts them (`block_salt`), so affinity never
mistakes one adapter's cached prefix for another's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

from tandem_engine.core.kv.hashing import block_hashes, block_salt
from tandem_engine.lifecycle import EngineRole
from tandem_engine.router.engines import EngineClient, EnginePool
from tandem_engine.router.flags import PREFIX_ROUTING
from tandem_engine.router.routing import (
    DEFAULT_WEIGHTS,
    EngineView,
    PrefixIndex,
    RoutingWeights,
    adapter_identity,
    choose,
    eligible,
    retired,
    serving_version,
)

POLL_INTERVAL = 0.05  # seconds between looks at the pool while waiting for an engine
# A router just started (or restarted under `tandem serve`, clients already sending) waits
# this long for engines it has not heard from yet rather than answering 503 at once: its
# first HELLO can go out before the connection is up, and the retry comes a
# --handshake-timeout (1 s) later; three of them.
STARTUP_GRACE_S = 3.0
NEVER_HEARD = "UNKNOWN"  # an EngineView's state before the engine's first load report


RECENT_S = 2.0  # exact routing: blocks sent this recently count as held (events lag)
CACHE_KEYS = 65536  # prompt_cache_key -> engine entries kept, least recently used out


class EnginePicker:
    def __init__(self, pool: EnginePool, *, weights: RoutingWeights = DEFAULT_WEIGHTS,
                 prefix_index_blocks: int = 65536, wait_timeout: float = 30.0,
                 prefix_routing: str = "exact") -> None:
        if prefix_routing not in PREFIX_ROUTING:
            raise ValueError(f"prefix routing {prefix_routing!r}: use one of "
                             f"{', '.join(PREFIX_ROUTING)}")
        self.pool = pool
        self.weights = weights
        self.prefix_index_blocks = prefix_index_blocks
        self.wait_timeout = wait_timeout  # the dispatcher's failover timeout
        self.exact = prefix_routing == "exact"
        self._cache_keys: OrderedDict[str, str] = OrderedDict()  # prompt_cache_key -> engine
        self._indexes: dict[str, PrefixIndex] = {}
        # Per engine address: the client object and its epoch_changes the index is for.
        self._index_generation: dict[str, tuple[EngineClient, int]] = {}
        self._tie_break = itertools.count()
        self._started = time.monotonic()
        # The last prompt's block-hash chains, by (epoch, block size, adapter identity):
        # one request's bypass check, prefill and decode choice and record hash it once
        # per chain. Keyed by the token list itself (held here, so never another's id).
        self._chains: tuple[Sequence[int], str | None, dict] = ((), None, {})

    # ---- what the API layer asks before dispatching ----------------------------------------

    def ready(self) -> bool:
        return serving_version(self.pool.views()) is not None

    async def wait_until_serving(self) -> bool:
        """Whether an engine serves, waiting up to `wait_timeout` while engines are only
        away for now (paused, suspended, refitting, verifying: an all-at-once refit's
        window) rather than failing the request."""
        deadline = time.monotonic() + self.wait_timeout
        while not self.ready():
            if time.monotonic() > deadline or not (self._starting() or any(
                    v.coming_back for v in self.pool.views())):
                return False
            await asyncio.sleep(POLL_INTERVAL)
        return True

    def _starting(self) -> bool:
        """Within the router's first STARTUP_GRACE_S, with an engine not heard from yet:
        it may be connecting now."""
        return (time.monotonic() - self._started < STARTUP_GRACE_S
                and any(v.state == NEVER_HEARD for v in self.pool.views()))

    def max_model_len(self) -> int | None:
        """The context limit of the serving version (the smallest among its engines)."""
        engines = eligible(self.pool.views())
        return min(e.max_model_len for e in engines) if engines else None

    # ---- picking ------------------------------------------------------------------------------

    def pick(self, token_ids: Sequence[int], cache_salt: str | None = None,
             version: str | None = None, exclude: Sequence[str] = (),
             adapter: str | None = None, cache_key: str | None = None
             ) -> EngineClient | None:
        """The engine for `token_ids` (recorded in its prefix index), or None; one that
        serves `adapter` (a name or an identity) when given.

        A colocated request avoids prefill-role engines while another engine can take it."""
        candidates = eligible(self.pool.views(), version, exclude, adapter)
        preferred = [e for e in candidates if self.pool.by_key[e.key].role != EngineRole.PREFILL]
        return self._choose(preferred or candidates, token_ids, cache_salt, adapter,
                            cache_key)

    async def wait_for_version(self, token_ids: Sequence[int], cache_salt: str | None,
                               version: str | None, exclude: Sequence[str] = (),
                               adapter: str | None = None) -> EngineClient | None:
        """An engine of weight `version` to continue a generation on, waiting up to
        `wait_timeout` for one (its engines may be paused or reconnecting); None when
        none came. Once `version` is `retired` (no alive engine runs it, another serves),
        an engine of the serving version: the caller continues there by recompute (the
        engine re-prefills prompt + tokens so far on its weights), as an engine's own
        Recompute refit does."""
        deadline = time.monotonic() + self.wait_timeout
        while True:
            client = self.pick(token_ids, cache_salt, version, exclude, adapter)
            if client is None and version is not None and retired(self.pool.views(), version):
                client = self.pick(token_ids, cache_salt, None, exclude, adapter)
            if client is not None or time.monotonic() > deadline:
                return client
            await asyncio.sleep(POLL_INTERVAL)

    def pick_pair(self, token_ids: Sequence[int], cache_salt: str | None = None,
                  adapter: str | None = None, cache_key: str | None = None
                  ) -> tuple[EngineClient, EngineClient] | None:
        """(prefill engine, decode engine) of the serving version for a disaggregated
        request, or None when the serving version lacks a prefill or a decode engine
        (serving `adapter`, when given: both at the same version of it)."""
        candidates = eligible(self.pool.views(), adapter=adapter)
        clients = self.pool.by_key
        if not (any(clients[e.key].role == EngineRole.PREFILL for e in candidates)
                and any(clients[e.key].role == EngineRole.DECODE for e in candidates)):
            return None
        able = [e for e in candidates if clients[e.key].can_hand_over]
        prefills = [e for e in able
                    if clients[e.key].role in (EngineRole.PREFILL, EngineRole.MIXED)]
        if not prefills:
            return None
        # Prefer a dedicated prefill engine; a mixed one only when none is available.
        prefills = [e for e in prefills if clients[e.key].role == EngineRole.PREFILL] or prefills
        decodes = [e for e in able if clients[e.key].role in (EngineRole.DECODE, EngineRole.MIXED)]
        prefill = self._choose(prefills, token_ids, cache_salt, adapter, cache_key)
        assert prefill is not None
        # The decode engine continues under the adapter version the prefill ran.
        identity = adapter_identity(prefill.view(), adapter) if adapter is not None else None
        decodes = [e for e in decodes if e.key != prefill.key
                   and (identity is None or identity in e.loras)]
        decodes = [e for e in decodes if clients[e.key].role == EngineRole.DECODE] or decodes
        if not decodes:
            return None
        # Load (and the adapter on the device) only: the decode engine pulls the prompt.
        decode = choose(decodes, {}, self.weights, next(self._tie_break), identity)
        assert decode is not None
        self._index(decode.key).add(self._chain(token_ids, cache_salt, decode.weight_epoch,
                                                decode.block_size, identity))
        return prefill, clients[decode.key]

    def remember(self, client: EngineClient, token_ids: Sequence[int],
                 cache_salt: str | None, adapter: str | None = None) -> None:
        """After a choice finished on `client` (under `adapter`, a name or an identity):
        it also caches the generated blocks."""
        self._index(client.key).add(self._hashes(client.view(), token_ids, cache_salt,
                                                 adapter))

    # ---- internals ----------------------------------------------------------------------------

    def bypass(self, token_ids: Sequence[int], cache_salt: str | None = None,
               adapter: str | None = None, cache_key: str | None = None
               ) -> EngineClient | None:
        """A disaggregated request's decode engine that already holds every full block of
        the prompt (exact routing only), to run it alone: nothing to prefill elsewhere or
        to transfer. None when no decode engine holds it all."""
        if not self.exact:
            return None
        candidates = [e for e in eligible(self.pool.views(), adapter=adapter)
                      if self.pool.by_key[e.key].role == EngineRole.DECODE]
        holding = [e for e in candidates
                   if (h := self._hashes(e, token_ids, cache_salt, adapter))
                   and self.pool.by_key[e.key].kv_index.holds(h)]
        return self._choose(holding, token_ids, cache_salt, adapter, cache_key)

    def _hashes(self, e: EngineView, token_ids: Sequence[int], cache_salt: str | None,
                adapter: str | None) -> list[int]:
        """The prompt's full blocks as engine `e` hashes them: its epoch and its version of
        the adapter salt the chain."""
        identity = adapter_identity(e, adapter) if adapter is not None else None
        return self._chain(token_ids, cache_salt, e.weight_epoch, e.block_size, identity)

    def _chain(self, token_ids: Sequence[int], cache_salt: str | None, epoch: int,
               block_size: int, identity: str | None) -> list[int]:
        """The prompt's full blocks' chained hashes under that salt, computed once per
        prompt and chain (`_chains`)."""
        held, salt, chains = self._chains
        if held is not token_ids or salt != cache_salt:
            chains = {}
            self._chains = (token_ids, cache_salt, chains)
        key = (epoch, block_size, identity)
        if key not in chains:
            chains[key] = block_hashes(token_ids, block_size,
                                       block_salt(epoch, cache_salt, identity))
        return chains[key]

    def _held(self, key: str, hashes: Sequence[int]) -> int:
        """How many leading `hashes` the engine at `key` holds, as far as this router
        knows: its exact index (once synced) or the blocks sent there just now, exact;
        the blocks this router sent there, approximate."""
        if not self.exact:
            return self._index(key).match(hashes)
        index = self.pool.by_key[key].kv_index
        exact = index.match(hashes) if index.synced else self._index(key).match(hashes)
        return max(exact, self._index(key).match(hashes, within=RECENT_S))

    def _choose(self, candidates: Sequence[EngineView], token_ids: Sequence[int],
                cache_salt: str | None, adapter: str | None = None,
                cache_key: str | None = None) -> EngineClient | None:
        if not candidates:
            return None
        hashes: dict[str, list[int]] = {}
        fraction: dict[str, float] = {}
        for e in candidates:
            hashes[e.key] = self._hashes(e, token_ids, cache_salt, adapter)
            n = len(hashes[e.key])
            fraction[e.key] = self._held(e.key, hashes[e.key]) / n if n else 0.0
        hinted = self._cache_keys.get(cache_key) if cache_key is not None else None
        if hinted is not None and hinted in fraction:
            fraction[hinted] = 1.0  # the key's engine: as if it held the whole prompt
        chosen = choose(candidates, fraction, self.weights, next(self._tie_break), adapter)
        assert chosen is not None
        self._index(chosen.key).add(hashes[chosen.key])
        if cache_key is not None:
            self._cache_keys[cache_key] = chosen.key
            self._cache_keys.move_to_end(cache_key)
            while len(self._cache_keys) > CACHE_KEYS:
                self._cache_keys.popitem(last=False)
        return self.pool.by_key[chosen.key]

    def _index(self, key: str) -> PrefixIndex:
        # An engine that restarted or refit holds none of the blocks we remember, nor does
        # a new engine at the address of one that left the pool (Kubernetes discovery).
        client = self.pool.by_key.get(key)
        if client is None:  # it left the pool: nothing to remember
            return PrefixIndex(1)
        generation = (client, client.epoch_changes)
        if key not in self._indexes:
            for gone in self._indexes.keys() - self.pool.by_key.keys():
                del self._indexes[gone], self._index_generation[gone]
            self._indexes[key] = PrefixIndex(self.prefix_index_blocks)
        elif self._index_generation[key] != generation:
            self._indexes[key].clear()
        self._index_generation[key] = generation
        return self._indexes[key]


def no_engine_message(pool: EnginePool, excluded: set[str] | frozenset[str] = frozenset(),
                      adapter: str | None = None) -> str:
    views = pool.views()
    states = ", ".join(f"{v.key}: {v.state if v.alive else 'unreachable'}" for v in views)
    refused = f"; refused by {', '.join(sorted(excluded))}" if excluded else ""
    under = "" if adapter is None else f" under LoRA adapter {adapter!r}"
    return f"no engine is available to serve the request{under} (engines: {states}{refused})"
