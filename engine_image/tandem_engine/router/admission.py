"""Who may send what, how much, and in which order: the router's admission control.

Every generation request passes `Admission.admit` after it is parsed and tokenized and
before any engine sees it, and gives its ticket back when it ends (`Ticket.done`). Four
rules, each answering in microseconds (a refused request gets its answer at once; nothing
here waits):

* **Tenants.** A request belongs to the tenant of its API key (`KeyPolicy`, read with the
  keys: auth.py), or, on a router without keys, to the `X-Tandem-Tenant` header's (else
  `default`). Metrics name tenants, never keys.
* **Models.** A key may be scoped to some models (the served model, adapters): any other
  is a 404 `model_not_found` naming the ones it may use, as OpenAI answers a key without
  access.
* **Rate limits** (`RateWindow`): requests per minute and tokens per minute per key,
  counted over the last 60 seconds exactly (a sliding log, not a bucket that lets a
  minute's worth through at once), so over any minute a key gets at most its limit. A
  request counts its prompt tokens when admitted and its output tokens when done.
  Past a limit: 429 `rate_limit_exceeded`, `Retry-After` the seconds until the window
  has room.
* **A bound** (`max_num_requests`): requests this router has in flight at once, counted
  from the moment their headers arrive (`enter`, in the router's front door, before the
  body is read): past it, 429 `too_many_requests` with `Retry-After`. A burst's excess is
  refused before any of it is parsed or tokenized, so it is answered in milliseconds (had
  the bound counted admitted requests only, a burst would pass it whole while its first
  requests were still being parsed). Engines bound their own queues
  (`--max-queued-requests`); a request every engine refuses as full is a 429 too.
* **Order: priority, then fairness.** A request's engine priority (the engine schedules
  lower first, and preempts a running request of a worse priority by recompute) is its
  `priority` (vLLM's: lower first) and, within one, its *fair-queuing tag*: the tokens its
  tenant already has in flight (each request's prompt plus its `max_tokens`, the most it
  can cost), over the tenant's `weight`, in `QUANTUM_TOKENS` on a log2 scale. This is weighted
  fair queuing with start-time tags over tokens: a tenant's next request starts after the
  work it has outstanding, so a tenant sending ten times another's load has its later
  requests queued behind the other's, and the engines preempt them for it. Chosen over
  VTC (virtual token counters of the tokens each tenant was served, Sheng et al., OSDI
  2024): VTC needs one queue that picks the next request when a slot frees, while here
  the order must be fixed when a request is handed to an engine (the engines' queues
  and preemption carry it). A tag from work in flight needs no history either: an idle
  tenant banks no credit and a busy one carries no debt once its requests end.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-tandem-tenant"
WINDOW_S = 60.0  # rate limits are per minute
QUANTUM_TOKENS = 32  # a fair-queuing tag's unit: tokens in flight (log2 scale)
FAIRNESS_LEVELS = 1000  # engine priority = priority * FAIRNESS_LEVELS + the tag's level
MAX_PRIORITY = 1_000_000  # |priority| a request may ask for (vLLM's is any int)
MAX_TENANTS = 10_000  # tenants remembered for fairness (idle ones beyond it forgotten)


@dataclass(frozen=True)
class KeyPolicy:
    """What one API key may do: its tenant (the name metrics and fairness use), limits
    per minute (None: none), the models it may name (empty: any) and its fair-share
    weight."""

    tenant: str
    rpm: int | None = None
    tpm: int | None = None
    models: frozenset[str] = frozenset()
    weight: float = 1.0


def default_tenant_name(key: str) -> str:
    """A key's tenant when its line names none: not the key (metrics show tenants)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


