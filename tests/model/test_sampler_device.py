"""Sampling on the logits' device: the same tokens and logprobs as a plain per-row
reference (torch.multinomial on the host), and only a [batch, 3 + ...] tensor crossing
to the host per step."""

from __future__ import annotations

import pytest
import torch
from tandem_engine.model.sampler import Sampler, draw_rows, top_k_top_p_filter
from tandem_engine.sampling_params import SamplingParams

VOCAB = 3000
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _History:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt_token_ids = prompt
        self.token_ids = prompt + output


def _reference(logits: torch.Tensor, params: list[SamplingParams],
               banned: list[tuple[int, ...]], gens: list[torch.Generator | None]
               ) -> list[int]:
    """The straightforward way: each row on the host, torch.multinomial for a draw."""
    tokens = []
    for row, p in enumerate(params):
        x = logits[row].cpu().clone()
        x[list(banned[row])] = float("-inf")
        if p.greedy:
            tokens.append(int(x.argmax()))
            continue
        x = top_k_top_p_filter(x / p.temperature, p.top_k, p.top_p)
        tokens.append(int(torch.multinomial(x.softmax(-1), 1, generator=gens[row])))
    return tokens


def _mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_p=0.9, seed=11),
            SamplingParams(temperature=1.0, top_k=40, seed=12, logprobs=3),
            SamplingParams(temperature=0.0, logprobs=1),
            SamplingParams(temperature=1.3, top_k=200, top_p=0.95, seed=13),
            SamplingParams(temperature=0.6, seed=14, logprobs=0)]


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_and_logprobs_match_a_per_row_host_reference(device: str) -> None:
    params = _mixed_params()
    ids = [f"r{i}" for i in range(len(params))]
    sampler = Sampler(0, device=device)
    ref_gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed)
                for p in params]
    torch.manual_seed(3)
    banned = [(), (5, 6), (), (7,), (), ()]
    for _ in range(6):  # generators advance step after step
        logits = torch.randn(len(params), VOCAB) * 4
        got = sampler.sample(logits.to(device), ids, params, banned)
        if device == "cpu":  # CUDA generators draw other numbers: distributions differ
            assert got.token_ids == _reference(logits, params, banned, ref_gens)
        else:
            greedy = [i for i, p in enumerate(params) if p.greedy]
            ref = _reference(logits, params, banned, ref_gens)
            assert [got.token_ids[i] for i in greedy] == [ref[i] for i in greedy]
        logprobs = torch.log_softmax(logits.double(), -1)
        for row, p in enumerate(params):
            tok = got.token_ids[row]
            assert got.logprobs[row] == pytest.approx(float(logprobs[row, tok]), abs=1e-5)
            assert got.ranks[row] == int((logprobs[row] > logprobs[row, tok]).sum()) + 1
            n = p.logprobs or 0
            assert got.top_ids[row] == logprobs[row].topk(n).indices.tolist()
            assert got.top_logprobs[row] == pytest.approx(
                logprobs[row].topk(n).values.tolist(), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_request_draws_the_same_tokens_alone_or_in_any_batch(device: str) -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    torch.manual_seed(0)
    steps = [torch.randn(5, VOCAB, device=device) * 3 for _ in range(8)]
    alone = Sampler(1, device=device)
    solo = [alone.sample(s[2:3], ["t"], [target], [()]).token_ids[0] for s in steps]
    crowd = Sampler(2, device=device)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, seed=5, logprobs=2),
              SamplingParams(temperature=1.0, repetition_penalty=1.3)]
    batched = []
    for i, s in enumerate(steps):
        order = [0, 1, 2, 3, 4] if i % 2 else [3, 2, 4, 0, 1]  # the target's row moves
        params = [target if r == 2 else others[r if r < 2 else r - 1] for r in order]
        rids = ["t" if r == 2 else f"o{r}" for r in order]
        hist = [_History([1, 2, 3], [4, 5])] * 5
        out = crowd.sample(s[order], rids, params, [()] * 5, hist)
        batched.append(out.token_ids[order.index(2)])
    assert batched == solo


def test_skip_draws_stands_in_for_tokens_drawn_by_another_engine() -> None:
    params = SamplingParams(temperature=1.0, seed=9)
    torch.manual_seed(1)
    steps = [torch.randn(1, VOCAB) for _ in range(4)]
    one = Sampler(0)
    full = [one.sample(s, ["r"], [params], [()]).token_ids[0] for s in steps]
    other = Sampler(0)
    other.skip_draws("r", params, 1, VOCAB)  # the prefill engine drew the first
    rest = [other.sample(s, ["r"], [params], [()]).token_ids[0] for s in steps[1:]]
    assert rest == full[1:]


