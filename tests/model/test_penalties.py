"""repetition_penalty, presence_penalty, frequency_penalty and min_p against references.

Each transform's logits equal transformers' logits processors on the same logits
(`RepetitionPenaltyLogitsProcessor`, `MinPLogitsWarper`); presence and frequency have no
transformers processor, so they are checked against the OpenAI docs' formula, token by
token. End to end on the tiny demo checkpoint, greedy generation with the penalties
equals transformers `generate` token for token, and the penalties keep the engine's
promises: per-row values in a batch, seeds, resumed requests, the prefix cache.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from reference import GAP_TIE, _model, random_prompts
from tandem_engine import LLM, RequestRejected, SamplingParams
from tandem_engine.model.sampler import Sampler, min_p_filter, sample_row
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

MAX_NEW = 16
V = 64


def _history(seed: int, n_prompt: int, n_output: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    # A small id range so tokens repeat: counts above one, prompt and output overlapping.
    return (torch.randint(0, 24, (n_prompt,), generator=g).tolist(),
            torch.randint(8, 32, (n_output,), generator=g).tolist())


class _History:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt_token_ids = prompt
        self.token_ids = prompt + output


def _openai_formula(logits: torch.Tensor, output: list[int], presence: float,
                    frequency: float) -> torch.Tensor:
    """OpenAI's definition, written out per token:
    mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for j in range(logits.shape[-1]):
        c = output.count(j)
        out[j] = logits[j] - c * frequency - float(c > 0) * presence
    return out


# ---- each transform against its reference --------------------------------------------------

@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty: float) -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 4
    histories = [_History(*_history(i, 10 + i, 5 * i)) for i in range(3)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=penalty)] * 3
    ours = Sampler(0).penalize(logits, [0, 1, 2], ["a", "b", "c"], params, histories)
    for row, h in enumerate(histories):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([h.token_ids]), logits[row:row + 1].clone())
        assert torch.equal(ours[row], hf[0]), f"row {row} differs from transformers"


@pytest.mark.parametrize(("presence", "frequency"), [(0.7, 0.0), (0.0, 0.4), (-1.5, 2.0),
                                                     (2.0, -2.0)])
def test_presence_and_frequency_equal_the_openai_formula(presence: float,
                                                         frequency: float) -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 4
    histories = [_History(*_history(10 + i, 12, 3 + 6 * i)) for i in range(3)]
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 3
    ours = Sampler(0).penalize(logits, [0, 1, 2], ["a", "b", "c"], params, histories)
    for row, h in enumerate(histories):
        output = h.token_ids[len(h.prompt_token_ids):]
        expected = _openai_formula(logits[row], output, presence, frequency)
        torch.testing.assert_close(ours[row], expected, rtol=0, atol=1e-6)
        # Prompt tokens do not count: a token only in the prompt keeps its logit.
        only_prompt = set(h.prompt_token_ids) - set(output)
        assert all(ours[row, t] == logits[row, t] for t in only_prompt)


