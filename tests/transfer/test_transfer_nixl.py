"""KV handoff over NIXL between real processes: what a decode engine pulls from a prefill
engine is exactly the blocks it asked for, incompatible pools are refused before any byte
moves, and frozen, killed and restarted peers end in a clear error within the deadline,
never a hang.

Each engine side is a spawned worker process hosting NixlBackends and answering commands
over a pipe; between commands it polls notifications every millisecond, as the passive
side of a transfer must. The pytest process itself never loads NIXL.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tandem_engine.transfer import KVGeometry, TransferError
from tandem_engine.transfer.nixl import _PeerCard

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                                reason="nixl-cu12 is not installed")

F32 = KVGeometry(num_layers=3, num_blocks=40, block_size=16, num_kv_heads=2, head_dim=32,
                 dtype="float32")


def _pool(geometry: KVGeometry, seed: int | None) -> Any:
    import torch

    if seed is None:
        return torch.zeros(geometry.shape, dtype=getattr(torch, geometry.dtype))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(geometry.shape, generator=g).to(getattr(torch, geometry.dtype))


def _same_bytes(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _worker_main(conn: Any) -> None:
    """One engine side: hosts NixlBackends by agent name and runs commands from the pipe."""
    import torch
    from tandem_engine.transfer import NixlBackend, TransferHandle

    torch.set_num_threads(1)
    backends: dict[str, NixlBackend] = {}
    pools: dict[str, tuple[torch.Tensor, int | None]] = {}
    inbox: dict[str, dict[str, list[bytes]]] = {}

    def open_(name: str, geometry: dict, seed: int | None) -> bytes:
        g = KVGeometry.from_dict(geometry)
        backend = NixlBackend(name)
        pool = _pool(g, seed)
        backend.register(pool, g)
        backends[name], pools[name], inbox[name] = backend, (pool, seed), {}
        return backend.agent_metadata()

    def add_peer(name: str, peer: str, metadata: bytes, geometry: dict) -> None:
        backends[name].add_peer(peer, metadata, KVGeometry.from_dict(geometry))

    def read(name: str, peer: str, remote: list[int], local: list[int], notif: bytes | None,
             timeout_s: float) -> None:
        backend = backends[name]
        handle: TransferHandle = backend.start_read(peer, remote, local, notif)
        backend.wait(handle, timeout_s)

    def verify(name: str, peer_geometry: dict, peer_seed: int, remote: list[int],
               local: list[int], others_untouched: bool = True) -> str:
        pool, own_seed = pools[name]
        source = _pool(KVGeometry.from_dict(peer_geometry), peer_seed)
        before = _pool(KVGeometry.of_tensor(pool), own_seed)
        for r, dst in zip(remote, local, strict=True):
            if not _same_bytes(pool[:, :, dst], source[:, :, r]):
                return f"local block {dst} is not remote block {r}"
        for b in sorted(set(range(pool.shape[2])) - set(local)) if others_untouched else []:
            if not _same_bytes(pool[:, :, b], before[:, :, b]):
                return f"local block {b} was not read into but changed"
        return "ok"

    def notes(name: str) -> dict[str, list[bytes]]:
        got, inbox[name] = inbox[name], {}
        return got

    def close(name: str) -> None:
        backends.pop(name).close()
        del pools[name], inbox[name]

    commands = {"open": open_, "add_peer": add_peer, "read": read, "verify": verify,
                "notes": notes, "close": close,
                "notify": lambda name, peer, msg: backends[name].notify(peer, msg)}
    while True:
        if conn.poll(0.001):
            cmd, *args = conn.recv()
            if cmd == "quit":
                for backend in backends.values():
                    backend.close()
                conn.send(("ok", None, 0.0))
                return
            start = time.monotonic()
            try:
                conn.send(("ok", commands[cmd](*args), time.monotonic() - start))
            except Exception as exc:
                conn.send((type(exc).__name__, str(exc), time.monotonic() - start))
        for name, backend in backends.items():  # the passive side's progress
            for peer, msgs in backend.new_notifications().items():
                inbox[name].setdefault(peer, []).extend(msgs)


class Worker:
    """The test's end of one worker process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.metadata: dict[str, bytes] = {}

    def call(self, *cmd: Any, timeout: float = 30.0) -> tuple[str, Any, float]:
        """(outcome, value or error message, seconds the command took in the worker);
        outcome is "ok" or the exception's class name."""
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            pytest.fail(f"worker did not answer {cmd[0]!r} within {timeout} s")
        return self.conn.recv()

    def ok(self, *cmd: Any, timeout: float = 30.0) -> Any:
        outcome, value, _ = self.call(*cmd, timeout=timeout)
        assert outcome == "ok", f"{cmd[0]} raised {outcome}: {value}"
        return value

    def wait_notes(self, name: str, peer: str, until: bytes, timeout: float = 5.0) -> list[bytes]:
        """Notifications `name` got from `peer`, collected until `until` is among them."""
        got: list[bytes] = []
        deadline = time.monotonic() + timeout
        while until not in got and time.monotonic() < deadline:
            got += self.ok("notes", name).get(peer, [])
            time.sleep(0.01)
        return got

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)  # also ends a SIGSTOPped process
        self.proc.join(10)

    def quit(self) -> int | None:
        """Close every backend and exit; the exit code (0 unless NIXL/UCX crashed)."""
        self.call("quit")
        self.proc.join(10)
        return self.proc.exitcode


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """Start workers with `workers.append(Worker())`; all are killed at teardown."""
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


