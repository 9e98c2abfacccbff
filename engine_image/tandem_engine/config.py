"""Engine configuration: small frozen dataclasses, the engine's defaults and their flags.

What a checkpoint is (`ModelConfig`, parsed from its config.json by its family's rule)
lives with the model families, in `model/family.py`. This module does not import torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from tandem_engine.errors import CheckpointError

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                  "fp16": "float16"}
KERNEL_CHOICES = ("auto", "native", "torch", "flex")
# `tandem demo-model --size`: 1b is ~1.0B parameters, for GPU throughput checks.
DEMO_MODEL_SIZES = ("tiny", "small", "1b")

# The engine's defaults, stated once: `EngineConfig`, the `tandem-engine` and `tandem` flags
# and the operator's spec parser import them. The CRD repeats them as schema defaults
# (tests/test_crd.py checks that they agree).
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 1024 * 1024
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_KV_PIN_TTL_S = 60  # prefill: how long a handed-off prompt's KV stays pinned at most
DEFAULT_KV_QUARANTINE_TTL_S = 60  # decode: how long blocks of an unknown-state pull stay out
MAX_KV_QUARANTINE_TTL_S = 3600
DEFAULT_KERNELS = "auto"
DEFAULT_THREADS = 1  # torch threads per engine process
# Where the engine runs: auto = cuda when torch sees a GPU, else cpu; or cpu, cuda, cuda:N.
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DEFAULT_DEVICE = "auto"
# On CUDA, with neither num_blocks nor kv_cache_memory_bytes given, the KV pool takes what
# is left of this share of the device's memory after the weights and a profiling step.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Speculative decoding (off unless asked): proposal methods, and the n-gram method's defaults.
# "mtp" proposes with the served checkpoint's multi-token-prediction heads
# (model/mtp.py, docs/mtp.md).
SPECULATIVE_METHODS = ("ngram", "draft", "mtp")
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_SPECULATIVE_TOKENS = 16
MTP_HIDDEN_ACTS = ("silu", "identity")
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
MAX_PROMPT_LOOKUP = 64
# `tandem mtp-heads fit` (cli/mtp_heads.py): corpus prompts, greedy tokens per prompt, ridge.
DEFAULT_MTP_FIT_PROMPTS = 64
DEFAULT_MTP_FIT_TOKENS = 96
DEFAULT_MTP_FIT_RIDGE = 1e-3


def context_room(prompt_tokens: int, max_model_len: int) -> int:
    """Tokens a request may still generate after a prompt of `prompt_tokens`: the one rule
    of the context limit (vLLM's: prompt tokens + max_tokens <= max_model_len), used by
    the router to refuse or size max_tokens and by the engine to admit a prompt (which
    must leave room for at least one token)."""
    return max_model_len - prompt_tokens


def parse_device(value: str, source: str = "engine option device") -> tuple[str, int | None]:
    """`auto`, `cpu`, `cuda` or `cuda:N` as (type, index); the index is None unless given.
    Only the syntax: whether a GPU is visible is the model runner's question."""
    kind, colon, index = str(value).strip().lower().partition(":")
    if not colon and kind in ("auto", "cpu", "cuda"):
        return kind, None
    if kind == "cuda" and index.isdigit():
        return kind, int(index)
    raise ValueError(f"{source} {value!r} is not a device: use one of "
                     f"{', '.join(DEVICE_CHOICES)} (e.g. --device cuda:0 for the first GPU, "
                     "or --device cpu)")


def device_arg(value: str) -> str:
    """The `--device` flag's argparse type: the value, once `parse_device` accepts it."""
    try:
        parse_device(value, "--device")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def fraction_arg(value: str) -> float:
    """The `--gpu-memory-utilization` flag's argparse type: a number in (0, 1]."""
    try:
        fraction = float(value)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a fraction in (0, 1]; e.g. 0.9 "
                                         "lets the engine use 90% of the GPU's memory")
    return fraction


