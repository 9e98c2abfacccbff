"""The weights URI grammar (`tandem_engine.weights`): file://, pvc:// and oci://, where a
pod sees each one's checkpoint, which volume it comes from, what a local stack accepts,
and a model image's /model holding one .gguf file."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem_engine.weights import (
    WeightsRef,
    WeightsURIError,
    checkpoint_problem,
    image_key,
    local_checkpoint_path,
    resolve_checkpoint,
    weights_source,
)

IMAGE = "registry.example.com/models/llama-3:v1"


@pytest.mark.parametrize(("uri", "path", "volume"), [
    ("file:///models/llama", "/models/llama", None),
    ("file://localhost/models/llama%203", "/models/llama 3", None),
    ("pvc://models/llama-3/v1", "/weights/pvc/models/llama-3/v1", "pvc:models"),
    ("pvc://team.models/a.gguf", "/weights/pvc/team.models/a.gguf", "pvc:team.models"),
    (f"oci://{IMAGE}", f"/weights/oci/{image_key(IMAGE)}", f"oci:{IMAGE}"),
    ("oci://localhost:5000/m/x@sha256:" + "0" * 64,
     "/weights/oci/" + image_key("localhost:5000/m/x@sha256:" + "0" * 64),
     "oci:localhost:5000/m/x@sha256:" + "0" * 64),
])
def test_each_scheme_names_a_path_in_the_pod_and_its_volume(uri: str, path: str,
                                                            volume: str | None) -> None:
    assert weights_source(uri).path == path
    assert WeightsRef(uri, "v1").path == path
    assert WeightsRef(uri, "v1").volume == volume


def test_weights_on_one_claim_share_its_volume_and_mount() -> None:
    a, b = weights_source("pvc://models/a"), weights_source("pvc://models/b/c")
    assert a.volume == b.volume and a.mount_path == b.mount_path == "/weights/pvc/models"
    assert weights_source("oci://r.io/m/x:v1").volume != weights_source("oci://r.io/m/x:v2").volume


@pytest.mark.parametrize(("uri", "message"), [
    ("pvc://Models/x", "'Models' is not a PersistentVolumeClaim name"),
    ("pvc://models", "needs the checkpoint's path inside the claim"),
    ("pvc://models/../etc", "without '..'"),
    ("oci://latest", "not an image reference"),
    ("oci://r.io/UPPER/x:v1", "not an image reference"),
    ("s3://bucket/llama", "s3:// and hf:// are not fetched by Tandem: copy the checkpoint"),
    ("hf://meta-llama/Llama-3", "(scheme 'hf' is not supported)"),
    ("/models/llama", "a bare path is not a URI"),
    ("file://host/models", "must not name a host"),
])
def test_a_bad_uri_names_the_input_and_the_fix(uri: str, message: str) -> None:
    with pytest.raises(WeightsURIError) as raised:
        weights_source(uri, "spec.model.weights.uri")
    assert str(raised.value).startswith(f"spec.model.weights.uri {uri!r}: ")
    assert message in str(raised.value)


def test_a_local_stack_reads_file_uris_only() -> None:
    assert local_checkpoint_path("file:///m/x", "--uri") == "/m/x"
    with pytest.raises(WeightsURIError, match=r"pvc:// weights are mounted by the operator .* "
                                              r"kubectl patch ipool"):
        local_checkpoint_path("pvc://models/x", "--uri")
    with pytest.raises(WeightsURIError, match=r"must be a file:// URI .*scheme 's3'"):
        local_checkpoint_path("s3://b/x", "--uri")


def test_a_folder_holding_one_gguf_file_is_that_checkpoint(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "llama.Q4_1.gguf").write_bytes(b"GGUF")
    assert resolve_checkpoint(model) == model / "llama.Q4_1.gguf"
    assert checkpoint_problem(model) is None
    (model / "other.gguf").write_bytes(b"GGUF")  # two: which one is not ours to guess
    assert resolve_checkpoint(model) == model
    assert "has no config.json" in (checkpoint_problem(model) or "")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_bytes(b"GGUF")
    assert resolve_checkpoint(hf) == hf  # a HuggingFace folder stays one
