"""Engine configuration: small frozen dataclasses, the engine's defaults and their flags.

What a checkpoint is (`ModelConfig`, parsed from its config.json by its family's rule)
lives with the model families, in `model/family.py`. This module does not import torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from tandem_engine.engine_flags import (
    EngineFlag,
    EngineOptionError,
    PoolField,
    check_fields,
    namespace_values,
)
from tandem_engine.errors import CheckpointError

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *SUPPORTED_DTYPES)  # --kv-cache-dtype
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                  "fp16": "float16"}
KERNEL_CHOICES = ("auto", "native", "torch", "flex")
# How the projections' weights are held (model/quant.py): auto = as the checkpoint holds
# them (a GGUF's quantized tensors stay quantized, an HF checkpoint stays dense); none =
# dense in the engine's dtype (a GGUF dequantized at load); int8 / int4 = weight-only
# integer weights, an HF checkpoint quantized at load.
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
DEFAULT_QUANTIZATION = "auto"
# `tandem demo-model --size`: 1b is ~1.0B parameters, for GPU throughput checks.
DEMO_MODEL_SIZES = ("tiny", "small", "1b")

# The engine's defaults, stated once: `EngineConfig` and its flag table (`ENGINE_FLAGS`,
# below) take them from here. The CRD repeats them as schema defaults
# (tests/server/test_engine_flags.py checks that they agree).
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
# What an InferencePool may ask of these (the CRD's bounds): a KV pool of 16 MiB to 1 TiB,
# a context of at most 1 Mi tokens.
MIN_POOL_KV_CACHE_BYTES = 16 * 1024**2
MAX_POOL_KV_CACHE_BYTES = 1024**4
MAX_POOL_MODEL_LEN = 1024**2
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


def speculative_from_flags(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative config the `SPECULATIVE_FLAGS` of a command line ask for (None:
    off); ValueError naming the field when a value breaks its rule."""
    if args.speculative_method is None:
        return None
    config = SpeculativeConfig(**namespace_values(SPECULATIVE_FLAGS, args))
    config.validate()
    return config


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
        """Each field within its flag's rule (`SPECULATIVE_FLAGS`), and a draft checkpoint
        for method draft and for it only."""
        check_fields(self, SPECULATIVE_FLAGS)
        if self.method == "draft" and not self.model:
            raise EngineOptionError("speculative", "model", self.model,
                                    "method draft needs the draft checkpoint: give "
                                    "model=PATH (--speculative-model)")
        if self.method != "draft" and self.model is not None:
            raise EngineOptionError("speculative", "model", self.model,
                                    "only method draft reads a second checkpoint; drop it "
                                    f"for {self.method}")


DEFAULT_STRUCTURED_OUTPUTS_CACHE_SIZE = 256
MAX_QUEUED_REQUESTS = 1_000_000  # the most --max-queued-requests may allow
# How long a finished request's seat waits for its priority's next request while worse
# ones wait (core/scheduler.py): a client's round trip through the router on one host is
# a few milliseconds; 20 ms covers it on a busy node and costs a worse-priority request
# at most that much delay.
DEFAULT_SEAT_RESERVE_MS = 20
MAX_SEAT_RESERVE_MS = 1000.0


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
    # Requests waiting (not running) at most before the engine process refuses a new
    # SUBMIT with 429 (server/worker.py; resumed and handed-over requests are always taken).
    # None: unbounded. The offline `LLM` queues every prompt it is given.
    max_queued_requests: int | None = None
    # Milliseconds a completed request's seat stays free for a request of its priority or
    # better while worse-priority requests wait and others run (core/scheduler.py); 0: off.
    seat_reserve_ms: float = DEFAULT_SEAT_RESERVE_MS
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # auto: on a CPU float32 for quantized weights, else bfloat16 where it has AMX or
    # AVX-512 BF16 and float32 elsewhere; on a GPU the checkpoint's (model/device.auto_dtype)
    dtype: str = "auto"
    # The KV pool's elements (KV_CACHE_DTYPES): auto = dtype's (model/runner.py)
    kv_cache_dtype: str = "auto"
    quantization: str = DEFAULT_QUANTIZATION  # QUANTIZATION_CHOICES
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
    # Structured outputs: distinct constraints (schemas, regexes, grammars) kept compiled.
    structured_outputs_cache_size: int = DEFAULT_STRUCTURED_OUTPUTS_CACHE_SIZE
    # LoRA adapters (vLLM's names): off unless enable_lora; max_loras on the device at
    # once, max_cpu_loras read adapters kept on the host (None: max_loras), ranks up to
    # max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def validate(self) -> None:
        """Each field within its flag's rule (`ENGINE_FLAGS`), the device and dtype
        spelled as the engine knows them, and the speculative config's own rules."""
        check_fields(self, ENGINE_CONFIG_FLAGS)
        parse_device(self.device)
        if self.dtype != "auto" and _DTYPE_ALIASES.get(self.dtype,
                                                       self.dtype) not in SUPPORTED_DTYPES:
            raise EngineOptionError("engine", "dtype", self.dtype,
                                    f"use auto or one of {', '.join(SUPPORTED_DTYPES)}")
        if self.speculative is not None and not isinstance(self.speculative,
                                                           SpeculativeConfig):
            raise EngineOptionError("engine", "speculative", self.speculative,
                                    "must be a SpeculativeConfig (SpeculativeConfig.of turns "
                                    "a dict into one)")
        if self.speculative is not None:
            self.speculative.validate()


