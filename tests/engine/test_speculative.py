"""Speculative decoding (n-gram proposals): the same tokens as without it, fewer steps.

Pure parts first (config validation, the proposer, acceptance, back-off, the
scheduler's block accounting under random drafts and rejections), then the engine on
the three tiny demo architectures against itself with speculation off: greedy token
identity and logprobs, mixed batches, chunked prefill, preemption, prefix hits, stop
conditions landing inside a verified block, penalties, and sampling (seeded runs draw
the same tokens; unseeded ones the same distribution, by a chi-square test).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import random_prompts, same_logprobs
from tandem_engine.config import EngineConfig, SpeculativeConfig
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.request import Request
from tandem_engine.core.scheduler import Scheduler
from tandem_engine.engine.backoff import BACKOFF_FIRST_PAUSE, AcceptanceBackoff
from tandem_engine.engine.llm import LLM
from tandem_engine.engine.speculative import (
    SpecDecodeCounters,
    accepted_length,
    propose_ngram,
)
from tandem_engine.sampling_params import SamplingParams
from test_scheduler import _check_invariants
from test_scheduler import ops as scheduler_ops

VOCAB = 2048  # the demo tokenizer's
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


# ---- config ------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "needles"), [
    ({"method": "eagle"}, ["method='eagle'", "ngram, draft, mtp"]),
    ({"method": "draft"}, ["model=None", "--speculative-model"]),
    ({"model": "d"}, ["model='d'", "only method draft"]),
    ({"num_speculative_tokens": 0}, ["num_speculative_tokens=0", "between 1 and 16"]),
    ({"num_speculative_tokens": 17}, ["num_speculative_tokens=17", "between 1 and 16"]),
    ({"prompt_lookup_min": 0}, ["prompt_lookup_min=0", "between 1"]),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2},
     ["prompt_lookup_max=2", "prompt_lookup_min (3)", "raise it"]),
    ({"disable_by_batch_size": 0}, ["disable_by_batch_size=0", "positive integer", "unset"]),
])
def test_bad_speculative_config_names_the_field_the_limit_and_the_fix(
        fields: dict, needles: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig(speculative=SpeculativeConfig(**fields)).validate()
    for needle in needles:
        assert needle in str(info.value)


def test_speculative_config_from_a_dict_refuses_unknown_keys() -> None:
    assert SpeculativeConfig.of({"num_speculative_tokens": 3}).num_speculative_tokens == 3
    with pytest.raises(ValueError, match=r"unknown speculative option.*'k'"):
        SpeculativeConfig.of({"k": 3})


# ---- proposer, acceptance, back-off --------------------------------------------------------

def _naive_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        for i in range(size - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[size - n:]:
                # The sequence taken to repeat with period (size - n) - i from there on.
                extended = list(tokens)
                while len(extended) < i + n + k:
                    extended.append(extended[len(extended) - (size - n - i)])
                return extended[i + n:i + n + k]
    return []


def test_ngram_proposes_what_followed_the_most_recent_longest_match() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # [6, 7] last occurred at index 6 (followed by 2, 3, ...), before that at 1.
    assert propose_ngram(tokens, 3, 1, 3) == [2, 3, 6]
    # A longer match wins over a more recent shorter one: [5, 6, 7] ... [9, 5, 6, 7].
    assert propose_ngram([5, 6, 7, 1, 4, 6, 7, 9, 5, 6, 7], 2, 2, 3) == [1, 4]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    # The match runs into the end: the repetition goes on, period 2 and period 3.
    assert propose_ngram([1, 2, 1, 2], 4, 2, 2) == [1, 2, 1, 2]
    assert propose_ngram([7, 1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2, 3, 1]
    assert propose_ngram([1, 2, 1], 0, 1, 2) == []


def test_ngram_skips_byte_matches_that_straddle_two_tokens() -> None:
    # Little-endian words: 0x01020304 0x05060708 hold bytes 04 03 02 01 08 07 06 05, whose
    # middle four spell 0x07080102.
    tricky = [0x01020304, 0x05060708]
    assert propose_ngram([*tricky, 9, 0x07080102], 2, 1, 1) == []
    assert propose_ngram([0x07080102, 5, *tricky, 9, 0x07080102], 2, 1, 1) == [5, tricky[0]]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=0, max_size=40), k=st.integers(1, 5),
       n_min=st.integers(1, 3), extra=st.integers(0, 2))
def test_ngram_agrees_with_the_naive_search(tokens: list[int], k: int, n_min: int,
                                            extra: int) -> None:
    assert propose_ngram(tokens, k, n_min, n_min + extra) == \
        _naive_ngram(tokens, k, n_min, n_min + extra)


def test_acceptance_is_the_longest_agreeing_prefix() -> None:
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_length([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_length([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_length([], [3]) == 0
    counters = SpecDecodeCounters()
    counters.record(3, 2)
    counters.record(4, 0)
    snap = counters.snapshot()
    assert (snap.num_drafts, snap.num_draft_tokens, snap.num_accepted_tokens) == (2, 7, 2)
    assert snap.accepted_per_position == (1, 1, 0, 0)
    assert snap.proposed_per_position == (2, 2, 2, 1)
    assert snap.acceptance_rate == pytest.approx(2 / 7)


def test_backoff_pauses_a_request_whose_drafts_fail_and_doubles_the_pause() -> None:
    b = AcceptanceBackoff()
    b.observe(4, 0, num_output_tokens=10)
    assert b.allows(11)  # one failure is not enough
    b.observe(4, 0, num_output_tokens=11)
    assert not b.allows(11) and not b.allows(11 + BACKOFF_FIRST_PAUSE - 1)
    assert b.allows(11 + BACKOFF_FIRST_PAUSE)
    b.observe(4, 0, num_output_tokens=30)  # the retry fails too: twice as long
    assert not b.allows(30 + 2 * BACKOFF_FIRST_PAUSE - 1)
    assert b.allows(30 + 2 * BACKOFF_FIRST_PAUSE)
    b.observe(4, 4, num_output_tokens=60)  # accepted: proposing goes on, the pause resets
    assert b.allows(61) and b.pause == BACKOFF_FIRST_PAUSE


# ---- scheduler and KV blocks under random drafts -------------------------------------------

BLOCK = 4


def _spec_step(sched: Scheduler, rng: random.Random) -> list[Request]:
    """The engine's step minus the model: propose, schedule, accept a random prefix of
    each draft, append, advance, finish."""
    for r in sched.running:
        room = r.params.max_tokens - r.num_output_tokens - 1
        r.spec_token_ids = ([rng.randrange(50) for _ in range(rng.randint(0, min(4, room)))]
                            if r.num_tokens - r.num_computed_tokens == 1 else [])
    out = sched.schedule()
    done, accepted = [], {}
    for chunk in out.chunks:
        r = chunk.request
        assert chunk.start == r.num_computed_tokens
        if not chunk.samples:
            continue
        emitted = [*chunk.draft[:rng.randint(0, len(chunk.draft))], 7]
        appended = 0
        for token in emitted:
            r.token_ids.append(token)
            appended += 1
            if r.num_output_tokens >= r.params.max_tokens:
                done.append(r)
                break
        if chunk.draft:
            accepted[r.request_id] = appended - 1
    sched.advance(out, accepted)
    for chunk in out.chunks:
        r = chunk.request
        assert r.num_computed_tokens <= r.num_tokens - (1 if chunk.samples else 0)
        if chunk.draft:  # rejected positions' blocks went back
            assert len(sched.kv.block_table(r.request_id)) == \
                sched.kv.blocks_needed(r.num_computed_tokens)
        assert r.num_cached_blocks * BLOCK <= r.num_computed_tokens
    for r in done:
        sched.finish(r)
    return done


spec_ops = scheduler_ops  # the scheduler's own mixes, now with drafts


@settings(max_examples=150, deadline=None)
@given(ops=spec_ops, num_blocks=st.integers(12, 40), budget=st.integers(1, 64),
       max_seqs=st.integers(1, 8), rng=st.randoms(use_true_random=False))
def test_no_block_leaks_after_any_mix_of_drafts_rejections_aborts_and_preemption(
        ops, num_blocks: int, budget: int, max_seqs: int, rng: random.Random) -> None:
    kv = KVCacheManager(num_blocks, BLOCK)
    sched = Scheduler(kv, max_seqs, budget)
    live: dict[int, Request] = {}
    n = 0
    for op, a, b in ops:
        if op == "add":
            prompt_len = min(a, kv.capacity_tokens - b)
            live[n] = Request(f"r{n}", list(range(prompt_len)), SamplingParams(max_tokens=b), n)
            sched.add(live[n])
            n += 1
        elif op == "step":
            for _ in range(a):
                for r in _spec_step(sched, rng):
                    live.pop(r.arrival_index)
        elif live:
            sched.finish(live.pop(sorted(live)[a % len(live)]))
        _check_invariants(sched)
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        _spec_step(sched, rng)
        _check_invariants(sched)
    assert sched.num_unfinished == 0
    assert kv.pool.num_free == num_blocks


def test_a_draft_takes_only_the_room_nobody_else_takes() -> None:
    kv = KVCacheManager(4, BLOCK)
    sched = Scheduler(kv, 4, 64)
    a = Request("a", list(range(7)), SamplingParams(max_tokens=20), 0)
    sched.add(a)
    sched.advance(sched.schedule())
    a.token_ids.append(1)
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]
    b = Request("b", list(range(100, 105)), SamplingParams(max_tokens=20), 1)
    sched.add(b)
    out = sched.schedule()
    # b's prompt takes the two free blocks first: a's draft gets no room (slot 7, its
    # last token's, is the last of its own blocks), and nobody is preempted.
    assert [c.request.request_id for c in out.chunks] == ["a", "b"]
    assert out.chunks[0].draft == () and out.chunks[0].num_tokens == 1
    assert not out.preempted and kv.pool.num_free == 0
    sched.finish(b)
    out = sched.schedule()  # now the two blocks are free: last token + 6 proposals
    assert out.chunks[0].draft == (1, 2, 3, 4, 5, 6) and kv.pool.num_free == 0
    sched.advance(out, {"a": 2})  # 2 accepted: 7 + 1 + 2 = 10 computed, 3 blocks
    assert a.num_computed_tokens == 10 and kv.pool.num_free == 1
    small = Scheduler(KVCacheManager(8, BLOCK), 4, 3)
    c = Request("c", list(range(5)), SamplingParams(max_tokens=20), 2)
    small.add(c)
    small.advance(small.schedule())
    small.advance(small.schedule())
    c.token_ids.append(1)
    c.spec_token_ids = [1, 2, 3, 4]
    assert small.schedule().chunks[0].draft == (1, 2)  # budget 3 = last token + 2


# ---- the engine against itself with speculation off ----------------------------------------
#
# The tiny demo models have random weights: they never copy their prompt, so n-gram
# proposals on them are almost always rejected (the tests of the n-gram method end to end
# use penalties that make them loop). To exercise verification with drafts that are
# mostly right, most tests swap in an oracle proposer that proposes what a run without
# speculation generated for the same prompt (every third draft with a wrong last token).

def _repeating(seed: int, period: int, repeats: int) -> list[int]:
    unit = random_prompts(VOCAB, [period], seed=seed)[0]
    return unit * repeats + unit[:period // 2]


PROMPTS = [_repeating(1, 12, 3), _repeating(2, 7, 5), *random_prompts(VOCAB, [20, 45],
                                                                       seed=3)]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


class OracleProposer:
    """Proposes `reference[prompt][i:i + k]` for a request with i output tokens (the
    engine's `Proposer`); every `wrong_every`-th draft's last token is wrong, so some are
    rejected midway (0: none)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int = 4,
                 wrong_every: int = 3) -> None:
        self.reference, self.k, self.wrong_every, self.calls = reference, k, wrong_every, 0

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        return [self.propose_one(r, limit) for r, limit in zip(requests, limits, strict=True)]

    def propose_one(self, request: Request, limit: int) -> list[int]:
        ref = self.reference.get(tuple(request.prompt_token_ids), [])
        n = request.num_output_tokens
        draft = list(ref[n:n + min(self.k, limit)])
        self.calls += 1
        if draft and self.wrong_every and self.calls % self.wrong_every == 0:
            draft[-1] = (draft[-1] + 1) % VOCAB
        return draft

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def _pair(model: Path, **options) -> tuple[LLM, LLM]:
    return LLM(model, **options), LLM(model, speculative_config=SPEC, **options)


