"""The engine's device: which one `--device` names, and what its memory holds.

`resolve_device` is the one place `auto` becomes `cuda` or `cpu` and where asking for a
GPU that torch cannot see fails (at start, never a silent fall back to the CPU).
`report_device` answers `/v1/state` and `/metrics`; `profile_step_memory` measures a
profiling step for the KV pool's sizing by memory fraction (`model.runner.num_kv_blocks`).
Every CUDA query goes through a `cuda` argument (torch.cuda by default), so tests on a
CPU machine inject CUDA-like numbers.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem_engine.config import EngineConfig, parse_device
from tandem_engine.core.request import Request
from tandem_engine.core.scheduler import ScheduledChunk, SchedulerOutput
from tandem_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem_engine.model.runner import ModelRunner


def resolve_device(name: str, cuda: Any = torch.cuda) -> torch.device:
    """The device `name` (auto, cpu, cuda, cuda:N) means on this machine. Raises
    ValueError naming the fix when it asks for a GPU torch cannot see."""
    kind, index = parse_device(name)
    if kind == "auto":
        kind, index = ("cuda", None) if cuda.is_available() else ("cpu", None)
    if kind == "cpu":
        return torch.device("cpu")
    if not cuda.is_available():
        raise ValueError(
            f"engine option device {name!r} asks for a GPU, but torch {torch.__version__} "
            "sees none (torch.cuda.is_available() is False: a CPU-only torch build, no "
            "NVIDIA driver, or no GPU given to this container — CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): run it where a GPU is "
            "visible (request nvidia.com/gpu), or use --device cpu")
    count = cuda.device_count()
    index = cuda.current_device() if index is None else index
    if index >= count:
        raise ValueError(f"engine option device {name!r}: this machine shows {count} GPU(s), "
                         f"cuda:0..cuda:{count - 1}; pick one of those")
    return torch.device("cuda", index)


# --dtype auto on a CPU: bfloat16 where the CPU multiplies bfloat16 in hardware (AMX tiles or
# AVX-512 BF16 dot products: oneDNN's bf16 matmuls ran 2-3x its float32 ones on such a Xeon),
# float32 elsewhere (there bfloat16 is widened in software and runs slower than float32).
# Weights served quantized (int4/int8) run float32 activations on every CPU: the native
# integer kernels round activations to int8 themselves, and a decode step runs as one fused
# call there (model/fused_decode.py), 2-3x torch's bfloat16 weight-only kernels at batch 1.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# "0" keeps auto at float32 on every CPU, "1" picks bfloat16 on every CPU (the test suite
# sets 0: its references are float32).
CPU_BF16_ENV = "TANDEM_CPU_BF16"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The ISA flags of this machine's first CPU (empty where /proc/cpuinfo is absent)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")) and ":" in line:
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def auto_dtype(device_type: str, checkpoint_dtype: str, flags: frozenset[str] | None = None,
               env: dict[str, str] | None = None, quantized: bool = False) -> str:
    """What `--dtype auto` means: on a CPU, float32 for quantized weights, else bfloat16
    when it has one of BF16_CPU_FLAGS and float32 when not ($TANDEM_CPU_BF16 overrides
    both); on a GPU the checkpoint's own dtype."""
    if device_type != "cpu":
        return checkpoint_dtype
    override = (os.environ if env is None else env).get(CPU_BF16_ENV)
    if override in ("0", "1"):
        return "bfloat16" if override == "1" else "float32"
    if quantized:
        return "float32"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(flag in flags for flag in BF16_CPU_FLAGS) else "float32"


