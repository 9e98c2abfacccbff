"""What happens to a sampled token: logprobs, stop conditions, text, and the outputs.

The engine's post-processing, in the spirit of vLLM v1's output processor. Stop
conditions are decided here, once, for every path: EOS and stop tokens (after
`min_tokens`), a structured-outputs constraint that is complete, stop strings (through
the request's `TextStream`, the one owner of text), `max_tokens` and the context
limit, and a prefill engine's handoff after the first token. A speculative step emits
several tokens for a request: the engine appends them one by one and stops at the first
that ends the generation, so the tokens after it (and their logprobs) are never added.
Runs under the engine's lock, on the stepping thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem_engine.core.request import FinishReason, Logprob, Request
from tandem_engine.engine.grammars import Grammars
from tandem_engine.engine.outputs import CompletionOutput, RequestOutput
from tandem_engine.model.sampler import SampleResult
from tandem_engine.text import TextStream
from tandem_engine.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int],
                 max_model_len: int, grammars: Grammars | None = None) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._texts: dict[str, TextStream] = {}

    def add(self, request: Request, resumed_token_ids: Sequence[int] = (),
            sent_chars: int = 0) -> None:
        """Start a request's text; resumed tokens (generated elsewhere) are its first
        outputs, of which the client already has `sent_chars` characters."""
        self._texts[request.request_id] = TextStream(
            self.tokenizer, request.params, resumed_token_ids=resumed_token_ids,
            sent_chars=sent_chars)
        if request.logprobs is not None:
            # Keep logprobs aligned with output tokens: none for tokens made elsewhere.
            request.logprobs.extend({} for _ in resumed_token_ids)

    def forget(self, request_id: str) -> None:
        self._texts.pop(request_id, None)

    def banned_tokens(self, request: Request, ahead: int = 0) -> tuple[int, ...]:
        """Tokens that may not be sampled yet: EOS and stop tokens before `min_tokens`
        (at the position `ahead` proposals past the request's last token)."""
        p = request.params
        if request.num_output_tokens + ahead >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_token_ids)
        return eos + p.stop_token_ids

    def finish_reason_at_start(self, request: Request) -> FinishReason | None:
        """A resumed request whose tokens already reach its limits ends at admission."""
        if (request.num_output_tokens >= request.params.max_tokens
                or request.num_tokens >= self.max_model_len):
            return FinishReason.LENGTH
        return None

    def append(self, request: Request, token: int, row: int | None = None,
               result: SampleResult | None = None) -> FinishReason | None:
        """Add a sampled token to `request`; the reason it ends now, if it does."""
        request.token_ids.append(token)
        p = request.params
        if result is not None and result.logprobs is not None and request.logprobs is not None:
            lp = result.logprobs[row]
            request.cumulative_logprob += lp
            entry = {token: Logprob(lp, result.ranks[row])}
            for rank, (tid, value) in enumerate(
                    zip(result.top_ids[row], result.top_logprobs[row], strict=True), start=1):
                entry.setdefault(tid, Logprob(value, rank))
            request.logprobs.append(entry)

        n_out = request.num_output_tokens
        complete = False
        if self.grammars is not None:
            request.error = self.grammars.advance(request, token)
            if request.error is not None:
                return FinishReason.ERROR
            complete = self.grammars.complete(request)
        if n_out >= p.min_tokens and (token in p.stop_token_ids
                                      or (not p.ignore_eos and token in self.eos_token_ids)):
            request.stop_reason = token if token in p.stop_token_ids else None
            return FinishReason.STOP
        text = self._texts[request.request_id]
        if text.push(token):
            request.stop_reason = text.stop_string
            return FinishReason.STOP
        if complete:  # the constraint admits nothing more: as if EOS came next
            return FinishReason.STOP
        if n_out >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        if request.pin_for_handoff:
            return FinishReason.HANDOFF  # a prefill engine's part ends at the first token
        return None

    def output(self, request: Request) -> RequestOutput:
        """The request's cumulative output now (built exactly once for a finished
        request: its last). Its text is what may be shown: held back
        while the generation may go on (here or, after a handoff or an engine's abort,
        elsewhere), all of it once it ended."""
        reason = request.finish_reason
        complete = reason in (FinishReason.STOP, FinishReason.LENGTH)
        if reason is None:
            text = self._texts.get(request.request_id)
        else:  # its last output: the text stream goes with it
            text = self._texts.pop(request.request_id, None)
        completion = CompletionOutput(
            index=0,
            text=text.visible(complete) if text is not None else "",
            token_ids=request.output_token_ids,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None
            else None,
            logprobs=request.logprobs,
            finish_reason=str(reason) if reason is not None else None,
            stop_reason=request.stop_reason,
            error=request.error,
        )
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [completion], finished=reason is not None,
                             epoch_segments=list(request.epoch_segments),
                             pinned_blocks=request.pinned_blocks,
                             prompt_logprobs=request.prompt_logprobs,
                             num_cached_tokens=max(request.num_cached_tokens, 0),
                             num_spec_proposed=request.num_spec_proposed,
                             num_spec_accepted=request.num_spec_accepted,
                             handoff_proposals=list(request.carried_proposals)
                             if reason is FinishReason.HANDOFF else [])