def _oracle_pair(model: Path, prompts: list[list[int]], params: SamplingParams = GREEDY,
                 **options) -> tuple[LLM, LLM]:
    """A plain engine and a speculative one whose proposer knows the plain engine's
    outputs for `prompts` under `params`."""
    plain, spec = _pair(model, **options)
    outs = plain.generate(prompts, params)
    spec.engine.proposer = OracleProposer(
        {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)})
    return plain, spec


def _with_late_arrivals(engine, prompts: list[list[int]], params, every: int = 3) -> list:
    """Run `prompts` on `engine`, adding one every `every` steps while the ones before it
    decode (and verify drafts); their final outputs, in prompt order. `params`: one
    SamplingParams for all, or one each."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    finished, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"late-{i}", prompt, each[i])
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id.removeprefix("late-"))] = out
        step += 1
    return [finished[i] for i in range(len(prompts))]


def _assert_same(plain, spec, logprobs: bool = False) -> None:
    for a, b in zip(plain, spec, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert y.token_ids == x.token_ids
        assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason,
                                                             x.stop_reason)
        if logprobs and x.logprobs is not None:
            assert len(y.logprobs) == len(y.token_ids)
            for step, (ex, ey) in enumerate(zip(x.logprobs, y.logprobs, strict=True)):
                assert not (problems := same_logprobs(ex, ey)), f"step {step}: {problems}"
            assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-3)


def _accepted(llm: LLM) -> int:
    return llm.engine.stats.speculative.num_accepted_tokens


def test_ngram_greedy_tokens_and_logprobs_equal_without_speculation(tiny_model: Path) -> None:
    plain, spec = _pair(tiny_model)
    # A strong repetition "penalty" below 1 makes the model loop over tokens it has seen,
    # so n-gram proposals get accepted; the plain prompts check nothing changes when
    # proposals fail.
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2,
                             repetition_penalty=r) for r in (1.0, 0.01)]
    prompts = [p for p in PROMPTS for _ in params]
    _assert_same(plain.generate(prompts, params * len(PROMPTS)),
                 spec.generate(prompts, params * len(PROMPTS)), logprobs=True)
    stats = spec.engine.stats.speculative
    assert stats.num_accepted_tokens > 0, "no proposal accepted: the test proves nothing"
    assert stats.num_draft_tokens > stats.num_drafts  # drafts of several tokens
    assert spec.engine.kv.pool.num_free == spec.engine.kv.num_blocks
    assert plain.engine.stats.speculative is None


def test_verified_blocks_give_the_same_tokens_and_logprobs(tiny_model: Path) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    plain, spec = _oracle_pair(tiny_model, PROMPTS, params)
    _assert_same(plain.generate(PROMPTS, params), spec.generate(PROMPTS, params),
                 logprobs=True)
    stats = spec.engine.stats.speculative
    assert stats.num_accepted_tokens > len(PROMPTS) * 20
    assert 0 < stats.accepted_per_position[3] < stats.num_drafts  # full and partial drafts
    assert len(spec.engine.step_timings) < len(plain.engine.step_timings) / 2
    assert spec.engine.kv.pool.num_free == spec.engine.kv.num_blocks


def test_mixed_lengths_chunked_prefill_and_arrivals_during_decode(tiny_qwen2: Path) -> None:
    prompts = [*PROMPTS, _repeating(4, 9, 6), *random_prompts(VOCAB, [70, 3], seed=5)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (2, 40, 3, 25, 1, 33, 9)]
    for options in ({}, {"max_num_batched_tokens": 8}):
        plain, spec = _oracle_pair(tiny_qwen2, prompts, **options)
        _assert_same(plain.generate(prompts, params), spec.generate(prompts, params))
        assert _accepted(spec) > 20
        if options:
            timings = spec.engine.step_timings
            assert max(t.num_prefill_tokens + t.num_decode_tokens for t in timings) <= 8
    # Requests arriving while others verify drafts.
    _assert_same(plain.generate(prompts, params),
                 _with_late_arrivals(spec.engine, prompts, params))


def test_preemption_prefix_hits_and_suspend_under_speculation(tiny_llama: Path) -> None:
    prompts = [_repeating(6, 10, 6), _repeating(7, 13, 5), *random_prompts(VOCAB, [80, 90],
                                                                           seed=8)]
    plain, spec = _oracle_pair(tiny_llama, prompts, num_blocks=18, max_num_batched_tokens=48)
    _assert_same(plain.generate(prompts, GREEDY), spec.generate(prompts, GREEDY))
    assert spec.engine.num_preemptions > 0 and _accepted(spec) > 20
    assert spec.engine.kv.pool.num_free == 18
    # The same prompt twice: the second is served from the prefix cache (only verified
    # blocks were ever cached, so a hit continues exactly as a fresh computation does).
    spec.generate(prompts[:1], GREEDY)
    again = spec.generate(prompts[:1], GREEDY)
    assert again[0].num_cached_tokens > 0
    _assert_same(plain.generate(prompts[:1], GREEDY), again)
    # Suspend (recompute) drops every proposal and KV; the generation continues the same.
    engine = spec.engine
    engine.add_request("s", prompts[1], GREEDY)
    for _ in range(4):
        engine.step()
    engine.pause()
    engine.suspend("recompute")
    engine.resume()
    engine.unpause()
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    _assert_same(plain.generate(prompts[1:2], GREEDY), outs)
    assert engine.kv.pool.num_free == 18


def test_stop_conditions_inside_a_verified_block(tiny_llama: Path) -> None:
    prompt = _repeating(9, 8, 6)
    plain, spec = _oracle_pair(tiny_llama, [prompt])
    ref = plain.generate([prompt], GREEDY)[0].outputs[0]
    tokens, text = ref.token_ids, ref.text
    variants = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                for m in range(1, 13)]
    variants += [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[tokens[i]], logprobs=1) for i in range(2, 30, 3)]
    variants += [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[tokens[i]], min_tokens=i + 2)
                 for i in range(3, 30, 5)]
    variants += [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                stop=[text[j:j + 3]], include_stop_str_in_output=inc)
                 for j in range(4, min(len(text) - 3, 60), 7) for inc in (False, True)]
    variants += [SamplingParams(max_tokens=48, temperature=0.0, repetition_penalty=1.3,
                                frequency_penalty=0.4, ignore_eos=True),
                 SamplingParams(max_tokens=48, temperature=0.0, presence_penalty=-1.0,
                                ignore_eos=True)]
    prompts = [prompt] * len(variants)
    _assert_same(plain.generate(prompts, variants), spec.generate(prompts, variants),
                 logprobs=True)
    assert _accepted(spec) > 100
    # EOS: the model's end token made one the output emits mid-way.
    for llm in (plain, spec):
        llm.engine.outputs.eos_token_ids = frozenset({tokens[14]})
    eos = [SamplingParams(max_tokens=48, temperature=0.0),
           SamplingParams(max_tokens=48, temperature=0.0, min_tokens=20, logprobs=0)]
    got = spec.generate([prompt, prompt], eos)
    _assert_same(plain.generate([prompt, prompt], eos), got, logprobs=True)
    assert got[0].outputs[0].finish_reason == "stop"


def test_context_limit_inside_a_verified_block(tiny_qwen3: Path) -> None:
    prompt = _repeating(10, 6, 4)[:25]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    plain, spec = _oracle_pair(tiny_qwen3, [prompt], params, max_model_len=40)
    got = spec.generate([prompt], params)
    _assert_same(plain.generate([prompt], params), got)
    assert got[0].outputs[0].finish_reason == "length"
    assert len(prompt) + len(got[0].outputs[0].token_ids) == 40
    assert _accepted(spec) > 5


# ---- sampling ------------------------------------------------------------------------------

def chi2_quantile_999(df: int) -> float:
    """chi2(df)'s 1 - 1e-3 quantile by Wilson and Hilferty's cube-root normal
    approximation (z = 3.0902 is the standard normal's 1 - 1e-3 quantile); at least the
    exact value for every df (10.83 at df = 1 gives 11.16, then within 1%).

    Under "same distribution" the homogeneity statistic of a 2 x K table exceeds
    chi2(K - 1)'s quantile with probability 1e-3 (asymptotically: categories with fewer
    than 10 pooled draws are merged, so expected counts are not tiny), so the test below
    fails falsely about once in a thousand draws of its samples; its engine seeds are
    fixed, so a given build passes or fails the same way every run."""
    z = 3.0902
    h = 2 / (9 * df)
    return df * (1 - h + z * h ** 0.5) ** 3


def _chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    pooled = Counter(a) + Counter(b)
    rare = {k for k, n in pooled.items() if n < 10}
    a, b = (Counter({("rare" if k in rare else k): n for k, n in c.items()}) for c in (a, b))
    keys = sorted(set(a) | set(b), key=str)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        for count, n in ((a[k], na), (b[k], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return stat, len(keys) - 1


def test_sampled_tokens_have_the_same_distribution_with_speculation(tiny_llama: Path) -> None:
    prompt = random_prompts(VOCAB, [12], seed=11)[0]
    # Unseeded requests draw from the engine's generator, so the two runs' draws are
    # independent. The proposals are the greedy continuation: often the likeliest token,
    # accepted with its probability, so the second and third tokens are often drawn from
    # verify rows past the first (logits computed with a proposal in the context).
    plain = LLM(tiny_llama, seed=1)
    greedy = plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
    spec = LLM(tiny_llama, seed=2, speculative_config=SPEC)
    spec.engine.proposer = OracleProposer({tuple(prompt): greedy}, k=2, wrong_every=0)
    n = 600
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    a = Counter(tuple(o.outputs[0].token_ids) for o in plain.generate([prompt] * n, params))
    b = Counter(tuple(o.outputs[0].token_ids) for o in spec.generate([prompt] * n, params))
    stats = spec.engine.stats.speculative
    assert stats.accepted_per_position[0] > n // 10, "too few accepted drafts to test"
    stat, df = _chi_square(a, b)
    assert df >= 3, f"too few categories: {a}"
    assert stat < chi2_quantile_999(df), (stat, df, a, b)


def test_seeded_sampling_draws_the_same_tokens_with_and_without_speculation(
        tiny_qwen2: Path) -> None:
    prompts = [*PROMPTS, *random_prompts(VOCAB, [15, 33], seed=14)]  # one seed each
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=0.9, seed=i,
                             ignore_eos=True, logprobs=1)
              for i, t in enumerate([0.3, 0.6, 1.0] * 2)]
    plain = LLM(tiny_qwen2)
    want = plain.generate(prompts, params)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want, strict=True)}
    for options in ({}, {"max_num_batched_tokens": 6}):  # the budget trims the drafts
        spec = LLM(tiny_qwen2, speculative_config=SPEC, **options)
        spec.engine.proposer = OracleProposer(reference)
        _assert_same(want, spec.generate(prompts, params), logprobs=True)
        assert _accepted(spec) > 10
        # Reproducible run to run.
        _assert_same(want, spec.generate(prompts, params))


def test_llm_accepts_speculative_config_the_way_vllm_spells_it(tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, speculative=SpeculativeConfig(num_speculative_tokens=2))
    assert llm.engine.config.speculative.num_speculative_tokens == 2
    with pytest.raises(TypeError, match="not both"):
        LLM(tiny_llama, speculative={}, speculative_config={})
    with pytest.raises(ValueError, match="num_speculative_tokens=99"):
        LLM(tiny_llama, speculative_config={"num_speculative_tokens": 99})


def test_flags_reach_the_engine_config_from_every_command(tmp_path: Path, capsys) -> None:
    from tandem_engine.cli.main import build_parser as tandem_parser
    from tandem_engine.cli.main import serve_engine_args
    from tandem_engine.server import main as engine_main

    parser = tandem_parser()
    serve = parser.parse_args(["serve", "--demo", "--speculative-method", "ngram",
                               "--speculative-tokens", "3", "--speculative-ngram-max", "5"])
    args = engine_main.build_parser().parse_args(
        ["--model", "m", "--port", "1", "--admin-port", "2", *serve_engine_args(serve)])
    assert engine_main.engine_config(args).speculative == SpeculativeConfig(
        "ngram", 3, 2, 5)
    off = parser.parse_args(["serve", "--demo"])
    assert "--speculative-method" not in serve_engine_args(off)
    gen = parser.parse_args(["generate", "--model", "m", "--speculative-method", "ngram",
                             "hi"])
    assert gen.speculative_method == "ngram" and gen.speculative_tokens == 4
    with pytest.raises(ValueError, match="num_speculative_tokens=40"):
        serve_engine_args(parser.parse_args(["serve", "--demo", "--speculative-method",
                                             "ngram", "--speculative-tokens", "40"]))
    rc = engine_main.main(["--model", str(tmp_path / "never-read"), "--port", "1",
                           "--admin-port", "2", "--weights-root", str(tmp_path),
                           "--speculative-method", "ngram", "--speculative-ngram-min", "0"])
    assert rc == 2
    assert "prompt_lookup_min=0" in capsys.readouterr().err


def test_metrics_count_drafts_and_accepted_tokens_by_position(tiny_llama: Path) -> None:
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families
    from tandem_engine.server.admin import build_admin_app
    from tandem_engine.server.control import EngineControl
    from tandem_engine.server.worker import EngineWorker

    plain, spec = _oracle_pair(tiny_llama, PROMPTS[:2])
    spec.generate(PROMPTS[:2], GREEDY)
    stats = spec.engine.stats.speculative

    def scrape(llm: LLM) -> dict[str, list]:
        worker = EngineWorker(llm.engine, engine_id="e0", model_name="tiny")
        text = TestClient(build_admin_app(EngineControl(worker))).get("/metrics").text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    families = scrape(spec)
    (proposed,) = families["vllm:spec_decode_num_draft_tokens"]
    assert proposed.value == stats.num_draft_tokens
    by_position = {s.labels["position"]: s.value
                   for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"]}
    assert by_position == {str(i): n for i, n in enumerate(stats.accepted_per_position)}
    verified = {s.labels["position"]: s.value
                for s in families["tandem_spec_decode_num_draft_tokens_per_pos"]}
    assert sum(verified.values()) == stats.num_draft_tokens
    assert all(by_position[i] <= verified[i] for i in verified)
    assert families["vllm:spec_decode_num_drafts"][0].value == stats.num_drafts > 0
    assert "vllm:spec_decode_num_draft_tokens" not in scrape(plain)  # off: not exported


def test_no_proposals_in_steps_with_more_running_requests_than_disable_by_batch_size(
        tiny_llama: Path) -> None:
    """vLLM's disable_by_batch_size: four requests decoding together never propose past a
    cap of 2 (they finish together), two do; the tokens are the same either way."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(tiny_llama)
    capped = LLM(tiny_llama, speculative_config={**SPEC, "disable_by_batch_size": 2})
    four = PROMPTS[:4]
    _assert_same(plain.generate(four, params), capped.generate(four, params))
    assert capped.engine.stats.speculative.num_drafts == 0
    _assert_same(plain.generate(four[:2], params), capped.generate(four[:2], params))
    assert capped.engine.stats.speculative.num_drafts > 0
