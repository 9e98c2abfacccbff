"""`tandem serve`'s restart budget refills: a child that dies now and then (each
incarnation living longer than the window allows restarts for) is restarted for ever,
where one that dies at once is stopped as crash-looping (test_serve.py). Real child
processes, `LocalStack.supervise` as `tandem serve` runs it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tandem_engine.cli.serve import LocalStack

LIFE = 0.6  # seconds each incarnation of the child lives
WINDOW = 1.0  # the budget's window: under 2 x LIFE, so when the child exits again at most
# one earlier restart is still in it (the limit is 2)


def test_a_child_that_dies_now_and_then_never_spends_the_budget(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path, log_dir=tmp_path, restart_limit=2, restart_window=WINDOW,
                       backoff_base=0.05, out=open(os.devnull, "w"))  # noqa: SIM115
    # `python -m timeit` as a child that runs LIFE seconds and exits (code 0: unexpected).
    child = stack._spawn("engine-0", ["timeit", "-n", "1", "-r", "1",
                                      f"import time; time.sleep({LIFE})"],
                         "http://127.0.0.1:1/")
    deadline = time.monotonic() + 60
    try:
        while child.restarts < 5:  # 2.5 x the budget, spent within about 5 s
            assert time.monotonic() < deadline, f"{child.restarts} restarts in 60 s"
            assert stack.supervise() is None, "the budget ran out though it refills"
            time.sleep(0.02)
        assert child.last_exit == "exit code 0"
    finally:
        stack.stop()
