"""The device through every layer, on a CPU machine: `--device` parsing and resolution (a
GPU asked for where none is visible fails at start), the operator's rendering of
spec.engine.device, the device in /v1/state and /metrics, and the KV cache sized by
memory fraction — every CUDA number injected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tandem_engine import LLM
from tandem_engine.cli.main import build_parser as tandem_parser
from tandem_engine.cli.main import serve_engine_args
from tandem_engine.config import (
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    EngineConfig,
    parse_device,
)
from tandem_engine.engine.kv_sizing import size_kv_pool
from tandem_engine.model.checkpoint import load_checkpoint
from tandem_engine.model.device import (
    MemoryProfile,
    profile_step_blocks,
    profile_step_memory,
    report_device,
    resolve_device,
)
from tandem_engine.model.family import ModelConfig
from tandem_engine.model.runner import (
    ModelRunner,
    kv_blocks_in_memory_fraction,
    kv_sized_by_memory_fraction,
    num_kv_blocks,
)
from tandem_engine.server import main as engine_main
from tandem_engine.server.admin import build_admin_app
from tandem_engine.server.control import EngineControl
from tandem_engine.server.worker import EngineWorker
from tandem_operator import manifests as m
from tandem_operator.spec import EngineDevice, PoolSpec, SpecError

GIB = 1 << 30


class FakeCuda:
    """torch.cuda's memory queries, answering with set numbers (no GPU needed)."""

    def __init__(self, available: bool = True, count: int = 1, *, total: int = 80 * GIB,
                 free: int = 60 * GIB, allocated: int = 10 * GIB, reserved: int = 12 * GIB,
                 peak: int = 14 * GIB) -> None:
        self.available, self.count = available, count
        self.total, self.free, self.allocated, self.reserved, self.peak = (
            total, free, allocated, reserved, peak)
        self.calls: list[str] = []

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device) -> str:
        return "NVIDIA H200"

    def mem_get_info(self, device) -> tuple[int, int]:
        return self.free, self.total

    def memory_allocated(self, device) -> int:
        return self.allocated

    def memory_reserved(self, device) -> int:
        return self.reserved

    def max_memory_allocated(self, device) -> int:
        return self.peak

    def synchronize(self, device) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append("reset_peak")


# ---- the --device string ------------------------------------------------------------------


@pytest.mark.parametrize(("value", "parsed"), [
    ("auto", ("auto", None)), ("cpu", ("cpu", None)), ("cuda", ("cuda", None)),
    ("cuda:1", ("cuda", 1)), ("CUDA:0", ("cuda", 0))])
def test_device_strings_that_parse(value: str, parsed: tuple[str, int | None]) -> None:
    assert parse_device(value) == parsed


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "", "mps"])
def test_a_bad_device_names_the_value_the_choices_and_the_fix(value: str) -> None:
    with pytest.raises(ValueError, match=rf"device {value!r} is not a device: use one of "
                       r"auto, cpu, cuda, cuda:N \(e\.g\. --device cuda:0"):
        EngineConfig(device=value).validate()


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.01])
def test_gpu_memory_utilization_is_a_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization={fraction!r} is invalid: "
                       r"must be a fraction in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=fraction).validate()
    EngineConfig(gpu_memory_utilization=1.0).validate()


def test_auto_is_cuda_only_where_torch_sees_a_gpu() -> None:
    assert resolve_device("auto", FakeCuda(available=False)) == torch.device("cpu")
    assert resolve_device("auto", FakeCuda()) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", FakeCuda(count=2)) == torch.device("cuda", 1)
    assert resolve_device("cpu", FakeCuda()) == torch.device("cpu")


def test_cuda_where_none_is_visible_fails_instead_of_falling_back() -> None:
    with pytest.raises(ValueError, match=r"device 'cuda' asks for a GPU, but torch .* sees "
                       r"none .*request nvidia.com/gpu\), or use --device cpu"):
        resolve_device("cuda", FakeCuda(available=False))
    with pytest.raises(ValueError, match=r"'cuda:2': this machine shows 2 GPU\(s\), "
                       r"cuda:0..cuda:1"):
        resolve_device("cuda:2", FakeCuda(count=2))


# ---- the commands -------------------------------------------------------------------------


def test_tandem_engine_refuses_a_bad_device_or_fraction_as_a_usage_error(capsys) -> None:
    base = ["--model", "m", "--port", "1", "--admin-port", "2"]
    parser = engine_main.build_parser()
    args = parser.parse_args(base)
    assert (args.device, args.gpu_memory_utilization, args.kv_cache_memory_bytes) == (
        "auto", 0.9, None)
    for bad in (["--device", "gpu"], ["--gpu-memory-utilization", "0"],
                ["--gpu-memory-utilization", "1.5"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*base, *bad])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'gpu' is not a device" in err and "'1.5' is not a fraction in (0, 1]" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's refusal")