def test_all_three_penalties_compose_as_vllm_orders_them() -> None:
    """Repetition first (HF processor), then the OpenAI formula on its result."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3)) * 4
    prompt, output = _history(7, 20, 15)
    p = SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    ours = Sampler(0).penalize(logits, [0], ["a"], [p], [_History(prompt, output)])
    repeated = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([prompt + output]),
                                                     logits.clone())
    expected = _openai_formula(repeated[0], output, 0.3, 0.2)
    torch.testing.assert_close(ours[0], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_equals_transformers_warper_after_temperature(min_p: float,
                                                            temperature: float) -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4)) * 3
    scaled = logits / temperature
    hf = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), scaled.clone())
    assert torch.equal(min_p_filter(scaled, min_p), hf)
    for row in range(4):  # the sampler's per-row call
        assert torch.equal(min_p_filter(scaled[row], min_p), hf[row])


def test_min_p_samples_only_inside_its_support() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    params = SamplingParams(min_p=0.5)  # keeps p >= 0.2: the first two
    g = torch.Generator().manual_seed(0)
    drawn = {sample_row(probs.log(), params, g) for _ in range(2000)}
    assert drawn == {0, 1}


def test_greedy_picks_the_argmax_of_the_penalized_logits() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    top = int(logits[0].argmax())
    # The top token is in the prompt; a strong repetition penalty moves greedy off it.
    history = _History([top], [])
    params = [SamplingParams(temperature=0.0, repetition_penalty=50.0),
              SamplingParams(temperature=0.0)]
    result = Sampler(0).sample(logits, ["a", "b"], params, [(), ()], [history, history])
    expected = RepetitionPenaltyLogitsProcessor(50.0)(torch.tensor([[top]]),
                                                      logits[:1].clone())
    assert result.token_ids[0] == int(expected.argmax()) != top
    assert result.token_ids[1] == int(logits[1].argmax())


def test_plain_rows_never_read_histories() -> None:
    """The fast path: no penalty in a row, no look at its tokens (None is fine)."""
    class Untouchable:
        def __getattr__(self, name: str):
            raise AssertionError(f"a plain row's history was read ({name})")

    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    plain = [SamplingParams(temperature=0.0), SamplingParams(seed=3, min_p=0.1)]
    Sampler(0).sample(logits[:2], ["a", "b"], plain, [(), ()])  # no histories at all
    mixed = [*plain, SamplingParams(frequency_penalty=1.0, seed=4)]
    histories = [Untouchable(), Untouchable(), _History([1, 2], [3])]
    Sampler(0).sample(logits, ["a", "b", "c"], mixed, [(), (), ()], histories)


# ---- end to end on the tiny checkpoint --------------------------------------------------------

class _OpenAIPenalties(LogitsProcessor):
    """presence/frequency over generated tokens only, for transformers' generate."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def _hf_penalized_greedy(path: Path, prompt: list[int], repetition: float = 1.0,
                         presence: float = 0.0, frequency: float = 0.0
                         ) -> tuple[list[int], int]:
    """transformers' greedy tokens, and how many lead before a near-tie of the processed
    scores (where float noise between batch layouts may flip a choice)."""
    model = _model(str(path))
    extra = LogitsProcessorList()
    if presence or frequency:
        extra.append(_OpenAIPenalties(len(prompt), presence, frequency))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                             repetition_penalty=repetition, logits_processor=extra,
                             output_scores=True, return_dict_in_generate=True)
    scores = torch.stack(out.scores)[:, 0].float()
    top2 = scores.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    decisive = next((i for i, gap in enumerate(gaps) if gap < GAP_TIE), len(gaps))
    return out.sequences[0, len(prompt):].tolist(), decisive


def _prompts(model_dir: Path) -> list[list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return random_prompts(vocab, [5, 23, 60], seed=3)


@cache
def _echo_prompts(model_dir: Path) -> list[list[int]]:
    """Prompts that hold the tokens the model is about to choose: base + its plain greedy
    continuation + base again. The random demo weights never repeat a token on their own,
    so on plain random prompts a penalty against repeats would change nothing."""
    return [p + _hf_penalized_greedy(model_dir, p)[0] + p for p in _prompts(model_dir)]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(tiny_llama, max_num_batched_tokens=128)


def _greedy(**penalties: float) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **penalties)


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8},
    {"presence_penalty": -2.0, "frequency_penalty": -1.0},
    {"repetition_penalty": 0.5, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 1.0},
], ids=lambda p: ",".join(f"{k.split('_')[0]}={v}" for k, v in p.items()))
def test_penalized_greedy_matches_transformers_generate(tiny_llama: Path, llm: LLM,
                                                        penalties: dict) -> None:
    prompts = _prompts(tiny_llama) + _echo_prompts(tiny_llama)
    outputs = llm.generate(prompts, _greedy(**penalties))  # one batch
    plain = llm.generate(prompts, _greedy())
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, decisive = _hf_penalized_greedy(
            tiny_llama, prompt, penalties.get("repetition_penalty", 1.0),
            penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0))
        tokens = out.outputs[0].token_ids
        assert tokens[:decisive] == ref[:decisive], (
            f"penalized greedy differs from transformers within {decisive} decisive steps:"
            f"\n  tandem: {tokens}\n  hf:     {ref}")
        compared += decisive
    assert compared >= 0.9 * MAX_NEW * len(prompts), f"only {compared} tokens were decisive"
    # The penalty really acted: some completion is not the plain greedy one.
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


def test_min_p_is_a_no_op_for_greedy_and_min_p_one_is_greedy(tiny_llama: Path,
                                                               llm: LLM) -> None:
    prompts = _prompts(tiny_llama)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    with_min_p = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                      ignore_eos=True, min_p=0.9))
    assert [o.outputs[0].token_ids for o in with_min_p] == plain
    # min_p = 1 keeps only the most likely token: sampling is then greedy.
    sampled = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=1.0,
                                                   ignore_eos=True, min_p=1.0, seed=5))
    assert [o.outputs[0].token_ids for o in sampled] == plain