def add_speculative_flags(parser: argparse.ArgumentParser, whose: str = "") -> None:
    """--speculative-method, --speculative-tokens, --speculative-ngram-min/-max and
    --speculative-model, as `tandem-engine`, `tandem generate` and `tandem serve` take them
    (off by default)."""
    parser.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                        help=f"{whose}speculative decoding: propose tokens by this method "
                        "and verify them all in one forward (ngram: prompt lookup in the "
                        "request's own prompt and output; draft: a small model of the same "
                        "tokenizer, --speculative-model; mtp: the checkpoint's "
                        "multi-token-prediction heads, at most one token per head); "
                        "default off")
    parser.add_argument("--speculative-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS,
                        metavar="K", help="with --speculative-method: tokens proposed per "
                        f"step at most (1-{MAX_SPECULATIVE_TOKENS}; default %(default)s)")
    parser.add_argument("--speculative-ngram-min", type=int, default=DEFAULT_PROMPT_LOOKUP_MIN,
                        metavar="N", help="ngram: shortest suffix of the request's tokens "
                        "looked up (default %(default)s)")
    parser.add_argument("--speculative-ngram-max", type=int, default=DEFAULT_PROMPT_LOOKUP_MAX,
                        metavar="N", help="ngram: longest suffix looked up first "
                        "(default %(default)s)")
    parser.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                        metavar="N", help="propose nothing in a step with more than N running "
                        "requests (at large batches verification costs more than it saves); "
                        "default: always propose")
    parser.add_argument("--speculative-model", default=None, metavar="PATH",
                        help="draft: the draft checkpoint (a folder or GGUF file with the "
                        "served model's tokenizer; `tandem draft-model` makes one)")


