"""Turning one step's logits into tokens: penalties, greedy, temperature, min-p, top-k,
top-p, seeds, logprobs.

The order is vLLM's: stop tokens banned inside min_tokens, then the repetition,
frequency and presence penalties (they change greedy choices too), then for sampled
rows temperature, min-p, top-k and top-p. Logprobs are those of the model's raw
distribution (before penalties, temperature and truncation), as vLLM and the OpenAI API
report them. A request with a seed draws from its own generator, so its tokens do not
depend on what else is in the batch; every transform is per row, so neither do its
logits. A batch where no row asks for a penalty or min-p takes the same path as before
they existed: one attribute check per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem_engine.core.request import Logprob
from tandem_engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # the sampled tokens' logprobs, when any row asked
    ranks: list[int] | None  # the sampled tokens' ranks (1 = most likely)
    top_ids: list[list[int]] | None  # per row: the top-n token ids (n = row's logprobs)
    top_logprobs: list[list[float]] | None
    # Rows that could not be sampled (their logits are not finite): row -> why. Their
    # token id is a placeholder; the engine fails those requests only.
    errors: dict[int, str] = field(default_factory=dict)


class TokenHistory(Protocol):
    """What the penalties read of a request (`core.request.Request` is one): its prompt,
    and prompt + output tokens so far (tokens resumed from another engine are output)."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def token_ids(self) -> list[int]: ...


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on logits [R, V]. `prompt_mask` [R, V] marks tokens in the prompt,
    `output_counts` [R, V] counts them in the output; the per-row penalties are [R].
    Repetition (HF/CTRL): a token seen in prompt or output has a positive logit divided
    by the penalty, a negative one multiplied. Then, as the OpenAI API defines them,
    logit -= frequency * count + presence * (count > 0), over output tokens only."""
    seen = prompt_mask | (output_counts > 0)
    penalty = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask (to -inf) every token whose probability is under min_p times the most likely
    token's (that one always stays). logits: [..., V] already divided by temperature."""
    probs = logits.softmax(-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def top_k_top_p_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the smallest set whose
    probability reaches top_p. logits: [V] already divided by temperature."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token if the mass strictly before it is below top_p (the first always stays).
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def non_finite_rows(logits: torch.Tensor) -> dict[int, str]:
    """Rows ([N, V]) holding a NaN or an infinity: no distribution to sample from."""
    finite = torch.isfinite(logits).all(dim=-1)
    if bool(finite.all()):
        return {}
    return {row: "the model produced non-finite logits (NaN or inf) for this request: "
                 "its weights or its input overflow; the request cannot be sampled"
            for row in (~finite).nonzero().flatten().tolist()}


def sample_row(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """Draw one token from one row of logits ([V], float32) under `params`."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.min_p > 0.0:
        scaled = min_p_filter(scaled, params.min_p)
    filtered = top_k_top_p_filter(scaled, params.top_k, params.top_p)
    probs = filtered.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        # A penalized request's prompt as a [V] mask, built once per prompt list (the
        # request's own, kept for its life): request id -> (that list, mask).
        self._prompt_masks: dict[str, tuple[list[int], torch.Tensor]] = {}

    def generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = self._request_generators[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def skip_draws(self, request_id: str, params: SamplingParams, draws: int,
                   vocab_size: int) -> None:
        """Advance a seeded request's generator past `draws` tokens sampled elsewhere (the
        first token of a handed-over request), so its later tokens are the ones a single
        engine would draw. One multinomial draw over V probabilities consumes the same
        random numbers whatever the probabilities are, so uniform ones stand in."""
        if params.greedy or params.seed is None:
            return
        gen = self.generator_for(request_id, params)
        uniform = torch.full((vocab_size,), 1.0 / vocab_size)
        for _ in range(draws):
            torch.multinomial(uniform, 1, generator=gen)

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int
                        ) -> list[dict[int, Logprob]]:
        """Teacher-forced logprobs: row i's logprob of `targets[i]` (with its rank) and
        the `top` most likely tokens, from the raw logits as the OpenAI API reports."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
        chosen_t = logprobs.gather(1, target)
        ranks = ((logprobs > chosen_t).sum(dim=1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        entries = [{t: Logprob(lp, rank)} for t, lp, rank in zip(targets, chosen, ranks,
                                                                  strict=True)]
        if top:
            values, indices = torch.topk(logprobs, top, dim=-1)
            for entry, ids, lps in zip(entries, indices.tolist(), values.tolist(), strict=True):
                for rank, (tid, value) in enumerate(zip(ids, lps, strict=True), start=1):
                    entry.setdefault(tid, Logprob(value, rank))
        return entries

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        self._prompt_masks.pop(request_id, None)

    def _prompt_mask(self, request_id: str, prompt: list[int], vocab: int) -> torch.Tensor:
        cached = self._prompt_masks.get(request_id)
        if cached is None or cached[0] is not prompt or cached[1].shape[0] != vocab:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[torch.tensor(prompt, dtype=torch.long)] = True
            cached = self._prompt_masks[request_id] = (prompt, mask)
        return cached[1]

    def penalize(self, logits: torch.Tensor, rows: list[int], request_ids: list[str],
                 params: list[SamplingParams], histories: Sequence[TokenHistory]
                 ) -> torch.Tensor:
        """`logits` with the penalties of `rows` applied; other rows are left untouched."""
        vocab = logits.shape[-1]
        prompt_mask = torch.stack([
            self._prompt_mask(request_ids[r], histories[r].prompt_token_ids, vocab)
            for r in rows])
        output_counts = torch.zeros(len(rows), vocab, dtype=logits.dtype)
        for i, r in enumerate(rows):
            history = histories[r]
            output = history.token_ids[len(history.prompt_token_ids):]
            if output:
                output_counts[i] = torch.bincount(
                    torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab]

        def per_row(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(params[r], name)) for r in rows],
                                dtype=logits.dtype)

        logits = logits.clone()
        logits[rows] = apply_penalties(
            logits[rows], prompt_mask, output_counts, per_row("repetition_penalty"),
            per_row("presence_penalty"), per_row("frequency_penalty"))
        return logits

    def checkpoint(self, request_ids: list[str], params: list[SamplingParams]
                   ) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The random state `sample` may consume for these rows, for `restore` (a batch
        whose sampling raised is re-sampled row by row from the same state)."""
        gens = [self.generator] + [self.generator_for(r, p) for r, p in
                                   zip(request_ids, params, strict=True)
                                   if not p.greedy and p.seed is not None]
        return [(g, g.get_state()) for g in gens]

    @staticmethod
    def restore(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for gen, state in states:
            gen.set_state(state)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams], banned: list[tuple[int, ...]],
               histories: Sequence[TokenHistory] | None = None) -> SampleResult:
        """logits: [N, V] float32, one row per request. `banned` token ids per row are
        masked before sampling (stop tokens inside min_tokens). `histories` (one per row)
        are read only for rows with a penalty, which need them."""
        raw = logits.cpu()
        errors = non_finite_rows(raw)
        logits = raw
        if any(banned):
            logits = raw.clone()
            for row, ids in enumerate(banned):
                if ids:
                    logits[row, list(ids)] = float("-inf")
        penalized = [i for i, p in enumerate(params) if p.penalized and i not in errors]
        if penalized:
            if histories is None:
                raise ValueError("sampling with penalties needs each request's tokens "
                                 "(histories)")
            logits = self.penalize(logits, penalized, request_ids, params, histories)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy and i not in errors]
        tokens = [0] * len(params)
        if greedy_rows:
            picked = torch.argmax(logits[greedy_rows], dim=-1).tolist()
            for row, tok in zip(greedy_rows, picked, strict=True):
                tokens[row] = tok
        for row, p in enumerate(params):
            if not p.greedy and row not in errors:
                tokens[row] = sample_row(logits[row], p, self.generator_for(request_ids[row], p))

        want = [p.logprobs for p in params]
        if all(n is None for n in want):
            return SampleResult(tokens, None, None, None, None, errors)
        logprobs = torch.log_softmax(raw, dim=-1)
        chosen_t = logprobs.gather(1, torch.tensor(tokens).unsqueeze(1))
        ranks = ((logprobs > chosen_t).sum(dim=1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        k = max(n or 0 for n in want)
        top_ids: list[list[int]] = [[] for _ in params]
        top_lps: list[list[float]] = [[] for _ in params]
        if k:
            values, indices = torch.topk(logprobs, k, dim=-1)
            values, indices = values.tolist(), indices.tolist()
            for row, n in enumerate(want):
                if n:
                    top_ids[row], top_lps[row] = indices[row][:n], values[row][:n]
        return SampleResult(tokens, chosen, ranks, top_ids, top_lps, errors)
