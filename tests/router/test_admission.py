"""The router's admission control (router/admission.py), without processes: key lines,
model scoping, rate limits over a sliding minute, the in-flight bound, and the order it
gives the engines (priority, then VTC fairness). tests/router/test_admission_e2e.py runs
them through real routers and engines."""

from __future__ import annotations

import pytest
from tandem_engine.router.admission import (
    FAIRNESS_LEVELS,
    QUANTUM_TOKENS,
    Admission,
    KeyPolicy,
    RateWindow,
    Refused,
    default_tenant_name,
)
from tandem_engine.router.auth import parse_key_line, policy_lines, resolve_key_policies


def test_key_lines_say_what_a_key_may_do() -> None:
    key, policy = parse_key_line("sk-1 tenant=acme rpm=60 tpm=5000 models=tiny,sql weight=2")
    assert key == "sk-1"
    assert policy == KeyPolicy("acme", 60, 5000, frozenset({"tiny", "sql"}), 2.0)
    key, policy = parse_key_line("sk-2")
    assert policy == KeyPolicy(default_tenant_name("sk-2"))
    assert "sk-2" not in policy.tenant  # metrics show tenants, never keys
    for line, words in (("sk rpm=0", "rpm='0'"), ("sk rpm=x", "rpm='x'"),
                        ("sk color=red", "'color=red' is not one of"),
                        ("sk rpm=1 rpm=2", "'rpm=2'"), ("sk weight=0", "weight='0'"),
                        ("sk tenant=" + "x" * 65, "at most 64")):
        with pytest.raises(ValueError, match=words):
            parse_key_line(line)
    policies = resolve_key_policies(None, {"TANDEM_API_KEY": "a tenant=t rpm=5\nb"})
    assert resolve_key_policies(None, {"TANDEM_API_KEY": policy_lines(policies)}) == policies


def test_a_key_scoped_to_models_gets_404_for_others() -> None:
    admission = Admission({"k": KeyPolicy("acme", models=frozenset({"tiny"}))})
    admission.admit("k", None, "tiny", 0, 5).done(0)
    with pytest.raises(Refused) as refused:
        admission.admit("k", None, "sql", 0, 5)
    assert refused.value.status == 404 and refused.value.code == "model_not_found"
    assert "may use tiny" in refused.value.message
    assert admission.refused == {("acme", "model_not_allowed"): 1}


def test_requests_per_minute_hold_over_a_sliding_minute() -> None:
    admission = Admission({"k": KeyPolicy("acme", rpm=3)})
    for t in (0.0, 10.0, 20.0):
        admission.admit("k", None, "m", 0, 1, now=t).done(0)
    with pytest.raises(Refused) as refused:
        admission.admit("k", None, "m", 0, 1, now=30.0)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.retry_after == pytest.approx(30.0)  # the request at 0 s expires
    assert "3 requests per minute" in refused.value.message
    admission.admit("k", None, "m", 0, 1, now=60.5).done(0)  # the window moved on


def test_tokens_per_minute_count_prompts_and_outputs() -> None:
    admission = Admission({"k": KeyPolicy("acme", tpm=100)})
    ticket = admission.admit("k", None, "m", 0, 30)
    ticket.done(50)  # 80 used
    with pytest.raises(Refused) as refused:
        admission.admit("k", None, "m", 0, 30)
    assert "100 tokens per minute" in refused.value.message
    admission.admit("k", None, "m", 0, 20).done(0)  # exactly 100


def test_a_rate_window_waits_for_room() -> None:
    window = RateWindow(10)
    window.take(4, 0.0)
    window.take(6, 5.0)
    assert window.wait_for(1, 6.0) == pytest.approx(54.0)
    assert window.wait_for(5, 6.0) == pytest.approx(59.0)  # both takes must expire
    assert window.wait_for(7, 6.0) == pytest.approx(59.0)
    assert window.wait_for(1, 60.0) == 0.0


def test_the_in_flight_bound_refuses_at_once_and_frees_when_done() -> None:
    admission = Admission(max_num_requests=2)
    admission.enter(None, None)
    admission.enter(None, "other")
    with pytest.raises(Refused) as refused:
        admission.enter(None, "third")
    assert refused.value.status == 429 and refused.value.retry_after == 1.0
    assert "--max-num-requests 2" in refused.value.message
    assert admission.refused == {("third", "router_full"): 1}
    admission.leave()
    assert admission.inflight == 1
    admission.enter(None, None)


def test_a_ticket_ends_once() -> None:
    admission = Admission()
    ticket = admission.admit(None, "t", "m", 0, 4, 4)
    ticket.done(3)
    ticket.done(3)  # once only
    assert {name: (work, active) for name, work, active in admission.tenants()} == \
        {"t": (0, 0)}


def test_priority_comes_first_then_the_tenant_with_less_work_in_flight() -> None:
    admission = Admission()
    q = QUANTUM_TOKENS
    heavy = [admission.admit(None, "heavy", "m", 0, q - 8, 8) for _ in range(5)]
    # log2(1 + the work in flight, in quanta): 0, 1, 2, 3, 4 quanta
    assert [t.engine_priority for t in heavy] == [0, 1, 1, 2, 2]
    light = admission.admit(None, "light", "m", 0, q - 8, 8)
    assert light.engine_priority == 0  # nothing in flight: ahead of heavy's later ones
    urgent = admission.admit(None, "heavy", "m", -1, 10, 0)
    assert urgent.engine_priority < light.engine_priority  # priority before fairness
    assert urgent.engine_priority == -FAIRNESS_LEVELS + 2  # 5 quanta in flight
    for t in heavy:
        t.done(8)
    assert admission.admit(None, "heavy", "m", 0, 10, 0).engine_priority == 0
    assert {name: work for name, work, _ in admission.tenants()} == {"heavy": 20,
                                                                    "light": q}


def test_a_weight_scales_a_tenant_s_share() -> None:
    admission = Admission({"big": KeyPolicy("big", weight=4.0)})
    tags = [admission.admit("big", None, "m", 0, QUANTUM_TOKENS, 0).engine_priority
            for _ in range(8)]
    assert tags == [0, 0, 0, 0, 1, 1, 1, 1]  # 4 quanta of a weight-4 tenant: one level


def test_tenants_from_headers_stay_bounded(monkeypatch) -> None:
    import tandem_engine.router.admission as a

    monkeypatch.setattr(a, "MAX_TENANTS", 10)
    admission = Admission()
    for i in range(100):
        admission.admit(None, f"t{i}", "m", 0, 1).done(0)
    assert len(list(admission.tenants())) <= 10
