"""Fault injection under streaming load: what Tandem survives, counted by its clients.

Run alone (2 cores: every engine, router, operator and the load share them):

    .venv/bin/python benchmarks/fault_matrix.py [--only ROW[,ROW...]] [--duration S]

Each row starts a real stack on the tiny demo model (written fresh to a temporary
folder): `tandem-engine` and `tandem-router` processes on loopback, real NIXL between
prefill and decode engines, `tandem serve` for the rows about its children, and the
operator with the test kubelet against the test API server (tests/kcluster, test-only code
imported from the tests folder) for the operator rows. It drives `--streams` concurrent
streaming completions with the `openai` client for `--duration` seconds, injects one fault
a third of the way in, and prints one markdown table row per fault:

    fault | topology | sent | ok | failed | resumed | promise held? | notes

* sent / ok / failed are counted by the clients. A request is ok when its stream ended
  with finish reason `length` (every request asks for `--max-tokens` with `ignore_eos`);
  failed when it raised or ended otherwise. A connection refused before anything reached
  a router (nobody listening: a router restarting) is not sent; the client retries it
  after 0.2 s and the notes count those refusals.
* resumed comes from the routers' `tandem_router_resumed_choices_total` (the delta over
  the row): requests that failed over mid-stream (tokens already streamed) and completed
  on another engine. A killed router's own counter dies with it; its rows read the others.
* kill = SIGKILL. stop = SIGSTOP held `--freeze` s (longer than the routers'
  `--heartbeat-deadline` of 1 s), then SIGCONT.
* The promise: 0 failed requests wherever another engine of the needed role exists. The
  only allowed losses are requests in flight on (or sent to) a router that was killed;
  they are counted per router.

Rows (`--only` takes these names): mixed-kill, mixed-stop (2 mixed engines); prefill-kill,
prefill-stop (2 prefill + 1 decode); decode-kill, decode-stop (1 prefill + 2 decode);
router-kill, router-stop (2 routers over 2 mixed engines, clients spread over both; a
client whose router failed moves to the other); serve-engine-kill, serve-router-kill
(`tandem serve --engines 2`: it restarts the child; stack.json must record the restart);
operator-kill, operator-stop (1 mixed engine + router pods run by the test kubelet; after
the fault the operator reconciles with no action taken and no pod replaced); refit-kill-drain,
refit-kill-refit, refit-kill-last (`tandem serve --engines 2` under a Rolling `tandem refit`:
kill -9 of engine-1 while wave 1 drains engine-0, while engine-0 loads the new weights, or
while wave 2 drains engine-1, the old version's last engine); nixl-frozen-read
(1 prefill + 1 decode: SIGSTOP the prefill engine as a stream's first token arrives, i.e.
while the decode engine pulls its KV; the pull's deadline fires and the request completes by
recompute); log-disk-full (`tandem serve` whose log folder is a 1 MiB tmpfs filled up
while it serves; falls back to logs that are symlinks to /dev/full where mount is refused).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The stacks and the load (fault_stacks.py), the rows (fault_rows.py); tests import the
# rows, `Serve` and `warm_up` from here.
from fault_rows import (
    REFIT_PHASES,
    engine_fault,
    log_disk_full,
    nixl_frozen_read,
    operator_fault,
    refit_engine_kill,
    router_fault,
    serve_child_kill,
    serve_refit_kill,
)
from fault_stacks import FREEZE_S, HEARTBEAT_DEADLINE_S, TABLE_HEADER, Row, Serve, warm_up

__all__ = ["ROWS", "Row", "Serve", "log_disk_full", "main", "operator_fault",
           "refit_engine_kill", "router_fault", "warm_up"]


# ---- the matrix -------------------------------------------------------------------------------

RowFn = Callable[[Path, Path, float, int], Row]
ROWS: dict[str, RowFn] = {
    "mixed-kill": lambda m, f, d, s: engine_fault(m, f, "mixed", True, d, s),
    "mixed-stop": lambda m, f, d, s: engine_fault(m, f, "mixed", False, d, s),
    "prefill-kill": lambda m, f, d, s: engine_fault(m, f, "prefill", True, d, s),
    "prefill-stop": lambda m, f, d, s: engine_fault(m, f, "prefill", False, d, s),
    "decode-kill": lambda m, f, d, s: engine_fault(m, f, "decode", True, d, s),
    "decode-stop": lambda m, f, d, s: engine_fault(m, f, "decode", False, d, s),
    "router-kill": lambda m, f, d, s: router_fault(m, f, True, d, s),
    "router-stop": lambda m, f, d, s: router_fault(m, f, False, d, s),
    "serve-engine-kill": lambda m, f, d, s: serve_child_kill(m, f, "engine", d, s),
    "serve-router-kill": lambda m, f, d, s: serve_child_kill(m, f, "router", d, s),
    **{f"refit-kill-{phase}": lambda m, f, d, s, phase=phase: serve_refit_kill(m, f, phase, d, s)
       for phase in REFIT_PHASES},
    "operator-kill": lambda m, f, d, s: operator_fault(m, f, True, d, s),
    "operator-stop": lambda m, f, d, s: operator_fault(m, f, False, d, s),
    "nixl-frozen-read": nixl_frozen_read,
    "log-disk-full": log_disk_full,
}


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_model(folder: Path) -> Path:
    import torch
    from tandem_engine.cli.demo_model import write_demo_model

    torch.set_num_threads(1)
    return write_demo_model(folder / "tiny-llama", arch="llama", size="tiny")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="rows: " + ", ".join(ROWS))
    ap.add_argument("--only", default=None, metavar="ROW[,ROW...]",
                    help="run these rows only (default: all)")
    ap.add_argument("--duration", type=float, default=12.0,
                    help="seconds of load per row (default 12)")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep every process log under this folder")
    args = ap.parse_args(argv)
    names = list(ROWS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(ROWS)}")

    print("command:", " ".join(sys.orig_argv))
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); {args.streams} streams x "
          f"{args.duration:g} s per row, 32 tokens each; SIGSTOP held {FREEZE_S:g} s "
          f"(router heartbeat deadline {HEARTBEAT_DEADLINE_S:g} s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        root = args.keep or Path(tmp)
        model = write_model(root)
        rows = []
        for name in names:
            started = time.monotonic()
            try:
                row = ROWS[name](model, root / name, args.duration, args.streams)
            except Exception as exc:
                row = Row(name, "-", 0, 0, 0, 0, "row did not run", False,
                          f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            print(f"  {name}: {time.monotonic() - started:.0f} s; {row.markdown()}",
                  flush=True)
    print()
    print(TABLE_HEADER)
    for row in rows:
        print(row.markdown())
    return 0 if all(r.held for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
