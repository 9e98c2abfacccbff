"""The router's API keys: who may use the OpenAI API.

Keys come from `tandem-router --api-key-file FILE` (one key a line; repeatable), from the
environment variable TANDEM_API_KEY (several keys separated by commas; the operator sets
it from the pool's Secret, and `tandem serve` passes its keys this way) and from
`--api-key KEY` (repeatable). The file and the variable keep a key out of `ps`;
`--api-key` puts it on the command line, where any user of the machine can read it
(`/proc/PID/cmdline`). Any configured key is accepted, as `Authorization: Bearer KEY`,
the header the OpenAI clients send. Every path needs one except the probes and the
scrape (`OPEN_PATHS`); a request without a valid key gets 401 in the OpenAI error shape.
Keys are compared as `tandem_engine.bearer` compares every token (SHA-256 digests,
`hmac.compare_digest`, every key each time). With no key configured the router serves
anyone (and `main` logs a warning saying so).

The LoRA adapter calls (`ADMIN_PATHS`: vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, `router/adapters.py`) are admin calls: they need the pool's
admin token, the engines' own (`--admin-token-file`, else $TANDEM_ADMIN_TOKEN; `tandem
serve` passes its stack's), and no API key opens them: a key is handed to every client,
while a load makes every engine read a folder and changes what the pool serves. A router
given no admin token refuses them (403, naming the fix); adapters are then loaded on
each engine's admin API, or from the start (`--lora-modules`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tandem_engine.bearer import BearerTokens, bearer_token
from tandem_engine.router.admission import KeyPolicy, default_tenant_name
from tandem_engine.router.openai_format import error_body

API_KEY_ENV = "TANDEM_API_KEY"  # a contract: the operator and `tandem serve` set it
ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"  # the engines' variable: the pool's admin token
# Kubernetes probes, Prometheus and vLLM's /health stay reachable without a key.
OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})
# The admin calls: the admin token, never an API key.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
MAX_KEY_FILE_BYTES = 1 << 20  # a key file is a few lines; anything larger is a mistake
SCOPE_KEY = "tandem.api_key"  # the ASGI scope's entry holding the accepted key


KEY_ATTRIBUTES = ("tenant", "rpm", "tpm", "models", "weight")


def read_api_key_file(path: Path, flag: str = "--api-key-file") -> list[str]:
    """The lines of a key file: one key a line (with its attributes, `parse_key_line`),
    blank lines, `#` comments and surrounding whitespace dropped. ValueError naming the
    file (and `flag`) when it cannot be read or holds no key."""
    try:
        with Path(path).open("rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot be read ({exc.strerror or exc}); give a "
                         "readable file holding one API key a line") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{flag} {path}: over {MAX_KEY_FILE_BYTES} bytes; give a file "
                         "holding one API key a line")
    try:
        keys = [line.strip() for line in data.decode().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text; give a file holding one API key "
                         "a line") from None
    if not keys:
        raise ValueError(f"{flag} {path}: holds no key; write one API key a line")
    return keys


def parse_key_line(line: str) -> tuple[str, KeyPolicy]:
    """`KEY [tenant=NAME] [rpm=N] [tpm=N] [models=A,B] [weight=W]`: a key and what it may
    do (admission.py): its tenant (default: a name derived from the key, never the key),
    requests and tokens per minute, the models (served model, adapters) it may name, and
    its fair-share weight. ValueError naming the part that is wrong."""
    key, *attributes = line.split()
    if any(c == "," for c in key) or not key.isprintable():
        raise ValueError("an API key (--api-key, --api-key-file or "
                         f"${API_KEY_ENV}) holds a comma or an unprintable character: use "
                         "printable characters only, and commas only between keys in the "
                         "variable")
    values: dict[str, str] = {}
    for attribute in attributes:
        name, sep, value = attribute.partition("=")
        if not sep or name not in KEY_ATTRIBUTES or not value or name in values:
            raise ValueError(f"an API key's line (--api-key, --api-key-file or "
                             f"${API_KEY_ENV}): {attribute!r} is not one of "
                             f"{', '.join(a + '=' for a in KEY_ATTRIBUTES)} (each once; a key "
                             "holds no whitespace: what follows it are its attributes)")
        values[name] = value

    def whole(name: str, low: int, high: int) -> int | None:
        if name not in values:
            return None
        try:
            n = int(values[name])
        except ValueError:
            n = low - 1
        if not low <= n <= high:
            raise ValueError(f"an API key's {name}={values[name]!r}: a whole number in "
                             f"{low}..{high}")
        return n

    try:
        weight = float(values.get("weight", "1"))
    except ValueError:
        weight = 0.0
    if not 0.01 <= weight <= 100:
        raise ValueError(f"an API key's weight={values['weight']!r}: a number in 0.01..100 "
                         "(its share against a weight-1 tenant's)")
    tenant = values.get("tenant") or default_tenant_name(key)
    if len(tenant) > 64 or not tenant.isprintable():
        raise ValueError(f"an API key's tenant={tenant!r}: at most 64 printable characters")
    models = frozenset(m for m in values.get("models", "").split(",") if m)
    return key, KeyPolicy(tenant, whole("rpm", 1, 10_000_000), whole("tpm", 1, 10**12),
                          models, weight)


def resolve_key_policies(flag_keys: Iterable[str] | None = None,
                         environ: Mapping[str, str] = os.environ,
                         key_files: Iterable[Path] | None = None) -> dict[str, KeyPolicy]:
    """The keys `--api-key`, `--api-key-file` and $TANDEM_API_KEY configure together,
    each once, with what each may do (`parse_key_line`). The variable holds keys
    separated by commas, or key lines separated by newlines (a Secret's value with
    attributes). ValueError naming what is wrong."""
    env = environ.get(API_KEY_ENV, "")
    from_env = env.splitlines() if "\n" in env else env.split(",")
    from_files = [line for path in key_files or () for line in read_api_key_file(path)]
    policies: dict[str, KeyPolicy] = {}
    for line in [*(flag_keys or ()), *from_files, *from_env]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, policy = parse_key_line(line)
        policies.setdefault(key, policy)
    return policies


def resolve_api_keys(flag_keys: Iterable[str] | None = None,
                     environ: Mapping[str, str] = os.environ,
                     key_files: Iterable[Path] | None = None) -> tuple[str, ...]:
    """The keys alone (`resolve_key_policies`)."""
    return tuple(resolve_key_policies(flag_keys, environ, key_files))


def policy_lines(policies: Mapping[str, KeyPolicy]) -> str:
    """Key lines (newline-separated), as $TANDEM_API_KEY carries them to a router."""
    out = []
    for key, p in policies.items():
        parts = [key] if p.tenant == default_tenant_name(key) else [key, f"tenant={p.tenant}"]
        parts += [f"{name}={value}" for name, value in (("rpm", p.rpm), ("tpm", p.tpm))
                  if value is not None]
        if p.models:
            parts.append(f"models={','.join(sorted(p.models))}")
        if p.weight != 1.0:
            parts.append(f"weight={p.weight:g}")
        out.append(" ".join(parts))
    return "\n".join(out)


def resolve_admin_token(path: Path | None, environ: Mapping[str, str] = os.environ
                        ) -> str | None:
    """The admin token: from `--admin-token-file` (ValueError naming it when it cannot be
    read or is empty), else $TANDEM_ADMIN_TOKEN, else None."""
    if path is None:
        return environ.get(ADMIN_TOKEN_ENV, "").strip() or None
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--admin-token-file {path}: cannot be read ({exc}); give a "
                         "readable file holding the pool's admin token") from None
    if not token:
        raise ValueError(f"--admin-token-file {path} is empty: write the pool's admin "
                         "token in it")
    return token


class ApiKeyMiddleware:
    """ASGI middleware: answers 401 to an HTTP request outside `OPEN_PATHS` that does not
    carry one of `keys` as a bearer token (no keys: such requests pass), and to one of
    `ADMIN_PATHS` that does not carry `admin_token` (403 when there is none). A plain
    ASGI wrapper (not Starlette's BaseHTTPMiddleware), so streamed responses and
    disconnects pass through untouched."""

    def __init__(self, app: Any, keys: Iterable[str] = (),
                 admin_token: str | None = None) -> None:
        self.app = app
        keys = list(keys)
        self._keys = BearerTokens(keys) if keys else None
        self._admin = BearerTokens([admin_token]) if admin_token else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = bearer_token(scope["headers"])
        refusal = (self._admin_refusal(presented) if scope["path"] in ADMIN_PATHS
                   else self._key_refusal(presented))
        if refusal is None:
            if self._keys is not None and presented is not None:
                scope[SCOPE_KEY] = presented.decode(errors="replace")  # admission's tenant
            await self.app(scope, receive, send)
            return
        status, code, message = refusal
        body = json.dumps(error_body(message, "invalid_request_error", None,
                                     code)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="tandem"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _admin_refusal(self, presented: bytes | None) -> tuple[int, str, str] | None:
        if self._admin is None:
            return (403, "admin_calls_off", "adapter calls through this router are off: "
                    "start it with the pool's admin token (--admin-token-file, or "
                    f"${ADMIN_TOKEN_ENV}), or call each engine's admin API")
        if self._admin.accepts(presented):
            return None
        return (401, "invalid_admin_token", "this admin call needs 'Authorization: Bearer "
                "<token>' with the pool's admin token (the engines'; an API key does not "
                "open it)")

    def _key_refusal(self, presented: bytes | None) -> tuple[int, str, str] | None:
        """Why the presented key is refused (status, code, message), or None when it is
        one of the keys or none is configured."""
        if self._keys is None or self._keys.accepts(presented):
            return None
        if presented is None:
            return (401, "invalid_api_key", "no API key provided: send it in an "
                    "Authorization header using Bearer auth (Authorization: Bearer "
                    "YOUR_KEY; the openai client's api_key)")
        return (401, "invalid_api_key", "incorrect API key provided: use one of the keys "
                "the router was started with (tandem-router --api-key-file, --api-key, or "
                f"${API_KEY_ENV})")
