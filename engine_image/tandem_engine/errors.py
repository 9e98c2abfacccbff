"""Errors a user of the engine can hit; each message names the input, the limit and the fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class TandemError(Exception):
    """Base class for every error Tandem raises on purpose."""


class CheckpointError(TandemError):
    """A checkpoint (folder or GGUF file) cannot be used: names the file, the tensor or
    metadata key, and what was expected."""


class RequestRejected(TandemError, ValueError):
    """A request cannot be accepted (prompt too long, bad sampling parameters...).

    The engine keeps serving every other request."""


def list_problems(problems: list[str], limit: int = 10) -> str:
    """Problems as an indented bullet list for an error message: the first `limit`, then
    how many more."""
    shown = problems[:limit]
    more = len(problems) - len(shown)
    return ("\n  - " + "\n  - ".join(shown)
            + (f"\n  ... and {more} more problems" if more else ""))


def path_problem(path: Path, kind: str) -> str | None:
    """Why `path` is not a `kind` ("file" or "folder") this process can use, as words that
    follow the path in a message; None when it is one. A path this process may not reach
    (a folder above it, or it, denies access) is said to be so, not "does not exist"."""
    try:
        mode = path.stat().st_mode
    except PermissionError:
        return (f"cannot be reached by this process (uid {os.getuid()}): permission denied "
                "on it or on a folder above it; make it readable to that user (chmod, or "
                "the pod's securityContext.fsGroup)")
    except OSError:
        return "does not exist"
    if stat.S_ISDIR(mode) != (kind == "folder"):
        return f"is not a {kind}"
    if not os.access(path, os.R_OK | (os.X_OK if kind == "folder" else 0)):
        return (f"is not readable by this process (uid {os.getuid()}); make it readable "
                "to that user (chmod, or the pod's securityContext.fsGroup)")
    return None
