"""`tandem refit --adapter NAME[@VERSION]=URI` and `--remove-adapter NAME`: change one LoRA
adapter on every engine of a running `tandem serve`, one engine at a time, serving on.

It calls each engine's admin API (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`
at the admin URLs and with the token of the stack's `stack.json`), not the router's
endpoint of the same name: the router does the call on every engine at once and rolls
nothing back (router/adapters.py), while one engine at a time keeps the others on the
previous version until this one serves the new one, and a reply per engine says exactly
which engines a failure must put back. A load is in place: the engine reads and checks the
folder, then serves the name at the new version, and requests already running finish under
the old one; nothing drains or pauses, and the router routes the name to every engine
serving some version of it throughout.

A change (`plan_change`, pure) is checked before any engine is touched: the name and
version, the folder inside the stack's weights roots, every engine answering, RUNNING and
started with `--enable-lora`, the router reachable with the API key (`--api-key`), and the
folder of every version the change might have to put back known. Then, per engine in the
stack's order: the call, its reply listing the new identity, and the router seeing it
(`GET /v1/engines`) before the next engine. Once every engine serves the new version, a
one-token completion under the name through the router verifies it end to end (the router
is the one way to run a request under an adapter: engines take requests over ZMQ only).

On a failure (the engine's refusal — bad shapes, a missing file —, no answer, the router not
seeing it, the completion failing) every engine already changed, and one that may have
been, is put back: loaded again at its previous version of the name, or the name unloaded
where it was new. The command then exits 1 with the engine's error. A removal unloads
engine by engine and rolls nothing back: unloading is idempotent (an engine that no longer
serves the name answers 404, counted as done), so a failed removal is finished by running
it again.

Where a previous version's folder comes from: the engines report identities
(`name@version`), not folders, so the stack keeps a record: `tandem serve` writes its
start-up `--lora-modules` into `stack.json`, and this command keeps `adapters.json` beside
it (each name's identity and folder after every change it made). A version loaded some
other way (the admin API directly) has no known folder: changing it is refused before
anything is touched, naming the fix.

One change at a time per stack: an flock on `adapters.lock` in the stack's log dir (held
until exit, released by the kernel if the process dies). Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import httpx
from msgspec import UNSET

from tandem_engine.admin_wire import EngineStatus, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tandem_engine.bench.client import resolve_api_key
from tandem_engine.cli.stack_claim import default_log_dir, read_stack
from tandem_engine.errors import RequestRejected
from tandem_engine.fleet import AdminError, EngineAdmin
from tandem_engine.lifecycle import EngineState
from tandem_engine.lora_request import LoRARequest, parse_lora_module
from tandem_engine.weights import local_checkpoint_path, nul_problem

LEDGER_FILE = "adapters.json"
LOCK_FILE = "adapters.lock"
CALL_TIMEOUT_S = 120.0  # one engine's load (it reads and checks the folder) or unload
ROUTER_SEES_TIMEOUT_S = 30.0  # the router's view of an engine catching up with a change
VERIFY_TIMEOUT_S = 60.0  # the one-token completion under the adapter
VERIFY_PROMPT = "Hello"


class AdapterChangeFailed(Exception):
    """A step of a change failed; the message names the engine, the step and the cause."""


# ---- the input ------------------------------------------------------------------------------


def parse_adapter(spec: str) -> LoRARequest:
    """`--adapter NAME[@VERSION]=URI` (URI: file:///folder, or a path) as the adapter to
    serve, its folder resolved here; ValueError naming the input."""
    name, sep, uri = spec.partition("=")
    if not sep or not name or not uri:
        raise ValueError(f"--adapter {spec!r}: write NAME=URI or NAME@VERSION=URI, e.g. "
                         "--adapter sql@2=file:///adapters/sql-v2")
    name, _, version = name.partition("@")
    path = local_checkpoint_path(uri, what="--adapter") if "://" in uri else uri
    if (problem := nul_problem(path)) is not None:
        raise ValueError(f"--adapter {spec!r}: {problem}")
    try:
        return LoRARequest(name, str(Path(path).resolve()), version or "1")
    except RequestRejected as exc:
        raise ValueError(f"--adapter {spec!r}: {exc}") from None


def check_inside_roots(lora: LoRARequest, roots: Sequence[str] | None, port: int) -> None:
    """ValueError unless the adapter's folder lies inside the stack's weights roots (the
    engines read run-time loads only there); `roots` None: the stack records none."""
    if roots is None or any(Path(lora.lora_path).is_relative_to(Path(root).resolve())
                            for root in roots):
        return
    raise ValueError(f"--adapter {lora.lora_name}: {lora.lora_path} is outside the weights "
                     f"roots of the stack on port {port} ({' or '.join(roots)}): put the "
                     "adapter there, or restart the stack with `tandem serve --weights-root "
                     "DIR` (repeatable) to allow the folder DIR holding it; no engine was "
                     "touched")


# ---- what the stack serves and has served ------------------------------------------------


class AdapterLedger:
    """`adapters.json` in the stack's log dir: each name's identity and folder after the
    last change this command made (None: removed), over the start-up `--lora-modules`
    that `tandem serve` records in `stack.json`."""

    def __init__(self, log_dir: Path, stack: dict[str, Any]) -> None:
        self.path = log_dir / LEDGER_FILE
        self.startup = [parse_lora_module(spec) for spec in stack.get("lora_modules") or ()]
        try:
            data = json.loads(self.path.read_text())
            self.changed: dict[str, LoRARequest | None] = {
                name: None if entry is None else LoRARequest(name, entry["path"],
                                                             entry["version"])
                for name, entry in data["adapters"].items()}
        except FileNotFoundError:
            self.changed = {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"cannot read the stack's adapter record {self.path} ({exc}): "
                             "fix or delete it") from exc

    def current(self, name: str) -> LoRARequest | None:
        """The version of `name` the stack last set (None: never served, or removed)."""
        if name in self.changed:
            return self.changed[name]
        return next((lora for lora in self.startup if lora.lora_name == name), None)

    def modules(self) -> list[str]:
        """What the stack serves now, as `--lora-modules` values (NAME@VERSION=PATH): the
        start-up ones with this command's changes over them. A restarted engine starts
        with these (`tandem serve`), not with the start-up list alone."""
        names = [lora.lora_name for lora in self.startup]
        names += [name for name in self.changed if name not in names]
        current = [self.current(name) for name in names]
        return [f"{lora.identity}={lora.lora_path}" for lora in current if lora is not None]

    def folders(self) -> dict[str, str]:
        """identity -> folder of every version the stack has a record of."""
        out = {lora.identity: lora.lora_path for lora in self.startup}
        out.update({lora.identity: lora.lora_path for lora in self.changed.values() if lora})
        return out

    def record(self, name: str, lora: LoRARequest | None) -> None:
        self.changed[name] = lora
        body = {"adapters": {n: None if lora is None else {"version": lora.lora_version,
                                                            "path": lora.lora_path}
                             for n, lora in sorted(self.changed.items())}}
        tmp = self.path.with_name(f".{LEDGER_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        tmp.replace(self.path)


@contextlib.contextmanager
def change_lock(log_dir: Path) -> Iterator[None]:
    """Hold `adapters.lock` for one change; RuntimeError when another change holds it."""
    fd = os.open(log_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise RuntimeError(f"another `tandem refit --adapter` (pid {holder}) is changing "
                               "this stack's adapters: wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


# ---- the plan (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineAdapterState:
    """One engine as the change sees it: the identity it serves of the name, if any."""

    name: str
    admin_url: str
    serves: str | None  # "name@version", or None


@dataclass(frozen=True)
class AdapterPlan:
    """A change of one adapter name: the target (None: remove it) and, per engine in the
    order they are changed, what a rollback puts back there (None: unload the name; a
    removal rolls nothing back)."""

    name: str
    target: LoRARequest | None
    engines: tuple[EngineAdapterState, ...]
    restore: dict[str, LoRARequest | None]

    def describe(self) -> str:
        before = sorted({e.serves or "(none)" for e in self.engines})
        after = (f"{self.target.identity} ({self.target.lora_path})" if self.target
                 else "removed")
        return (f"adapter {self.name}: {', '.join(before)} → {after}, on "
                f"{len(self.engines)} engine(s) one at a time")


def engine_adapter_state(name: str, admin_url: str, status: EngineStatus | None,
                         adapter: str) -> EngineAdapterState:
    """What an engine's `/v1/state` says of `adapter`; ValueError when the engine cannot
    take part in a change (no answer, not RUNNING, LoRA off)."""
    if status is None:
        raise ValueError(f"engine {name} does not answer its admin API at {admin_url}; is "
                         "the stack running (and healthy)? No engine was touched")
    if status.state is not EngineState.RUNNING:
        raise ValueError(f"engine {name} is {status.state.value} (a weights refit under way?): "
                         "wait until every engine serves, then run this again; no engine "
                         "was touched")
    if status.loras is UNSET:
        raise ValueError(f"engine {name} serves no LoRA adapters: restart the stack with "
                         "`tandem serve --enable-lora` (and --max-loras, --max-lora-rank to "
                         "fit them); no engine was touched")
    serves = next((i for i in status.loras if i.partition("@")[0] == adapter), None)
    return EngineAdapterState(name, admin_url, serves)


def plan_change(name: str, target: LoRARequest | None,
                engines: Sequence[EngineAdapterState], ledger: AdapterLedger) -> AdapterPlan:
    """The change, or ValueError (nothing touched) when it cannot be made safely.

    What a rollback restores on an engine is the version it serves now; an engine already
    on the target (an interrupted change, run again) gets the version the stack last set
    instead, when that is another. A version whose folder the stack has no record of
    cannot be restored, so changing it is refused."""
    if target is None:
        if not any(e.serves for e in engines):
            raise ValueError(f"--remove-adapter {name}: no engine of the stack serves it")
        return AdapterPlan(name, None, tuple(engines), {})
    folders = ledger.folders()
    folders.setdefault(target.identity, target.lora_path)
    last = ledger.current(name)
    restore: dict[str, LoRARequest | None] = {}
    for e in engines:
        identity = e.serves
        if identity == target.identity and last is not None:
            identity = last.identity
        if identity is None:
            restore[e.name] = None
            continue
        if identity not in folders:
            raise ValueError(
                f"--adapter {target.identity}: engine {e.name} serves {identity}, and this "
                "stack has no record of the folder it was loaded from (loaded through the "
                "admin API, not `tandem serve --lora-modules` or `tandem refit --adapter`), "
                "so a failed change could not put it back. Load that version with `tandem "
                f"refit --adapter {identity}=ITS_FOLDER` first, or remove it with `tandem "
                f"refit --remove-adapter {name}`; no engine was touched")
        version = identity.partition("@")[2]
        restore[e.name] = LoRARequest(name, folders[identity], version)
    return AdapterPlan(name, target, tuple(engines), restore)


# ---- carrying it out -----------------------------------------------------------------------


class Router(Protocol):
    """What a change needs of the stack's router (`StackRouter`; tests fake it)."""

    async def wait_serving(self, engine: str, name: str, identity: str | None,
                           timeout: float) -> None: ...

    async def complete_one(self, name: str) -> None: ...


class StackRouter:
    """The stack's router over HTTP, with the API key its clients use (if it has any)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        base = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base, headers=headers, timeout=10.0)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def served_model(self) -> str:
        """The base model's name (`GET /v1/models`); ValueError when the router refuses
        the key or does not answer."""
        try:
            r = await self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ValueError(f"the stack's router at {self.http.base_url} does not answer "
                             f"({type(exc).__name__}); is the stack running?") from None
        if r.status_code in (401, 403):
            raise ValueError(f"the stack's router at {self.http.base_url} refuses this "
                             f"command's API key (HTTP {r.status_code}): pass one of the "
                             "stack's keys with --api-key (or $TANDEM_API_KEY); no engine "
                             "was touched")
        try:
            return str(r.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"the stack's router at {self.http.base_url}: GET /v1/models "
                             f"answered HTTP {r.status_code} {r.text[:200]!r}") from None

    async def wait_serving(self, engine: str, name: str, identity: str | None,
                           timeout: float) -> None:
        """Wait until the router sees `engine` serve `identity` of `name` (None: serve no
        version of it); AdapterChangeFailed after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        seen: Any = "no answer"
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await self.http.get("/v1/engines")
                entry = next((e for e in r.json().get("engines", [])
                              if e.get("engine_id") == engine), None)
                seen = None if entry is None else [
                    i for i in entry.get("loras", []) if i.partition("@")[0] == name]
                if entry is not None and entry.get("alive") and seen == (
                        [identity] if identity else []):
                    return
            if time.monotonic() > deadline:
                raise AdapterChangeFailed(
                    f"the router did not see engine {engine} serve "
                    f"{identity or f'no version of {name}'} within {timeout:g} s (it sees "
                    f"{'no such engine' if seen is None else seen})")
            await asyncio.sleep(0.1)

    async def complete_one(self, name: str) -> None:
        """A one-token completion under adapter `name`; AdapterChangeFailed unless it
        answers one token."""
        body = {"model": name, "prompt": VERIFY_PROMPT, "max_tokens": 1, "temperature": 0,
                "ignore_eos": True}
        try:
            r = await self.http.post("/v1/completions", json=body, timeout=VERIFY_TIMEOUT_S)
            tokens = (r.json().get("usage") or {}).get("completion_tokens")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise AdapterChangeFailed(f"a one-token completion under {name} through the "
                                      f"router failed: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200 or tokens != 1:
            raise AdapterChangeFailed(f"a one-token completion under {name} through the "
                                      f"router answered HTTP {r.status_code}: "
                                      f"{r.text[:300]}")


class _Log:
    def __init__(self, out: TextIO) -> None:
        self.out, self.started = out, time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {text}", file=self.out, flush=True)


async def _set(admin: EngineAdmin, router: Router, engine: EngineAdapterState, name: str,
               lora: LoRARequest | None) -> None:
    """Make `engine` serve `lora` under `name` (None: no version of it), and wait for the
    router to see it. AdminError or AdapterChangeFailed."""
    if lora is None:
        try:
            await admin.call(engine.name, engine.admin_url, "/v1/unload_lora_adapter",
                             UnloadLoRAAdapterRequest(lora_name=name).to_body(),
                             timeout=CALL_TIMEOUT_S)
        except AdminError as exc:
            if exc.status != 404:  # 404: it serves no version of it: done
                raise
    else:
        reply = await admin.call(engine.name, engine.admin_url, "/v1/load_lora_adapter",
                                 LoadLoRAAdapterRequest(lora_name=name,
                                                        lora_path=lora.lora_path,
                                                        lora_version=lora.lora_version
                                                        ).to_body(),
                                 timeout=CALL_TIMEOUT_S)
        if lora.identity not in (reply.get("loras") or []):
            raise AdapterChangeFailed(f"engine {engine.name} answered the load but does not "
                                      f"list {lora.identity} among its adapters "
                                      f"({reply.get('loras')})")
    await router.wait_serving(engine.name, name, lora.identity if lora else None,
                              ROUTER_SEES_TIMEOUT_S)


async def apply_change(plan: AdapterPlan, admin: EngineAdmin, router: Router,
                       out: TextIO, err: TextIO) -> int:
    """Carry out `plan` (see the module docstring); the exit status: 0 done (and verified),
    1 failed (a load: rolled back)."""
    log = _Log(out)
    name, target = plan.name, plan.target
    print(plan.describe(), file=out, flush=True)
    touched: list[EngineAdapterState] = []  # engines that may have changed, in order
    try:
        for engine in plan.engines:
            touched.append(engine)
            await _set(admin, router, engine, name, target)
            log(f"{engine.name}: serves {target.identity}" if target
                else f"{engine.name}: no longer serves {name}")
        if target is not None:
            await router.complete_one(name)
            log(f"verified: a one-token completion under {name} through the router")
    except (AdminError, AdapterChangeFailed) as exc:
        if target is None:
            left = [e.name for e in plan.engines[len(touched) - 1:]]
            print(f"tandem refit: removing adapter {name} failed: {exc}. "
                  f"{', '.join(left)} may still serve it: run the same command again",
                  file=err, flush=True)
            return 1
        if isinstance(exc, AdminError) and exc.status is not None and exc.status >= 400:
            touched.pop()  # the engine refused: it serves what it did
        then = await _roll_back(plan, touched, admin, router, log)
        print(f"tandem refit: adapter {target.identity} failed: {exc}. {then}", file=err,
              flush=True)
        return 1
    took = time.monotonic() - log.started
    if target is None:
        print(f"adapter {name} removed from every engine in {took:.1f} s", file=out,
              flush=True)
    else:
        print(f"adapter change succeeded: every engine serves {target.identity}, verified, "
              f"in {took:.1f} s", file=out, flush=True)
    return 0


async def _roll_back(plan: AdapterPlan, touched: list[EngineAdapterState],
                     admin: EngineAdmin, router: Router, log: Callable[[str], None]) -> str:
    """Put each touched engine back (latest first); what happened, in words."""
    if not touched:
        return "No engine had changed: every engine serves what it did."
    back, stuck = [], []
    for engine in reversed(touched):
        lora = plan.restore[engine.name]
        try:
            await _set(admin, router, engine, plan.name, lora)
        except (AdminError, AdapterChangeFailed) as exc:
            stuck.append(f"{engine.name} ({exc})")
            continue
        what = lora.identity if lora else f"no {plan.name}"
        log(f"{engine.name}: rolled back, serves {what}")
        back.append(f"{engine.name} serves {what}")
    text = f"Rolled back: {'; '.join(back)} again." if back else ""
    if stuck:
        text += (f" Could not put back: {'; '.join(stuck)}: fix the cause and run "
                 "`tandem refit --adapter` with the previous version")
    return text.strip()


# ---- the command -----------------------------------------------------------------------------


async def _change(args: argparse.Namespace, stack: dict[str, Any], ledger: AdapterLedger,
                  name: str, target: LoRARequest | None, out: TextIO, err: TextIO) -> int:
    admin = EngineAdmin(stack.get("admin_token"))
    router = StackRouter(stack["router"], resolve_api_key(args.api_key))
    try:
        base = await router.served_model()
        if name == base:
            raise ValueError(f"an adapter cannot be named {base!r}, the served model's "
                             "name: requests name it to run without one")
        states = []
        for e in stack["engines"]:
            status = await admin.probe(e["admin_url"])
            states.append(engine_adapter_state(e["name"], e["admin_url"], status, name))
        plan = plan_change(name, target, states, ledger)
        code = await apply_change(plan, admin, router, out, err)
        if code == 0:
            ledger.record(name, target)
        return code
    finally:
        await router.aclose()
        await admin.close()


def refit_adapter(args: argparse.Namespace, out: TextIO | None = None,
                  err: TextIO | None = None) -> int:
    """`tandem refit --adapter` / `--remove-adapter`: ValueError for bad input (the CLI
    exits 2; nothing touched), else the exit status."""
    target = parse_adapter(args.adapter) if args.adapter else None
    name = target.lora_name if target else args.remove_adapter
    if target is None:
        LoRARequest(name, "-")  # the name's own check (RequestRejected is a ValueError)
    stack = read_stack(args.port)
    roots = stack.get("weights_roots")
    if target is not None:
        check_inside_roots(target, roots if isinstance(roots, list) else None, args.port)
    log_dir = default_log_dir(args.port)
    out, err = out or sys.stdout, err or sys.stderr
    with change_lock(log_dir):
        ledger = AdapterLedger(log_dir, stack)
        try:
            return asyncio.run(_change(args, stack, ledger, name, target, out, err))
        except KeyboardInterrupt:
            print(f"tandem refit: interrupted; engines may serve different versions of "
                  f"{name}: run the same command again to finish", file=err, flush=True)
            return 130