@pytest.fixture(scope="module")
def decode() -> Iterator[Worker]:
    w = Worker()
    try:
        yield w
        assert w.quit() == 0, "decode worker crashed while closing its NIXL backends"
    finally:
        w.kill()


@pytest.fixture(scope="module")
def prefill() -> Iterator[Worker]:
    """Serves `prefill-f32` (F32, seed 1) and `prefill-bf16`."""
    w = Worker()
    try:
        w.metadata["prefill-f32"] = w.ok("open", "prefill-f32", F32.to_dict(), 1)
        yield w
    finally:
        w.kill()


def test_geometry_names_every_mismatched_field() -> None:
    other = KVGeometry(3, 99, 32, 4, 32, "bfloat16")
    why = F32.incompatibility(other)
    assert why is not None
    assert "block_size is 16 here but 32 on the peer" in why
    assert "num_kv_heads is 2 here but 4 on the peer" in why
    assert "dtype is 'float32' here but 'bfloat16'" in why
    assert "num_blocks" not in why and "num_layers" not in why
    assert F32.incompatibility(KVGeometry(3, 7, 16, 2, 32, "float32")) is None
    assert F32.chunk_bytes == 16 * 2 * 32 * 4 and F32.block_bytes == 6 * F32.chunk_bytes
    assert KVGeometry.from_dict(F32.to_dict()) == F32
    with pytest.raises(ValueError, match="dtype"):
        KVGeometry(1, 1, 1, 1, 1, "int7")
    with pytest.raises(ValueError, match="block_size"):
        KVGeometry(1, 1, 0, 1, 1, "float32")
    with pytest.raises(TransferError, match=r"not a NixlBackend\.agent_metadata"):
        _PeerCard.decode(b"garbage", "p")


