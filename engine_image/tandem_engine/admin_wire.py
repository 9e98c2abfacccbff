"""The engine admin HTTP API's bodies and replies, as msgspec structs, in one module.

The admin API (`server/admin.py`) decodes its request bodies into these structs and
builds every `GET /v1/state` (and the state every lifecycle call answers with) as an
`EngineStatus`; its one client (`fleet/admin.py`, used by the operator, `tandem refit`
and `tandem serve`) sends the same request structs and decodes the same status. A refit
is one `RefitRequest` from the fleet's transaction to `LLMEngine.refit`.

The JSON is the wire of every engine version in a pool, so it only ever grows: a field
is added with a default (an older engine's reply still decodes; an older client ignores
the new field), never renamed. Fields a reply may lack are `UNSET` and then left out
of the JSON altogether (the state of an engine still loading its checkpoint has no KV
numbers; a running engine's has no `loading`). Torch-free: the operator imports it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from tandem_engine.lifecycle import EngineRole, EngineState, KVMode

URI = Annotated[str, Meta(min_length=1, max_length=4096)]


class AdminBodyError(ValueError):
    """An admin request body that does not decode; the message names the call and the
    field (`$.epoch`) and what it must be."""


# ---- requests ---------------------------------------------------------------------------------


class AdminRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request body of the admin API."""

    def to_body(self) -> dict[str, Any]:
        """The JSON object the client sends."""
        return msgspec.to_builtins(self)


class SuspendRequest(AdminRequest):
    """`POST /v1/suspend`: what happens to the KV cache."""

    mode: KVMode = KVMode.PERSIST


class RefitRequest(AdminRequest):
    """`POST /v1/refit`: the checkpoint to load and the name the fleet knows it by.

    `version` None: the engine names it by `uri`. `epoch` None: the engine's epoch + 1 (a
    fleet numbers its refits pool-wide, so every engine of one refit gets the same).
    `low_memory` streams the new weights into the serving ones tensor by tensor: device
    peak 1x the weights plus one tensor instead of old + new (`EngineStatus
    .last_refit_peak_bytes`). `draft_uri` (speculative method draft): the draft checkpoint
    to load with the new weights (None: the engine keeps its draft)."""

    uri: URI
    version: Annotated[str, Meta(max_length=253)] | None = None
    epoch: Annotated[int, Meta(ge=0, le=2**62)] | None = None
    low_memory: bool = False
    draft_uri: URI | None = None

    def to_body(self) -> dict[str, Any]:
        """The JSON body: `draft_uri` only when there is one, so an engine that runs no
        draft gets the body it always did."""
        body = msgspec.to_builtins(self)
        if self.draft_uri is None:
            del body["draft_uri"]
        return body


CANARY_DEFAULT_TOKEN_IDS = (1, 2, 3, 4, 5, 6, 7, 8)


class CanaryRequest(AdminRequest):
    """`POST /v1/canary`: a text (tokenized by the engine) or token ids, and how many
    greedy tokens to make within `timeout` seconds."""

    prompt: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    prompt_token_ids: Annotated[list[int], Meta(min_length=2, max_length=256)] = (
        msgspec.field(default_factory=lambda: list(CANARY_DEFAULT_TOKEN_IDS)))
    max_tokens: Annotated[int, Meta(ge=1, le=64)] = 4
    timeout: Annotated[float, Meta(gt=0, le=600)] = 30.0
    # Under a LoRA adapter the engine serves (an adapter transaction's verification): its
    # name, and the version it must be at (refused otherwise).
    lora_name: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    lora_version: Annotated[str, Meta(min_length=1, max_length=64)] | None = None

    def to_body(self) -> dict[str, Any]:
        """The JSON body, naming the one prompt it carries (the text, else the ids), and
        the adapter only when there is one."""
        body = msgspec.to_builtins(self)
        del body["prompt_token_ids" if self.prompt is not None else "prompt"]
        for key in ("lora_name", "lora_version"):
            if body[key] is None:
                del body[key]
        return body


