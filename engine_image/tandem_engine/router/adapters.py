"""vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` on the router: the
call done on every engine of the pool.

The router is where a vLLM client sends these calls, and the one place that reaches every
engine (a Kubernetes pool's engines are not reachable from outside). It hands the call to
each connected engine over the ZMQ connection it already holds (LORA_LOAD / LORA_UNLOAD,
each answered by a LORA_REPLY within `engines.LORA_CALL_TIMEOUT`), all at once, and
answers 200 only when every engine did it; otherwise the first refusal in pool order, its
status (400 a bad adapter or LoRA off, 404 a name no engine serves, 503 an engine that did
not answer) and the engine's words, naming the engines that did it. Nothing is rolled
back: a load is idempotent (the same name, version and path again just reads it again),
so the caller fixes the problem and repeats the call, or unloads.

Who may call: these are admin calls, not API calls (`auth.py`): they need the pool's
admin token (`tandem-router --admin-token-file`, $TANDEM_ADMIN_TOKEN), not a client's API
key, since a load makes the engines read a folder of their filesystem and changes what
the whole pool serves, and API keys are handed to every client. Engines read only inside
their `--weights-root` (server/adapters.py), whoever asks.

What it does not do: an engine that is not connected at the time (restarting, or added
by discovery later) is not told, and comes up with its `--lora-modules` only. Routing
follows what each engine reports (its heartbeat's adapters), so requests for the adapter
never go there. The durable way to give every engine an adapter, one restarted or
added later included, is `--lora-modules` (in a pool, `spec.engine.args`; the operator
does not manage adapters yet).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from tandem_engine import protocol as p
from tandem_engine.admin_wire import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tandem_engine.errors import RequestRejected
from tandem_engine.lora_request import LoRARequest
from tandem_engine.router.engines import EngineClient, EnginePool, EngineUnavailable
from tandem_engine.router.request_errors import InvalidRequest


@dataclass(frozen=True)
class CallResult:
    """What the router answers: an HTTP status and vLLM's message (or the refusal)."""

    status: int
    message: str


def parse_load(body: Any, served_model_name: str) -> LoadLoRAAdapterRequest:
    """vLLM's load body, checked as the engines check it (InvalidRequest 400 naming the
    field): an adapter's name may not be the served model's."""
    request = _convert(body, LoadLoRAAdapterRequest, "/v1/load_lora_adapter",
                       '{"lora_name": NAME, "lora_path": PATH, "lora_version"?: VERSION}')
    try:
        LoRARequest(request.lora_name, request.lora_path, request.lora_version)
    except RequestRejected as exc:
        raise InvalidRequest(str(exc), "lora_name") from None
    if request.lora_name == served_model_name:
        raise InvalidRequest(f"a LoRA adapter cannot be named {served_model_name!r}, the "
                             "served model's name: requests name it to run without one",
                             "lora_name")
    return request


def parse_unload(body: Any) -> UnloadLoRAAdapterRequest:
    return _convert(body, UnloadLoRAAdapterRequest, "/v1/unload_lora_adapter",
                    '{"lora_name": NAME}')


def _convert(body: Any, kind: type[Any], path: str, shape: str) -> Any:
    try:
        return msgspec.convert(body, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"POST {path}: invalid body: {exc}; send {shape}") from None


async def load_everywhere(pool: EnginePool, request: LoadLoRAAdapterRequest) -> CallResult:
    """Load the adapter on every connected engine."""
    replies = await _everywhere(pool, lambda: p.LoadLoRA(
        uuid.uuid4().hex, request.lora_name, request.lora_path, request.lora_version))
    if isinstance(replies, CallResult):
        return replies
    failed = [(key, r) for key, r in replies if r.status != 200]
    if not failed:
        return CallResult(200, f"Success: LoRA adapter '{request.lora_name}' added "
                               "successfully.")
    return _refusal(failed[0], [key for key, r in replies if r.status == 200], "loaded")


async def unload_everywhere(pool: EnginePool, request: UnloadLoRAAdapterRequest
                            ) -> CallResult:
    """Unload the adapter from every connected engine: 200 when none serves it any more
    and one did, 404 when none did."""
    name = request.lora_name
    replies = await _everywhere(pool, lambda: p.UnloadLoRA(uuid.uuid4().hex, name))
    if isinstance(replies, CallResult):
        return replies
    done = [key for key, r in replies if r.status == 200]
    failed = [(key, r) for key, r in replies if r.status not in (200, 404)]
    if failed:
        return _refusal(failed[0], done, "unloaded")
    if not done:
        return CallResult(404, f"The lora adapter '{name}' cannot be found: no engine "
                               "serves it")
    return CallResult(200, f"Success: LoRA adapter '{name}' removed successfully.")


async def _everywhere(pool: EnginePool, message: Any
                      ) -> list[tuple[str, p.LoRAReply]] | CallResult:
    """The call on every connected engine at once, each reply by engine (a lost or
    silent engine's as a 503 reply); a CallResult when no engine is connected."""
    clients = [c for c in pool.clients if c.connected]
    if not clients:
        return CallResult(503, "no engine is connected to this router: nothing to load "
                               "the adapter on (GET /v1/engines)")
    replies = await asyncio.gather(*(_call(c, message()) for c in clients))
    return [(c.key, r) for c, r in zip(clients, replies, strict=True)]


async def _call(client: EngineClient, message: p.LoadLoRA | p.UnloadLoRA) -> p.LoRAReply:
    try:
        return await client.lora_call(message)
    except EngineUnavailable as exc:
        return p.LoRAReply(message.call_id, 503, str(exc))


def _refusal(failed: tuple[str, p.LoRAReply], done: list[str], verb: str) -> CallResult:
    key, reply = failed
    also = f" ({verb} on {', '.join(done)})" if done else ""
    return CallResult(reply.status, f"engine {key}: {reply.message}{also}")
