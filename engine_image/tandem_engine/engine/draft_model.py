"""Speculative decoding with a draft model: a small checkpoint of the same tokenizer
proposes each decode's next tokens greedily, and the served model verifies them.

Why acceptance stays exact: the draft proposes its argmax, so its proposal distribution
q is a point mass at the proposed token x. The engine's verification (`LLMEngine._emit`,
the sampler's exponential race; engine/speculative.py) accepts x with probability p(x)
and otherwise emits a draw from p with x removed: speculative rejection sampling for a
point-mass q, so every emitted token is distributed as the served model alone would
draw it (greedy: token-identical; seeded: the same draws), whatever the draft says.

The draft runs in the same engine, on the same device, dtype, kernels and block size,
as a second `ModelRunner` with its own paged KV pool and its own `KVCacheManager`
(prefix caching off: a draft block is never shared). Per request it remembers how many
leading tokens of the request its cache holds (`DraftState.computed`). Each step, for
the step's candidate decodes together:

1. catch up: the tokens the draft has not computed (the whole prompt on a request's
   first proposal, afterwards the tokens accepted since) run as one chunk per request,
   in as few forwards as `max_num_batched_tokens` allows; the last position's argmax
   is proposal 0;
2. proposal j (1..k-1): one batched forward of every request's proposal j-1, one
   token each, at the positions after its tokens.

A proposal is written into the draft's cache at its position before it is verified; a
rejected one is simply overwritten later, since `computed` only ever counts the
leading positions whose token is the request's own (found at the next proposal by
comparing the tokens the request got with the ones the draft computed).

Memory: the draft's pool has as many blocks as the served model's (`num_blocks`), each
block holding the draft's layers only. A request the draft pool cannot hold gets no
proposals (it never fails for it). A request whose KV the engine dropped (preemption,
suspend with recompute) has its draft blocks freed too, so waiting requests hold no
draft memory; a suspend releases the draft's whole pool and forgets every request
(`release_kv`): after the resume each request catches up once. A refit of the draft's
weights forgets every request as well (their cached KV came from the old weights).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tandem_engine.config import EngineConfig, SpeculativeConfig
from tandem_engine.core.kv import KVCacheManager
from tandem_engine.core.request import Request
from tandem_engine.engine.backoff import Backoffs
from tandem_engine.errors import CheckpointError
from tandem_engine.model.checkpoint import load_checkpoint
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.runner import ModelRunner, TokenRun
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import checkpoint_problem

log = logging.getLogger(__name__)

# Token ids compared between the draft's tokenizer and the served one (besides the
# special ids and the sizes): this many, spread evenly over the vocabulary.
VOCAB_SAMPLE = 256


@dataclass(frozen=True)
class DraftCheckpoint:
    """A validated draft checkpoint, its tensors loaded on the host."""

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def load_draft_checkpoint(path: str | Path, target_path: str | Path,
                          target_config: ModelConfig, target_tokenizer: Tokenizer,
                          dtype: str, reference: ModelConfig | None = None) -> DraftCheckpoint:
    """Validate and load the draft at `path` (a folder or a GGUF file) in `dtype`.
    Raises ValueError naming both paths when its vocabulary or tokenizer differs from the
    served model's (`target_*`), CheckpointError when it is missing or malformed, and
    with `reference` (a refit) when its shape differs from the running draft's."""
    draft_path = Path(path)
    if (problem := checkpoint_problem(draft_path)) is not None:
        raise CheckpointError(
            f"draft model: {problem}; give --speculative-model (or "
            "SpeculativeConfig.model) a checkpoint folder or GGUF file; `tandem draft-model "
            "TARGET OUT --layers K` writes one from the served model")
    tokenizer = Tokenizer.from_path(draft_path)
    config, tensors = load_checkpoint(draft_path, dtype, reference=reference)
    _check_same_vocabulary(draft_path, config, tokenizer, Path(target_path), target_config,
                           target_tokenizer)
    return DraftCheckpoint(draft_path, config, tensors)


