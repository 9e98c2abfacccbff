"""Request priority through the real engine (vLLM's semantics: lower first, equal
priorities by arrival): a late urgent request overtakes the queue and preempts the
latest arrival of a full batch; `LLM.generate(priority=...)` passes one per prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem_engine import LLM, SamplingParams

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