@dataclass(frozen=True)
class DeviceReport:
    """The device and its memory, as `/v1/state` and `/metrics` report it. On CUDA the
    numbers are device-wide (used = total − free, every process) plus what this process's
    torch allocator holds; on the CPU, used is this process's resident set (RSS) and total
    the host's physical memory (`memory_source` says which)."""

    type: str  # cpu | cuda
    index: int | None
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    memory_source: str
    torch_allocated_bytes: int | None = None  # CUDA: live tensors
    torch_reserved_bytes: int | None = None  # CUDA: held by torch's caching allocator
    torch_peak_bytes: int | None = None  # CUDA: peak allocated since start / the last reset

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def report_device(device: torch.device, cuda: Any = torch.cuda) -> DeviceReport:
    if device.type == "cuda":
        free, total = cuda.mem_get_info(device)
        return DeviceReport(
            type="cuda", index=device.index, name=cuda.get_device_name(device),
            memory_total_bytes=int(total), memory_used_bytes=int(total - free),
            memory_source="cuda device: total and used (total - free, all processes)",
            torch_allocated_bytes=int(cuda.memory_allocated(device)),
            torch_reserved_bytes=int(cuda.memory_reserved(device)),
            torch_peak_bytes=int(cuda.max_memory_allocated(device)))
    return DeviceReport(type=device.type, index=device.index, name=_cpu_name(),
                        memory_total_bytes=_host_memory_bytes(),
                        memory_used_bytes=_process_rss_bytes(),
                        memory_source="cpu: used = this process's RSS, total = host memory")


def _cpu_name() -> str:
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak RSS is the best there is (KiB on Linux, B on macOS)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ---- sizing the KV pool by memory fraction ------------------------------------------------


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling step measured on the device, in bytes."""

    total: int  # the device's memory
    weights: int  # held by the model (weights, RoPE tables) once loaded
    activation_peak: int  # the largest step's peak above that (the scratch KV excluded)
    outside_torch: int  # used on the device outside this process's torch allocator:
    # the CUDA context and libraries (and any other process on the device)


def profile_step_blocks(engine_config: EngineConfig) -> int:
    """Blocks of the scratch KV pool the profiling step writes into (see `_profile_step`)."""
    bs = engine_config.block_size
    rows = _profile_rows(engine_config)
    return -(-(engine_config.max_num_batched_tokens - rows + 1) // bs) + rows - 1


def profile_step_memory(runner: ModelRunner, engine_config: EngineConfig,
                        cuda: Any = torch.cuda) -> MemoryProfile:
    """Run one forward pass at the largest step (max_num_batched_tokens tokens: one long
    prefill beside single-token rows up to max_num_seqs, each sampled) on a runner whose
    KV pool is the scratch one, and read what it took. The scratch pool is freed after."""
    device = runner.device
    cuda.synchronize(device)
    cuda.empty_cache()
    scratch = runner.kv_bytes
    weights = int(cuda.memory_allocated(device)) - scratch
    cuda.reset_peak_memory_stats(device)
    runner.forward(runner.prepare(_profile_step(engine_config)))
    cuda.synchronize(device)
    peak = int(cuda.max_memory_allocated(device))
    runner.free_kv()
    cuda.empty_cache()
    free, total = cuda.mem_get_info(device)
    outside = int(total - free) - int(cuda.memory_reserved(device))
    return MemoryProfile(total=int(total), weights=weights,
                         activation_peak=max(0, peak - weights - scratch),
                         outside_torch=max(0, outside))


def _profile_rows(engine_config: EngineConfig) -> int:
    return max(1, min(engine_config.max_num_seqs, engine_config.max_num_batched_tokens // 2))


def _profile_step(engine_config: EngineConfig) -> SchedulerOutput:
    """The largest step the scheduler may make: one prefill chunk of all but `rows - 1` of
    max_num_batched_tokens tokens, and `rows - 1` one-token rows, every row sampled."""
    bs, rows = engine_config.block_size, _profile_rows(engine_config)
    long = engine_config.max_num_batched_tokens - rows + 1
    lengths = [long] + [1] * (rows - 1)
    chunks, next_block = [], 0
    params = SamplingParams(max_tokens=1)
    for i, n in enumerate(lengths):
        request = Request(f"profile-{i}", [0] * n, params, arrival_index=i)
        blocks = -(-n // bs)
        chunks.append(ScheduledChunk(request, 0, n, list(range(next_block, next_block + blocks)),
                                     samples=True))
        next_block += blocks
    return SchedulerOutput(chunks=chunks, num_prefill_tokens=long if long > 1 else 0,
                           num_decode_tokens=sum(n for n in lengths if n == 1))