class Refused(Exception):
    """A request admission refuses: HTTP `status`, OpenAI `code`, the message, and for a
    429 the seconds to wait (`Retry-After`)."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None,
                 reason: str = "") -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.retry_after = retry_after
        self.reason = reason or code


class RateWindow:
    """Amounts (requests, tokens) taken in the last `WINDOW_S` seconds, exactly."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._log: deque[tuple[float, int]] = deque()
        self._total = 0

    def _expire(self, now: float) -> None:
        while self._log and self._log[0][0] <= now - WINDOW_S:
            self._total -= self._log.popleft()[1]

    def used(self, now: float) -> int:
        self._expire(now)
        return self._total

    def wait_for(self, amount: int, now: float) -> float:
        """Seconds until `amount` more fits (0: now). An amount over the limit itself
        fits once the window is empty."""
        self._expire(now)
        room = self.limit - self._total
        if amount <= room:
            return 0.0
        need, freed = min(amount, self.limit) - room, 0
        for at, n in self._log:
            freed += n
            if freed >= need:
                return max(0.0, at + WINDOW_S - now)
        return WINDOW_S

    def take(self, amount: int, now: float) -> None:
        if amount > 0:
            self._expire(now)
            self._log.append((now, amount))
            self._total += amount


@dataclass
class _Tenant:
    outstanding: int = 0  # tokens reserved by its requests in flight (prompt + max_tokens)
    active: int = 0  # requests in flight
    weight: float = 1.0


@dataclass
class Ticket:
    """One admitted request: its tenant, its engine priority, and how to end it."""

    admission: Admission
    tenant: str
    key_id: str
    priority: int
    engine_priority: int
    prompt_tokens: int
    reserved: int  # tokens it may cost: prompt + max_tokens
    ended: bool = field(default=False)

    def done(self, output_tokens: int) -> None:
        """The request ended (any way) after `output_tokens` tokens: charge them."""
        if not self.ended:
            self.ended = True
            self.admission.release(self, output_tokens)