def test_scattered_read_moves_exactly_those_blocks(prefill: Worker, decode: Worker) -> None:
    mine = KVGeometry(3, 24, 16, 2, 32, "float32")  # fewer blocks than the prefill pool
    decode.ok("open", "decode-f32", mine.to_dict(), 2)
    decode.ok("add_peer", "decode-f32", "prefill-f32", prefill.metadata["prefill-f32"],
              F32.to_dict())
    remote, local = [3, 17, 18, 39, 0, 25], [20, 1, 2, 5, 23, 9]
    decode.ok("read", "decode-f32", "prefill-f32", remote, local, b"req-1 pulled", 10.0)
    assert decode.ok("verify", "decode-f32", F32.to_dict(), 1, remote, local) == "ok"
    assert prefill.wait_notes("prefill-f32", "decode-f32", b"req-1 pulled") == [b"req-1 pulled"]

    # A warm connection: the next read and a bare notification are quick.
    outcome, _, took = decode.call("read", "decode-f32", "prefill-f32", [5], [0], b"req-2", 5.0)
    assert outcome == "ok" and took < 1.0
    decode.ok("notify", "decode-f32", "prefill-f32", b"req-3 all cached")
    assert prefill.wait_notes("prefill-f32", "decode-f32", b"req-3 all cached") == [
        b"req-2", b"req-3 all cached"]

    outcome, msg, _ = decode.call("read", "decode-f32", "prefill-f32", [40], [0], None, 5.0)
    assert outcome == "ValueError" and "block id 40" in msg
    outcome, msg, _ = decode.call("read", "decode-f32", "prefill-f32", [1, 2], [4, 4], None, 5.0)
    assert outcome == "ValueError" and "twice" in msg
    decode.ok("close", "decode-f32")


def test_bfloat16_pool(prefill: Worker, decode: Worker) -> None:
    theirs = KVGeometry(2, 30, 16, 4, 64, "bfloat16")
    metadata = prefill.ok("open", "prefill-bf16", theirs.to_dict(), 5)
    decode.ok("open", "decode-bf16", KVGeometry(2, 12, 16, 4, 64, "bfloat16").to_dict(), 6)
    decode.ok("add_peer", "decode-bf16", "prefill-bf16", metadata, theirs.to_dict())
    remote, local = [29, 0, 14, 15, 16, 2], [0, 11, 3, 4, 5, 7]
    decode.ok("read", "decode-bf16", "prefill-bf16", remote, local, b"bf16 done", 10.0)
    assert decode.ok("verify", "decode-bf16", theirs.to_dict(), 5, remote, local) == "ok"
    assert prefill.wait_notes("prefill-bf16", "decode-bf16", b"bf16 done") == [b"bf16 done"]
    decode.ok("close", "decode-bf16")
    prefill.ok("close", "prefill-bf16")


def test_incompatible_geometry_is_refused_by_add_peer(prefill: Worker, decode: Worker) -> None:
    metadata = prefill.metadata["prefill-f32"]
    for field, geometry in [
        ("num_kv_heads", KVGeometry(3, 24, 16, 4, 32, "float32")),
        ("dtype", KVGeometry(3, 24, 16, 2, 32, "float16")),
    ]:
        decode.ok("open", "decode-odd", geometry.to_dict(), None)
        outcome, msg, _ = decode.call("add_peer", "decode-odd", "prefill-f32", metadata,
                                      F32.to_dict())
        assert outcome == "GeometryMismatch" and field in msg and "prefill-f32" in msg, msg
        outcome, msg, _ = decode.call("read", "decode-odd", "prefill-f32", [0], [0], None, 5.0)
        assert outcome == "TransferError" and "unknown peer" in msg
        decode.ok("close", "decode-odd")

    # A geometry that does not describe the pool the metadata registered is refused too,
    # as is metadata passed under another agent's name.
    decode.ok("open", "decode-odd", F32.to_dict(), None)
    block_32 = KVGeometry(3, 40, 32, 2, 32, "float32")
    outcome, msg, _ = decode.call("add_peer", "decode-odd", "prefill-f32", metadata,
                                  block_32.to_dict())
    assert outcome == "GeometryMismatch" and "block_size" in msg
    wrong_count = KVGeometry(3, 41, 16, 2, 32, "float32")
    outcome, msg, _ = decode.call("add_peer", "decode-odd", "prefill-f32", metadata,
                                  wrong_count.to_dict())
    assert outcome == "GeometryMismatch" and "described as" in msg
    outcome, msg, _ = decode.call("add_peer", "decode-odd", "prefill-x", metadata, F32.to_dict())
    assert outcome == "TransferError" and "belongs to agent 'prefill-f32'" in msg
    decode.ok("close", "decode-odd")