def test_tandem_engine_asked_for_cuda_without_a_gpu_exits_2_before_loading(
        tmp_path: Path, capsys) -> None:
    """The model is never read: the refusal comes before the load (no such folder either)."""
    rc = engine_main.main(["--model", str(tmp_path / "never-read"), "--port", "1",
                           "--admin-port", "2", "--weights-root", str(tmp_path),
                           "--device", "cuda"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "tandem-engine: error: engine option device 'cuda' asks for a GPU" in err


def test_tandem_serve_and_generate_take_the_device() -> None:
    parser = tandem_parser()
    serve = parser.parse_args(["serve", "--demo", "--device", "cuda:1",
                               "--gpu-memory-utilization", "0.5"])
    engine_args = serve_engine_args(serve)
    assert engine_args[engine_args.index("--device") + 1] == "cuda:1"
    assert engine_args[engine_args.index("--gpu-memory-utilization") + 1] == "0.5"
    # What serve passes, tandem-engine accepts.
    engine_main.build_parser().parse_args(["--model", "m", "--port", "1", "--admin-port", "2",
                                           *engine_args])
    gen = parser.parse_args(["generate", "--model", "m", "hi"])
    assert gen.device == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model", "m", "--device", "tpu", "hi"])


# ---- the operator renders spec.engine.device ----------------------------------------------


def pool(**spec) -> PoolSpec:
    body = {"model": {"name": "llama", "weights": {"uri": "file:///models/llama",
                                                   "version": "v1"}}, **spec}
    return PoolSpec.from_body({"metadata": {"name": "pool", "namespace": "ns"}, "spec": body})


@pytest.mark.parametrize(("device", "resources", "flag"), [
    (EngineDevice.AUTO, None, "cpu"),
    (EngineDevice.AUTO, {"limits": {"cpu": "4"}}, "cpu"),
    (EngineDevice.AUTO, {"limits": {"nvidia.com/gpu": 1}}, "cuda"),
    (EngineDevice.AUTO, {"requests": {"nvidia.com/gpu": "2"}}, "cuda"),
    (EngineDevice.AUTO, {"limits": {"nvidia.com/gpu": "0"}}, "cpu"),
    (EngineDevice.CPU, {"limits": {"nvidia.com/gpu": 1}}, "cpu"),
    (EngineDevice.CUDA, None, "cuda"),
])
def test_engine_device_flag(device: EngineDevice, resources, flag: str) -> None:
    assert m.engine_device(device, resources) == flag


def test_the_pool_device_reaches_each_roles_engine_args() -> None:
    gpu = {"limits": {"nvidia.com/gpu": 1}}
    s = pool(engine={"resources": gpu}, decode={"resources": {"limits": {"cpu": "8"}}})
    assert s.engine.device is EngineDevice.AUTO

    def flag(spec: PoolSpec, group: str) -> str:
        args = m.engine_args(spec, group, spec.weights, 30)
        return args[args.index("--device") + 1]

    assert flag(s, "prefill") == "cuda"  # spec.engine's GPU
    assert flag(s, "decode") == "cpu"  # the role's resources replace the engine's
    assert flag(pool(engine={"device": "CUDA"}), "prefill") == "cuda"
    with pytest.raises(SpecError, match=r"spec.engine.device = 'GPU' is not one of "
                       "Auto, CPU, CUDA"):
        pool(engine={"device": "GPU"})


# ---- /v1/state and /metrics ---------------------------------------------------------------


def test_state_and_metrics_report_the_device_and_its_memory(tiny_llama: Path) -> None:
    engine = LLM(tiny_llama, num_blocks=16, kernels="torch").engine
    assert engine.device == torch.device("cpu") and engine.config.device == "cpu"
    worker = EngineWorker(engine, engine_id="e0", model_name="tiny")
    cpu = TestClient(build_admin_app(EngineControl(worker))).get("/v1/state").json()["device"]
    assert cpu["type"] == "cpu" and cpu["memory_source"].startswith("cpu: used = this "
                                                                     "process's RSS")
    assert 0 < cpu["memory_used_bytes"] < cpu["memory_total_bytes"]

    fake = FakeCuda(total=141 * GIB, free=100 * GIB)
    probe = lambda: report_device(torch.device("cuda", 0), fake)  # noqa: E731
    client = TestClient(build_admin_app(EngineControl(worker, device_probe=probe)))
    assert client.get("/v1/state").json()["device"] == {
        "type": "cuda", "index": 0, "name": "NVIDIA H200",
        "memory_total_bytes": 141 * GIB, "memory_used_bytes": 41 * GIB,
        "memory_source": "cuda device: total and used (total - free, all processes)",
        "torch_allocated_bytes": 10 * GIB, "torch_reserved_bytes": 12 * GIB,
        "torch_peak_bytes": 14 * GIB}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(client.get("/metrics").text)
               for s in family.samples if s.name.startswith("tandem_device")}
    assert samples == {
        ("tandem_device_info", (("engine_id", "e0"), ("index", "0"), ("model_name", "tiny"),
                                ("name", "NVIDIA H200"), ("role", "mixed"),
                                ("type", "cuda"))): 1,
        **{("tandem_device_memory_bytes", (("engine_id", "e0"), ("kind", kind),
                                           ("model_name", "tiny"), ("role", "mixed"),
                                           ("type", "cuda"))): value
           for kind, value in (("total", 141 * GIB), ("used", 41 * GIB),
                               ("torch_allocated", 10 * GIB), ("torch_reserved", 12 * GIB),
                               ("torch_peak", 14 * GIB))}}


# ---- KV cache sizing by memory fraction ---------------------------------------------------

PER_BLOCK = 1 << 20  # 1 MiB a block


def profile(**kw: int) -> MemoryProfile:
    numbers = {"total": 100 * GIB, "weights": 20 * GIB, "activation_peak": 5 * GIB,
               "outside_torch": 1 * GIB, **kw}
    return MemoryProfile(**numbers)


def test_the_pool_takes_what_the_fraction_leaves() -> None:
    # 0.9 × 100 GiB − 20 − 5 − 1 = 64 GiB = 65536 blocks of 1 MiB
    assert kv_blocks_in_memory_fraction(profile(), 0.9, PER_BLOCK, 8, 128) == 64 * 1024
    assert kv_blocks_in_memory_fraction(profile(), 0.5, PER_BLOCK, 8, 128) == 24 * 1024
    # a partial block is not a block
    assert kv_blocks_in_memory_fraction(profile(outside_torch=GIB + 1), 0.9, PER_BLOCK, 8,
                                        128) == 64 * 1024 - 1


def test_one_max_length_request_exactly_fits_and_one_byte_less_refuses() -> None:
    need = 1000  # blocks of one max_model_len request
    weights = 90 * GIB - 5 * GIB - GIB - need * PER_BLOCK  # leaves exactly `need` blocks
    assert kv_blocks_in_memory_fraction(profile(weights=weights), 0.9, PER_BLOCK, need,
                                        16000) == need
    with pytest.raises(ValueError) as exc:
        kv_blocks_in_memory_fraction(profile(weights=weights + 1), 0.9, PER_BLOCK, need, 16000)
    message = str(exc.value)
    assert f"{need - 1} KV blocks of {PER_BLOCK} bytes" in message
    assert f"one request of max_model_len=16000 tokens needs {need}" in message


def test_the_refusal_names_the_numbers_and_the_fixes() -> None:
    with pytest.raises(ValueError) as exc:
        kv_blocks_in_memory_fraction(profile(weights=88 * GIB), 0.9, PER_BLOCK, 8, 128)
    assert str(exc.value) == (
        "the KV cache does not fit: gpu_memory_utilization=0.9 of the device's 100.00 GiB "
        "leaves -4.00 GiB after the weights (88.00 GiB), the largest step's activations "
        "(5.00 GiB) and memory outside torch (1.00 GiB): 0 KV blocks of 1048576 bytes, but "
        "one request of max_model_len=128 tokens needs 8. Raise --gpu-memory-utilization, "
        "lower --max-model-len (or --max-num-batched-tokens), or give --num-blocks or "
        "--kv-cache-memory-bytes")


TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                   intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, max_position_embeddings=256)
TINY_PER_BLOCK = 16 * TINY.kv_bytes_per_token(4)  # float32, block_size 16: 4 KiB