# The engine's flags, each stated once: field, flag, type, default, help, bounds and the
# rule's words, and the InferencePool field that sets it (engine_flags.py says what derives
# from them). The order is the command line's: the operator renders a pool's flags in it
# (a pod's args, and so its template hash, keep it), `tandem-engine --help` lists them so.
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("max_num_seqs", "--max-num-seqs", int, DEFAULT_MAX_NUM_SEQS,
               "requests scheduled in one step at most", minimum=0, above_minimum=True,
               limit="must be at least 1", serve=True,
               pool=PoolField("engine.maxNumSeqs", 1, 1024)),
    EngineFlag("max_num_batched_tokens", "--max-num-batched-tokens", int,
               DEFAULT_MAX_NUM_BATCHED_TOKENS,
               "tokens (prompt chunks and decodes) in one step at most", minimum=0,
               above_minimum=True, limit="must be at least 1", serve=True,
               pool=PoolField("engine.maxNumBatchedTokens", 16, 65536)),
    EngineFlag("block_size", "--block-size", int, DEFAULT_BLOCK_SIZE, "tokens per KV block",
               minimum=0, above_minimum=True, maximum=1024,
               limit="must be between 1 and 1024 tokens",
               pool=PoolField("engine.kvCache.blockSize", 1, 256)),
    EngineFlag("threads", "--threads", int, DEFAULT_THREADS, "torch threads of each engine",
               scope="process", serve=True, pool=PoolField("engine.threads", 1, 256)),
    EngineFlag("device", "--device", device_arg, DEFAULT_DEVICE,
               "auto, cpu, cuda or cuda:N; auto = cuda when torch sees a GPU, else cpu. "
               "Asking for cuda where no GPU is visible fails at start", serve=True,
               pool=PoolField("engine.device", kind="enum")),
    EngineFlag("kv_pin_ttl_s", "--kv-pin-ttl", float, float(DEFAULT_KV_PIN_TTL_S),
               "prefill: seconds a handed-off prompt's KV stays pinned at most",
               pool=PoolField("kvTransfer.pinTTLSeconds", 1, 3600)),
    EngineFlag("num_blocks", "--num-blocks", int, None,
               "KV blocks in the pool (default: sized from the memory budget)", minimum=0,
               above_minimum=True, limit="must be a positive block count",
               pool=PoolField("engine.kvCache.numBlocks", 16, 1048576)),
    EngineFlag("kv_cache_memory_bytes", "--kv-cache-memory-bytes", int, None,
               f"the KV pool's byte budget (default: {DEFAULT_KV_CACHE_MEMORY_BYTES} on CPU; "
               "on CUDA the pool takes what --gpu-memory-utilization leaves); --num-blocks "
               "overrides it", minimum=0, above_minimum=True, limit="must be positive",
               serve=True,
               pool=PoolField("engine.kvCache.memory", MIN_POOL_KV_CACHE_BYTES,
                              MAX_POOL_KV_CACHE_BYTES, kind="quantity")),
    # Speculative decoding: off unless a method is given (a SpeculativeConfig's own
    # method defaults to ngram).
    EngineFlag("method", "--speculative-method", str, None,
               "speculative decoding: propose tokens by this method and verify them all in "
               "one forward (ngram: prompt lookup in the request's own prompt and output; "
               "draft: a small model of the same tokenizer, --speculative-model; mtp: the "
               "checkpoint's multi-token-prediction heads, at most one token per head); "
               "default off", scope="speculative", choices=SPECULATIVE_METHODS,
               limit=f"use one of {', '.join(SPECULATIVE_METHODS)}", serve=True,
               pool=PoolField("engine.speculative.method", kind="enum")),
    EngineFlag("num_speculative_tokens", "--speculative-tokens", int,
               DEFAULT_SPECULATIVE_TOKENS, "with --speculative-method: tokens proposed per "
               f"step at most (1-{MAX_SPECULATIVE_TOKENS}; default %(default)s)",
               scope="speculative", minimum=1, maximum=MAX_SPECULATIVE_TOKENS, whole=True,
               limit=f"must be an integer between 1 and {MAX_SPECULATIVE_TOKENS} (proposals "
               "beyond a few are rarely all accepted; 3-5 is typical)", metavar="K",
               serve=True, pool=PoolField("engine.speculative.numSpeculativeTokens", 1,
                                          MAX_SPECULATIVE_TOKENS)),
    EngineFlag("prompt_lookup_min", "--speculative-ngram-min", int,
               DEFAULT_PROMPT_LOOKUP_MIN, "ngram: shortest suffix of the request's tokens "
               "looked up (default %(default)s)", scope="speculative", minimum=1,
               maximum=MAX_PROMPT_LOOKUP, whole=True,
               limit=f"must be an integer between 1 and {MAX_PROMPT_LOOKUP} tokens",
               metavar="N", serve=True, ngram_only=True,
               pool=PoolField("engine.speculative.promptLookupMin", 1, MAX_PROMPT_LOOKUP,
                              defaulted=False)),
    EngineFlag("prompt_lookup_max", "--speculative-ngram-max", int,
               DEFAULT_PROMPT_LOOKUP_MAX, "ngram: longest suffix looked up first "
               "(default %(default)s)", scope="speculative", floor="prompt_lookup_min",
               maximum=MAX_PROMPT_LOOKUP, whole=True,
               limit="must be an integer between prompt_lookup_min ({floor}) and "
               f"{MAX_PROMPT_LOOKUP}: raise it or lower prompt_lookup_min", metavar="N",
               serve=True, ngram_only=True,
               pool=PoolField("engine.speculative.promptLookupMax", 1, MAX_PROMPT_LOOKUP,
                              defaulted=False)),
    EngineFlag("disable_by_batch_size", "--speculative-disable-by-batch-size", int, None,
               "propose nothing in a step with more than N running requests (at large "
               "batches verification costs more than it saves); default: always propose",
               scope="speculative", minimum=1, whole=True,
               limit="must be a positive integer (the most running requests a step may "
               "have and still propose), or unset to always propose", metavar="N",
               serve=True, pool=PoolField("engine.speculative.disableByBatchSize", 1, 1024)),
    EngineFlag("model", "--speculative-model", str, None,
               "draft: the draft checkpoint (a folder or GGUF file with the served model's "
               "tokenizer; `tandem draft-model` makes one)", scope="speculative",
               metavar="PATH", serve=True,
               pool=PoolField("model.weights.draft.uri", kind="string")),
    # On CUDA only (not rendered for a CPU engine, which ignores it: its KV pool is
    # --kv-cache-memory-bytes, DEFAULT_KV_CACHE_MEMORY_BYTES unless given).
    EngineFlag("gpu_memory_utilization", "--gpu-memory-utilization", fraction_arg,
               DEFAULT_GPU_MEMORY_UTILIZATION, "CUDA, with neither --num-blocks nor "
               "--kv-cache-memory-bytes: the share (0 < F <= 1) of the GPU's memory the "
               "engine fills; the KV pool gets what the weights and the largest step's "
               "activations leave (default %(default)s; ignored, with a warning, on the CPU "
               "or beside an explicit KV size)", minimum=0, above_minimum=True,
               maximum=1, limit="must be a fraction in (0, 1], e.g. 0.9", metavar="F",
               serve=True, cuda_only=True,
               pool=PoolField("engine.gpuMemoryUtilization", kind="decimal",
                              defaulted=False)),
    EngineFlag("max_model_len", "--max-model-len", int, None,
               "longest sequence, prompt and output (default: the model's context)",
               minimum=0, above_minimum=True, limit="must be positive", serve=True,
               pool=PoolField("engine.maxModelLen", 16, MAX_POOL_MODEL_LEN)),
    EngineFlag("dtype", "--dtype", str, "auto", "weights and activations: auto (on a CPU "
               "float32 for quantized weights, else bfloat16 with AMX or AVX-512 BF16 and "
               "float32 without; on a GPU the checkpoint's), float32, bfloat16 or float16",
               serve=True, pool=PoolField("engine.dtype", kind="enum")),
    EngineFlag("kv_cache_dtype", "--kv-cache-dtype", str, "auto", "the KV cache's elements: "
               "auto (float16 on a CPU serving quantized weights, as llama.cpp; else "
               "--dtype's), float32, bfloat16 or float16 (16 bits: twice a float32 pool's "
               "tokens in the same bytes, rounded as stored) (default %(default)s)",
               choices=KV_CACHE_DTYPES,
               limit=f"use one of {', '.join(KV_CACHE_DTYPES)}", serve=True,
               pool=PoolField("engine.kvCacheDtype", kind="enum")),
    EngineFlag("quantization", "--quantization", str, DEFAULT_QUANTIZATION,
               "projection weights: auto (as the checkpoint holds them: a GGUF stays "
               "quantized), none (dense in --dtype), int8 or int4 (weight-only; an HF "
               "checkpoint is quantized at load) (default %(default)s)",
               choices=QUANTIZATION_CHOICES,
               limit=f"use one of {', '.join(QUANTIZATION_CHOICES)}", serve=True,
               pool=PoolField("engine.quantization", kind="enum")),
    EngineFlag("max_queued_requests", "--max-queued-requests", int, None,
               "requests waiting for the running batch at most; a new one beyond them is "
               "refused with 429 so the router tries it later or on another engine "
               "(resumed and handed-over requests are always taken); default: unbounded",
               minimum=1, maximum=MAX_QUEUED_REQUESTS, whole=True,
               limit=f"must be an integer between 1 and {MAX_QUEUED_REQUESTS}, or unset "
               "for no bound", metavar="N", serve=True,
               pool=PoolField("engine.maxQueuedRequests", 1, MAX_QUEUED_REQUESTS,
                              defaulted=False)),
    EngineFlag("seat_reserve_ms", "--seat-reserve-ms", float, DEFAULT_SEAT_RESERVE_MS,
               "when a request completes while others run and requests of a worse "
               "priority wait, its seat stays free up to MS for the next request of its "
               "priority or better, so a client sending one request at a time finds its "
               "seat rather than a worse request's prefill in its way; the engine never "
               "idles for it; 0 turns it off (default %(default)s)", minimum=0,
               maximum=MAX_SEAT_RESERVE_MS,
               limit=f"must be between 0 and {MAX_SEAT_RESERVE_MS:g} milliseconds",
               metavar="MS", serve=True),
    # Flags a pool passes in spec.engine.args when it wants them.
    EngineFlag("kernels", "--kernels", str, DEFAULT_KERNELS, "attention/projection "
               "kernels: auto (native on CPU, flex on CUDA), native (CPU), torch (portable "
               "gather path), flex (torch flex_attention over the paged KV) "
               "(default %(default)s)", choices=KERNEL_CHOICES,
               limit=f"use one of {', '.join(KERNEL_CHOICES)}", serve=True),
    EngineFlag("cuda_graphs", "--cuda-graphs", bool, True, "CUDA: replay decode steps from "
               "CUDA graphs at fixed batch sizes (ignored on CPU)"),
    EngineFlag("seed", "--seed", int, 0, "seed of the sampler for requests that give none"),
    EngineFlag("kv_quarantine_ttl_s", "--kv-quarantine-ttl", float,
               float(DEFAULT_KV_QUARANTINE_TTL_S), "decode: seconds at most that the KV "
               "blocks of a pull whose transfer state is unknown (a timeout) stay out of use "
               f"(<= {MAX_KV_QUARANTINE_TTL_S})", minimum=0, above_minimum=True,
               maximum=MAX_KV_QUARANTINE_TTL_S,
               limit=f"must be in (0, {MAX_KV_QUARANTINE_TTL_S}] seconds"),
    EngineFlag("structured_outputs_cache_size", "--structured-outputs-cache-size", int,
               DEFAULT_STRUCTURED_OUTPUTS_CACHE_SIZE, "structured outputs (llguidance): "
               "distinct JSON schemas, regexes and grammars kept compiled; the least "
               "recently used beyond it is compiled again when next asked for "
               "(default %(default)s)", minimum=1, maximum=65536, whole=True,
               limit="must be an integer between 1 and 65536", metavar="N", serve=True),
    EngineFlag("enable_lora", "--enable-lora", bool, False, "serve LoRA adapters "
               "(--lora-modules, POST /v1/load_lora_adapter): their deltas are added to the "
               "projections of the requests that name one", serve=True),
    EngineFlag("max_loras", "--max-loras", int, 1, "with --enable-lora: adapters on the "
               "device at once; a request whose adapter finds no free slot waits for one "
               "(default %(default)s)", minimum=1, maximum=64, whole=True,
               limit="must be an integer between 1 and 64", metavar="N", serve=True),
    EngineFlag("max_lora_rank", "--max-lora-rank", int, 16, "with --enable-lora: the "
               "largest adapter rank served (default %(default)s)", minimum=1, maximum=512,
               whole=True, limit="must be an integer between 1 and 512", metavar="R",
               serve=True),
    EngineFlag("max_cpu_loras", "--max-cpu-loras", int, None, "with --enable-lora: "
               "adapters kept read on the host (default: --max-loras); one evicted is read "
               "from disk again when next used", minimum=1, maximum=4096, whole=True,
               limit="must be an integer between 1 and 4096", metavar="N", serve=True),
    # vLLM's flag; the process loads them once the model is (a bad one ends the start).
    EngineFlag("lora_modules", "--lora-modules", str, None, "with --enable-lora: LoRA "
               "adapters served from the start, each NAME=PATH or NAME@VERSION=PATH (a "
               "PEFT folder; version default 1); a request names one in `model`. One that "
               "cannot be loaded stops the engine before it serves",
               scope="process", nargs="+", metavar="NAME[@VERSION]=PATH", serve=True),
)
ENGINE_CONFIG_FLAGS = tuple(flag for flag in ENGINE_FLAGS if flag.scope == "engine")  # its own
SPECULATIVE_FLAGS = tuple(flag for flag in ENGINE_FLAGS if flag.scope == "speculative")
SERVE_FLAGS = tuple(flag for flag in ENGINE_FLAGS if flag.serve)  # what `tandem serve` passes
POOL_FLAGS = tuple(flag for flag in ENGINE_FLAGS if flag.pool is not None)  # the operator's


def engine_flag(field: str) -> EngineFlag:
    """The table's entry for a config field (KeyError naming the known ones)."""
    for flag in ENGINE_FLAGS:
        if flag.field == field:
            return flag
    raise KeyError(f"no engine flag sets {field!r}; known: "
                   f"{', '.join(f.field for f in ENGINE_FLAGS)}")


def flag_values(config: EngineConfig, **process: Any) -> dict[str, Any]:
    """The table's fields of `config` (its speculative config's too when on) and the
    process flags' `process` values: what `flag_args` renders as a command line."""
    values = {flag.field: getattr(config, flag.field) for flag in ENGINE_CONFIG_FLAGS}
    if config.speculative is not None:
        values.update({flag.field: getattr(config.speculative, flag.field)
                       for flag in SPECULATIVE_FLAGS})
    return {**values, **process}
