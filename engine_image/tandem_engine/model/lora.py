"""LoRA adapters on the model's projections: PEFT files in, one batched delta per
projection out.

`read_adapter` reads a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`)
and checks it against the served model: every target a projection this model has (q, k,
v, o, gate, up, down of each decoder layer), every A [r, in] and B [out, r] of its
projection's shape, its rank within `max_lora_rank`. The scaling (`lora_alpha / r`, or
`/ sqrt(r)` with rslora) is folded into B.

`LoRASlots` holds `max_loras` adapters on the model's device and adds their deltas to the
projections' outputs through forward hooks, so the base model, its packed and quantized
weights and its refit are untouched. Per projection it keeps every slot's A
([slots, in, rank]) and B ([slots, rank, out]). A step's tokens each name a slot (-1: the
base model); they are grouped by slot, padded to the largest group, and the delta of the
whole batch is one segmented matmul pair per projection,

    bmm(bmm(x[groups], A[slots present]), B[slots present])

added back to the grouped rows: two calls whatever the mix of adapters, never a loop
over them, and each token multiplies by its own adapter's rank columns only (base-model
tokens by none).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem_engine.errors import CheckpointError
from tandem_engine.model.family import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections an adapter may target: (the module that owns it, its name).
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: (layer, target) -> (A [r, in], B * scale
    [out, r]), float32."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shape(c: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of a target projection of `c`'s decoder layers."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv),
            "v_proj": (c.hidden_size, kv), "o_proj": (q, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}[target]


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int
                 ) -> LoRAAdapter:
    """The PEFT adapter in folder `path`, checked against the served model (CheckpointError
    naming the file, the field and the fix)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    where = f"LoRA adapter {name!r} ({folder})"
    cfg_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not folder.is_dir():
        raise CheckpointError(f"{where}: no such folder; give the folder PEFT saved the "
                              f"adapter to ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    missing = [f.name for f in (cfg_file, weights_file) if not f.is_file()]
    if missing:
        raise CheckpointError(f"{where}: {' and '.join(missing)} missing; a PEFT adapter "
                              f"folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{where}: {ADAPTER_CONFIG} is not JSON: {exc}") from None
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{where}: {ADAPTER_CONFIG} r={rank!r} must be a positive rank")
    if rank > max_rank:
        raise CheckpointError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}: "
                              f"start the engine with --max-lora-rank {rank} or more")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("modules_to_save", None),
                    ("rank_pattern", {}), ("alpha_pattern", {})):
        if cfg.get(key, ok) not in (ok, None, {}, False):
            raise CheckpointError(f"{where}: {ADAPTER_CONFIG} {key}={cfg[key]!r} is not "
                                  "supported (plain LoRA on the attention and MLP "
                                  "projections only)")
    if cfg.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: bias={cfg['bias']!r} is not supported: train with "
                              "bias='none'")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:  # cut short, not safetensors, unreadable
        raise CheckpointError(f"{where}: {ADAPTER_WEIGHTS} cannot be read as safetensors "
                              f"({exc}); copy the file PEFT saved again") from None
    for key, tensor in tensors.items():
        parsed = _parse_key(key)
        if parsed is None:
            raise CheckpointError(f"{where}: tensor {key!r} is not a LoRA A or B weight of a "
                                  f"decoder layer's {', '.join(TARGETS)} projection")
        layer, target, side = parsed
        if not 0 <= layer < config.num_layers:
            raise CheckpointError(f"{where}: tensor {key!r} names layer {layer}; the model "
                                  f"has {config.num_layers}")
        pairs.setdefault((layer, target), {})[side] = tensor
    if not pairs:
        raise CheckpointError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    weights = {}
    for (layer, target), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise CheckpointError(f"{where}: layer {layer} {target} has lora_{''.join(sides)} "
                                  "without its other half")
        a, b = sides["A"], sides["B"]
        fan_in, fan_out = projection_shape(config, target)
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise CheckpointError(
                f"{where}: layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the model's projection ({fan_in} -> {fan_out}) "
                f"at rank {rank}: the adapter was trained for another base model")
        weights[(layer, target)] = (a.float().contiguous(), (b.float() * scale).contiguous())
    return LoRAAdapter(name, str(folder), rank, weights)


