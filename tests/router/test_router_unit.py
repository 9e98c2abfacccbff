"""The router's parts without engine processes: routing and the picker, request
validation, response shapes, chat templates, one attempt's outcomes, failover and resume
over scripted engines, and the HTTP app's error paths (with no engine reachable)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from tandem_engine import protocol as p
from tandem_engine.router import api_params as ap
from tandem_engine.router import openai_format as fmt
from tandem_engine.router.api_params import InvalidRequest
from tandem_engine.router.chat import ChatTemplate
from tandem_engine.router.engines import parse_address
from tandem_engine.router.routing import (
    EngineView,
    PrefixIndex,
    RoutingWeights,
    choose,
    eligible,
    load_cost,
    serving_version,
)
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer


def view(key: str, **kw) -> EngineView:
    base = dict(key=key, alive=True, state="RUNNING", weight_version="v1", weight_epoch=0,
                num_running=0, num_waiting=0, kv_usage=0.0, inflight=0, block_size=16,
                max_model_len=1024)
    return EngineView(**{**base, **kw})


# ---- routing ------------------------------------------------------------------------------------


def test_serving_version_is_the_newest_with_a_running_engine() -> None:
    engines = [view("a", weight_version="v1", weight_epoch=0),
               view("b", weight_version="v2", weight_epoch=1),
               view("c", weight_version="v3", weight_epoch=2, state="PAUSED")]
    assert serving_version(engines) == "v2"  # v3 is newer but nothing of it runs
    assert serving_version([replace(e, alive=False) for e in engines]) is None
    assert serving_version([]) is None
    # Equal epochs: the version with more serving engines, then the larger name.
    tie = [view("a", weight_version="x"), view("b", weight_version="y"),
           view("c", weight_version="y")]
    assert serving_version(tie) == "y"


def test_eligible_keeps_alive_running_engines_of_one_version() -> None:
    engines = [view("a"), view("b", state="PAUSED"), view("c", alive=False),
               view("d", weight_version="v0", weight_epoch=-1), view("e")]
    assert [e.key for e in eligible(engines)] == ["a", "e"]
    assert [e.key for e in eligible(engines, exclude=["a"])] == ["e"]
    assert [e.key for e in eligible(engines, version="v0")] == ["d"]
    assert eligible(engines, version="v9") == []


def test_load_cost_uses_the_larger_of_reported_and_known_load() -> None:
    assert load_cost(view("a")) == 0
    assert load_cost(view("a", num_running=3)) == 3
    assert load_cost(view("a", inflight=5, num_running=3)) == 5
    w = RoutingWeights(waiting_weight=1.0, kv_weight=4.0)
    assert load_cost(view("a", num_running=1, num_waiting=2, kv_usage=0.5), w) == 3 + 2 + 2


def test_choose_prefers_cached_prefix_unless_much_more_loaded() -> None:
    w = RoutingWeights(affinity_weight=4.0)
    a, b = view("a", inflight=2), view("b")
    assert choose([a, b], {"a": 1.0}, w).key == "a"  # 4 - 2 > 0
    assert choose([replace(a, inflight=6), b], {"a": 1.0}, w).key == "b"  # 4 - 6 < 0
    assert choose([a, b], {"a": 0.25}, w).key == "b"  # 1 - 2 < 0
    assert choose([], {}, w) is None


def test_choose_rotates_among_equal_engines() -> None:
    engines = [view("a"), view("b"), view("c")]
    assert [choose(engines, {}, tie_break=i).key for i in range(4)] == ["a", "b", "c", "a"]


def test_prefix_index_matches_leading_hashes_and_evicts_lru() -> None:
    index = PrefixIndex(capacity=4)
    index.add([1, 2, 3])
    assert index.match([1, 2, 3, 4]) == 3
    assert index.match([2, 3]) == 2 and index.match([9, 1]) == 0
    index.add([1, 7, 8])  # touches 1; 2 is now the oldest and goes first
    assert len(index) == 4 and index.match([2]) == 0 and index.match([1]) == 1
    index.clear()
    assert index.match([1]) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert parse_address("tcp://engine-0.svc:80") == "tcp://engine-0.svc:80"
    for bad in ("localhost", ":5", "h:0", "h:x", "h:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)


# ---- request validation --------------------------------------------------------------------------


def completion(**kw) -> ap.CompletionRequest:
    return ap.parse_completion({"model": "m", "prompt": "hi", **kw})


def chat(**kw) -> ap.ChatRequest:
    return ap.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_completion_prompts_strings_ids_and_batches() -> None:
    assert completion(prompt="a").prompts == ["a"]
    assert completion(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    for bad in ([], None, 5, [["a"]], [[]], [1, "a"], [[-1]]):
        with pytest.raises(InvalidRequest) as err:
            completion(prompt=bad)
        assert err.value.param == "prompt" and err.value.status == 400
    with pytest.raises(InvalidRequest, match="over the limit of 64"):
        completion(prompt=["a"] * 5, n=16)


@pytest.mark.parametrize(("field", "value", "param", "limit"), [
    ("n", 0, "n", "between 1 and 16"),
    ("n", 17, "n", "between 1 and 16"),
    ("max_tokens", 0, "max_tokens", "between 1 and"),
    ("max_tokens", "8", "max_tokens", "integer"),
    ("temperature", 2.5, "temperature", "[0, 2]"),
    ("temperature", True, "temperature", "[0, 2]"),
    ("top_p", 0, "top_p", "(0, 1]"),
    ("top_k", -2, "top_k", "between -1 and"),
    ("seed", -1, "seed", "between 0 and"),
    ("logprobs", 21, "logprobs", "between 0 and 20"),
    ("stop", ["x"] * 17, "stop", "limit of 16"),
    ("stop", [""], "stop", "1..256"),
    ("stop", 3, "stop", "string or a list"),
    ("stream", "yes", "stream", "true or false"),
    ("presence_penalty", "0.5", "presence_penalty", "must be a number"),
    ("logit_bias", {"1": 5}, "logit_bias", "not supported"),
    ("echo", 1, "echo", "true or false"),
    ("use_beam_search", True, "use_beam_search", "not supported"),
    ("prompt_logprobs", 21, "prompt_logprobs", "between 0 and 20"),
    ("no_such_thing", 1, "no_such_thing", "unrecognized"),
    ("best_of", 3, "best_of", "not supported"),
    ("cache_salt", "", "cache_salt", "1..256"),
    ("model", None, "model", "required"),
])
def test_invalid_parameters_name_the_parameter_and_the_limit(field, value, param,
                                                             limit) -> None:
    with pytest.raises(InvalidRequest) as err:
        completion(**{field: value})
    assert err.value.param == param and err.value.status == 400
    assert limit in err.value.message and param in err.value.message


def test_neutral_values_of_unsupported_parameters_are_accepted() -> None:
    req = completion(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, echo=False,
                     best_of=1, user="u", stop="x", stream_options={"include_usage": True},
                     stream=True, seed=7, top_k=5, min_tokens=2, ignore_eos=True,
                     cache_salt="tenant")
    o = req.options
    assert o.stream and o.include_usage and o.seed == 7 and o.cache_salt == "tenant"
    assert o.sampling_args == {"top_k": 5, "min_tokens": 2, "stop": ["x"],
                               "ignore_eos": True, "presence_penalty": 0.0,
                               "frequency_penalty": 0.0}


def test_chat_messages_and_logprobs() -> None:
    req = chat(messages=[{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}],
               logprobs=True, top_logprobs=3, max_completion_tokens=9, max_tokens=4)
    assert [m["content"] for m in req.messages] == ["s", "a\nb", ""]
    assert req.options.logprobs == 3 and req.options.max_tokens == 9
    assert chat(logprobs=True).options.logprobs == 0
    assert chat().options.logprobs is None
    cases = [({"top_logprobs": 2}, "top_logprobs"), ({"messages": []}, "messages"),
             ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
              "messages[0].content"),
             ({"tools": [{"type": "function"}]}, "tools[0].function"),
             ({"response_format": {"type": "xml"}}, "response_format.type"),
             # Checked even when max_completion_tokens wins, and a name must be text.
             ({"max_completion_tokens": 9, "max_tokens": -5}, "max_tokens"),
             ({"messages": [{"role": "user", "content": "x", "name": 7}]}, "messages[0].name")]
    for body, param in cases:
        with pytest.raises(InvalidRequest) as err:
            chat(**body)
        assert err.value.param == param


def test_resolve_max_tokens_against_the_context() -> None:
    o = completion().options
    assert ap.resolve_max_tokens(o, 10, 100, default=16) == 16
    assert ap.resolve_max_tokens(o, 95, 100, default=16) == 5
    assert ap.resolve_max_tokens(o, 10, 100, default=None) == 90
    assert ap.resolve_max_tokens(completion(max_tokens=90).options, 10, 100, default=16) == 90
    with pytest.raises(InvalidRequest, match="at most 90 tokens") as err:
        ap.resolve_max_tokens(completion(max_tokens=91).options, 10, 100, default=16)
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="context limit of 100 tokens") as err:
        ap.resolve_max_tokens(o, 101, 100, default=16, prompt_param="messages")
    assert err.value.param == "messages" and err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest, match="empty"):
        ap.resolve_max_tokens(o, 0, 100, default=16)


def test_engine_sampling_seeds_each_choice_and_validates_like_the_engine() -> None:
    o = completion(seed=5, n=3, temperature=0.5, stop=["\n"], logprobs=2).options
    params = [ap.engine_sampling(o, 8, j) for j in range(3)]
    assert [s.seed for s in params] == [5, 6, 7]
    assert params[0] == SamplingParams(temperature=0.5, stop=("\n",), max_tokens=8,
                                       logprobs=2, seed=5)
    # What the request left out keeps SamplingParams' defaults.
    assert ap.engine_sampling(completion().options, 8, 0) == SamplingParams(max_tokens=8)
    with pytest.raises(InvalidRequest) as err:
        ap.engine_sampling(completion(min_tokens=9).options, 8, 0)
    assert err.value.param == "min_tokens" and "max_tokens (8)" in err.value.message


# ---- response shapes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


def test_logprob_shapes(tokenizer: Tokenizer) -> None:
    strings = fmt.TokenStrings(tokenizer)
    ids = tokenizer.encode("hello world", add_special_tokens=False)[:2]
    lps = [p.TokenLogprobs(-0.5, [(ids[0], -0.5), (7, -1.0)]),
           p.TokenLogprobs(-math.inf, [])]
    c = fmt.completion_logprobs(ids, lps, strings, text_offset=3)
    assert c["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert c["token_logprobs"] == [-0.5, fmt.MIN_LOGPROB]
    assert c["text_offset"] == [3, 3 + len(c["tokens"][0])]
    assert list(c["top_logprobs"][0].values()) == [-0.5, -1.0] and c["top_logprobs"][1] == {}
    merged = fmt.merge_completion_logprobs([c, c])
    assert len(merged["tokens"]) == 4
    entries = fmt.chat_logprobs(ids, lps, strings)
    assert entries[0]["token"] == c["tokens"][0]
    assert entries[0]["bytes"] == list(c["tokens"][0].encode())
    assert [t["logprob"] for t in entries[0]["top_logprobs"]] == [-0.5, -1.0]


def test_response_and_error_shapes() -> None:
    assert fmt.usage(3, 4, 2) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                  "prompt_tokens_details": {"cached_tokens": 2}}
    assert fmt.error_body("bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                  "code": None}}
    choice = fmt.chat_choice(1, "hi", None, "length")
    assert choice["message"] == {"role": "assistant", "content": "hi"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert fmt.completion_choice(0, "x", None, "abort")["finish_reason"] == "stop"
    chunk = fmt.chat_chunk("id", 1, "m", [fmt.chat_chunk_choice(0, {"content": "a"})])
    assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
    assert fmt.completion_chunk("id", 1, "m", [], fmt.usage(1, 2))["choices"] == []


# ---- chat template -------------------------------------------------------------------------------


def test_chat_template_renders_the_checkpoints_template(tokenizer: Tokenizer) -> None:
    template = ChatTemplate.from_tokenizer(tokenizer)
    assert template is not None
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == f"{tokenizer.bos_token}<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_errors_and_sandbox() -> None:
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="roles must alternate") as err:
        refusing.render([{"role": "user", "content": "x"}])
    assert err.value.status == 400
    escaping = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequest, match="could not render"):
        escaping.render([])
    assert ChatTemplate("{{ messages | tojson }}").render([{"c": "é"}]) == '[{"c": "é"}]'


# ---- the picker ----------------------------------------------------------------------------------


def _scripted_pool(roles: dict[str, str]):
    from tandem_engine.router.engines import EnginePool
    from test_router_disagg import colocated, scripted

    pool = EnginePool(list(roles))
    for client in pool.clients:
        scripted(client, roles[client.key], colocated, [])
    return pool


def test_picker_keeps_colocated_requests_off_prefill_engines() -> None:
    from tandem_engine.router.picker import EnginePicker

    pool = _scripted_pool({"127.0.0.1:1": "prefill", "127.0.0.1:2": "decode"})
    picker = EnginePicker(pool)
    assert {picker.pick([1, 2, 3]).key for _ in range(4)} == {"127.0.0.1:2"}
    # The prefill engine still serves when nothing else can.
    assert picker.pick([1, 2, 3], exclude=["127.0.0.1:2"]).key == "127.0.0.1:1"


def test_picker_follows_prefixes_and_forgets_them_when_an_engine_refits() -> None:
    from tandem_engine.router.picker import EnginePicker

    pool = _scripted_pool({"127.0.0.1:1": "mixed", "127.0.0.1:2": "mixed"})
    picker = EnginePicker(pool)
    prompt = list(range(64))  # four full blocks of 16
    home = picker.pick(prompt)
    assert all(picker.pick(prompt) is home for _ in range(3))  # affinity beats rotation
    other = next(c for c in pool.clients if c is not home)
    picker.remember(other, prompt, None)
    home.epoch_changes += 1  # a refit: what it cached is gone
    assert picker.pick(prompt) is other


def test_a_disaggregated_request_hashes_its_prompt_once(monkeypatch) -> None:
    """The bypass check, the prefill choice and the decode engine's record share one hash
    chain (engines of one epoch and block size): a long prompt is hashed once."""
    from tandem_engine.router import picker as picker_module

    calls = []
    real = picker_module.block_hashes
    monkeypatch.setattr(picker_module, "block_hashes",
                        lambda *args: calls.append(args) or real(*args))
    pool = _scripted_pool({"127.0.0.1:1": "prefill", "127.0.0.1:2": "decode"})
    picker = picker_module.EnginePicker(pool)
    prompt = list(range(64))
    assert picker.bypass(prompt) is None  # the decode engine holds nothing yet
    prefill, decode = picker.pick_pair(prompt)
    assert (prefill.key, decode.key) == ("127.0.0.1:1", "127.0.0.1:2")
    assert len(calls) == 1
    picker.pick_pair(list(prompt))  # another request with the same tokens: hashed again
    assert len(calls) == 2


# ---- one attempt ---------------------------------------------------------------------------------


def _attempt(items, *, state: str = "RUNNING", timeout: float = 0.05, role: str = "mixed"):
    import asyncio

    from tandem_engine.router.attempts import Attempt
    from tandem_engine.router.engines import EnginePool
    from test_router_disagg import colocated, scripted

    client = EnginePool(["127.0.0.1:1"]).clients[0]
    scripted(client, role, colocated, [])
    client.load = p.Load(state, 0, 0, 0.0, "v1", 1)
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait((0.0, item))
    return Attempt(client, "r.1", queue, timeout, timeout)


def _steps(steps) -> list:
    import asyncio

    async def go() -> list:
        return [s async for s in steps]
    return asyncio.run(go())


def test_an_attempt_relays_the_engine_text_and_counts_what_the_client_has() -> None:
    from tandem_engine.router.attempts import Delta, Finished, Progress, colocated

    progress = Progress()
    steps = _steps(colocated(_attempt([
        p.Output("r.1", [1, 2], "ab"), p.Output("r.1", [], "c"),
        p.Output("r.1", [3], "", finished=True, finish_reason="stop", stop_reason="z")]),
        progress))
    assert [type(s) for s in steps] == [Delta, Delta, Delta, Finished]
    assert "".join(s.text for s in steps[:3]) == "abc"
    assert (steps[2].finished, steps[2].finish_reason, steps[2].stop_reason) == (
        True, "stop", "z")
    assert progress.generated == [1, 2, 3] and progress.version == "v1"
    assert progress.resume() == p.Resume([1, 2, 3], sent_chars=3)
    assert Progress().resume() is None


@pytest.mark.parametrize(("item", "reason"), [
    (p.Reject("r.1", 503, "draining"), "rejected"),
    (p.Output("r.1", [4], "d", finished=True, finish_reason="abort"), "engine_aborted"),
])
def test_an_attempt_fails_over_from_an_engine_that_cannot_go_on(item, reason) -> None:
    from tandem_engine.router.attempts import FailOver, Progress, colocated

    steps = _steps(colocated(_attempt([p.Output("r.1", [1], "a"), item]), Progress()))
    assert isinstance(steps[-1], FailOver) and steps[-1].reason == reason
    assert steps[-1].exclude  # a live engine that refused is avoided for the choice
    assert not any(getattr(s, "finished", False) for s in steps)  # no final delta


def test_an_attempt_fails_over_from_a_lost_or_silent_engine() -> None:
    from tandem_engine.router.attempts import FailOver, Progress, colocated
    from tandem_engine.router.engines import EngineLost

    lost = _steps(colocated(_attempt([EngineLost("gone")]), Progress()))
    assert lost == [FailOver("engine_lost", "gone")] and not lost[0].exclude
    stalled = _steps(colocated(_attempt([]), Progress()))
    assert stalled[0].reason == "stalled" and "no output" in stalled[0].detail


def test_a_paused_engines_silence_is_waited_out() -> None:
    import asyncio

    from tandem_engine.router.attempts import Progress, colocated

    async def go() -> None:
        steps = colocated(_attempt([], state="PAUSED", timeout=0.01), Progress())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(steps.__anext__(), 0.2)

    asyncio.run(go())


def test_an_invalid_request_reaches_the_client_unless_the_engine_is_to_blame() -> None:
    from tandem_engine.router.attempts import (
        EngineRejected,
        FailOver,
        GenerationFailed,
        Progress,
        colocated,
        prefill,
    )

    bad = p.Reject("r.1", 400, "prompt too long")
    with pytest.raises(EngineRejected) as err:
        _steps(colocated(_attempt([bad]), Progress()))
    assert err.value.status == 400
    with pytest.raises(GenerationFailed, match="refused the continuation"):
        _steps(colocated(_attempt([bad]), Progress(generated=[1])))
    # A decode engine refusing a pulled request, or a prefill engine refusing after the
    # first token: the request itself was fine.
    assert isinstance(_steps(colocated(_attempt([bad]), Progress(), pulled=True))[-1],
                      FailOver)
    assert isinstance(_steps(prefill(_attempt([bad]), Progress(generated=[1])))[-1],
                      FailOver)


def test_a_prefill_attempt_hands_off_the_pinned_kv() -> None:
    from tandem_engine.router.attempts import Finished, HandOff, Progress, prefill
    from test_router_disagg import AGENT

    handoff = p.Output("r.1", [9], "h", finished=True, handoff=p.Handoff("pin-1", [3, 4]))
    steps = _steps(prefill(_attempt([handoff], role="prefill"), Progress()))
    assert not steps[0].finished and steps[0].finish_reason is None  # more to come
    assert steps[-1] == HandOff(p.PullSource(AGENT, "pin-1", [3, 4]))
    unpinned = p.Output("r.1", [9], "h", finished=True)
    assert _steps(prefill(_attempt([unpinned], role="prefill"), Progress()))[-1] \
        == HandOff(None)
    eos = p.Output("r.1", [9], "", finished=True, finish_reason="stop")
    steps = _steps(prefill(_attempt([eos]), Progress()))
    assert steps[0].finished and steps[-1] == Finished()


# ---- failover over scripted engines -------------------------------------------------------------

A, B = "127.0.0.1:2001", "127.0.0.1:2002"


def _generate(dispatcher, sampling: SamplingParams, prompt=(5, 6, 7, 8, 9)) -> list:
    import asyncio

    async def go() -> list:
        return [d async for d in dispatcher.generate("r", list(prompt), sampling)]
    return asyncio.run(go())


def test_a_failover_resubmits_the_original_request_resumed() -> None:
    """Engine A streamed two tokens (three characters) and died; engine B gets the
    original prompt and SamplingParams and resumes after what the client has."""
    from tandem_engine.router.engines import EngineLost
    from test_router_disagg import PROMPT, TARGET, scripted_dispatcher

    def dies(request_id, prompt, sampling, pin, resume, pull):
        dispatcher.pool.by_key[A].connected = False
        return [p.Output(request_id, TARGET[:1], "x"), p.Output(request_id, TARGET[1:2], "xx"),
                EngineLost("gone")]

    def resumes(request_id, prompt, sampling, pin, resume, pull):
        rest = TARGET[len(resume.token_ids):]
        return [p.Output(request_id, [t], "y") for t in rest[:-1]] + [
            p.Output(request_id, rest[-1:], "y", finished=True, finish_reason="stop")]

    dispatcher, calls, metrics = scripted_dispatcher({A: ("mixed", dies),
                                                      B: ("mixed", resumes)})
    sampling = SamplingParams(max_tokens=6, min_tokens=4, temperature=0.0, stop=["zz"])
    dispatcher.pool.by_key[B].load = p.Load("RUNNING", 5, 0, 0.0, "v1", 1)  # A first
    deltas = _generate(dispatcher, sampling, PROMPT)
    assert [t for d in deltas for t in d.token_ids] == TARGET
    assert "".join(d.text for d in deltas) == "x" + "xx" + "y" * 4
    assert [(c.key, c.prompt, c.sampling, c.resume) for c in calls] == [
        (A, PROMPT, sampling, None), (B, PROMPT, sampling, p.Resume(TARGET[:2], 3))]
    assert metrics.failovers.labels("engine_lost")._value.get() == 1


def test_every_token_arrived_but_not_the_final_output() -> None:
    """The engine died after max_tokens tokens but before its final output: the next
    engine is still asked, with everything resumed; it finishes at once with `length`
    and the text the first one held back."""
    from tandem_engine.router.engines import EngineLost
    from test_router_disagg import PROMPT, TARGET, scripted_dispatcher

    def dies(request_id, prompt, sampling, pin, resume, pull):
        dispatcher.pool.by_key[A].connected = False
        return [p.Output(request_id, TARGET[:3], "x"), EngineLost("gone")]

    def finishes(request_id, prompt, sampling, pin, resume, pull):
        assert resume == p.Resume(TARGET[:3], 1)
        return [p.Output(request_id, [], "yz", finished=True, finish_reason="length")]

    dispatcher, calls, _ = scripted_dispatcher({A: ("mixed", dies), B: ("mixed", finishes)})
    dispatcher.pool.by_key[B].load = p.Load("RUNNING", 5, 0, 0.0, "v1", 1)
    deltas = _generate(dispatcher, SamplingParams(max_tokens=3), PROMPT)
    assert [c.key for c in calls] == [A, B]
    assert "".join(d.text for d in deltas) == "xyz"
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"


def test_a_choice_gives_up_after_max_attempts() -> None:
    from tandem_engine.router.attempts import GenerationFailed
    from test_router_disagg import scripted_dispatcher

    def refuses(request_id, prompt, sampling, pin, resume, pull):
        return [p.Output(request_id, [1], "a"), p.Reject(request_id, 503, "busy")]

    dispatcher, calls, _ = scripted_dispatcher({A: ("mixed", refuses), B: ("mixed", refuses)},
                                               max_attempts=2, failover_timeout=0.1)
    with pytest.raises(GenerationFailed):
        _generate(dispatcher, SamplingParams(max_tokens=6))
    assert [c.resume for c in calls] == [None, p.Resume([1], 1)]  # both tried, then none


def test_a_client_that_leaves_aborts_the_request_on_its_engine() -> None:
    import asyncio

    from test_router_disagg import scripted_dispatcher

    def slow(request_id, prompt, sampling, pin, resume, pull):
        return [p.Output(request_id, [1], "a")]  # and then nothing for a while

    dispatcher, _, _ = scripted_dispatcher({A: ("mixed", slow)})

    async def go() -> None:
        stream = dispatcher.generate("r", [5, 6, 7], SamplingParams(max_tokens=6))
        assert (await stream.__anext__()).token_ids == [1]
        await stream.aclose()

    asyncio.run(go())
    assert dispatcher.pool.by_key[A].aborted == ["r.1"]


# ---- the app with no engine reachable ------------------------------------------------------------


def _free_port() -> int:
    from tandem_engine.cli.serve import free_port

    return free_port()


@pytest.fixture
def client(tokenizer: Tokenizer):
    from fastapi.testclient import TestClient
    from tandem_engine.router.engines import EnginePool
    from tandem_engine.router.openai_api import build_app

    pool = EnginePool([f"127.0.0.1:{_free_port()}"], heartbeat_deadline=1.0)
    with TestClient(build_app(pool, tokenizer, "tiny")) as c:
        yield c


def test_app_without_engines(client) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 503
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "no_engine_available" and "unreachable" in err["message"]
    r = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    engines = client.get("/v1/engines").json()["engines"]
    assert len(engines) == 1 and engines[0]["alive"] is False
    metrics = client.get("/metrics").text
    assert 'tandem_router_requests_total{outcome="unavailable"} 1.0' in metrics
    assert 'tandem_router_requests_total{outcome="invalid"} 3.0' in metrics
    assert "tandem_router_time_to_first_token_seconds_bucket" in metrics
    assert "tandem_router_engine_up{" in metrics


def test_router_never_imports_torch() -> None:
    code = ("import sys\n"
            "import tandem_engine.router.main, tandem_engine.router.openai_api\n"
            "from tandem_engine.router.main import build_parser\n"
            "assert 'torch' not in sys.modules, 'the router imported torch'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr


def test_a_new_router_waits_for_engines_it_has_not_heard_from_yet(monkeypatch) -> None:
    """A router (re)started with clients already sending (`tandem serve` restarting it): a
    request that arrives before its engines' first WELCOME waits for one instead of a 503;
    after the start-up grace, an engine never heard from holds no request."""
    import asyncio
    import time

    from tandem_engine.router import picker as picker_module
    from tandem_engine.router.engines import EnginePool
    from tandem_engine.router.picker import EnginePicker

    pool = EnginePool(["127.0.0.1:1"])
    picker = EnginePicker(pool, wait_timeout=5.0)
    client = pool.clients[0]

    async def welcome_later() -> bool:
        async def welcome() -> None:
            await asyncio.sleep(0.2)
            client.connected, client.load = True, p.Load("RUNNING", 0, 0, 0.0, "v1", 1)
        task = asyncio.create_task(welcome())
        ready = await picker.wait_until_serving()
        await task
        return ready
    assert asyncio.run(welcome_later())

    monkeypatch.setattr(picker_module, "STARTUP_GRACE_S", 0.0)
    started = time.monotonic()
    assert not asyncio.run(EnginePicker(EnginePool(["127.0.0.1:1"]),
                                        wait_timeout=5.0).wait_until_serving())
    assert time.monotonic() - started < 1.0