# A pool big enough that a READ of all of it takes milliseconds: 32 MiB.
BIG = KVGeometry(num_layers=8, num_blocks=128, block_size=16, num_kv_heads=4, head_dim=64,
                 dtype="float32")


@pytest.mark.slow
def test_frozen_peer_times_out_then_recovers(workers: list[Worker], decode: Worker) -> None:
    frozen = Worker()
    workers.append(frozen)
    metadata = frozen.ok("open", "prefill-frozen", BIG.to_dict(), 3)
    decode.ok("open", "decode-big", BIG.to_dict(), None)
    decode.ok("add_peer", "decode-big", "prefill-frozen", metadata, BIG.to_dict())
    decode.ok("read", "decode-big", "prefill-frozen", [0], [0], b"warm", 10.0)

    os.kill(frozen.proc.pid, signal.SIGSTOP)
    every = list(range(BIG.num_blocks))
    deadline = 1.0
    outcome, msg, took = decode.call("read", "decode-big", "prefill-frozen", every, every,
                                     b"while frozen", deadline, timeout=deadline + 10)
    assert outcome == "TransferTimeout", (outcome, msg)
    assert "prefill-frozen" in msg and deadline <= took < deadline + 0.5

    os.kill(frozen.proc.pid, signal.SIGCONT)
    decode.ok("add_peer", "decode-big", "prefill-frozen", metadata, BIG.to_dict())  # no-op
    decode.ok("read", "decode-big", "prefill-frozen", every[::-1], every, b"thawed", 10.0)
    assert decode.ok("verify", "decode-big", BIG.to_dict(), 3, every[::-1], every) == "ok"
    assert b"thawed" in frozen.wait_notes("prefill-frozen", "decode-big", b"thawed")
    decode.ok("close", "decode-big")


@pytest.mark.slow
def test_killed_peer_fails_fast_and_its_restart_is_readable(workers: list[Worker],
                                                            decode: Worker) -> None:
    first = Worker()
    workers.append(first)
    metadata = first.ok("open", "prefill-mortal", BIG.to_dict(), 7)
    decode.ok("open", "decode-big", BIG.to_dict(), None)
    decode.ok("add_peer", "decode-big", "prefill-mortal", metadata, BIG.to_dict())
    decode.ok("read", "decode-big", "prefill-mortal", [0], [0], b"warm", 10.0)

    first.kill()
    every = list(range(BIG.num_blocks))
    outcome, msg, took = decode.call("read", "decode-big", "prefill-mortal", every, every,
                                     b"dead", 5.0, timeout=15)
    assert outcome in ("TransferError", "TransferTimeout"), (outcome, msg)
    assert "prefill-mortal" in msg
    assert took < 1.0 or outcome == "TransferTimeout"

    second = Worker()  # same agent name, new process, new metadata
    workers.append(second)
    fresh = second.ok("open", "prefill-mortal", BIG.to_dict(), 8)
    assert fresh != metadata
    decode.ok("add_peer", "decode-big", "prefill-mortal", fresh, BIG.to_dict())
    remote, local = every[:64], every[64:]
    decode.ok("read", "decode-big", "prefill-mortal", remote, local, b"again", 10.0)
    # Blocks 0..63 may hold the warm read and whatever the failed read left there.
    assert decode.ok("verify", "decode-big", BIG.to_dict(), 8, remote, local, False) == "ok"
    assert second.wait_notes("prefill-mortal", "decode-big", b"again") == [b"again"]
    decode.ok("close", "decode-big")