def test_a_row_with_nothing_left_to_draw_raises_and_non_finite_rows_are_errors() -> None:
    logits = torch.randn(3, VOCAB)
    empty = SamplingParams(seed=1)
    object.__setattr__(empty, "top_p", 1e-46)  # past validation: 0 in float32, masks all
    params = [SamplingParams(seed=1), empty, SamplingParams(seed=2)]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        Sampler(0).sample(logits, ["a", "b", "c"], params, [()] * 3)
    logits[1] = float("nan")
    out = Sampler(0).sample(logits, ["a", "b", "c"], [SamplingParams(seed=1)] * 3, [()] * 3)
    assert list(out.errors) == [1]
    with pytest.raises(IndexError, match=rf"outside the vocabulary \[0, {VOCAB}\)"):
        Sampler(0).sample(logits, ["a"], [SamplingParams()], [(VOCAB,)])


class _HostReads:
    """Records every way a tensor's values reach Python or the host: which call, and how
    many elements it read or copied."""

    READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int]] = []
        self.copies: list[tuple[str, int]] = []
        for name in self.READS:
            self._wrap(monkeypatch, name, self.reads, lambda *a, **k: True)
        self._wrap(monkeypatch, "cpu", self.copies, lambda *a, **k: True)
        self._wrap(monkeypatch, "to", self.copies, self._to_host)

    @staticmethod
    def _to_host(*args, **kwargs) -> bool:
        target = kwargs.get("device", args[0] if args else None)
        return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"

    @staticmethod
    def _wrap(monkeypatch, name, log, counts) -> None:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if counts(*args, **kwargs):
                log.append((name, self.numel()))
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, wrapper)


@pytest.mark.parametrize("batch", [1, 6])
def test_one_small_tensor_crosses_to_the_host_per_step(monkeypatch: pytest.MonkeyPatch,
                                                        batch: int) -> None:
    """Fails if the full logits (or any [.., V] tensor) are copied or read on the host, or
    if a row is read on its own (an int()/item() per row): the only read is the packed
    [batch, 5 + 2k] result."""
    params = (_mixed_params() * 2)[:batch]
    params[0] = SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3)
    k = max(p.logprobs or 0 for p in params)
    cols = 5 + 2 * k if any(p.logprobs is not None for p in params) else 3
    logits = torch.randn(batch, VOCAB)
    hist = [_History([1, 2, 3], [4, 4, 9])] * batch
    sampler = Sampler(0)
    sampler.sample(logits, [f"r{i}" for i in range(batch)], params, [(3,)] * batch, hist)
    probe = _HostReads(monkeypatch)
    sampler.sample(logits, [f"r{i}" for i in range(batch)], params, [(3,)] * batch, hist)
    assert probe.reads == [("tolist", batch * cols)]
    assert all(n < VOCAB for _, n in probe.copies), probe.copies
    assert [n for name, n in probe.copies if name == "cpu"] == [batch * cols]


def test_unseeded_rows_drawn_together_follow_their_distributions() -> None:
    """Inverse-transform draws (unseeded rows with temperature alone): each token as often
    as its probability says, never a token of probability 0, and a row that is no
    distribution (NaN) reported by a score that is not > 0."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]).repeat(20_000, 1)
    tokens, scores = draw_rows(probs, gen)
    counts = torch.bincount(tokens[0::2], minlength=6).double() / 20_000
    assert counts.tolist() == pytest.approx([0, 0.5, 0, 0.25, 0.25, 0], abs=0.015)
    assert set(tokens[1::2].tolist()) == {5}
    assert bool((scores > 0).all())
    nan = torch.full((1, 6), float("nan"))
    assert not bool(draw_rows(nan, gen)[1][0] > 0)


def test_a_large_sampled_batch_without_seeds_draws_plausible_tokens() -> None:
    sampler = Sampler(0)
    logits = torch.full((64, VOCAB), -20.0)
    logits[:, 7] = 5.0  # almost all the mass
    params = [SamplingParams(temperature=1.0)] * 64
    got = sampler.sample(logits, [f"r{i}" for i in range(64)], params, [()] * 64)
    assert got.token_ids.count(7) >= 60 and not got.errors
    masked = logits.clone()
    masked[:, 7] = float("-inf")  # banned: never drawn
    got = sampler.sample(logits, [f"r{i}" for i in range(64)], params, [(7,)] * 64)
    assert 7 not in got.token_ids
