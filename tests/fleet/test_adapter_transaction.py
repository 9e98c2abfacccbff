"""The adapter transaction's rules (tandem_engine.fleet.adapters), without engines: what each
engine must load or unload, waves, when it is done, reopening, and the record the operator
keeps in status. The steps against real engines run in
tests/operator_tests/test_operator_adapters.py."""

from __future__ import annotations

import json

from tandem_engine.fleet.adapters import (
    STAGING_PREFIX,
    AdapterEngineRecord,
    AdapterObs,
    AdapterRef,
    AdapterTransaction,
    adapter_set,
    begin,
    changes,
    choose_wave,
    describe,
    done,
    finished,
    leftovers,
    lora_off,
    managed,
    reopen,
    same_score,
    staging_name,
)
from tandem_engine.fleet.transaction import Failure, Phase
from tandem_engine.lifecycle import EngineState
from tandem_engine.refit_policy import OnFailure, RefitStrategy

SQL1 = AdapterRef("sql", "1", "file:///adapters/sql-v1")
SQL2 = AdapterRef("sql", "2", "file:///adapters/sql-v2")
CHAT1 = AdapterRef("chat", "1", "file:///adapters/chat-v1")


def engine(name: str, *loras: str, state: EngineState | None = EngineState.RUNNING,
           lora: bool = True) -> AdapterObs:
    role = "prefill" if name.startswith("prefill") else "decode"
    return AdapterObs(name, role, f"http://{name}", state, tuple(loras) if lora else None)


def tx_to(target: list[AdapterRef], previous: list[AdapterRef], **kw) -> AdapterTransaction:
    tx = begin(adapter_set(target), adapter_set(previous), 100.0)
    for key, value in kw.items():
        setattr(tx, key, value)
    return tx


def test_an_engine_loads_the_new_version_and_unloads_what_the_goal_dropped() -> None:
    tx = tx_to([SQL2], [SQL1, CHAT1])
    e = engine("decode-a", "sql@1", "chat@1", "other@3")
    loads, unloads = changes(tx, e)
    assert loads == [SQL2]  # replaces sql@1 in place
    assert unloads == ["chat"]
    # An adapter the pool does not manage (loaded through the router) is left alone.
    assert managed(tx, e) == {"sql@1", "chat@1"}
    assert not done(tx, e)
    assert done(tx, engine("decode-a", "sql@2", "other@3"))


def test_a_rollback_moves_engines_back_to_the_previous_set() -> None:
    tx = tx_to([SQL2, CHAT1], [SQL1], phase=Phase.ROLLING_BACK)
    assert tx.goal == {"sql": SQL1}
    loads, unloads = changes(tx, engine("prefill-a", "sql@2", "chat@1"))
    assert loads == [SQL1] and unloads == ["chat"]


def test_rolling_waves_take_one_engine_per_role_and_wait_for_the_wave() -> None:
    tx = tx_to([SQL2], [SQL1], max_unavailable=1)
    fleet = [engine(n, "sql@1") for n in ("prefill-b", "prefill-a", "decode-b", "decode-a")]
    assert choose_wave(tx, fleet) == ["decode-a", "prefill-a"]
    tx.engines = {n: AdapterEngineRecord() for n in ("decode-a", "prefill-a")}
    assert choose_wave(tx, fleet) == []  # the wave is under way
    fleet = [engine("prefill-a", "sql@2"), engine("decode-a", "sql@2"),
             engine("prefill-b", "sql@1"), engine("decode-b", "sql@1")]
    assert choose_wave(tx, fleet) == ["decode-b", "prefill-b"]
    # Two per role with a budget of 2; AllAtOnce takes everything behind.
    tx = tx_to([SQL2], [SQL1], max_unavailable=2)
    fleet = [engine(n, "sql@1") for n in ("prefill-a", "prefill-b", "decode-a", "decode-b",
                                          "decode-c")]
    assert choose_wave(tx, fleet) == ["decode-a", "decode-b", "prefill-a", "prefill-b"]
    tx = tx_to([SQL2], [SQL1], strategy=RefitStrategy.ALL_AT_ONCE)
    assert len(choose_wave(tx, fleet)) == 5


def test_engines_that_do_not_answer_or_are_on_the_goal_are_not_taken() -> None:
    tx = tx_to([SQL2], [SQL1])
    fleet = [engine("decode-a", state=None), engine("decode-b", "sql@2"),
             engine("decode-c", "sql@1", state=EngineState.SUSPENDED),
             engine("decode-d", "sql@1")]
    assert choose_wave(tx, fleet) == ["decode-d"]
    # Finished once every engine that answers and serves is on the goal.
    assert not finished(tx, fleet)
    assert finished(tx, [engine("decode-a", state=None), engine("decode-b", "sql@2")])
    assert not finished(tx, [engine("decode-a", state=None)])  # nobody answers: not proven


