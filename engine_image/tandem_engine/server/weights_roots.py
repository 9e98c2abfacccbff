"""Where a refit (or a LoRA adapter loaded at run time) may read weights from: an
allow-list of folders (`--weights-root`).

A refit names a checkpoint by URI; the admin API is reachable by the operator and the
routers, and a refit reads whatever the engine can see. So the path is resolved
(symlinks, `..`) and must lie inside one of the roots, and be a checkpoint there.
Every refusal answers the same text (`REFUSED`), so the error is no oracle for what
exists on the engine's filesystem; the precise reason goes to the engine's log only. That
includes a path no file can have (a NUL byte, `%00` in the URI): refused like the rest.
(`tandem refit` checks the same rule, `weights_root_problem`, against the roots a local
stack records, before it touches any engine, and tells its user the reason.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem_engine.weights import nul_problem, weights_root_problem

log = logging.getLogger(__name__)

REFUSED = ("refit path refused: it is not a checkpoint inside the allowed weights roots "
           "(--weights-root)")


ADAPTER_REFUSED = ("LoRA adapter path refused: it is not inside the allowed weights roots "
                   "(--weights-root)")


class RefitPathRefused(ValueError):
    """A refit path outside the weights roots, or no checkpoint: always `REFUSED`."""

    def __init__(self) -> None:
        super().__init__(REFUSED)


class AdapterPathRefused(ValueError):
    """A LoRA adapter path outside the weights roots: always `ADAPTER_REFUSED`."""

    def __init__(self) -> None:
        super().__init__(ADAPTER_REFUSED)


@dataclass(frozen=True)
class WeightsRoots:
    roots: tuple[Path, ...]  # resolved

    @classmethod
    def of(cls, roots: Sequence[Path], model: Path) -> WeightsRoots:
        """The `--weights-root` folders; with none, the folder holding the start-up
        `--model`. A root that is not a folder raises ValueError naming it."""
        resolved = []
        for root in roots or [Path(model).resolve().parent]:
            path = Path(root).resolve()
            if not path.is_dir():
                raise ValueError(f"--weights-root {root}: not a folder; give folders that "
                                 "hold the checkpoints refits may load")
            resolved.append(path)
        return cls(tuple(resolved))

    def admit(self, path: str | Path) -> Path:
        """The resolved checkpoint `path` names, if it lies inside a root and looks like a
        checkpoint; else RefitPathRefused (the reason is logged here only)."""
        reason = weights_root_problem(path, self.roots)
        if reason is not None:
            # repr: a path's own newlines or NUL bytes cannot forge or cut a log line
            log.warning("refit to %r refused: %s", str(path), reason)
            raise RefitPathRefused()
        return Path(path).resolve()

    def admit_adapter(self, path: str | Path) -> Path:
        """The resolved LoRA adapter folder `path` names, if it lies inside a root; else
        AdapterPathRefused (the reason is logged here only). What the folder holds is the
        adapter reader's to check, once the path is admitted."""
        reason = nul_problem(path)  # before resolve(), which would raise
        resolved = Path(path).resolve() if reason is None else None
        if resolved is not None and not any(resolved.is_relative_to(root)
                                            for root in self.roots):
            reason = f"{resolved} is outside the weights roots"
        if resolved is None or reason is not None:
            log.warning("LoRA adapter %r refused: %s", str(path), reason)
            raise AdapterPathRefused()
        return resolved
