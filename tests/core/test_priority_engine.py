"""Request priority through the real engine (vLLM's semantics: lower first, equal
priorities by arrival): a late urgent request overtakes the queue and preempts the
latest arrival of a full batch; `LLM.generate(priority=...)` passes one per prompt; a
completed request's seat waits for its priority's next request (`seat_reserve_ms`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem_engine import LLM, SamplingParams
from tandem_engine.core.request import RequestStatus

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    return [5 + i, 6, 7, 8, 9, 10]


def test_a_late_urgent_request_gets_its_first_token_before_the_queue(
        tiny_llama: Path) -> None:
    engine = LLM(tiny_llama, max_num_seqs=2).engine
    normal = [f"n{i}" for i in range(6)]
    for i, rid in enumerate(normal):
        engine.add_request(rid, _prompt(i), PARAMS)
    first_token_step: dict[str, int] = {}
    finished: dict[str, int] = {}

    def step(number: int) -> None:
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token_step.setdefault(out.request_id, number)
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)

    step(0)  # n0 and n1 run: the batch is full
    assert set(first_token_step) == {"n0", "n1"}
    engine.add_request("urgent", _prompt(9), PARAMS, priority=-1)
    step(1)
    # It takes the seat of the latest arrival (recomputed later), ahead of n2..n5.
    assert first_token_step["urgent"] == 1 and engine.num_preemptions == 1
    number = 2
    while engine.has_unfinished_requests():
        step(number)
        number += 1
    assert all(first_token_step["urgent"] < first_token_step[rid] for rid in normal[2:])
    assert finished == {rid: PARAMS.max_tokens for rid in [*normal, "urgent"]}
    assert engine.num_preemptions == 1  # nobody preempts an equal priority


def test_generate_takes_one_priority_per_prompt(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, max_num_seqs=1)
    order: list[str] = []
    step = llm.engine.step

    def recording_step():
        outputs = step()
        order.extend(o.request_id for o in outputs if o.outputs[0].token_ids
                     and o.request_id not in order)
        return outputs

    llm.engine.step = recording_step  # type: ignore[method-assign]
    outputs = llm.generate([_prompt(i) for i in range(3)], PARAMS, priority=[1, 1, 0])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6, 6]
    assert order == ["llm-2", "llm-0", "llm-1"]
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([_prompt(0), _prompt(1)], PARAMS, priority=[0])


@pytest.mark.parametrize("reserve_ms", [1000, 0, None])
def test_a_light_clients_next_request_finds_its_seat_free(tiny_llama: Path,
                                                           reserve_ms: int | None) -> None:
    """Two seats: a light client's request (priority 0) beside a heavy one's (5), more
    heavy ones waiting. When the light request completes, its seat stays free for the
    light client's next request, which then runs at once and preempts nobody; with the
    reservation off (0, and the offline `LLM`'s default: None), a heavy request takes the
    seat and is preempted (its prefill wasted) when the light client comes back."""
    options = {} if reserve_ms is None else {"seat_reserve_ms": reserve_ms}
    engine = LLM(tiny_llama, max_num_seqs=2, **options).engine
    light = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    heavy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("light-1", _prompt(0), light, priority=0)
    for i in range(3):
        engine.add_request(f"heavy-{i}", _prompt(1 + i), heavy, priority=5)
    finished: list[str] = []
    while "light-1" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    engine.step()  # the client's next request is on its way meanwhile
    queued = engine.requests["heavy-1"]
    assert (queued.status is RequestStatus.WAITING) == bool(reserve_ms)
    engine.add_request("light-2", _prompt(9), light, priority=0)
    engine.step()
    assert engine.requests["light-2"].status is RequestStatus.RUNNING
    assert engine.num_preemptions == (0 if reserve_ms else 1)
    while engine.has_unfinished_requests():
        engine.step()