def _parse_key(key: str) -> tuple[int, str, str] | None:
    """`...layers.{i}.{owner}.{target}.lora_{A|B}[.default].weight` -> (i, target, side)."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer, owner, target, lora = int(parts[at + 1]), parts[at + 2], parts[at + 3], \
            parts[at + 4]
    except (ValueError, IndexError):
        return None
    if TARGETS.get(target) != owner or lora not in ("lora_A", "lora_B") \
            or parts[-1] != "weight":
        return None
    return layer, target, lora[-1]


class LoRASlots:
    """`max_loras` adapter slots on the model's projections (forward hooks). `attach` a
    model (again after every weight load: hooks belong to modules), `load`/`clear` a slot,
    `activate` a step's per-token slots before its forward pass and `deactivate` after."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.num_slots, self.max_rank = config, max_loras, max_rank
        self.dtype, self.device = dtype, device
        # Per projection: every slot's A [slots, in, rank] and B [slots, rank, out], zero
        # where a slot is empty or its adapter's rank is smaller.
        self._a: dict[tuple[int, str], torch.Tensor] = {}
        self._b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(config.num_layers):
            for target in TARGETS:
                fan_in, fan_out = projection_shape(config, target)
                self._a[(layer, target)] = torch.zeros(max_loras, fan_in, max_rank,
                                                       dtype=dtype, device=device)
                self._b[(layer, target)] = torch.zeros(max_loras, max_rank, fan_out,
                                                       dtype=dtype, device=device)
        self._used: dict[int, set[tuple[int, str]]] = {}  # slot -> the projections it fills
        self._step: _Groups | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self._a.values(), *self._b.values()))

    def attach(self, model: nn.Module) -> None:
        """Hook every target projection of `model` (the previous model's hooks go)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for layer_index, layer in enumerate(model.model.layers):
            for target, owner in TARGETS.items():
                module = getattr(getattr(layer, owner, None), target, None)
                if module is not None:
                    self._handles.append(module.register_forward_hook(
                        self._hook(layer_index, target)))

    def _hook(self, layer: int, target: str):
        key = (layer, target)

        def add_delta(_module: nn.Module, inputs: tuple[torch.Tensor, ...],
                      output: torch.Tensor) -> torch.Tensor | None:
            step = self._step
            if step is None:
                return None
            return step.add(inputs[0], output, self._a[key], self._b[key])

        return add_delta

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.clear(slot)
        for key, (a, b) in adapter.weights.items():
            self._a[key][slot, :, :adapter.rank] = a.t().to(self.device, self.dtype)
            self._b[key][slot, :adapter.rank, :] = b.t().to(self.device, self.dtype)
        self._used[slot] = set(adapter.weights)

    def clear(self, slot: int) -> None:
        for key in self._used.pop(slot, ()):
            self._a[key][slot] = 0
            self._b[key][slot] = 0

    def activate(self, token_slots: list[int]) -> None:
        """The next forward pass's tokens, each with its slot (-1: the base model)."""
        self._step = _Groups.of(token_slots, self.num_slots, self.device)

    def deactivate(self) -> None:
        self._step = None


class _Groups:
    """One step's tokens grouped by adapter slot, padded to the largest group: the token
    each group row reads (`rows`, [groups * width]; a padding row reads token 0 and its
    result is dropped), the group rows that are real (`real`; None without padding) and
    their tokens (`targets`), and the slots present (`slots`; None when every slot is, in
    order). A projection's delta is then two batched matmuls over the groups, [G, width,
    in] @ [G, in, rank] @ [G, rank, out], added into the real rows' tokens (base-model
    tokens get nothing). The grouped input is shared by the projections that read the same
    activations (q, k and v; gate and up)."""

    def __init__(self, rows: torch.Tensor, real: torch.Tensor | None, targets: torch.Tensor,
                 slots: torch.Tensor | None, groups: int, width: int) -> None:
        self.rows, self.real, self.targets, self.slots = rows, real, targets, slots
        self.groups, self.width = groups, width
        self._grouped: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, grouped)

    @classmethod
    def of(cls, token_slots: list[int], num_slots: int, device: torch.device) -> _Groups | None:
        members: dict[int, list[int]] = {}
        for token, slot in enumerate(token_slots):
            if slot >= 0:
                members.setdefault(slot, []).append(token)
        if not members:
            return None
        present = sorted(members)
        width = max(len(m) for m in members.values())
        rows: list[int] = []
        real: list[int] = []
        for slot in present:
            group = members[slot]
            real += range(len(rows), len(rows) + len(group))
            rows += group + [0] * (width - len(group))
        targets = [rows[r] for r in real]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        slots = None if present == list(range(num_slots)) else tensor(present)
        return cls(tensor(rows), None if len(real) == len(rows) else tensor(real),
                   tensor(targets), slots, len(present), width)

    def add(self, x: torch.Tensor, output: torch.Tensor, a: torch.Tensor, b: torch.Tensor
            ) -> torch.Tensor:
        if self.slots is not None:
            a, b = a.index_select(0, self.slots), b.index_select(0, self.slots)
        if self._grouped is None or self._grouped[0] is not x:
            self._grouped = (x, x.to(a.dtype).index_select(0, self.rows)
                             .view(self.groups, self.width, -1))
        delta = torch.bmm(torch.bmm(self._grouped[1], a), b).view(self.groups * self.width, -1)
        if self.real is not None:
            delta = delta.index_select(0, self.real)
        return output.index_add_(0, self.targets, delta.to(output.dtype))
