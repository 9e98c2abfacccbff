"""Where a suspended engine's KV pool goes, and how it comes back (lifecycle.KVMode).

`persist` keeps the pool where it is. `offload` copies it to host memory and frees it
(on CUDA to pinned memory, synchronized, torch's cache emptied); `resume` copies it back.
`recompute` checkpoints every in-flight request as prompt + generated tokens (back to
the front of the queue in arrival order), resets the prefix cache (its contents are
gone, so nothing may match them) and frees the pool; `resume` allocates a new one. Under
both, pulls still writing into the pool count as failed (their requests recompute) and
the draft model's pool is dropped, not kept (every request catches up after the resume).

Called by `LLMEngine.suspend` / `resume` inside the transition, under the engine lock.
"""

from __future__ import annotations

from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.engine.handoff_ledger import HandoffLedger
from tandem_engine.engine.speculation import Speculation
from tandem_engine.lifecycle import EngineStateError, KVMode
from tandem_engine.model.runner import ModelRunner


def parse_kv_mode(mode: KVMode | str) -> KVMode:
    """The suspend mode `mode` names (EngineStateError: none)."""
    try:
        return KVMode(mode)
    except ValueError:
        raise EngineStateError(
            f"KV management mode {mode!r} is unknown; use one of "
            f"{', '.join(m.value for m in KVMode)}") from None


def release_pool(mode: KVMode, runner: ModelRunner, scheduler: Scheduler,
                 kv: KVCacheManager, handoffs: HandoffLedger, speculation: Speculation
                 ) -> int:
    """Move the pool out under `mode`; returns the bytes of KV storage released."""
    released = 0
    if mode is not KVMode.PERSIST:
        handoffs.fail_all()  # the pool is copied away or dropped
        released += speculation.release_kv()
    if mode is KVMode.OFFLOAD:
        released += runner.offload_kv()
    elif mode is KVMode.RECOMPUTE:
        scheduler.preempt_all()
        kv.reset_prefix_cache()
        released += runner.free_kv()
    return released


def restore_pool(mode: KVMode | None, runner: ModelRunner, speculation: Speculation) -> None:
    """Bring back what `release_pool(mode, ...)` moved out."""
    if mode is KVMode.OFFLOAD:
        runner.restore_kv()
    elif mode is KVMode.RECOMPUTE:
        runner.allocate_kv()
    speculation.restore_kv()