class Admission:
    def __init__(self, policies: Mapping[str, KeyPolicy] | None = None, *,
                 max_num_requests: int | None = None) -> None:
        """`policies`: by API key (none: a router without keys). `max_num_requests`:
        requests in flight at once (None: no bound)."""
        if max_num_requests is not None and max_num_requests < 1:
            raise ValueError(f"max_num_requests {max_num_requests} must be >= 1 (e.g. "
                             "--max-num-requests 256)")
        self.policies = dict(policies or {})
        self.max_num_requests = max_num_requests
        self.inflight = 0
        self._tenants: dict[str, _Tenant] = {}
        self._rpm: dict[str, RateWindow] = {}
        self._tpm: dict[str, RateWindow] = {}
        # What was refused, by (tenant, reason); and admitted, by tenant.
        self.refused: dict[tuple[str, str], int] = {}
        self.admitted: dict[str, int] = {}

    # ---- who ----------------------------------------------------------------------------------

    def policy(self, key: str | None, tenant_header: str | None) -> tuple[str, KeyPolicy]:
        """(key id, policy) of a request: its key's, or on a router without keys the
        tenant header's (a valid key is checked before: auth.py)."""
        if key is not None and key in self.policies:
            return key, self.policies[key]
        tenant = (tenant_header or DEFAULT_TENANT).strip()[:64] or DEFAULT_TENANT
        return f"tenant:{tenant}", KeyPolicy(tenant)

    # ---- admitting ----------------------------------------------------------------------------

    def enter(self, key: str | None, tenant_header: str | None) -> None:
        """A request's seat in the router, taken when its headers arrive (before its body
        is read) and given back with `leave` when it ends, however it ends. Refused (429)
        when the router is full."""
        if self.max_num_requests is not None and self.inflight >= self.max_num_requests:
            raise self._refuse(self.policy(key, tenant_header)[1].tenant, self._full())
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1

    def _full(self) -> Refused:
        return Refused(429, "too_many_requests", f"the router has {self.inflight} requests "
                       f"in flight, its limit (--max-num-requests {self.max_num_requests}): "
                       "retry after a moment", retry_after=1.0, reason="router_full")

    def admit(self, key: str | None, tenant_header: str | None, model: str, priority: int,
              prompt_tokens: int, max_tokens: int = 0, now: float | None = None) -> Ticket:
        """A ticket, or Refused (404 a model the key may not use, 429 a rate limit), for a
        request that has its seat (`enter`).
        `max_tokens`: the most output tokens the request may make (every choice's)."""
        now = time.monotonic() if now is None else now
        key_id, policy = self.policy(key, tenant_header)
        tenant = policy.tenant
        if policy.models and model not in policy.models:
            raise self._refuse(tenant, Refused(
                404, "model_not_found", f"The model '{model}' does not exist or this API key "
                f"(tenant {tenant}) may not use it: it may use "
                f"{', '.join(sorted(policy.models))}", reason="model_not_allowed"))
        waits = []
        if policy.rpm is not None:
            window = self._rpm.setdefault(key_id, RateWindow(policy.rpm))
            waits.append(("requests", policy.rpm, window.wait_for(1, now)))
        if policy.tpm is not None:
            window = self._tpm.setdefault(key_id, RateWindow(policy.tpm))
            waits.append(("tokens", policy.tpm, window.wait_for(prompt_tokens, now)))
        over = [(what, limit, wait) for what, limit, wait in waits if wait > 0]
        if over:
            what, limit, wait = max(over, key=lambda w: w[2])
            raise self._refuse(tenant, Refused(
                429, "rate_limit_exceeded", f"Rate limit reached for tenant {tenant}: "
                f"{limit} {what} per minute. Retry after {math.ceil(wait)} s",
                retry_after=wait, reason=f"rate_limit_{'rpm' if what == 'requests' else 'tpm'}"))
        if policy.rpm is not None:
            self._rpm[key_id].take(1, now)
        if policy.tpm is not None:
            self._tpm[key_id].take(prompt_tokens, now)
        state = self._activate(tenant, policy.weight)
        level = self.level(tenant)
        reserved = prompt_tokens + max_tokens
        state.outstanding += reserved
        self.admitted[tenant] = self.admitted.get(tenant, 0) + 1
        priority = max(-MAX_PRIORITY, min(MAX_PRIORITY, priority))
        return Ticket(self, tenant, key_id, priority, priority * FAIRNESS_LEVELS + level,
                      prompt_tokens, reserved)

    def release(self, ticket: Ticket, output_tokens: int) -> None:
        state = self._tenants[ticket.tenant]
        state.active -= 1
        state.outstanding -= ticket.reserved
        window = self._tpm.get(ticket.key_id)
        if window is not None:
            window.take(output_tokens, time.monotonic())

    def refused_for(self, tenant: str, reason: str) -> None:
        """Count a refusal decided elsewhere (every engine's queue full)."""
        self.refused[(tenant, reason)] = self.refused.get((tenant, reason), 0) + 1

    # ---- fairness -----------------------------------------------------------------------------

    def _activate(self, tenant: str, weight: float) -> _Tenant:
        if tenant not in self._tenants and len(self._tenants) >= MAX_TENANTS:
            # Bounded (tenant headers come from clients): forget idle tenants (one with
            # requests in flight never is); they hold nothing but their weight.
            idle = [name for name, t in self._tenants.items() if t.active == 0]
            for name in idle[:max(1, len(idle) // 2)]:
                del self._tenants[name]
        state = self._tenants.setdefault(tenant, _Tenant(weight=weight))
        state.weight = weight
        state.active += 1
        return state

    def level(self, tenant: str) -> int:
        """The fair-queuing tag of the tenant's next request: its tokens in flight over
        its weight, in QUANTUM_TOKENS, on a log2 scale: a tenant with twice another's work
        in flight is a level behind it. Coarse on purpose: the engines preempt a running
        request for a waiting one of a better level, so neighbouring requests of one tenant
        should rarely differ."""
        t = self._tenants[tenant]
        work = t.outstanding / t.weight / QUANTUM_TOKENS
        return min(int(math.log2(1 + work)), FAIRNESS_LEVELS - 1)

    def tenants(self) -> Iterable[tuple[str, int, int]]:
        """(tenant, tokens in flight, requests in flight), for metrics."""
        return ((name, t.outstanding, t.active) for name, t in sorted(self._tenants.items()))

    def _refuse(self, tenant: str, refusal: Refused) -> Refused:
        self.refused_for(tenant, refusal.reason)
        return refusal
