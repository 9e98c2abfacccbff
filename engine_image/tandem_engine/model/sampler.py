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

Everything runs on the logits' device (a GPU's logits never cross to the host whole).
A row with its own seed draws with the exponential race `argmax(probs / Exp(1))`, which
is exactly what `torch.multinomial` does for one sample (same random numbers, same token)
but without its validity checks, each a host synchronisation; its generator then
advances by V numbers a token, whatever the batch (`skip_draws` relies on it). Rows
without a seed and with temperature alone draw together from the engine's generator by
inverse transform (`draw_rows`: one uniform number a row, not V), the common case of a
large sampled batch. What crosses is one small
tensor per step: [N, 3] (token, finite, draw score) or, when a row asks for logprobs,
[N, 5 + 2k] (then logprob, rank, k top ids, k top logprobs), copied once and unpacked on
the host. Host-built inputs (banned ids, penalty values, output tokens) go the other way
without waiting (`non_blocking`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

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


class TokenMasks(NamedTuple):
    """Structured outputs' allowed tokens for some rows of a step: `bitmask` [M, W] int32
    on the host (bit t of row m: token t allowed), `rows[m]` the logits row it masks."""

    bitmask: torch.Tensor
    rows: list[int]

    def row(self, row: int) -> TokenMasks | None:
        """The mask of one logits row, as the masks of a one-row batch."""
        if row not in self.rows:
            return None
        m = self.rows.index(row)
        return TokenMasks(self.bitmask[m:m + 1], [0])


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """`logits` [R, V] with every token a row's mask forbids at -inf, on the logits'
    device (the bitmap crosses, never the logits)."""
    dev, vocab = logits.device, logits.shape[-1]
    packed = masks.bitmask.to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    index = to_device(masks.rows, torch.long, dev)
    rows = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, rows)


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


NON_FINITE = ("the model produced non-finite logits (NaN or inf) for this request: "
              "its weights or its input overflow; the request cannot be sampled")


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, copied without waiting for the device."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def draw_row(logits: torch.Tensor, params: SamplingParams,
             generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token from one row of logits ([V], float32) under sampling `params`, on the
    logits' device: (token id, its race score), both 0-d. The score is > 0 exactly when
    the filtered distribution was valid: softmax spreads a NaN to every entry, and no
    mass left scores 0. An invalid draw still yields an id; the caller refuses it."""
    scaled = logits / params.temperature
    if params.min_p > 0.0:
        scaled = min_p_filter(scaled, params.min_p)
    probs = top_k_top_p_filter(scaled, params.top_k, params.top_p).softmax(-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    score, token = (probs / race).max(dim=-1)
    return token, score


def draw_rows(probs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """One token from each row of `probs` [N, V] by inverse transform: one uniform number
    per row against the row's cumulative distribution (in float64), where the exponential
    race draws V. Returns (tokens, their probabilities): a probability > 0 exactly when
    the row was a distribution (a NaN row gives NaN). The token always has a probability
    > 0: the uniform lands strictly inside a token's share, and a rounding at the very top
    falls back to the last token with any."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator)
    token = torch.searchsorted(cdf, u * total, right=True)
    # The last token with any share (a NaN row finds none: its score stays NaN).
    token = torch.minimum(token, torch.searchsorted(cdf, total)).clamp_(max=cdf.shape[-1] - 1)
    return token.squeeze(1), probs.gather(1, token).squeeze(1)


