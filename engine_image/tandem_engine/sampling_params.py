"""Per-request sampling and stopping parameters, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass

from tandem_engine.errors import RequestRejected
from tandem_engine.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Below these the sampler's arithmetic stops being finite (logits / temperature
# overflows; a top-p mass under float32's resolution keeps no token): a temperature
# under MIN_TEMPERATURE samples greedily, a top_p under MIN_TOP_P is refused.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-8
# presence_penalty and frequency_penalty lie in [-2, 2], as in OpenAI's API and vLLM.
# repetition_penalty divides or multiplies logits: vLLM only asks > 0, but a tiny or
# huge one overflows a logit to inf; these bounds keep it finite for any logit a model
# produces, and lose nothing (1e-2 already makes a seen token all but certain, 1e2 bans it).
MAX_PENALTY = 2.0
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
MAX_TOKEN_ID = 2**31 - 1  # the engine checks stop token ids against its vocabulary


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    temperature 0 (or any value under MIN_TEMPERATURE, 1e-5) means greedy; top_p must be
    at least MIN_TOP_P (1e-8). `seed` makes sampling reproducible whatever else
    shares the batch. `logprobs=n` returns the sampled token's logprob and the
    top-n alternatives at each step (0 = only the sampled token's); `prompt_logprobs=n`
    does the same for every prompt token after the first (teacher-forced: each
    token's logprob given the ones before it; the prompt is then computed in full, not
    matched from the prefix cache).

    Penalties, as vLLM defines them, change the logits before any choice (greedy too):
    `repetition_penalty` (1 = off) divides the positive logits and multiplies the
    negative ones of every token already in the prompt or the output (HF/CTRL);
    `presence_penalty` and `frequency_penalty` (0 = off) subtract, as the OpenAI API
    does, `presence * (count > 0) + frequency * count` from each token's logit, counting
    output tokens only (a resumed request's earlier tokens included). `min_p` (0 = off),
    after temperature, drops every token less likely than min_p times the most likely
    one (a no-op when greedy). Logprobs stay those of the raw distribution.

    `structured_outputs` (vLLM's name) constrains every generated token to a JSON
    schema, a regex, a choice or a grammar: tokens the constraint forbids are masked
    before sampling, and the request ends (reason stop) once the constraint is complete.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; prompt and output tokens
    presence_penalty: float = 0.0  # 0 = off; output tokens
    frequency_penalty: float = 0.0  # 0 = off; output tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Accept a single string / any iterable for stop like vLLM, store a tuple.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Some penalty changes this request's logits (the sampler needs its tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise RequestRejected for a token id or count the model's vocabulary cannot
        honour (the engine checks this at admission; the edge does not know the model)."""
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise RequestRejected(
                f"sampling parameter stop_token_ids={bad!r} is invalid: token id {bad} is "
                f"outside the model's vocabulary [0, {vocab_size}); drop it or use an id "
                f"below {vocab_size}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and n > vocab_size:
                raise RequestRejected(
                    f"sampling parameter {name}={n} is invalid: the model's vocabulary has "
                    f"only {vocab_size} tokens; ask for at most that many")

    def _validate(self) -> None:
        def bad(name: str, value: object, limit: str) -> RequestRejected:
            return RequestRejected(f"sampling parameter {name}={value!r} is invalid: {limit}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", self.min_tokens,
                      f"must be an integer between 0 and max_tokens ({self.max_tokens})")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise bad("temperature", self.temperature, "must be between 0 and 100 (0, or "
                      f"anything under {MIN_TEMPERATURE:g}, = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be -1 or 0 (off) or a positive integer")
        if not MIN_TOP_P <= float(self.top_p) <= 1.0:
            raise bad("top_p", self.top_p,
                      f"must be in [{MIN_TOP_P:g}, 1] (for the single most likely token "
                      "use top_k=1 or temperature=0)")
        if not 0.0 <= _number(self.min_p) <= 1.0:
            raise bad("min_p", self.min_p, "must be a number in [0, 1] (0 = off; keeps the "
                      "tokens at least min_p times as likely as the most likely one)")
        if not MIN_REPETITION_PENALTY <= _number(self.repetition_penalty) \
                <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", self.repetition_penalty,
                      f"must be a number in [{MIN_REPETITION_PENALTY:g}, "
                      f"{MAX_REPETITION_PENALTY:g}] (1 = off; above 1 discourages tokens "
                      "already in the prompt or output, below 1 encourages them)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= _number(value) <= MAX_PENALTY:
                raise bad(name, value, f"must be a number in [-{MAX_PENALTY:g}, "
                          f"{MAX_PENALTY:g}] (0 = off; above 0 discourages tokens already "
                          "generated, below 0 encourages them)")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0
                                      or self.seed >= 2**63):
            raise bad("seed", self.seed, "must be an integer in [0, 2**63)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"must be between 0 and {MAX_LOGPROBS}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"{len(self.stop)} strings", f"at most {MAX_STOP_STRINGS} allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad("stop", s, f"each stop string must be 1..{MAX_STOP_STRING_CHARS} chars")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise bad("stop_token_ids", t, "token ids must be integers in "
                          f"[0, {MAX_TOKEN_ID}] (and inside the model's vocabulary)")


def _number(value: object) -> float:
    """A real number as a float; NaN for anything else (a string, a bool, None), so the
    range check that follows refuses it with the parameter's own message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return float("nan")
    return float(value)