class LoadLoRAAdapterRequest(AdminRequest):
    """`POST /v1/load_lora_adapter` (vLLM's body): serve the PEFT folder `lora_path` under
    `lora_name` at `lora_version`. The engine reads it only inside its weights roots; the
    name and version are checked as `LoRARequest` checks them."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=128)]
    lora_path: URI
    lora_version: Annotated[str, Meta(min_length=1, max_length=64)] = "1"


class UnloadLoRAAdapterRequest(AdminRequest):
    """`POST /v1/unload_lora_adapter` (vLLM's body): stop serving `lora_name`."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=128)]


def decode_body(call: str, body: bytes, kind: type[AdminRequest], *,
                optional: bool = False) -> Any:
    """The struct `kind` from an admin request's JSON `body`, or AdminBodyError naming
    the `call` and the field. With `optional`, an empty body (or JSON null) is the
    struct's defaults. Like the API's earlier validator, a number or boolean given as a
    string is accepted ("3", "true"); unknown fields are ignored."""
    if optional and body.strip() in (b"", b"null"):
        return kind()
    try:
        return msgspec.json.decode(body, type=kind, strict=False)
    except msgspec.ValidationError as exc:
        raise AdminBodyError(f"{call}: invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise AdminBodyError(f"{call}: the body is not JSON: {exc}") from None


# ---- replies ----------------------------------------------------------------------------------


class CanaryReply(msgspec.Struct, frozen=True, kw_only=True):
    """What `POST /v1/canary` answers: the greedy tokens, the prompt's mean negative
    log-likelihood per token (nats) and mean top-1 probability, and the weights it ran on."""

    token_ids: list[int]
    mean_nll: float
    top1_mass: float | None = None  # None from an engine that does not report it
    weight_version: str = ""
    weight_epoch: int = 0
    lora: str = ""  # the adapter's identity (name@version) it ran under; "" the base model


class DeviceStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's device and its memory (`model/device.DeviceReport`, field for field):
    device-wide on CUDA plus what this process's torch holds; on the CPU, used is the
    process's RSS and total the host's memory (`memory_source` says which)."""

    type: str
    index: int | None
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    memory_source: str
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None
    torch_peak_bytes: int | None = None


class LoadingProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far an engine's start-up load is (totals 0 until the checkpoint is validated)."""

    phase: str
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int = 0
    seconds: float = 0.0


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/state`, and the reply of every lifecycle call: one snapshot of an engine
    and its process. The state, weights and counts are what the fleet decides from;
    fields with defaults may be missing from an older engine's reply."""

    engine_id: str = ""
    incarnation: str | UnsetType = UNSET  # unset while loading
    role: EngineRole = EngineRole.MIXED
    model: str = ""
    state: EngineState
    weight_version: str
    weight_epoch: int
    weight_uri: str = ""
    num_running: int
    num_waiting: int
    kv_usage: float = 0.0
    draining: bool = False
    unhealthy: str | None = None  # why the engine needs a restart (its steps keep failing)
    # The KV numbers, unset while loading.
    pinned_blocks: int | UnsetType = UNSET  # KV kept for decode engines' pulls
    quarantined_blocks: int | UnsetType = UNSET  # KV a pull of unknown state may still write
    # Pulls on a decode engine: pulled_blocks, reused_blocks, bytes, failed, failed_<cause>,
    # recomputed.
    kv_pulls: dict[str, int] | UnsetType = UNSET
    device: DeviceStatus | UnsetType = UNSET
    weight_bytes: int | UnsetType = UNSET  # the serving weights on the device
    kv_cache_bytes: int | UnsetType = UNSET  # the KV pool (0 while suspended)
    kv_cache_dtype: str | UnsetType = UNSET  # its elements: float32, bfloat16 or float16
    # Peak weight memory of the last refit (None: none yet): old + new, or with
    # low_memory 1x the weights plus one tensor.
    last_refit_peak_bytes: int | UnsetType | None = UNSET
    loading: LoadingProgress | UnsetType = UNSET  # only while the checkpoint loads
    # LoRA adapters (engines with --enable-lora), as identities "name@version": those it
    # serves, and those on its device now.
    loras: list[str] | UnsetType = UNSET
    resident_loras: list[str] | UnsetType = UNSET
    # The prefix cache as its routers index it: the block hashes it holds, and the seq of
    # the last KV event batch published (unset while loading).
    cached_blocks: int | UnsetType = UNSET
    kv_event_seq: int | UnsetType = UNSET

    @property
    def num_pinned_blocks(self) -> int:
        return self.pinned_blocks if isinstance(self.pinned_blocks, int) else 0


def encode_status(status: EngineStatus) -> dict[str, Any]:
    """The JSON object of a status (unset fields left out)."""
    return msgspec.to_builtins(status)


def decode_status(data: bytes | dict[str, Any]) -> EngineStatus:
    """An engine's status from its JSON (bytes, or the object already parsed). Raises
    msgspec.ValidationError (a ValueError) naming the field that does not fit."""
    if isinstance(data, bytes | bytearray):
        return msgspec.json.decode(data, type=EngineStatus, strict=False)
    return msgspec.convert(data, EngineStatus, strict=False)


def decode_canary(data: dict[str, Any]) -> CanaryReply:
    """A canary reply from its parsed JSON; msgspec.ValidationError when it does not fit."""
    return msgspec.convert(data, CanaryReply, strict=False)
