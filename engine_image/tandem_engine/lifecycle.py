"""The engine's lifecycle as one declarative transition table.

LOADING → RUNNING (the process reads its checkpoint; there is no engine to signal yet)
RUNNING → PAUSING → PAUSED → UNPAUSING → RUNNING
PAUSED → SUSPENDING → SUSPENDED → RESUMING → RESUMED (a paused engine with its
memory back: it unpauses, suspends again or stops like PAUSED)
PAUSED | SUSPENDED | RESUMED → STOPPING → STOPPED

A signal the current state does not allow raises `EngineStateError` naming the state
and the signals it allows; nothing is ever silently ignored. Torch-free, so the
operator and the router can share these names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem_engine.errors import TandemError


class EngineState(str, enum.Enum):
    LOADING = "LOADING"  # the engine process is up, its checkpoint still loading
    RUNNING = "RUNNING"
    PAUSING = "PAUSING"
    PAUSED = "PAUSED"
    UNPAUSING = "UNPAUSING"
    SUSPENDING = "SUSPENDING"
    SUSPENDED = "SUSPENDED"
    RESUMING = "RESUMING"
    RESUMED = "RESUMED"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"

    def __str__(self) -> str:
        return self.value


class EngineRole(str, enum.Enum):
    """What an engine does in a pool: everything, or one side of a KV handoff."""

    MIXED = "mixed"  # prefill and decode, colocated
    PREFILL = "prefill"  # computes prompts and hands their KV over
    DECODE = "decode"  # pulls a prompt's KV and generates the rest

    def __str__(self) -> str:
        return self.value


class Signal(str, enum.Enum):
    PAUSE = "PAUSE"
    UNPAUSE = "UNPAUSE"
    SUSPEND = "SUSPEND"
    RESUME = "RESUME"
    STOP = "STOP"

    def __str__(self) -> str:
        return self.value


class KVMode(str, enum.Enum):
    """What SUSPEND does with the KV cache."""

    PERSIST = "persist"  # keep it where it is
    OFFLOAD = "offload"  # copy to host memory, free the pool's storage, restore on resume
    RECOMPUTE = "recompute"  # free it; in-flight requests are re-prefilled after resume

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Transition:
    allowed_from: frozenset[EngineState]
    transient: EngineState
    target: EngineState


S = EngineState
TRANSITIONS: dict[Signal, Transition] = {
    Signal.PAUSE: Transition(frozenset({S.RUNNING}), S.PAUSING, S.PAUSED),
    Signal.UNPAUSE: Transition(frozenset({S.PAUSED, S.RESUMED}), S.UNPAUSING, S.RUNNING),
    Signal.SUSPEND: Transition(frozenset({S.PAUSED, S.RESUMED}), S.SUSPENDING, S.SUSPENDED),
    Signal.RESUME: Transition(frozenset({S.SUSPENDED}), S.RESUMING, S.RESUMED),
    Signal.STOP: Transition(frozenset({S.PAUSED, S.SUSPENDED, S.RESUMED}), S.STOPPING,
                            S.STOPPED),
}

# States a caller may wait for; transient ones pass too quickly to wait on.
STABLE_STATES = frozenset({S.RUNNING, S.PAUSED, S.SUSPENDED, S.RESUMED, S.STOPPED})
# States in which the engine does not step and weights may be swapped.
REFIT_STATES = frozenset({S.PAUSED, S.SUSPENDED, S.RESUMED})
# States a fleet waits out rather than send a signal: those a signal passes through, and
# LOADING (no engine to signal yet; it turns RUNNING by itself once loaded).
TRANSIENT_STATES = frozenset({S.LOADING, *(t.transient for t in TRANSITIONS.values())})
# An engine on its way out (STOP): routers and refits no longer count it.
LEAVING_STATES = frozenset({S.STOPPING, S.STOPPED})


class EngineStateError(TandemError):
    """A lifecycle signal or call the engine's current state does not allow."""


def allowed_signals(state: EngineState) -> list[Signal]:
    return [sig for sig, t in TRANSITIONS.items() if state in t.allowed_from]


def transition_for(state: EngineState, signal: Signal) -> Transition:
    """The transition `signal` starts from `state`, or EngineStateError."""
    t = TRANSITIONS[signal]
    if state not in t.allowed_from:
        allowed = ", ".join(str(s) for s in allowed_signals(state)) or "none"
        raise EngineStateError(
            f"signal {signal} is not allowed in state {state}; allowed in {state}: {allowed}")
    return t


def _check_table() -> None:
    # A state read off the wire is a plain str; it finds itself in the sets above only
    # because every name equals its value (an Enum hashes by name).
    assert all(s.name == s.value for s in EngineState)
    # Every stable state but STOPPED has a way out; transient states are never a source.
    assert TRANSIENT_STATES.isdisjoint(STABLE_STATES)
    assert not allowed_signals(S.LOADING), "a loading process has no engine to signal"
    for t in TRANSITIONS.values():
        assert t.allowed_from <= STABLE_STATES and t.target in STABLE_STATES
    for state in STABLE_STATES - {S.STOPPED}:
        assert allowed_signals(state), f"{state} would be a dead end"


_check_table()
