"""What an engine pod runs: the `tandem-engine` command line of a pool's group.

The engine's own flags come from its flag table (`tandem_engine.config.POOL_FLAGS`): the
pool's fields become an `EngineConfig` (`spec.engine_config`, which the engine's own
rules check as the spec is parsed) whose flags are rendered in the table's order, so a
pod's args, and with them its template hash, depend on the spec alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from tandem_engine.config import POOL_FLAGS, engine_flag, flag_values
from tandem_engine.engine_flags import flag_args
from tandem_engine.fleet.adapters import AdapterRef
from tandem_engine.weights import WeightsRef, checkpoint_path, weights_source

from tandem_operator.spec import GPU_RESOURCE, EngineDevice, Group, PoolSpec, engine_config

ENGINE_ZMQ_PORT = 5555
ENGINE_ADMIN_PORT = 8080
ENGINE_METRICS_PORT = 9100  # read-only: /metrics, /healthz, /readyz


def weights_roots(spec: PoolSpec, weights: WeightsRef, draft_uri: str | None = None
                  ) -> list[str]:
    """The folders an engine on `weights` (and the draft checkpoint `draft_uri`) may refit
    from (`--weights-root`; the engine refuses any other): `spec.engine.weightsRoots`, and
    the engine volume mounts that hold those checkpoints, and the weights' own volume (a
    `pvc://` claim, a model image's copy). None (weights baked into the
    image, or outside every mount, and no weightsRoots) leaves the engine's default, the
    folder holding its start-up checkpoint."""
    paths = [PurePosixPath(weights.path)]
    if draft_uri is not None:
        paths.append(PurePosixPath(checkpoint_path(draft_uri)))
    # The adapters' folders, so the engines may load them at run time (spec.adapters: a
    # pod's args and template depend on the spec alone).
    paths += [PurePosixPath(checkpoint_path(a.uri)) for a in spec.adapters]
    mounted = [m for m in (weights_source(uri).mount_path for uri in (
        weights.uri, *(a.uri for a in spec.adapters))) if m]  # claims: refits within them
    roots = [*spec.engine.weights_roots, *mounted,
             *(str(mount["mountPath"]) for path in paths for mount in spec.engine.volume_mounts
               if mount.get("mountPath") and path.is_relative_to(str(mount["mountPath"])))]
    return list(dict.fromkeys(roots))


def engine_resources(spec: PoolSpec, group: Group) -> Mapping[str, Any] | None:
    """The group's engine container resources: the role's, else spec.engine's."""
    role = spec.role(group)
    return role.resources if role.resources is not None else spec.engine.resources


def engine_device(device: EngineDevice, resources: Mapping[str, Any] | None) -> str:
    """An engine's `--device`: CPU and CUDA as written; Auto is cuda when the container
    requests or limits nvidia.com/gpu (> 0), so an engine on a GPU pod that sees no GPU
    fails at start instead of running on the CPU; else cpu."""
    if device is EngineDevice.AUTO:
        asked = [(resources or {}).get(part) or {} for part in ("requests", "limits")]
        return "cuda" if any(_positive(a.get(GPU_RESOURCE)) for a in asked) else "cpu"
    return "cuda" if device is EngineDevice.CUDA else "cpu"


def _positive(quantity: Any) -> bool:
    """A GPU count (an integer quantity: 1, "2") above zero."""
    try:
        return int(str(quantity).strip()) > 0
    except ValueError:
        return False


def lora_args(spec: PoolSpec) -> list[str]:
    """spec.engine.lora as the engine's LoRA flags (none when it is unset)."""
    lora = spec.engine.lora
    if lora is None:
        return []
    args = [engine_flag("enable_lora").flag,
            engine_flag("max_loras").flag, str(lora.max_loras),
            engine_flag("max_lora_rank").flag, str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += [engine_flag("max_cpu_loras").flag, str(lora.max_cpu_loras)]
    return args


def lora_modules(adapters: Sequence[AdapterRef]) -> list[str]:
    """`--lora-modules NAME@VERSION=PATH ...` for the adapters a new engine starts with
    (each folder as the pod sees it); none for none."""
    if not adapters:
        return []
    return [engine_flag("lora_modules").flag,
            *(f"{a.identity}={checkpoint_path(a.uri)}" for a in sorted(adapters,
                                                                      key=lambda a: a.name))]


def engine_args(spec: PoolSpec, group: Group, weights: WeightsRef, drain_seconds: int,
                epoch: int | None = None, draft_uri: str | None = None,
                adapters: Sequence[AdapterRef] | None = None) -> list[str]:
    """The engine's command line, loading `weights`, the draft checkpoint `draft_uri` and
    the LoRA adapters `adapters`; `epoch` and `adapters` None leave --weight-epoch and
    --lora-modules out (the template hash, which neither a refit nor an adapter change
    touches)."""
    e = spec.engine
    roots = weights_roots(spec, weights, draft_uri)
    args = ["--role", str(spec.engine_role(group)), "--model", weights.path,
            "--served-model-name", spec.model_name,
            "--host", "$(POD_IP)", "--port", str(ENGINE_ZMQ_PORT),
            "--admin-port", str(ENGINE_ADMIN_PORT), "--metrics-port", str(ENGINE_METRICS_PORT),
            *(arg for root in roots for arg in ("--weights-root", root)),
            "--engine-id", "$(POD_NAME)",
            "--weight-version", weights.version,
            *(("--weight-epoch", str(epoch)) if epoch is not None else ())]
    # The engine's own flags, from the flag table (config.POOL_FLAGS, in its order): every
    # engine gets the speculative ones, prefill ones too. A prefill engine makes only a
    # request's first token, so it never speculates (nor runs a draft), but one set of flags
    # keeps the pods of a pool uniform (as `tandem serve` starts its engines) and lets every
    # engine take the same refit body, draft included.
    config = engine_config(spec, engine_device(e.device, engine_resources(spec, group)),
                           draft_uri)
    args += flag_args(POOL_FLAGS, flag_values(config, threads=e.threads))
    # SIGTERM makes an engine stop admitting and finish what it runs: let it take as long as
    # an operator drain may (the pod's grace period leaves 10 s on top).
    args += ["--shutdown-grace", str(drain_seconds)]
    args += lora_args(spec) + lora_modules(adapters or ())
    return [*args, *e.args]
