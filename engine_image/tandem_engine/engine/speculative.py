"""Speculative decoding: proposing tokens, verifying them in one forward, backing off.

Each step, before scheduling, the engine asks the proposer for up to k tokens that may
follow each running decode (`Request.spec_token_ids`). The scheduler appends them to
the decode's chunk when the budget and free blocks allow; the runner returns logits for
every position of such a chunk (its last token's and one per proposal); the sampler
draws one token per position exactly as it would without speculation, the history at
position i including proposals 0..i-1 (penalties, `min_tokens` bans); and the longest
prefix of proposals equal to those draws is accepted, followed by the draw at the first
mismatch (or after the last proposal): 1..k+1 tokens per step.

Why that is exact, greedy or sampled: the sampler's draw is the exponential race
`argmax p(v) / E_v`, whose winner is distributed as p. Accepting proposal x iff the
race picks x accepts with probability p(x), and a rejected position emits the race's
winner, which given "not x" is distributed as p with x removed and renormalized. That
is speculative rejection sampling with a proposal distribution q that is a point mass
at x. Every emitted token is the draw at its own position, so its logprob is the one
the sampler computed there. A seeded request's generator is rewound so that it has
consumed one draw per emitted token (draws at positions after a rejection are taken
back): its tokens are the ones it draws without speculation, whatever the batch, the
budget or the proposals were.

The n-gram proposer (prompt lookup) needs no second model; nor does the mtp proposer
(`MtpProposer`), which reads the served checkpoint's own heads. The draft proposer
(engine/draft_model.py) runs a small checkpoint of the same tokenizer, proposing its
greedy tokens: q is a point mass there too. A back-off (every method's,
engine/backoff.py) keeps workloads a proposer cannot predict from paying for
verification that fails.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from tandem_engine.config import EngineConfig, SpeculativeConfig
from tandem_engine.core.request import Request
from tandem_engine.engine.backoff import Backoffs
from tandem_engine.engine.draft_model import DraftCheckpoint, DraftModelProposer
from tandem_engine.engine.stats import SpecDecodeStats

if TYPE_CHECKING:
    from tandem_engine.model.mtp import MtpHeads


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the `k` tokens that followed the most recent earlier occurrence of
    the last n tokens of `tokens`, trying n from `n_max` down to `n_min`; [] when none
    occurs (or k < 1).

    When that continuation reaches the end of `tokens` (the match lies within the last
    k tokens: the sequence repeats with a period shorter than k), it goes on as the
    repetition would, the proposals themselves taken as the sequence's next tokens: in
    ...ABCAB the match of "AB" is followed by "CAB", then "C" again, and so on."""
    size = len(tokens)
    if k < 1 or size < 2:
        return []
    # Token ids as 4-byte words, so the search runs in bytes.rfind (C speed); a hit must
    # start on a word boundary.
    words = array("i", tokens).tobytes()
    width = array("i").itemsize
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = words[(size - n) * width:]
        end = (size - 1) * width  # an earlier occurrence ends before the last token
        while True:
            at = words.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:
                draft = list(tokens[at // width + n:at // width + n + k])
                period = size - (at // width + n)  # the match repeats this many tokens on
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
            end = at + len(pattern) - 1
    return []


def accepted_length(draft: Sequence[int], drawn: Sequence[int]) -> int:
    """How many leading proposals equal the target's own draw at their position
    (`drawn` has one token per verified position: len(draft) + 1)."""
    accepted = 0
    while accepted < len(draft) and drawn[accepted] == draft[accepted]:
        accepted += 1
    return accepted


@dataclass(frozen=True)
class DraftedHistory:
    """A request's tokens as if its first proposals were accepted: what the penalties
    see at a verified position (`model.sampler.TokenHistory`)."""

    request: Request
    draft: tuple[int, ...]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + list(self.draft)


class Proposer(Protocol):
    """What the engine needs of a proposal method. `propose` gets the step's candidate
    decodes together (each has exactly one token not yet computed: its last) with the
    most each may propose (>= 1); it returns one list per request, [] for none. A
    method with a model of its own proposes for all of them in one batch."""

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]: ...

    def observe(self, request: Request, proposed: int, accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.backoffs = Backoffs()

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(request, limit)
                for request, limit in zip(requests, limits, strict=True)]

    def propose_one(self, request: Request, limit: int) -> list[int]:
        """Up to min(k, `limit`) tokens to verify after the request's last token."""
        k = min(self.config.num_speculative_tokens, limit)
        if k < 1 or not self.backoffs.allows(request):
            return []
        return propose_ngram(request.token_ids, k, self.config.prompt_lookup_min,
                             self.config.prompt_lookup_max)

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        self.backoffs.observe(request, proposed, accepted)

    def forget(self, request_id: str) -> None:
        self.backoffs.forget(request_id)


def check_mtp_heads(config: SpeculativeConfig, heads: MtpHeads | None, source: str) -> None:
    """ValueError naming `source` (the checkpoint) unless it has at least
    `num_speculative_tokens` heads (vLLM refuses more proposals than heads too)."""
    k = config.num_speculative_tokens
    if heads is None:
        raise ValueError(
            f"speculative method mtp needs multi-token-prediction heads, and checkpoint "
            f"{source} has no mtp heads (config.json has no num_mtp_heads): fit some with "
            f"`tandem mtp-heads fit {source} OUT --heads {k}` and serve OUT, or write a demo "
            f"model with `tandem demo-model DIR --mtp-heads {k}` (docs/mtp.md)")
    if heads.num_heads < k:
        raise ValueError(
            f"speculative option num_speculative_tokens={k} exceeds the {heads.num_heads} "
            f"mtp heads of checkpoint {source} (one proposal per head): lower it to at most "
            f"{heads.num_heads} or fit more heads (`tandem mtp-heads fit ... --heads {k}`)")


@dataclass(frozen=True)
class _Remembered:
    num_tokens: int  # the request's token count when the row was taken
    hidden: torch.Tensor  # [hidden]: the state at position num_tokens - 2


class MtpProposer:
    """Proposals from the served checkpoint's own multi-token-prediction heads (layout
    and position arithmetic: model/mtp.py).

    The heads start from the target's final-normed hidden state at a request's last
    computed position, which the forward that computed it already had: the engine asks
    the runner for the sampling rows' hidden states (`ModelRunner.capture_hidden`) and
    hands the row that produced each request's last emitted token to `remember`. A
    request whose token count moved on without such a row (a refit clears every row)
    proposes nothing that step. Proposal j is the argmax of head j: a point mass, so
    acceptance stays exact; a bad head only costs verification, which the back-off
    limits as for the n-gram method."""

    def __init__(self, config: SpeculativeConfig, heads: MtpHeads,
                 logits: Callable[[torch.Tensor], torch.Tensor],
                 embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """`heads` already on the target's device and dtype; `logits` is the target's
        lm_head ([M, hidden] -> [M, vocab]), `embed` its input embedding ([M] token ids
        -> [M, hidden]; heads with mtp_token_input read the emitted token's)."""
        self.config = config
        self.heads = heads
        self._logits = logits
        self._embed = embed
        self._rows: dict[str, _Remembered] = {}
        self.backoffs = Backoffs()

    def load_heads(self, heads: MtpHeads) -> None:
        """New heads (a refit, already checked): every remembered row came from the old
        weights, so none is used again."""
        self.heads = heads
        self._rows.clear()

    def remember(self, requests: Sequence[Request], hidden: torch.Tensor) -> None:
        """Row r of `hidden` is the state that produced requests[r]'s last token."""
        for request, row in zip(requests, hidden, strict=True):
            self._rows[request.request_id] = _Remembered(request.num_tokens, row)

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        picked: list[tuple[int, int]] = []  # (index in requests, proposals)
        rows: list[torch.Tensor] = []
        for index, (request, limit) in enumerate(zip(requests, limits, strict=True)):
            k = min(self.config.num_speculative_tokens, self.heads.num_heads, limit)
            remembered = self._rows.get(request.request_id)
            if (k < 1 or remembered is None or remembered.num_tokens != request.num_tokens
                    or not self.backoffs.allows(request)):
                continue
            picked.append((index, k))
            rows.append(remembered.hidden)
        if rows:
            n = max(k for _, k in picked)
            h = torch.stack(rows)
            with torch.inference_mode():
                e = None if self.heads.token_weight is None else self._embed(torch.tensor(
                    [requests[index].token_ids[-1] for index, _ in picked], device=h.device))
                tokens = self.heads.propose(h, n, self._logits, e)
            for (index, k), row in zip(picked, tokens, strict=True):
                out[index] = row[:k]
        return out

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        self.backoffs.observe(request, proposed, accepted)

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self.backoffs.forget(request_id)


def make_proposer(config: SpeculativeConfig, engine_config: EngineConfig | None = None,
                  draft: DraftCheckpoint | None = None, num_blocks: int = 0,
                  max_model_len: int = 0, dtype: str = "float32", *,
                  mtp_heads: MtpHeads | None = None,
                  target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  target_embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  checkpoint: str = "(tensors given)") -> Proposer:
    """The proposer of `config.method`. The draft method also needs the engine's config,
    its draft checkpoint (loaded and checked against the served model by
    `load_draft_checkpoint`), the blocks of its KV pool, the engine's max_model_len and
    the served model's dtype. Method mtp takes the served checkpoint's heads
    (`mtp_heads`, on the target's device and dtype), the target's lm_head
    (`target_logits`) and input embedding (`target_embed`), and the checkpoint's name
    for its errors."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft":
        if engine_config is None or draft is None or num_blocks < 1 or max_model_len < 1:
            raise ValueError("the draft method needs the engine config, the draft "
                             "checkpoint, num_blocks and max_model_len")
        return DraftModelProposer(config, engine_config, draft, num_blocks, max_model_len,
                                  dtype)
    if config.method == "mtp":
        check_mtp_heads(config, mtp_heads, checkpoint)
        assert mtp_heads is not None and target_logits is not None
        assert target_embed is not None
        return MtpProposer(config, mtp_heads, target_logits, target_embed)
    raise ValueError(f"speculative method {config.method!r} has no proposer")


@dataclass
class SpecDecodeCounters:
    """Totals since the engine started (published in `EngineStats.speculative`)."""

    num_drafts: int = 0  # decode steps that verified proposals
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0
    # [i]: drafts whose proposal i was accepted / that had a proposal i at all
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for counts in (self.accepted_per_position, self.proposed_per_position):
            if len(counts) < proposed:
                counts.extend([0] * (proposed - len(counts)))
        for i in range(proposed):
            self.proposed_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_position),
                               tuple(self.proposed_per_position))