def test_a_batch_mixing_penalized_and_plain_rows_changes_no_row(tiny_llama: Path,
                                                                llm: LLM) -> None:
    prompt = _echo_prompts(tiny_llama)[1]  # where repetition_penalty changes choices
    kinds = [
        _greedy(),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=11, ignore_eos=True),
        _greedy(repetition_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=12, ignore_eos=True,
                       min_p=0.05, presence_penalty=1.0, repetition_penalty=1.2),
        _greedy(presence_penalty=-1.0),
    ]
    alone = [llm.generate([prompt], p)[0].outputs[0].token_ids for p in kinds]
    together = [o.outputs[0].token_ids for o in llm.generate([prompt] * len(kinds), kinds)]
    assert together == alone
    assert alone[2] != alone[0]  # the penalty really acts on this prompt


def test_resumed_tokens_count_as_output(tiny_llama: Path, llm: LLM) -> None:
    prompt = _prompts(tiny_llama)[0]
    # Negative penalties: the random demo weights repeat a token only when pushed to.
    penalties = {"presence_penalty": -2.0, "frequency_penalty": -1.0,
                 "repetition_penalty": 0.9}
    full = llm.generate([prompt], _greedy(**penalties))[0].outputs[0].token_ids
    engine = llm.engine
    request = engine.add_request("resumed", prompt, _greedy(**penalties),
                                 resumed_token_ids=full[:3])
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_token_ids == full
    # Counted as prompt instead, presence/frequency would not see them: it matters here.
    as_prompt = llm.generate([prompt + full[:3]], SamplingParams(
        max_tokens=MAX_NEW - 3, temperature=0.0, ignore_eos=True, **penalties))
    assert as_prompt[0].outputs[0].token_ids != full[3:]


def test_preemption_keeps_penalized_tokens(tiny_llama: Path, llm: LLM) -> None:
    """A preempted request recomputes its KV; its prompt and output stay what they were."""
    prompts = _prompts(tiny_llama) + _echo_prompts(tiny_llama)
    params = _greedy(repetition_penalty=1.3, presence_penalty=-1.0)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = LLM(tiny_llama, num_blocks=14, max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == expected
    assert small.engine.num_preemptions > 0


def test_prefix_cache_hits_give_the_same_penalized_tokens(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, max_num_batched_tokens=128)
    prompt = _echo_prompts(tiny_llama)[1]  # 62 tokens: three full 16-token blocks to reuse
    params = _greedy(repetition_penalty=1.3, frequency_penalty=0.5)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    before = llm.engine.prefix_cache_stats()["hit_tokens"]
    second = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert llm.engine.prefix_cache_stats()["hit_tokens"] > before
    assert second == first
    assert first != llm.generate([prompt], _greedy())[0].outputs[0].token_ids


def test_seeded_penalized_sampling_is_reproducible(tiny_llama: Path, llm: LLM) -> None:
    prompt = _prompts(tiny_llama)[0]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=21, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.5, min_p=0.02)
    runs = [llm.generate([prompt], params)[0].outputs[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "value", "limit"), [
    ("repetition_penalty", 0.0, "[0.01, 100]"),
    ("repetition_penalty", -1.0, "[0.01, 100]"),
    ("repetition_penalty", 1e-40, "[0.01, 100]"),
    ("repetition_penalty", 101.0, "[0.01, 100]"),
    ("repetition_penalty", float("nan"), "[0.01, 100]"),
    ("repetition_penalty", float("inf"), "[0.01, 100]"),
    ("repetition_penalty", "1.2", "[0.01, 100]"),
    ("presence_penalty", 2.01, "[-2, 2]"),
    ("presence_penalty", -3, "[-2, 2]"),
    ("presence_penalty", float("nan"), "[-2, 2]"),
    ("presence_penalty", True, "[-2, 2]"),
    ("frequency_penalty", -2.5, "[-2, 2]"),
    ("frequency_penalty", float("-inf"), "[-2, 2]"),
    ("frequency_penalty", None, "[-2, 2]"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("min_p", float("nan"), "[0, 1]"),
    ("min_p", "0.1", "[0, 1]"),
])
def test_bad_values_are_refused_naming_the_parameter_and_its_limit(name: str, value: object,
                                                                   limit: str) -> None:
    with pytest.raises(RequestRejected) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert f"sampling parameter {name}=" in message and limit in message
    assert "= off" in message  # says how to turn it off


@pytest.mark.parametrize("values", [
    {"repetition_penalty": 0.01}, {"repetition_penalty": 100}, {"repetition_penalty": 1},
    {"presence_penalty": -2}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0},
    {"frequency_penalty": 2}, {"min_p": 0}, {"min_p": 1}, {"min_p": 0.05},
])
def test_limits_are_inclusive(values: dict) -> None:
    SamplingParams(**values)
