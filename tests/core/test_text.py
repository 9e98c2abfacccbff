"""The one owner of text (`tandem_engine.text.TextStream`): every path that shows text —
streaming, non-streaming, and a generation resumed on another engine after a failover
or a handoff — releases exactly the text of an uninterrupted run, never a piece of a
stop string it later takes back, and never loses text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.text import TextStream
from tandem_engine.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


def engine_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    d = IncrementalDetokenizer(tokenizer)
    return "".join(d.push(t) for t in ids)


def expected_text(tokenizer: Tokenizer, ids: list[int], stops: list[str],
                  include: bool) -> tuple[str, int | None]:
    """What an uninterrupted generation shows (no min_tokens), by brute force: the first
    token after which the decoded text holds a stop string ends it, trimmed at the
    earliest stop string. Returns (text, number of tokens consumed or None)."""
    for k in range(1, len(ids) + 1):
        text = engine_text(tokenizer, ids[:k])
        found = [(text.find(s), n, s) for n, s in enumerate(stops) if s in text]
        if found:
            i, _, s = min(found)
            return (text[:i + len(s)] if include else text[:i]), k
    return engine_text(tokenizer, ids), None


def stream(text: TextStream, ids: list[int], released: str = "") -> tuple[str, list[str]]:
    """Push `ids` as a generation would: after each token, what may be shown now. Returns
    the client's whole text and every snapshot of it along the way."""
    snapshots = []
    for t in ids:
        stopped = text.push(t)
        shown = text.visible(stopped)
        assert shown.startswith(released), "released text was taken back"
        released = shown
        snapshots.append(released)
        if stopped:
            return released, snapshots
    released = text.visible(True)
    snapshots.append(released)
    return released, snapshots


@st.composite
def generations(draw, tokenizer: Tokenizer):
    ids = draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=24))
    full = engine_text(tokenizer, ids)
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if full and draw(st.booleans()):  # a piece of the text itself: it will match
            a = draw(st.integers(0, len(full) - 1))
            b = draw(st.integers(a + 1, min(len(full), a + 8)))
            stops.append(full[a:b])
        else:
            stops.append(draw(st.text(min_size=1, max_size=4)))
    return ids, stops, draw(st.booleans())


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_and_final_text_equal_an_uninterrupted_run(tokenizer: Tokenizer,
                                                            data) -> None:
    ids, stops, include = data.draw(generations(tokenizer))
    params = SamplingParams(max_tokens=64, stop=stops, include_stop_str_in_output=include)
    want, stop_at = expected_text(tokenizer, ids, stops, include)

    shown, snapshots = stream(TextStream(tokenizer, params), ids)
    assert shown == want  # streaming: nothing lost, nothing extra
    for snapshot in snapshots[:-1]:  # never a piece of a stop string that then matched
        assert want.startswith(snapshot)
        if not include:
            assert not any(s in snapshot for s in stops)

    final = TextStream(tokenizer, params)  # non-streaming: only the last output is read
    for t in ids[:stop_at]:
        final.push(t)
    assert final.visible(True) == want
    assert (final.stop_string is None) == (stop_at is None)
    assert final.stop_string is None or final.stop_string in stops


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_failover_splice_shows_the_same_text(tokenizer: Tokenizer, data) -> None:
    """Engine A streams `cut` tokens and dies; engine B resumes with those tokens and the
    number of characters the client got. The client sees an uninterrupted run's text."""
    ids, stops, include = data.draw(generations(tokenizer))
    params = SamplingParams(max_tokens=64, stop=stops, include_stop_str_in_output=include)
    want, stop_at = expected_text(tokenizer, ids, stops, include)
    last = len(ids) if stop_at is None else stop_at
    cut = data.draw(st.integers(0, last - 1))  # A ended before the generation did

    a = TextStream(tokenizer, params)
    for t in ids[:cut]:
        assert not a.push(t)
    sent = a.visible(False)
    b = TextStream(tokenizer, params, resumed_token_ids=ids[:cut], sent_chars=len(sent))
    shown, _ = stream(b, ids[cut:], released=sent)
    assert shown == want


def test_resuming_recovers_held_back_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Once upon a time there was a tiny engine", add_special_tokens=False)
    full = engine_text(tokenizer, ids)
    params = SamplingParams(max_tokens=64, stop=["zzzz"])
    for cut in range(1, len(ids)):
        before = engine_text(tokenizer, ids[:cut])
        sent = before[: max(0, len(before) - 3)]  # the old engine held 3 characters back
        text = TextStream(tokenizer, params, resumed_token_ids=ids[:cut], sent_chars=len(sent))
        for t in ids[cut:]:
            assert not text.push(t)
        assert text.visible(True) == full and text.visible(True).startswith(sent)
        assert text.stop_string is None


def test_resuming_finds_a_stop_string_across_the_hand_over(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the cat sat on the mat and slept", add_special_tokens=False)
    full = engine_text(tokenizer, ids)
    stop = "on the mat"
    start = full.index(stop)
    for include in (False, True):
        params = SamplingParams(max_tokens=64, stop=[stop], include_stop_str_in_output=include)
        for cut in range(1, len(ids)):
            before = engine_text(tokenizer, ids[:cut])
            if stop in before:
                break  # the old engine would have stopped by itself
            sent = before[: max(0, len(before) - (len(stop) - 1))]
            text = TextStream(tokenizer, params, resumed_token_ids=ids[:cut],
                              sent_chars=len(sent))
            assert text.visible(False) == sent  # nothing held back is released early
            stopped = False
            for t in ids[cut:]:
                if text.push(t):
                    stopped = True
                    break
            assert stopped and text.stop_string == stop
            end = start + len(stop) if include else start
            assert text.visible(True) == full[:end]


def test_min_tokens_counts_resumed_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a b a b a b", add_special_tokens=False)
    params = SamplingParams(max_tokens=64, stop=["b"], min_tokens=len(ids) + 1)
    text = TextStream(tokenizer, params, resumed_token_ids=ids[:1])
    assert not any(text.push(t) for t in ids[1:])  # min_tokens not reached: no stop
    assert text.num_tokens == len(ids)
    assert text.visible(True) == engine_text(tokenizer, ids)
    stopped = TextStream(tokenizer, SamplingParams(max_tokens=64, stop=["a"]))
    with pytest.raises(RuntimeError):
        stopped.push(ids[0])
        stopped.push(ids[1])