def test_explicit_sizes_win_and_the_cpu_default_is_unchanged() -> None:
    huge = profile(total=1000 * GIB)
    cuda = EngineConfig(device="cuda")
    assert kv_sized_by_memory_fraction(cuda)
    assert not kv_sized_by_memory_fraction(EngineConfig(device="cpu"))
    assert not kv_sized_by_memory_fraction(EngineConfig(device="cuda", num_blocks=7))
    assert not kv_sized_by_memory_fraction(EngineConfig(device="cuda:0",
                                                        kv_cache_memory_bytes=1 << 20))
    assert num_kv_blocks(TINY, EngineConfig(device="cuda", num_blocks=7), "float32",
                         huge, 256) == 7
    assert num_kv_blocks(TINY, EngineConfig(device="cuda", kv_cache_memory_bytes=40960),
                         "float32", huge, 256) == 10
    assert num_kv_blocks(TINY, cuda, "float32", profile(total=10 * GIB, weights=GIB,
                         activation_peak=0, outside_torch=0), 256) == 8 * GIB // TINY_PER_BLOCK
    assert num_kv_blocks(TINY, EngineConfig(), "float32") == (
        DEFAULT_KV_CACHE_MEMORY_BYTES // TINY_PER_BLOCK)


@pytest.mark.parametrize(("config", "why"), [
    (EngineConfig(device="cpu", gpu_memory_utilization=0.5), "this one runs on the CPU"),
    (EngineConfig(device="cuda", num_blocks=7, gpu_memory_utilization=0.5),
     "the KV pool is sized by num_blocks or kv_cache_memory_bytes"),
])
def test_a_fraction_that_sizes_nothing_is_ignored_with_a_warning(
        config: EngineConfig, why: str, caplog: pytest.LogCaptureFixture) -> None:
    """The operator refuses gpuMemoryUtilization for device CPU and beside a KV size, and
    does not render it for an engine on the CPU; an engine given it anyway says so."""
    with caplog.at_level("WARNING", logger="tandem_engine.engine.kv_sizing"):
        sizing = size_kv_pool(TINY, config, {}, "float32", 256, None)
    assert sizing.runner is None
    assert "gpu_memory_utilization=0.5 is ignored: " in caplog.text and why in caplog.text
    caplog.clear()
    size_kv_pool(TINY, EngineConfig(device="cpu"), {}, "float32", 256, None)
    assert caplog.text == ""


def test_the_profiling_step_runs_and_its_numbers_become_the_profile(tiny_llama: Path) -> None:
    """The largest step (a long prefill and max_num_seqs − 1 single-token rows) runs on a
    CPU runner through the scratch pool; the injected allocator numbers are read around it."""
    config = EngineConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=40,
                          kernels="torch")
    model_config, tensors = load_checkpoint(tiny_llama)
    blocks = profile_step_blocks(config)
    assert blocks == 3 + 3  # ceil(37 / 16) for the prefill, one block per single token
    runner = ModelRunner(model_config, config, tensors, blocks, 64)
    forwards = []
    forward = runner.forward
    runner.forward = lambda step: forwards.append(step) or forward(step)
    scratch = runner.kv_bytes
    fake = FakeCuda(total=80 * GIB, free=50 * GIB, allocated=GIB + scratch, reserved=29 * GIB,
                    peak=GIB + scratch + 3 * GIB)
    measured = profile_step_memory(runner, config, fake)
    assert measured == MemoryProfile(total=80 * GIB, weights=GIB, activation_peak=3 * GIB,
                                     outside_torch=GIB)
    (step,) = forwards
    assert step.input_ids.numel() == 40 and len(step.requests) == 4
    assert fake.calls == ["synchronize", "empty_cache", "reset_peak", "synchronize",
                          "empty_cache"]
    assert runner.kv_cache is None  # the scratch pool is released
    runner.resize_kv(9)
    assert runner.kv_cache.shape[2] == 9


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the CPU on a CPU machine")
def test_a_default_engine_on_a_cpu_machine_sizes_as_before(tiny_llama: Path) -> None:
    engine = LLM(tiny_llama, kernels="torch").engine
    per_block = engine.config.block_size * engine.model_config.kv_bytes_per_token(4)
    assert engine.config.device == "cpu"
    assert engine.runner.kv_shape[2] == DEFAULT_KV_CACHE_MEMORY_BYTES // per_block


