"""Exact prefix-aware routing from the engines' KV events, with real processes: two engines
and two routers over them.

* A workload of 8 long shared prefixes, each first sent through one router and repeated
  through the other, lands its repeats on the engine holding the prefix (measured by the
  engine's own `cached_tokens`) with exact routing, and about half as often with the
  routers' memory of what each sent (`--prefix-routing approximate`, the earlier way).
* Evictions in a small KV pool are seen by both routers: their index of each engine holds
  exactly what the engine holds, within a second of it.
* An engine killed and started again (a new incarnation) is indexed again from scratch.
* `prompt_cache_key` keeps requests of one key on one engine.
* In a disaggregated pair, a prompt the decode engine already holds skips the prefill
  engine (P/D bypass).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from tandem_engine.cli.serve import free_port
from test_router_e2e import MODEL, _engine_cmd, _metric, _router_cmd, _spawn, _stop, _wait_ready

pytestmark = pytest.mark.slow
BLOCK = 16  # the engines' KV block size (the default)
PREFIX_TOKENS = 8 * BLOCK  # each shared prefix: 8 full blocks
NUM_BLOCKS = 96  # each engine's KV pool: about 10 prefixes' worth, so the workload evicts


@dataclass
class Stack:
    folder: Path
    model: Path
    engine_ports: list[tuple[int, int]]
    routers: list[str] = field(default_factory=list)
    engines: list[subprocess.Popen] = field(default_factory=list)
    router_procs: list[subprocess.Popen] = field(default_factory=list)

    def admin(self, i: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[i][1]}"

    def start_engine(self, i: int, *flags: str) -> subprocess.Popen:
        zp, ap = self.engine_ports[i]
        log = self.folder / f"engine{i}-{len(self.engines)}.log"
        cmd = _engine_cmd(self.model, zp, ap)
        cmd[cmd.index("--num-blocks") + 1] = str(NUM_BLOCKS)
        proc = _spawn([*cmd, *flags], log)
        _wait_ready(f"{self.admin(i)}/readyz", proc, log)
        return proc

    def engine_state(self, i: int) -> dict:
        return httpx.get(f"{self.admin(i)}/v1/state", timeout=5).json()

    def index_of(self, router: str) -> dict[str, dict]:
        engines = httpx.get(f"{router}/v1/engines", timeout=5).json()["engines"]
        return {e["address"]: e["kv_index"] for e in engines}

    def complete(self, router: str, prompt: list[int], **extra) -> dict:
        r = httpx.post(f"{router}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        _stop(self.router_procs + self.engines)


def start_stack(model: Path, folder: Path, routing: str, engines: int = 2,
                roles: tuple[str, ...] = ("mixed", "mixed")) -> Stack:
    stack = Stack(folder, model, [(free_port(), free_port()) for _ in range(engines)])
    try:
        for i, role in enumerate(roles):
            stack.engines.append(stack.start_engine(i, "--role", role))
        keys = [f"127.0.0.1:{zp}" for zp, _ in stack.engine_ports]
        for r in range(2):
            port = free_port()
            log = folder / f"router{r}.log"
            proc = _spawn([*_router_cmd(model, keys, port), "--prefix-routing", routing], log)
            stack.router_procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            _wait_ready(f"{url}/readyz", proc, log)
            stack.routers.append(url)
        for url in stack.routers:  # every engine seen and indexed by both routers
            wait(lambda u=url: all(e["synced"] for e in stack.index_of(u).values())
                 and len(stack.index_of(u)) == engines, 20, "both routers' indexes synced")
    except BaseException:
        stack.stop()
        raise
    return stack


def wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def prefixes(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(PREFIX_TOKENS)] for _ in range(8)]


def shared_prefix_hits(stack: Stack, seed: int, repeats: int = 2) -> tuple[int, int]:
    """Each of 8 prefixes sent once through router 0, then `repeats` times through router
    1 with a new suffix, one request at a time: (repeats that found the whole prefix in
    their engine's cache, repeats). Router 1 first serves one request of its own, as a
    router sharing a pool with others does: its view of who holds what is not router 0's."""
    rng = random.Random(seed + 1)
    stack.complete(stack.routers[1], [rng.randrange(3, 2000) for _ in range(20)])
    hits = total = 0
    for prefix in prefixes(seed):
        stack.complete(stack.routers[0], prefix + [rng.randrange(3, 2000) for _ in range(5)])
        time.sleep(0.2)  # the engine's events reach the other router
        for _ in range(repeats):
            out = stack.complete(stack.routers[1],
                                 prefix + [rng.randrange(3, 2000) for _ in range(5)])
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            hits += cached >= PREFIX_TOKENS
            total += 1
    return hits, total


@pytest.fixture(scope="module")
def exact(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tiny_llama, tmp_path_factory.mktemp("kv-exact"), "exact")
    yield stack
    stack.stop()


def test_repeats_of_a_shared_prefix_land_where_its_kv_is(tiny_llama: Path, exact: Stack,
                                                         tmp_path: Path) -> None:
    hits, total = shared_prefix_hits(exact, seed=1)
    assert hits >= 0.9 * total, (hits, total)
    # The routers' memory of what each sent alone (the earlier way): the router that did
    # not send a prefix first does not know where it is.
    approximate = start_stack(tiny_llama, tmp_path, "approximate")
    try:
        guessed, total_guessed = shared_prefix_hits(approximate, seed=1)
    finally:
        approximate.stop()
    assert guessed < hits, (guessed, hits, total)
    print(f"repeats landing on the prefix's engine: exact {hits}/{total}, "
          f"approximate {guessed}/{total_guessed}")


def test_both_routers_index_exactly_what_each_engine_holds(exact: Stack) -> None:
    rng = random.Random(7)
    for n in range(24):  # far more than a pool holds: evictions
        exact.complete(exact.routers[n % 2], [rng.randrange(3, 2000) for _ in range(80)])
    for i, (zp, _) in enumerate(exact.engine_ports):
        key = f"127.0.0.1:{zp}"

        def same(key=key, i=i) -> bool:
            state = exact.engine_state(i)
            return all(
                (idx[key]["blocks"], idx[key]["seq"]) == (state["cached_blocks"],
                                                          state["kv_event_seq"])
                for idx in (exact.index_of(r) for r in exact.routers))
        wait(same, 1.0, f"both routers' index of engine {i} to equal its cache")
        state = exact.engine_state(i)
        assert 0 < state["cached_blocks"] <= NUM_BLOCKS
    metrics = httpx.get(f"{exact.routers[0]}/metrics", timeout=5).text
    assert _metric(metrics, "tandem_router_kv_index_synced", {}) == 1.0
    assert _metric(metrics, "tandem_router_kv_index_blocks", {}) > 0


def test_a_restarted_engine_is_indexed_again(exact: Stack) -> None:
    old = exact.engines[0]
    os.kill(old.pid, signal.SIGKILL)
    old.wait(10)
    exact.engines[0] = exact.start_engine(0, "--role", "mixed")
    key = f"127.0.0.1:{exact.engine_ports[0][0]}"
    for router in exact.routers:
        wait(lambda r=router: exact.index_of(r)[key]["synced"]
             and exact.index_of(r)[key]["blocks"] == 0, 20, "the new incarnation indexed")
    prefix = prefixes(seed=3)[0]
    # Sent until it lands on the new engine, then repeated through the other router.
    for _ in range(6):
        exact.complete(exact.routers[0], [*prefix, 5])
        if exact.engine_state(0)["cached_blocks"] >= PREFIX_TOKENS // BLOCK:
            break
    wait(lambda: exact.index_of(exact.routers[1])[key]["blocks"]
         == exact.engine_state(0)["cached_blocks"], 1.0, "router 1 to see the new cache")


def test_a_prompt_cache_key_keeps_requests_on_one_engine(exact: Stack) -> None:
    rng = random.Random(11)
    seen = set()
    for _ in range(6):  # different prompts (no shared block), one key
        before = [exact.engine_state(i)["kv_event_seq"] for i in range(2)]
        exact.complete(exact.routers[0], [rng.randrange(3, 2000) for _ in range(40)],
                       prompt_cache_key="tenant-a/conversation-1")
        time.sleep(0.1)
        after = [exact.engine_state(i)["kv_event_seq"] for i in range(2)]
        seen |= {i for i in range(2) if after[i] != before[i]}
    assert len(seen) == 1, seen


def test_a_decode_engine_holding_the_prompt_skips_the_prefill_engine(
        tiny_llama: Path, tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu12")
    stack = start_stack(tiny_llama, tmp_path, "exact", roles=("prefill", "decode"))
    try:
        prompt = prefixes(seed=5)[0]
        first = stack.complete(stack.routers[0], prompt, max_tokens=4)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        decode = f"127.0.0.1:{stack.engine_ports[1][0]}"
        wait(lambda: stack.index_of(stack.routers[1])[decode]["blocks"]
             >= PREFIX_TOKENS // BLOCK, 2.0, "the decode engine's pulled prompt indexed")
        again = stack.complete(stack.routers[1], prompt, max_tokens=4)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_TOKENS - BLOCK
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        metrics = httpx.get(f"{stack.routers[1]}/metrics", timeout=5).text
        assert _metric(metrics, "tandem_router_disaggregated_requests_total",
                       {"outcome": "bypassed"}) == 1.0
    finally:
        stack.stop()
