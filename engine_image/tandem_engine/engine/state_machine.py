"""The engine's lifecycle state, moved by signals through the table in lifecycle.py.

A signal takes the engine through its transient state while its action runs (the KV
pool released by a suspend, brought back by a resume, every request aborted by a
stop): on success to the target state, on any error back to the state before, and
either way the engine's snapshot is published. A signal the current state does not
allow is an `EngineStateError`, never a silent no-op. `wait_until` blocks a thread
until a stable state is reached.

Holds the engine's lock (a condition on it) while it moves, so a signal from another
thread waits for the step in progress.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from tandem_engine.lifecycle import STABLE_STATES, EngineState, Signal, transition_for


class StateMachine:
    """The engine's state (`state`: read without the lock), moved by `signal`."""

    def __init__(self, lock: threading.RLock, publish: Callable[[], None]) -> None:
        """`publish` (called with the lock held) is the engine's bound method, held weakly:
        the engine owns its state machine, and a reference back would make a cycle that
        keeps the engine, and its KV pool, alive until the next garbage collection."""
        self.state = EngineState.RUNNING
        self._changed = threading.Condition(lock)
        self._publish_ref = weakref.WeakMethod(publish)

    def _publish(self) -> None:
        publish = self._publish_ref()
        if publish is not None:
            publish()

    def signal(self, signal: Signal, action: Callable[[], None] | None = None) -> None:
        with self._changed:
            transition = transition_for(self.state, signal)
            before = self.state
            self.state = transition.transient
            try:
                if action is not None:
                    action()
            except BaseException:
                self.state = before
                self._publish()
                raise
            self.state = transition.target
            self._publish()
            self._changed.notify_all()

    def wait_until(self, state: EngineState | str, timeout: float | None = None) -> None:
        """Block until the engine is in `state` (a stable state only)."""
        target = EngineState(state)
        if target not in STABLE_STATES:
            raise ValueError(f"wait_until({target}): only stable states can be waited for "
                             f"({', '.join(sorted(str(s) for s in STABLE_STATES))})")
        with self._changed:
            if not self._changed.wait_for(lambda: self.state is target, timeout):
                raise TimeoutError(f"engine still {self.state} after {timeout} s, "
                                   f"not {target}")