def test_dtype_auto_picks_bfloat16_only_on_cpus_that_multiply_it_in_hardware() -> None:
    from tandem_engine.model.device import auto_dtype

    amx = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    avx512_bf16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
    avx2 = frozenset({"avx2", "fma"})
    assert auto_dtype("cpu", "float32", amx, env={}) == "bfloat16"
    assert auto_dtype("cpu", "float32", avx512_bf16, env={}) == "bfloat16"
    assert auto_dtype("cpu", "bfloat16", avx2, env={}) == "float32"
    assert auto_dtype("cuda", "bfloat16", avx2, env={}) == "bfloat16"
    assert auto_dtype("cuda", "float32", amx, env={}) == "float32"
    assert auto_dtype("cpu", "float32", amx, env={"TANDEM_CPU_BF16": "0"}) == "float32"
    assert auto_dtype("cpu", "float32", avx2, env={"TANDEM_CPU_BF16": "1"}) == "bfloat16"
    # quantized weights: float32 activations for the native integer kernels, on any CPU
    assert auto_dtype("cpu", "float32", amx, env={}, quantized=True) == "float32"
    assert auto_dtype("cpu", "float32", avx512_bf16, env={}, quantized=True) == "float32"
    assert auto_dtype("cuda", "bfloat16", amx, env={}, quantized=True) == "bfloat16"
