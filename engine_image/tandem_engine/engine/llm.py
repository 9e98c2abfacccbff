"""`LLM`: the offline API in the shape vLLM users know.

    llm = LLM(model="path/to/checkpoint", max_num_seqs=32)
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from tandem_engine.config import EngineConfig, SpeculativeConfig
from tandem_engine.engine.llm_engine import LLMEngine
from tandem_engine.engine.outputs import PromptScore, RequestOutput
from tandem_engine.lifecycle import EngineState, EngineStateError, KVMode
from tandem_engine.lora_request import LoRARequest
from tandem_engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | Path, **engine_options: object) -> None:
        """`engine_options` are the fields of `EngineConfig` (block_size, num_blocks,
        kv_cache_memory_bytes, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
        max_model_len, dtype, device, seed, ...). `device`: auto (the default: cuda when
        torch sees a GPU, else cpu), cpu, cuda or cuda:N; asking for cuda where no GPU is
        visible raises ValueError. `speculative` turns on speculative decoding: a
        `SpeculativeConfig` or a dict of its fields, also accepted as vLLM's
        `speculative_config={"method": "ngram", "num_speculative_tokens": 4, ...}`.
        `seat_reserve_ms` is 0 here unless given: offline, every prompt is queued at once,
        so no client comes back for a reserved seat (a server's engine reserves 20 ms)."""
        if "speculative_config" in engine_options:
            if "speculative" in engine_options:
                raise TypeError("give speculative or speculative_config, not both")
            engine_options["speculative"] = engine_options.pop("speculative_config")
        if engine_options.get("speculative") is not None:
            engine_options["speculative"] = SpeculativeConfig.of(
                engine_options["speculative"])  # type: ignore[arg-type]
        engine_options.setdefault("seat_reserve_ms", 0)
        known = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine.from_checkpoint(model, EngineConfig(**engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in prompt order.
        `lora_request` (vLLM's): the adapter of every prompt, or one per prompt (None: the
        base model); an adapter the engine does not serve yet is loaded first (the engine
        needs enable_lora). `priority` (vLLM's): one per prompt, lower scheduled first
        (default: 0 each, first come first served)."""
        if self.engine.state is not EngineState.RUNNING:
            raise EngineStateError(f"generate() needs a RUNNING engine; it is "
                                   f"{self.engine.state} (unpause() or resume() first)")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_list)} "
                                 "prompts: give one, or one per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} "
                                 "prompts: give one, or one per prompt")
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} "
                             "prompts: give one per prompt, or none")
        for lora in {lora for lora in loras if lora is not None}:
            if lora not in self.engine.loras.known.values():
                self.engine.load_lora(lora)
        ids = []
        try:
            for prompt, p, lora, rank in zip(prompt_list, params, loras, priorities,
                                             strict=True):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p,
                                        lora_name=lora.lora_name if lora else None,
                                        priority=rank)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            self.engine.step()  # drain the abort outputs
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def score(self, texts: Prompt | Sequence[Prompt]) -> list[PromptScore]:
        """Teacher-forced logprobs of each text under the model: every token after the
        first, given the ones before it (perplexity, a refit's quality check). A text
        is a string (tokenized with the model's tokenizer, special tokens as it adds
        them) or a list of token ids; it needs at least two tokens."""
        prompt_list = _as_prompt_list(texts)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=0)
        outputs = self.generate(prompt_list, params)
        scores = []
        for text, out in zip(prompt_list, outputs, strict=True):
            if len(out.prompt_token_ids) < 2:
                raise ValueError(f"cannot score {text!r}: it has {len(out.prompt_token_ids)} "
                                 "token(s); a score needs at least 2")
            scores.append(PromptScore.of(out))
        return scores


    # ---- lifecycle: thin calls into the engine's state machine ----------------------------

    @property
    def state(self) -> EngineState:
        return self.engine.state

    def pause(self) -> None:
        self.engine.pause()

    def unpause(self) -> None:
        self.engine.unpause()

    def suspend(self, mode: KVMode | str = KVMode.PERSIST) -> int:
        """Release KV memory (persist, offload or recompute); returns bytes released."""
        return self.engine.suspend(mode)

    def resume(self) -> None:
        self.engine.resume()

    def refit(self, path: str | Path, version: str | None = None) -> int:
        """Load new weights in place (while paused or suspended); returns the new epoch."""
        return self.engine.refit(path, version)

    def stop(self) -> None:
        self.engine.stop()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items
