"""Fault injection under streaming load, the rows no other test covers: a full disk for
`tandem serve`'s log folder, kill -9 of one of two routers, kill -9 of the operator.

Each test runs one row of `benchmarks/fault_matrix.py` (the one implementation of the
stacks, the load and the faults; docs/reliability.md holds its full table) with a few
seconds of load, and asserts the client-side counts: 0 failed requests wherever the
promise says so, and losses only on a killed router. The other rows are covered here
elsewhere: a mixed engine killed or frozen (test_router_e2e), a `serve` engine killed
(test_serve), a prefill engine frozen or killed mid-pull (test_disagg_failures).

Faults during each phase of a Rolling refit share one `tandem serve --engines 2`, refitted
back and forth between two checkpoints, one case per phase.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fault_matrix

pytestmark = pytest.mark.slow
DURATION_S = 3.0
STREAMS = 6


def test_a_full_log_folder_fails_no_request_and_kills_no_process(
        tiny_llama: Path, tmp_path: Path) -> None:
    """`tandem serve`'s log folder on a full 1 MiB tmpfs (or logs that are /dev/full), and
    an engine killed meanwhile so that everyone writes logs: no request fails, no child
    dies of a write error, the killed engine restarts."""
    row = fault_matrix.log_disk_full(tiny_llama, tmp_path, DURATION_S, STREAMS)
    assert row.sent > 0 and row.failed == 0, (row, row.detail["errors"][:3])
    assert row.detail["serving"] and row.detail["others_died"] == 0, row
    assert row.held, row


def test_a_killed_router_loses_only_its_own_requests(tiny_llama: Path, tmp_path: Path) -> None:
    """Two routers over the same engine, clients spread over both; kill -9 of one: the
    requests it had are the only losses (counted), the other router fails none.

    Exactly: every client stream on the killed router loses at most the one request it had
    in flight there and then moves to the other router, once. A request broken before its
    response began is a connection error and moves its stream at once; one broken
    mid-stream fails otherwise, and the stream's next request finds nobody listening
    (refused, not sent); a stream that was between two requests is only refused."""
    row = fault_matrix.router_fault(tiny_llama, tmp_path, True, DURATION_S, STREAMS, engines=1)
    victim, survivor = row.detail["victim"], row.detail["survivor"]
    on_victim = len(range(0, STREAMS, 2))  # stream i starts on router i % 2
    assert survivor.sent > 0 and survivor.failed == 0, (row, survivor.errors[:3])
    assert survivor.refused == 0, row
    moved_at_once = sum("APIConnectionError" in e for e in victim.errors)
    assert victim.refused + moved_at_once == on_victim, victim  # one move per stream
    assert 1 <= victim.failed <= on_victim, victim  # streams run back to back
    assert row.failed == victim.failed
    assert row.detail["engines_alive"], row
    assert row.held, row


def test_a_killed_operator_fails_no_request_and_churns_no_pod(
        tiny_llama: Path, tmp_path: Path) -> None:
    """kill -9 of the operator while its pool serves: no request fails; the restarted
    operator reconciles the pool and takes no action (same pods, same uids)."""
    pytest.importorskip("kopf")
    row = fault_matrix.operator_fault(tiny_llama, tmp_path, True, DURATION_S, STREAMS)
    assert row.sent > 0 and row.failed == 0, row
    assert row.detail["actions"] == 0, row
    assert row.detail["pods_before"] == row.detail["pods_after"], row
    assert len(row.detail["pods_after"]) == 2, row  # the engine and the router
    assert row.held, row


@pytest.fixture(scope="module")
def refit_serve(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[fault_matrix.Serve, dict[str, Path]]]:
    """`tandem serve --engines 2` on v1 that may refit to v2 (its --weights-root)."""
    from tandem_engine.cli.demo_model import write_demo_model

    root = tmp_path_factory.mktemp("refit-kill")
    v2 = write_demo_model(root / "weights" / "v2", arch="llama", size="tiny", seed=1)
    serve = fault_matrix.Serve(tiny_llama, root / "serve")
    serve.cmd += ["--weights-root", str(v2.parent)]
    serve.start()
    try:
        fault_matrix.warm_up([serve.url])
        yield serve, {"v1": tiny_llama, "v2": v2}
    finally:
        serve.stop()


def engine_versions(serve: fault_matrix.Serve) -> set[str]:
    """The versions the engines serve, from their own admin APIs: the router's view of an
    engine the last case killed and restarted can lag its load reports."""
    stack = serve.stack()
    token = stack.get("admin_token")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return {httpx.get(f"{e['admin_url']}/v1/state", headers=headers, timeout=10
                      ).json()["weight_version"] for e in stack["engines"]}


# The phases that stranded requests before; `refit` (engine-0 off RUNNING when engine-1
# dies) is a row of benchmarks/fault_matrix.py: each case waits out an engine restart.
@pytest.mark.parametrize("phase", ["drain", "last"])
def test_an_engine_killed_during_a_rolling_refit_fails_no_request(
        refit_serve: tuple[fault_matrix.Serve, dict[str, Path]], phase: str) -> None:
    """kill -9 of engine-1 while wave 1 drains engine-0 (the wave is re-planned: engine-0
    serves again until engine-1 is back, so engine-1's requests continue on their own
    version), or while wave 2 drains engine-1, the old version's last engine (its requests
    continue on the new weights by recompute at once, not after a 30 s failover timeout).
    No request fails, and the refit ends with both engines on the target once engine-1
    is back: a killed engine is no reason to roll back."""
    serve, checkpoints = refit_serve
    version = "v1" if engine_versions(serve) == {"v2"} else "v2"
    row = fault_matrix.refit_engine_kill(serve, checkpoints[version], version, phase, 4)
    assert row.sent > 0 and row.failed == 0, (row, row.detail["errors"][:3],
                                              row.detail["refit_out"][-3000:])
    assert row.detail["refit_rc"] == 0, row.detail["refit_out"][-3000:]
    assert row.detail["versions"] == [version, version], row
    assert row.held, row