def _check_same_vocabulary(draft_path: Path, draft_config: ModelConfig,
                           draft_tokenizer: Tokenizer, target_path: Path,
                           target_config: ModelConfig, target_tokenizer: Tokenizer) -> None:
    """The draft's proposals are token ids of the served model: both must mean the same
    thing by every id. Compares the model vocabulary sizes, the tokenizers' sizes and
    special ids, and the tokens of `VOCAB_SAMPLE` ids spread over the vocabulary."""
    problems = []
    if draft_config.vocab_size != target_config.vocab_size:
        problems.append(f"model vocab_size {draft_config.vocab_size} vs "
                        f"{target_config.vocab_size}")
    if draft_tokenizer.vocab_size != target_tokenizer.vocab_size:
        problems.append(f"tokenizer size {draft_tokenizer.vocab_size} vs "
                        f"{target_tokenizer.vocab_size}")
    for name in ("eos_token_ids", "bos_token_id"):
        mine, theirs = getattr(draft_tokenizer, name), getattr(target_tokenizer, name)
        if mine != theirs:
            problems.append(f"{name} {mine} vs {theirs}")
    size = min(draft_tokenizer.vocab_size, target_tokenizer.vocab_size)
    step = max(1, size // VOCAB_SAMPLE)
    differing = [i for i in range(0, size, step)
                 if draft_tokenizer.id_to_token(i) != target_tokenizer.id_to_token(i)]
    if differing:
        i = differing[0]
        problems.append(f"{len(differing)} of {len(range(0, size, step))} sampled token ids "
                        f"differ, e.g. id {i} is {draft_tokenizer.id_to_token(i)!r} vs "
                        f"{target_tokenizer.id_to_token(i)!r}")
    if problems:
        raise ValueError(
            f"draft model {draft_path} does not share the vocabulary of the served model "
            f"{target_path} (draft vs served: {'; '.join(problems)}): a draft must use the "
            "same tokenizer; make one with `tandem draft-model TARGET OUT --layers K`")


def draft_kv_blocks(num_blocks: int, target: ModelConfig, draft: ModelConfig) -> int:
    """Of `num_blocks` blocks of the served model's pool (memory it may fill), how many
    to keep when a draft pool of the same count must fit beside it: both pools then
    cost what the served one alone would have (the sizing by memory fraction)."""
    target_bytes = target.kv_bytes_per_token(1)
    return max(1, num_blocks * target_bytes // (target_bytes + draft.kv_bytes_per_token(1)))


@dataclass
class DraftState:
    """What the draft's cache holds of one request: KV for its first `computed` tokens,
    and the proposals it wrote after them at the last proposal (`written`: compared
    with the request's tokens at the next one)."""

    request: Request
    computed: int = 0
    num_preemptions: int = 0
    written: tuple[int, ...] = ()


class DraftModelProposer:
    """The "draft" method's `Proposer` (engine/speculative.py); module docstring."""

    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig,
                 checkpoint: DraftCheckpoint, num_blocks: int, max_model_len: int,
                 dtype: str) -> None:
        self.config = config
        self.model_config = checkpoint.config
        self.path = checkpoint.path
        # The served model's device, dtype, kernels and block size; never CUDA graphs
        # (the draft's forwards are not the fixed decode shapes they replay).
        runner_config = replace(engine_config, dtype=dtype, cuda_graphs=False)
        self.runner = ModelRunner(checkpoint.config, runner_config, checkpoint.tensors,
                                  num_blocks, max_model_len)
        self.kv = KVCacheManager(num_blocks, engine_config.block_size,
                                 enable_prefix_caching=False)
        self.max_batched_tokens = engine_config.max_num_batched_tokens
        # Positions past the draft's own context get no proposals.
        self.max_position = min(max_model_len, checkpoint.config.max_position_embeddings)
        self._states: dict[str, DraftState] = {}
        self.backoffs = Backoffs()

    # ---- the Proposer protocol -------------------------------------------------------------

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        self._drop_dropped()
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, DraftState, int]] = []  # (index, state, proposals wanted)
        for i, (request, limit) in enumerate(zip(requests, limits, strict=True)):
            k = min(self.config.num_speculative_tokens, limit,
                    self.max_position - request.num_tokens)
            if k < 1 or not self.backoffs.allows(request):
                continue
            state = self._state(request)
            # Slots up to proposal k-2's position: proposal k-1 is never run by the draft.
            if self.kv.allocate_slots(request.request_id, request.num_tokens + k - 1):
                active.append((i, state, k))
        if not active:
            return drafts
        first = self._catch_up([state for _, state, _ in active])
        for (i, _, _), token in zip(active, first, strict=True):
            drafts[i].append(token)
        for j in range(1, max(k for _, _, k in active)):
            going = [(i, state) for i, state, k in active if k > j]
            runs = []
            for i, state in going:
                position = state.request.num_tokens + j - 1
                runs.append(TokenRun([drafts[i][-1]], position,
                                     self.kv.block_table(state.request.request_id)))
            for (i, _), token in zip(going, self._argmax(runs), strict=True):
                drafts[i].append(token)
        for i, state, k in active:
            state.written = tuple(drafts[i][:k - 1])
        return drafts

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        """Back off a request whose drafts keep failing (what was accepted, the next
        proposal reads from the request's own tokens)."""
        self.backoffs.observe(request, proposed, accepted)

    def forget(self, request_id: str) -> None:
        self.backoffs.forget(request_id)
        self._states.pop(request_id, None)
        self.kv.free(request_id)

    # ---- the engine's lifecycle --------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.kv.pool.num_free

    def reset(self) -> None:
        """Forget every request's draft KV (their blocks go back to the pool)."""
        for request_id in list(self._states):
            self.forget(request_id)

    def release_kv(self) -> int:
        """A suspend: drop the pool's storage and every request's state; return the bytes
        released."""
        self.reset()
        return self.runner.free_kv()

    def restore_kv(self) -> None:
        """A resume: a fresh, empty pool."""
        if self.runner.kv_cache is None:
            self.runner.allocate_kv()

    def load_weights(self, checkpoint: DraftCheckpoint) -> None:
        """A refit of the draft (validated already, same shape): swap its weights and
        forget every request's draft KV, which the old weights computed."""
        self.runner.load_weights(checkpoint.tensors)
        self.model_config = checkpoint.config
        self.path = checkpoint.path
        self.reset()

    # ---- steps -----------------------------------------------------------------------------

    def _state(self, request: Request) -> DraftState:
        """The request's state, with `computed` moved past the proposals of the last step
        that became its tokens."""
        state = self._states.get(request.request_id)
        if state is None:
            state = DraftState(request, num_preemptions=request.num_preemptions)
            self._states[request.request_id] = state
            return state
        tokens = request.token_ids
        at = state.computed
        # The draft ran proposals 0..len(written)-1 after its `computed` tokens; the ones
        # the request now has are computed, the first that differs is not (nor after it).
        agreed = 0
        while (agreed < len(state.written) and at + agreed < len(tokens)
               and tokens[at + agreed] == state.written[agreed]):
            agreed += 1
        state.computed = min(at + agreed, request.num_tokens - 1)
        state.written = ()
        return state

    def _drop_dropped(self) -> None:
        """Free the draft blocks of requests whose KV the engine dropped since their last
        proposal (preempted: they recompute before they decode again)."""
        for request_id, state in list(self._states.items()):
            if state.request.num_preemptions != state.num_preemptions:
                self.forget(request_id)

    def _catch_up(self, states: list[DraftState]) -> list[int]:
        """Run every request's tokens the draft has not computed (through its last token)
        and return proposal 0 for each: forwards of at most max_num_batched_tokens tokens,
        each request's tokens cut into chunks where a forward is full."""
        first = [0] * len(states)
        pending = list(range(len(states)))
        while pending:
            budget = self.max_batched_tokens
            runs: list[TokenRun] = []
            finishing: list[int] = []
            for n in pending:
                if budget < 1:
                    break
                state = states[n]
                request = state.request
                take = min(budget, request.num_tokens - state.computed)
                runs.append(TokenRun(request.token_ids[state.computed:state.computed + take],
                                     state.computed, self.kv.block_table(request.request_id)))
                state.computed += take
                budget -= take
                if state.computed == request.num_tokens:
                    finishing.append(n)
            tokens = self._argmax(runs)
            done = set(finishing)
            for n, token in zip(pending, tokens, strict=False):
                if n in done:
                    first[n] = token
            pending = [n for n in pending if n not in done]
        return first

    def _argmax(self, runs: list[TokenRun]) -> list[int]:
        return self.runner.forward_runs(runs).argmax(dim=-1).tolist()