def speculative_from_flags(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative config the flags of `add_speculative_flags` ask for (None: off);
    ValueError naming the flag's field when a value is out of range."""
    if args.speculative_method is None:
        return None
    config = SpeculativeConfig(args.speculative_method, args.speculative_tokens,
                               args.speculative_ngram_min, args.speculative_ngram_max,
                               args.speculative_model,
                               args.speculative_disable_by_batch_size)
    config.validate()
    return config


def speculative_flags(args: argparse.Namespace) -> list[str]:
    """The same flags again, for a command that starts engines (`tandem serve`); checked
    here first, so a bad value fails before any engine starts."""
    if speculative_from_flags(args) is None:
        return []
    flags = ["--speculative-method", args.speculative_method,
             "--speculative-tokens", str(args.speculative_tokens),
             "--speculative-ngram-min", str(args.speculative_ngram_min),
             "--speculative-ngram-max", str(args.speculative_ngram_max)]
    if args.speculative_model is not None:
        flags += ["--speculative-model", args.speculative_model]
    if args.speculative_disable_by_batch_size is not None:
        flags += ["--speculative-disable-by-batch-size",
                  str(args.speculative_disable_by_batch_size)]
    return flags


def normalize_dtype(value: Any, source: str, key: str = "dtype") -> str:
    name = str(value).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise CheckpointError(
            f"{source}: {key} {value!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
        )
    return name


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `speculative_config`: each decode step a proposer
    guesses up to `num_speculative_tokens` next tokens, and one forward of the model
    verifies them all (engine/speculative.py).

    `method` names the proposer. "ngram" (prompt lookup): the tokens that followed the
    most recent earlier occurrence of the request's last n tokens (n from
    `prompt_lookup_max` down to `prompt_lookup_min`) in its own prompt and output.
    "draft": the greedy tokens of a small checkpoint of the same tokenizer, `model` (a
    folder or GGUF file; engine/draft_model.py). "mtp": the multi-token-prediction heads
    of the served checkpoint itself (model/mtp.py; `num_speculative_tokens` at most its
    head count)."""

    method: str = "ngram"
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: str | None = None  # method "draft": the draft checkpoint
    # vLLM's name: no proposals in a step with more running requests than this (None:
    # always propose). Verifying k proposals costs k more positions per request; at a
    # large batch the step is compute-bound and they cost more than they save.
    disable_by_batch_size: int | None = None

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """A config from itself or from a dict of its fields (vLLM's `speculative_config`
        spelling); an unknown key is a ValueError naming the known ones."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a SpeculativeConfig or a dict of "
                             f"its fields, not {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative option(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def validate(self) -> None:
        def check(ok: bool, name: str, value: Any, limit: str) -> None:
            if not ok:
                raise ValueError(f"speculative option {name}={value!r} is invalid: {limit}")

        check(self.method in SPECULATIVE_METHODS, "method", self.method,
              f"use one of {', '.join(SPECULATIVE_METHODS)}")
        if self.method == "draft":
            check(bool(self.model), "model", self.model,
                  "method draft needs the draft checkpoint: give model=PATH "
                  "(--speculative-model)")
        else:
            check(self.model is None, "model", self.model,
                  f"only method draft reads a second checkpoint; drop it for {self.method}")
        check(_is_int(self.num_speculative_tokens)
              and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
              "num_speculative_tokens", self.num_speculative_tokens,
              f"must be an integer between 1 and {MAX_SPECULATIVE_TOKENS} (proposals "
              "beyond a few are rarely all accepted; 3-5 is typical)")
        check(_is_int(self.prompt_lookup_min)
              and 1 <= self.prompt_lookup_min <= MAX_PROMPT_LOOKUP,
              "prompt_lookup_min", self.prompt_lookup_min,
              f"must be an integer between 1 and {MAX_PROMPT_LOOKUP} tokens")
        check(self.disable_by_batch_size is None or (
              _is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
              "disable_by_batch_size", self.disable_by_batch_size,
              "must be a positive integer (the most running requests a step may have and "
              "still propose), or unset to always propose")
        check(_is_int(self.prompt_lookup_max)
              and self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP,
              "prompt_lookup_max", self.prompt_lookup_max,
              f"must be an integer between prompt_lookup_min ({self.prompt_lookup_min}) and "
              f"{MAX_PROMPT_LOOKUP}: raise it or lower prompt_lookup_min")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model; every field has a vLLM-style name."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # exact count; overrides kv_cache_memory_bytes
    # The KV pool's byte budget; None = the device's default: DEFAULT_KV_CACHE_MEMORY_BYTES
    # on CPU, gpu_memory_utilization of the device on CUDA.
    kv_cache_memory_bytes: int | None = None
    # CUDA only, when neither num_blocks nor kv_cache_memory_bytes is given: the share of the
    # device's memory the engine may use (weights + activations + KV pool), as vLLM's.
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    dtype: str = "auto"  # auto = the checkpoint's dtype
    device: str = DEFAULT_DEVICE  # auto | cpu | cuda | cuda:N
    seed: int = 0
    enable_prefix_caching: bool = True
    # How long a prefill engine keeps a handed-off prompt's KV pinned when the decode
    # engine never says it is done pulling.
    kv_pin_ttl_s: float = float(DEFAULT_KV_PIN_TTL_S)
    # How long a decode engine keeps the destination blocks of a pull whose transfer state
    # is unknown (a timeout) out of use at most, when the transport never says it ended.
    kv_quarantine_ttl_s: float = float(DEFAULT_KV_QUARANTINE_TTL_S)
    # CPU kernels: "native" = the compiled decode-attention kernel and oneDNN-packed
    # projections; "torch" = plain torch ops (gather + SDPA, default matmul);
    # "auto" = native on CPU when the kernel builds (a warning says when not), else torch;
    # on CUDA flex when the block size is a multiple of 16, else torch. "flex" = torch's
    # flex_attention reading the paged KV in place (compiled; CUDA, and CPU for tests).
    kernels: str = DEFAULT_KERNELS
    # CUDA with the flex backend: decode steps replayed from CUDA graphs captured at a fixed
    # set of batch sizes (padded). Ignored on CPU.
    cuda_graphs: bool = True
    # Speculative decoding; None = off.
    speculative: SpeculativeConfig | None = None

    def validate(self) -> None:
        def check(ok: bool, name: str, value: Any, limit: str) -> None:
            if not ok:
                raise ValueError(f"engine option {name}={value!r} is invalid: {limit}")

        check(self.block_size > 0 and self.block_size <= 1024, "block_size", self.block_size,
              "must be between 1 and 1024 tokens")
        check(self.num_blocks is None or self.num_blocks > 0, "num_blocks", self.num_blocks,
              "must be a positive block count")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be positive")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
              self.gpu_memory_utilization, "must be a fraction in (0, 1], e.g. 0.9")
        parse_device(self.device)
        check(0 < self.kv_quarantine_ttl_s <= MAX_KV_QUARANTINE_TTL_S, "kv_quarantine_ttl_s",
              self.kv_quarantine_ttl_s, f"must be in (0, {MAX_KV_QUARANTINE_TTL_S}] seconds")
        check(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "must be at least 1")
        check(self.max_num_batched_tokens > 0, "max_num_batched_tokens",
              self.max_num_batched_tokens, "must be at least 1")
        check(self.max_model_len is None or self.max_model_len > 0, "max_model_len",
              self.max_model_len, "must be positive")
        check(self.kernels in KERNEL_CHOICES, "kernels", self.kernels,
              f"use one of {', '.join(KERNEL_CHOICES)}")
        check(self.dtype == "auto" or _DTYPE_ALIASES.get(self.dtype, self.dtype)
              in SUPPORTED_DTYPES, "dtype", self.dtype,
              f"use auto or one of {', '.join(SUPPORTED_DTYPES)}")
        check(self.speculative is None or isinstance(self.speculative, SpeculativeConfig),
              "speculative", self.speculative,
              "must be a SpeculativeConfig (SpeculativeConfig.of turns a dict into one)")
        if self.speculative is not None:
            self.speculative.validate()