def sample_row(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """Draw one token from one row of logits ([V], float32) under `params` (host int)."""
    if params.greedy:
        return int(torch.argmax(logits))
    token, score = draw_row(logits, params, generator)
    if not bool(score > 0):
        raise ValueError(_INVALID)
    return int(token)


_INVALID = ("the filtered distribution holds no probability (NaN, or every token masked): "
            "its sampling parameters leave nothing to draw")


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        # Generators live on the device the logits do (CUDA draws need CUDA generators).
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        # A penalized request's prompt as a [V] mask, built once per prompt list (the
        # request's own, kept for its life): request id -> (that list, mask).
        self._prompt_masks: dict[str, tuple[list[int], torch.Tensor]] = {}

    def generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = self._request_generators[request_id] = torch.Generator(
                self.device).manual_seed(params.seed)
        return gen

    def skip_draws(self, request_id: str, params: SamplingParams, draws: int,
                   vocab_size: int) -> None:
        """Advance a seeded request's generator past `draws` tokens sampled elsewhere (the
        first token of a handed-over request), so its later tokens are the ones a single
        engine would draw. A draw consumes V exponentials whatever the probabilities."""
        if params.greedy or params.seed is None:
            return
        gen = self.generator_for(request_id, params)
        scratch = torch.empty(vocab_size, device=self.device)
        for _ in range(draws):
            scratch.exponential_(1, generator=gen)

    def seeded_state(self, request_id: str, params: SamplingParams) -> torch.Tensor | None:
        """The state of a seeded sampled request's own generator (None for the others),
        for `rewind`."""
        if params.greedy or params.seed is None:
            return None
        return self.generator_for(request_id, params).get_state()

    def rewind(self, request_id: str, params: SamplingParams, state: torch.Tensor,
               draws: int, vocab_size: int) -> None:
        """Put a seeded request's generator back to `state` (from `seeded_state`), then
        past `draws` draws: a speculative step drew at positions whose tokens it did not
        emit, and those draws belong to the request's later tokens."""
        self.generator_for(request_id, params).set_state(state)
        self.skip_draws(request_id, params, draws, vocab_size)

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int
                        ) -> list[dict[int, Logprob]]:
        """Teacher-forced logprobs: row i's logprob of `targets[i]` (with its rank) and
        the `top` most likely tokens, from the raw logits as the OpenAI API reports."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = to_device(targets, torch.long, logprobs.device).unsqueeze(1)
        host = _logprob_columns(logprobs, target, top).cpu().tolist()
        entries = []
        for t, row in zip(targets, host, strict=True):
            entry = {t: Logprob(row[0], int(row[1]))}
            for rank in range(1, top + 1):
                entry.setdefault(int(row[1 + rank]), Logprob(row[1 + top + rank], rank))
            entries.append(entry)
        return entries

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        self._prompt_masks.pop(request_id, None)

    def _prompt_mask(self, request_id: str, prompt: list[int], vocab: int,
                     device: torch.device) -> torch.Tensor:
        cached = self._prompt_masks.get(request_id)
        if cached is None or cached[0] is not prompt or cached[1].shape[0] != vocab:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            mask[to_device(prompt, torch.long, device)] = True
            cached = self._prompt_masks[request_id] = (prompt, mask)
        return cached[1]

    def penalize(self, logits: torch.Tensor, rows: list[int], request_ids: list[str],
                 params: list[SamplingParams], histories: Sequence[TokenHistory]
                 ) -> torch.Tensor:
        """`logits` with the penalties of `rows` applied; other rows are left untouched."""
        vocab, dev = logits.shape[-1], logits.device
        prompt_mask = torch.stack([
            self._prompt_mask(request_ids[r], histories[r].prompt_token_ids, vocab, dev)
            for r in rows])
        # Every row's output tokens in one host→device copy, counted on the device.
        count_rows: list[int] = []
        count_ids: list[int] = []
        for i, r in enumerate(rows):
            history = histories[r]
            output = history.token_ids[len(history.prompt_token_ids):]
            count_rows.extend([i] * len(output))
            count_ids.extend(output)
        output_counts = torch.zeros(len(rows), vocab, dtype=logits.dtype, device=dev)
        if count_ids:
            where = to_device([count_rows, count_ids], torch.long, dev)
            output_counts.index_put_((where[0], where[1]),
                                     torch.ones((), dtype=logits.dtype, device=dev)
                                     .expand(len(count_ids)), accumulate=True)
        names = ("repetition_penalty", "presence_penalty", "frequency_penalty")
        values = to_device([[float(getattr(params[r], n)) for r in rows] for n in names],
                           logits.dtype, dev)
        index = to_device(rows, torch.long, dev)
        return logits.index_copy(0, index, apply_penalties(
            logits.index_select(0, index), prompt_mask, output_counts, *values))

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
               histories: Sequence[TokenHistory] | None = None,
               masks: TokenMasks | None = None) -> SampleResult:
        """logits: [N, V] float32, one row per request. `banned` token ids per row are
        masked before sampling (stop tokens inside min_tokens), and so is every token
        `masks` forbids (structured outputs). `histories` (one per row) are read only for
        rows with a penalty, which need them."""
        packed = self.sample_on_device(logits, request_ids, params, banned, histories, masks)
        return unpack(packed.cpu().tolist(), params)  # the step's one device→host copy

    def sample_on_device(self, logits: torch.Tensor, request_ids: list[str],
                         params: list[SamplingParams], banned: list[tuple[int, ...]],
                         histories: Sequence[TokenHistory] | None = None,
                         masks: TokenMasks | None = None) -> torch.Tensor:
        """`sample`'s work, all on the logits' device, packed as one float64 tensor:
        [N, 3] (token, finite, score) or with logprobs [N, 5 + 2k] (see the module
        docstring). `finite` is 0 for non-finite logits (the model's fault); `score` is
        the draw's race score, not > 0 for a sampled row whose filtered distribution was
        empty (its parameters' fault), 1 for greedy rows."""
        raw = logits
        dev, vocab = raw.device, raw.shape[-1]
        # Every logit checked, not the row's sum: finite logits of over-confident weights
        # (~1e36) sum to inf, and such weights must reach the refit's confidence check.
        # A row's largest and smallest logits are finite exactly when all are (NaN
        # propagates through both): two passes, where isfinite().all() took five (0.84
        # against 0.16 ms for 17 rows of SmolLM2's 49,152 logits on 2 cores).
        finite = torch.isfinite(raw.amax(dim=-1)) & torch.isfinite(raw.amin(dim=-1))
        if any(banned):
            rows = [row for row, ids in enumerate(banned) for _ in ids]
            cols = [c for ids in banned for c in ids]
            if not all(0 <= c < vocab for c in cols):  # the device would assert, not raise
                raise IndexError(f"banned token ids {sorted(set(cols))} fall outside the "
                                 f"vocabulary [0, {vocab})")
            where = to_device([rows, cols], torch.long, dev)
            logits = raw.index_put((where[0], where[1]),  # a fill on the device, no copy
                                   torch.full((), float("-inf"), dtype=raw.dtype, device=dev))
        if masks is not None:
            logits = apply_token_masks(logits, masks)
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            if histories is None:
                raise ValueError("sampling with penalties needs each request's tokens "
                                 "(histories)")
            logits = self.penalize(logits, penalized, request_ids, params, histories)
        # Unseeded rows with temperature alone draw together from the engine's generator
        # (one softmax and one race over [rows, V]); the rest row by row (a seeded row
        # draws from its own generator, so its tokens do not depend on the batch).
        together = [i for i, p in enumerate(params) if _plain_draw(p)]
        alone = [i for i, p in enumerate(params) if not p.greedy and not _plain_draw(p)]
        draws = {row: draw_row(logits[row], params[row],
                               self.generator_for(request_ids[row], params[row]))
                 for row in alone}
        tokens = logits.argmax(dim=-1)  # greedy rows' tokens; sampled rows overwrite
        scores = torch.ones(len(params), dtype=logits.dtype, device=dev)
        if together:
            index = to_device(together, torch.long, dev)
            temperature = to_device([params[i].temperature for i in together], logits.dtype,
                                    dev)
            probs = (logits.index_select(0, index) / temperature.unsqueeze(1)).softmax(-1)
            token, score = draw_rows(probs, self.generator)
            tokens = tokens.index_copy(0, index, token)
            scores = scores.index_copy(0, index, score)
        if draws:
            index = to_device(list(draws), torch.long, dev)
            tokens = tokens.index_copy(0, index, torch.stack([t for t, _ in draws.values()]))
            scores = scores.index_copy(0, index, torch.stack([s for _, s in draws.values()]))
        columns = [torch.stack([tokens.double(), finite.double(), scores.double()], dim=1)]
        if any(p.logprobs is not None for p in params):
            k = max(p.logprobs or 0 for p in params)
            columns.append(_logprob_columns(torch.log_softmax(raw, dim=-1),
                                            tokens.unsqueeze(1), k))
        return torch.cat(columns, dim=1)


def _plain_draw(params: SamplingParams) -> bool:
    """A sampled row with temperature alone and no seed of its own."""
    return (not params.greedy and params.seed is None and params.min_p == 0.0
            and params.top_k <= 0 and params.top_p >= 1.0)


def _logprob_columns(logprobs: torch.Tensor, chosen: torch.Tensor, top: int
                     ) -> torch.Tensor:
    """[N, 2 + 2*top] float64: the chosen token's logprob and rank (1 = most likely),
    then the `top` most likely ids and their logprobs (float64 holds both exactly)."""
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=1, keepdim=True) + 1
    columns = [chosen_lp.double(), ranks.double()]
    if top:
        values, indices = torch.topk(logprobs, top, dim=-1)
        columns += [indices.double(), values.double()]
    return torch.cat(columns, dim=1)


def unpack(host: list[list[float]], params: list[SamplingParams]) -> SampleResult:
    """`Sampler.sample_on_device`'s rows (as host lists) as a `SampleResult`. Raises when a
    sampled row's distribution was empty (step_guard then finds that row alone)."""
    errors = {row: NON_FINITE for row, r in enumerate(host) if r[1] == 0}
    empty = [row for row, r in enumerate(host) if r[1] != 0 and not r[2] > 0]
    if empty:
        raise ValueError(f"rows {empty}: {_INVALID}")
    tokens = [int(r[0]) for r in host]
    if all(p.logprobs is None for p in params):
        return SampleResult(tokens, None, None, None, None, errors)
    k = (len(host[0]) - 5) // 2
    top_ids: list[list[int]] = [[] for _ in params]
    top_lps: list[list[float]] = [[] for _ in params]
    for row, p in enumerate(params):
        if p.logprobs:
            top_ids[row] = [int(t) for t in host[row][5:5 + p.logprobs]]
            top_lps[row] = host[row][5 + k:5 + k + p.logprobs]
    return SampleResult(tokens, [r[3] for r in host], [int(r[4]) for r in host],
                        top_ids, top_lps, errors)