def test_an_engine_without_lora_is_named_while_the_goal_has_adapters() -> None:
    tx = tx_to([SQL2], [])
    fleet = [engine("decode-a", lora=False), engine("decode-b")]
    assert lora_off(tx, fleet) == ["decode-a"]
    assert lora_off(tx_to([], []), fleet) == []


def test_staging_names_are_the_operator_s_and_are_cleaned_up() -> None:
    assert staging_name("sql") == STAGING_PREFIX + "sql"
    assert len(staging_name("x" * 128)) == 128
    e = engine("decode-a", "sql@1", f"{STAGING_PREFIX}sql@2")
    assert leftovers(e) == [f"{STAGING_PREFIX}sql"]
    tx = tx_to([SQL1], [SQL1])
    assert done(tx, e)  # a staging name is not one of the pool's adapters


def test_a_finished_transaction_reopens_for_an_engine_off_its_final_set() -> None:
    tx = tx_to([SQL2], [SQL1], phase=Phase.SUCCEEDED, finished_at=150.0)
    tx.engines = {"decode-new": AdapterEngineRecord(since=120.0)}
    fleet = [engine("decode-a", "sql@2"), engine("decode-new", "sql@1")]
    events = reopen(tx, fleet, 200.0)
    assert tx.phase is Phase.PROGRESSING and tx.finished_at is None
    assert "decode-new" not in tx.engines  # it joins the next wave
    assert [e.reason for e in events] == ["AdapterRefitResumed"]
    assert "decode-new (sql@1)" in events[0].message
    rolled = tx_to([SQL2], [SQL1], phase=Phase.ROLLED_BACK)
    reopen(rolled, fleet, 200.0)
    assert rolled.phase is Phase.ROLLING_BACK
    settled = tx_to([SQL2], [SQL1], phase=Phase.SUCCEEDED)
    assert reopen(settled, [engine("decode-a", "sql@2")], 200.0) == []


def test_two_canaries_of_one_version_agree_within_the_near_tie_rule() -> None:
    assert same_score(2.3456, 2.3456 + 1e-6)
    assert same_score(0.0, 5e-5)
    assert not same_score(2.3456, 2.36)


def test_the_record_survives_status_as_json() -> None:
    tx = tx_to([SQL2, CHAT1], [SQL1], strategy=RefitStrategy.ALL_AT_ONCE,
               on_failure=OnFailure.HALT, max_unavailable=2, wave=3, phase=Phase.HALTED,
               finished_at=130.5)
    tx.engines = {"decode-a": AdapterEngineRecord(since=101.0, verified=["sql@2"])}
    tx.scores = {"sql@2": 4.25}
    tx.failure = Failure("decode-b", "POST /v1/load_lora_adapter", "HTTP 400: bad shapes")
    data = json.loads(json.dumps(tx.to_dict()))
    assert data["target"] == [CHAT1.to_dict(), SQL2.to_dict()]  # sorted by name
    assert data["phase"] == "Halted" and data["strategy"] == "AllAtOnce"
    assert AdapterTransaction.from_dict(data) == tx


def test_describe_names_identities_in_order() -> None:
    assert describe(adapter_set([SQL2, CHAT1])) == "chat@1, sql@2"
    assert describe({}) == "none"


class StuckAdmin:
    """An admin client whose every call answers HTTP 500 (an engine that keeps failing):
    the one stand-in here, for the engine's side of `advance`, which the operator test
    runs against real engines."""

    async def call(self, engine: str, url: str, path: str, body=None, timeout=None):
        from tandem_engine.fleet.admin import AdminError

        raise AdminError(engine, f"POST {path}", "HTTP 500: internal error", 500)


def test_an_engine_that_keeps_failing_fails_the_transaction_after_the_step_timeout() -> None:
    import asyncio

    from tandem_engine.fleet.adapters import advance

    tx = tx_to([SQL2], [SQL1], step_timeout=300.0)
    fleet = [engine("decode-a", "sql@1")]
    paths = {"sql": "/adapters/sql-v2"}
    asyncio.run(advance(tx, fleet, StuckAdmin(), paths, 100.0))
    assert tx.phase is Phase.PROGRESSING and tx.engines["decode-a"].last_error.endswith(
        "internal error")
    asyncio.run(advance(tx, fleet, StuckAdmin(), paths, 350.0))  # retried: within the timeout
    assert tx.phase is Phase.PROGRESSING
    events = asyncio.run(advance(tx, fleet, StuckAdmin(), paths, 401.0))
    assert tx.phase is Phase.ROLLING_BACK
    assert tx.failure is not None and tx.failure.engine == "decode-a"
    assert "no progress in 300 s" in tx.failure.message
    assert [e.reason for e in events] == ["AdapterRefitFailed", "AdapterRefitRollingBack"]
