"""Per-request sampling and stopping parameters, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass

from tandem_engine.errors import RequestRejected

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Below these the sampler's arithmetic stops being finite (logits / temperature
# overflows; a top-p mass under float32's resolution keeps no token): a temperature
# under MIN_TEMPERATURE samples greedily, a top_p under MIN_TOP_P is refused.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-8
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
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

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
