"""A LoRA adapter as requests, the wire and the router name it (vLLM's `LoRARequest`).

Torch-free: the router and the protocol import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem_engine.errors import RequestRejected

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name (what a request's `model` says), where its PEFT folder is, and
    its version: a new version of a name is another adapter (to the prefix cache too)."""

    lora_name: str
    lora_path: str
    lora_version: str = "1"

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not ADAPTER_NAME.match(self.lora_name):
            raise RequestRejected(f"LoRA adapter name {self.lora_name!r} is invalid: 1-128 "
                                  "letters, digits and . _ : - (starting with a letter or "
                                  "digit)")
        if not isinstance(self.lora_version, str) or not 1 <= len(self.lora_version) <= 64:
            raise RequestRejected(f"LoRA adapter {self.lora_name!r}: version "
                                  f"{self.lora_version!r} must be 1-64 characters")

    @property
    def identity(self) -> str:
        return f"{self.lora_name}@{self.lora_version}"


def parse_lora_module(spec: str) -> LoRARequest:
    """`NAME=PATH` or `NAME@VERSION=PATH` (the `--lora-modules` form) as a LoRARequest."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: write NAME=PATH (or NAME@VERSION=PATH)")
    name, _, version = name.partition("@")
    try:
        return LoRARequest(name, path, version or "1")
    except RequestRejected as exc:
        raise ValueError(f"--lora-modules {spec!r}: {exc}") from None
