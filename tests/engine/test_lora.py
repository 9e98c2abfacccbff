"""LoRA adapters in the engine against transformers + PEFT on the same checkpoint: greedy
tokens equal (the near-tie rule) for random adapters of two ranks over each demo family,
alone and in one batch mixing three adapters and the base model; the prefix cache never
crosses adapters; slots and the host cache evict and reload; speculation and a base refit
keep adapters right; bad adapters are refused naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from reference import assert_matches, hf_greedy, hf_lora_greedy
from tandem_engine import LLM, RequestRejected, SamplingParams
from tandem_engine.errors import CheckpointError
from tandem_engine.lora_request import LoRARequest

MAX_NEW = 12
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [300, 12, 8, 8, 41, 77, 5, 19, 23, 61, 2, 90]]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)


def make_adapter(base: Path, folder: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT adapter of `base` with random A and B (PEFT starts B at zero, which would
    change nothing), saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                            target_modules=targets, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(f"lora-{tiny_model.name}")
    return {
        "attn4": make_adapter(tiny_model, root / "attn4", 4,
                              ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
        "all8": make_adapter(tiny_model, root / "all8", 8,
                             ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"], 2),
        "mlp8": make_adapter(tiny_model, root / "mlp8", 8, ["gate_proj", "down_proj"], 3),
    }


def write_random_adapter(folder: Path, config, rank: int, targets: list[str],
                         seed: int, std: float = 0.05) -> Path:
    """A PEFT adapter folder for a model of `config` (a ModelConfig: any checkpoint the
    engine loads, a GGUF file included), written directly: random A and B of the shapes
    PEFT saves."""
    from safetensors.torch import save_file
    from tandem_engine.model.lora import projection_shape

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in targets:
            owner = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = projection_shape(config, target)
            key = f"base_model.model.model.layers.{layer}.{owner}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none"}))
    return folder


def _lora(name: str, adapters: dict[str, Path]) -> LoRARequest:
    return LoRARequest(name, str(adapters[name]))


def _check(model: Path, adapter: Path | None, prompt: list[int], out) -> None:
    ref = hf_greedy(model, tuple(prompt), MAX_NEW) if adapter is None \
        else hf_lora_greedy(model, adapter, tuple(prompt), MAX_NEW)
    completion = out.outputs[0]
    logprobs = [next(iter(step.values())).logprob for step in completion.logprobs]
    assert assert_matches(ref, completion.token_ids, logprobs) > 0


def test_adapters_alone_and_mixed_in_one_batch_match_transformers_and_peft(
        tiny_model: Path, adapters: dict[str, Path]) -> None:
    llm = LLM(tiny_model, enable_lora=True, max_loras=4, max_lora_rank=8)
    base_out = llm.generate([PROMPTS[0]], GREEDY)[0]
    for name in adapters:
        out = llm.generate([PROMPTS[0]], GREEDY, lora_request=_lora(name, adapters))[0]
        _check(tiny_model, adapters[name], PROMPTS[0], out)
        assert out.outputs[0].token_ids != base_out.outputs[0].token_ids  # it does something
    # One batch: three adapters and the base model, each request its own.
    mix = [None, *(_lora(n, adapters) for n in adapters)]
    prompts = [PROMPTS[i % 2] for i in range(len(mix))]
    outs = llm.generate(prompts, GREEDY, lora_request=mix)
    for lora, prompt, out in zip(mix, prompts, outs, strict=True):
        _check(tiny_model, None if lora is None else Path(lora.lora_path), prompt, out)


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-llama")
    return {f"a{i}": make_adapter(tiny_llama, root / f"a{i}", 4 + 4 * (i % 2),
                                  ["q_proj", "v_proj", "down_proj"], 10 + i) for i in range(3)}


def test_slots_and_the_host_cache_evict_and_reload(tiny_llama: Path,
                                                   llama_adapters: dict[str, Path]) -> None:
    # Two device slots and one adapter on the host for three adapters in one batch: one
    # request waits for a slot, and adapters are read again from disk.
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=1)
    loras = [_lora(n, llama_adapters) for n in llama_adapters]
    outs = llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=loras)
    for lora, out in zip(loras, outs, strict=True):
        _check(tiny_llama, Path(lora.lora_path), PROMPTS[0], out)
    again = llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=loras[::-1])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[::-1]]
    assert llm.engine.loras.evictions > 0 and llm.engine.loras.loads > 2


def test_the_prefix_cache_never_crosses_adapters(tiny_llama: Path,
                                                 llama_adapters: dict[str, Path]) -> None:
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    prompt = list(range(40, 72))
    a, b = _lora("a0", llama_adapters), _lora("a1", llama_adapters)
    first = llm.generate([prompt], GREEDY, lora_request=a)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, lora_request=b)[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, lora_request=a)[0].num_cached_tokens > 0
    # A new version of the same name is another adapter.
    a2 = LoRARequest("a0", a.lora_path + "-v2", "2")
    shutil.copytree(a.lora_path, a2.lora_path)
    llm.engine.load_lora(a2)
    assert llm.generate([prompt], GREEDY, lora_request=a2)[0].num_cached_tokens == 0


def test_speculation_and_a_base_refit_keep_adapters_right(
        tiny_llama: Path, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    lora = _lora("a1", llama_adapters)
    plain = LLM(tiny_llama, enable_lora=True, max_lora_rank=8)
    spec = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    repetitive = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    want = plain.generate([repetitive], GREEDY, lora_request=lora)[0].outputs[0].token_ids
    assert spec.generate([repetitive], GREEDY, lora_request=lora)[0].outputs[0].token_ids \
        == want
    # A refit of the base to another checkpoint of the same shapes keeps the adapter; it
    # then applies to the new base, as transformers + PEFT over that base computes.
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    from safetensors.torch import load_file, save_file
    weights = load_file(str(other / "model.safetensors"))
    save_file({k: v * 0.9 if "mlp" in k else v for k, v in weights.items()},
              str(other / "model.safetensors"))
    plain.pause()
    plain.refit(other)
    plain.unpause()
    out = plain.generate([PROMPTS[1]], GREEDY, lora_request=lora)[0]
    _check(other, Path(lora.lora_path), PROMPTS[1], out)


def test_bad_adapters_and_names_are_refused(tiny_llama: Path, llama_adapters: dict[str, Path],
                                            tmp_path: Path) -> None:
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=4)
    with pytest.raises(CheckpointError, match="over --max-lora-rank 4"):
        llm.engine.load_lora(_lora("a1", llama_adapters))  # rank 8
    with pytest.raises(RequestRejected, match="'nope' is not loaded"):
        llm.engine.add_request("r", PROMPTS[0], GREEDY, lora_name="nope")
    broken = tmp_path / "broken"
    shutil.copytree(llama_adapters["a0"], broken)
    cfg = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        llm.engine.load_lora(LoRARequest("broken", str(broken)))
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors"):
        llm.engine.load_lora(LoRARequest("empty", str(tmp_path)))
    # A weights file cut short (a copy interrupted): named, not a crash of the call.
    cut = tmp_path / "cut"
    shutil.copytree(llama_adapters["a0"], cut)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors cannot be read as "
                                              "safetensors"):
        llm.engine.load_lora(LoRARequest("cut", str(cut)))
    with pytest.raises(RequestRejected, match="--enable-lora"):
        LLM(tiny_llama).engine.load_lora(_lora("a0", llama_adapters))
    with pytest.raises(RequestRejected, match="name"):
        LoRARequest("bad name!", str(broken))


def test_suspend_with_the_kv_offloaded_keeps_adapters(tiny_llama: Path,
                                                      llama_adapters: dict[str, Path]) -> None:
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8)
    lora = _lora("a0", llama_adapters)
    want = llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)[0].outputs[0].token_ids
    llm.pause()
    llm.suspend("offload")
    llm.resume()
    llm.unpause()
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)[0].outputs[0].token_ids \
        == want


@pytest.mark.slow
def test_an_adapter_over_the_real_model_s_quantized_weights(smollm2_gguf: Path,
                                                            tmp_path: Path) -> None:
    """The GGUF stays int4 and the adapter's delta is added in float: greedy text equals
    the dequantized float32 model's with the same adapter, or first differs at a near tie
    (the quantized kernels' rounding, as without an adapter)."""
    from tandem_engine.bench.quality import greedy_agreement

    quantized = LLM(smollm2_gguf, enable_lora=True, max_lora_rank=8)
    dense = LLM(smollm2_gguf, enable_lora=True, max_lora_rank=8, quantization="none",
                dtype="float32")
    folder = write_random_adapter(tmp_path / "smol", quantized.engine.model_config, 8,
                                  ["q_proj", "v_proj", "down_proj"], 5)
    lora = LoRARequest("smol", str(folder))
    prompts = ["The capital of France is", "def fibonacci(n):"]
    for c in greedy_agreement(dense, quantized, prompts, 24, lora_request=lora):
        assert c.near_tie, (c.first_difference, c.reference_gap)
    base = quantized.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    with_adapter = quantized.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0),
                                      lora_request=lora)
    assert [o.outputs[0].token_ids for o in base] != \
        [o.outputs[0].token_ids for o in with_adapter]
