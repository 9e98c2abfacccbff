"""The operator's pure halves: parsing an InferencePool (the CRD's defaults and rules) and the
manifests built from it, checked field by field and against Kubernetes' own schemas."""

from __future__ import annotations

import base64
import copy
import subprocess
import sys
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tandem_engine.server import main as engine_main
from tandem_engine.weights import WeightsRef, checkpoint_path
from tandem_operator import manifests as m
from tandem_operator.spec import PoolSpec, SpecError

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "inferencepools.tandem.dev.yaml"


def body(**spec: Any) -> dict[str, Any]:
    full: dict[str, Any] = {"model": {"name": "llama",
                                      "weights": {"uri": "file:///models/llama", "version": "v1"}}}
    for key, value in spec.items():
        full[key] = value
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": "ns", "uid": "uid-1", "generation": 3},
            "spec": full}


def parse(**spec: Any) -> PoolSpec:
    return PoolSpec.from_body(body(**spec))


# What every pool pod's containers get: a writable /tmp on an emptyDir, HOME and TMPDIR there.
TMP_VOLUME = {"name": "tandem-tmp", "emptyDir": {}}
TMP_MOUNT = {"name": "tandem-tmp", "mountPath": "/tmp"}
TMP_ENV = [{"name": "HOME", "value": "/tmp"}, {"name": "TMPDIR", "value": "/tmp"}]
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod["spec"]["containers"]
    return c


# ---- spec: defaults and rules -------------------------------------------------------------------


def _schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply a structural schema's defaults the way the API server does."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _schema_defaults(sub, value[key])
    return value


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_the_operator_defaults_are_the_crds() -> None:
    raw = body()
    defaulted = _schema_defaults(_crd_schema(), copy.deepcopy(raw))
    assert defaulted["spec"]["engine"]["kvCache"]["blockSize"] == 16  # defaults did apply
    assert PoolSpec.from_body(defaulted) == PoolSpec.from_body(raw)


def test_identity_and_spec_fields() -> None:
    s = parse(prefill={"replicas": 2}, decode={"replicas": 3}, router={"replicas": 2},
              engine={"kvCache": {"numBlocks": 256}, "threads": 2, "args": ["--seed", "7"]},
              rollout={"maxSurge": 0, "maxUnavailable": 1},
              refit={"drainTimeoutSeconds": 30}, kvTransfer={"pinTTLSeconds": 9})
    assert (s.name, s.namespace, s.uid, s.generation) == ("pool", "ns", "uid-1", 3)
    assert s.weights == WeightsRef("file:///models/llama", "v1")
    assert (s.replicas("prefill"), s.replicas("decode"), s.replicas("router")) == (2, 3, 2)
    assert s.engine.kv_cache.num_blocks == 256 and s.engine.threads == 2
    assert s.engine.args == ("--seed", "7")
    assert (s.rollout.max_surge, s.rollout.max_unavailable) == (0, 1)
    assert s.refit.drain_timeout_seconds == 30 and s.kv_transfer.pin_ttl_seconds == 9


def test_decode_runs_mixed_without_prefill() -> None:
    assert parse().engine_role("decode") == "decode"
    assert parse(prefill={"replicas": 0}).engine_role("decode") == "mixed"
    assert parse(prefill={"replicas": 0}).engine_role("prefill") == "prefill"
    with pytest.raises(ValueError, match="not an engine group"):
        parse().engine_role("router")


@pytest.mark.parametrize(("spec", "message"), [
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 0}},
     "decode.replicas must be at least 1 when prefill.replicas > 0"),
    ({"prefill": {"replicas": 0}, "decode": {"replicas": 0}}, "at least one engine"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "must not both be 0"),
    ({"engine": {"kvCache": {"numBlocks": 64, "memoryMiB": 64}}}, "at most one of kvCache"),
    ({"prefill": {"replicas": 65}}, r"spec.prefill.replicas = 65 is outside 0..64"),
    ({"prefill": {"replicas": "2"}}, "must be an integer"),
    ({"engine": {"imagePullPolicy": "Sometimes"}}, "is not one of Always, IfNotPresent, Never"),
    ({"router": {"service": {"type": "ExternalName"}}}, "spec.router.service.type"),
    ({"engine": {"args": ["x"] * 65}}, "at most 64"),
    ({"engine": "big"}, "spec.engine must be an object"),
])
def test_rules_of_the_crd_are_rechecked(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(**spec)


@pytest.mark.parametrize(("model", "message"), [
    ({}, "spec.model.weights.uri is required"),
    ({"name": "x", "weights": {"uri": "s3://bucket/model", "version": "v1"}},
     r"must be file:///ABSOLUTE/PATH, pvc://CLAIM/PATH .* \(scheme 's3' is not supported\); "
     r"s3:// and hf:// are not fetched by Tandem: copy the checkpoint into a volume"),
    ({"name": "x", "weights": {"uri": "pvc://Models/x", "version": "v1"}},
     "'Models' is not a PersistentVolumeClaim name"),
    ({"name": "x", "weights": {"uri": "pvc://models", "version": "v1"}},
     "needs the checkpoint's path inside the claim"),
    ({"name": "x", "weights": {"uri": "oci://not-an-image", "version": "v1"}},
     "not an image reference: write oci://REGISTRY/REPOSITORY:TAG"),
    ({"name": "x", "weights": {"uri": "file://host/models/x", "version": "v1"}},
     "must not name a host"),
    ({"name": "x", "weights": {"uri": "file:///models/x"}}, "version is required"),
    ({"weights": {"uri": "file:///models/x", "version": "v1"}}, "spec.model.name is required"),
])
def test_model_errors_name_the_field(model: dict[str, Any], message: str) -> None:
    b = body()
    b["spec"]["model"] = model
    with pytest.raises(SpecError, match=message):
        PoolSpec.from_body(b)


def test_no_spec_at_all() -> None:
    with pytest.raises(SpecError, match="spec is required"):
        PoolSpec.from_body({"metadata": {"name": "x"}})


def test_checkpoint_path() -> None:
    assert checkpoint_path("file:///models/llama%203") == "/models/llama 3"
    assert checkpoint_path("file://localhost/m") == "/m"
    with pytest.raises(ValueError, match="absolute checkpoint folder"):
        checkpoint_path("file:///")
    with pytest.raises(SpecError, match=r"^spec.model.weights.uri 'file:///': needs an absolute"):
        PoolSpec.from_body(body(model={"name": "x", "weights": {"uri": "file:///",
                                                                "version": "v1"}}))


# ---- pods ---------------------------------------------------------------------------------------


def test_a_pools_quantization_reaches_every_engine_as_the_engines_word() -> None:
    s = parse(engine={"quantization": "Int4"})
    for group in ("prefill", "decode"):
        args = m.pod(s, group, s.weights, epoch=1)["spec"]["containers"][0]["args"]
        assert args[args.index("--quantization") + 1] == "int4"
    with pytest.raises(SpecError, match=r"spec.engine.quantization = 'int4' is not one of "
                       r"Auto, None, Int8, Int4"):
        parse(engine={"quantization": "int4"})


def test_engine_pod_for_each_role() -> None:
    s = parse(engine={"kvCache": {"memoryMiB": 512}, "maxNumSeqs": 8,
                      "maxNumBatchedTokens": 256, "threads": 2, "args": ["--seed", "1"]},
              refit={"drainTimeoutSeconds": 50}, kvTransfer={"pinTTLSeconds": 30})
    for group, role in (("prefill", "prefill"), ("decode", "decode")):
        pod = m.pod(s, group, s.weights, epoch=3)
        meta = pod["metadata"]
        assert meta["generateName"] == f"pool-{group}-" and "name" not in meta
        assert meta["namespace"] == "ns"
        assert meta["labels"] == {
            "app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "pool",
            "app.kubernetes.io/component": group, "app.kubernetes.io/managed-by":
            "tandem-operator", "app.kubernetes.io/part-of": "tandem",
            "tandem.dev/pool": "pool", "tandem.dev/role": role, "tandem.dev/engine": "true"}
        assert meta["annotations"] == {"tandem.dev/template-hash": m.template_hash(s, group),
                                       "tandem.dev/weights-version": "v1",
                                       "tandem.dev/weights-uri": "file:///models/llama",
                                       "tandem.dev/weights-epoch": "3",
                                       "prometheus.io/scrape": "true",
                                       "prometheus.io/port": "9100",
                                       "prometheus.io/path": "/metrics"}
        assert meta["ownerReferences"] == [{
            "apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool", "name": "pool",
            "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
        c = container(pod)
        assert c["name"] == "engine" and c["command"] == ["tandem-engine"]
        assert c["args"] == [
            "--role", role, "--model", "/models/llama", "--served-model-name", "llama",
            "--host", "$(POD_IP)", "--port", "5555", "--admin-port", "8080",
            "--metrics-port", "9100",
            "--engine-id", "$(POD_NAME)", "--weight-version", "v1", "--weight-epoch", "3",
            "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--block-size", "16", "--threads", "2",
            "--device", "cpu", "--kv-pin-ttl", "30",
            "--kv-cache-memory-bytes", str(512 * 1024 * 1024), "--dtype", "auto",
            "--kv-cache-dtype", "auto", "--quantization", "auto", "--shutdown-grace", "50",
            "--seed", "1"]
        assert c["ports"] == [{"name": "zmq", "containerPort": 5555, "protocol": "TCP"},
                              {"name": "admin", "containerPort": 8080, "protocol": "TCP"},
                              {"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]
        assert c["readinessProbe"] == {"httpGet": {"path": "/readyz", "port": "metrics"},
                                       "periodSeconds": 2}
        # A checkpoint may load for spec.engine.startupTimeoutSeconds (default 1800 s);
        # liveness waits for the startup probe and then looks often.
        assert c["startupProbe"] == {"httpGet": {"path": "/healthz", "port": "metrics"},
                                     "periodSeconds": 2, "failureThreshold": 900}
        assert c["livenessProbe"] == {"httpGet": {"path": "/healthz", "port": "metrics"},
                                      "periodSeconds": 10, "failureThreshold": 3}
        assert pod["spec"]["terminationGracePeriodSeconds"] == 60
        assert pod["spec"]["restartPolicy"] == "Always"
    mixed = parse(prefill={"replicas": 0})
    pod = m.pod(mixed, "decode", mixed.weights)
    assert container(pod)["args"][:2] == ["--role", "mixed"]
    assert pod["metadata"]["labels"]["tandem.dev/role"] == "mixed"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"


def test_kv_cache_sizing_flags() -> None:
    blocks = parse(engine={"kvCache": {"numBlocks": 1024}})
    args = container(m.pod(blocks, "decode", blocks.weights))["args"]
    assert args[args.index("--num-blocks") + 1] == "1024"
    assert "--kv-cache-memory-bytes" not in args
    neither = parse()
    args = container(m.pod(neither, "decode", neither.weights))["args"]
    assert "--num-blocks" not in args and "--kv-cache-memory-bytes" not in args


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_first_class_engine_fields_render_their_flags() -> None:
    s = parse(engine={"kvCache": {"memory": "2Gi"}, "maxModelLen": 8192, "dtype": "BFloat16"})
    args = container(m.pod(s, "decode", s.weights))["args"]
    assert _flag(args, "--kv-cache-memory-bytes") == str(2 * 2**30)
    assert (_flag(args, "--max-model-len"), _flag(args, "--dtype")) == ("8192", "bfloat16")
    assert "--gpu-memory-utilization" not in args  # a CPU engine: it would mean nothing
    plain = container(m.pod(parse(), "decode", parse().weights))["args"]
    assert "--max-model-len" not in plain and _flag(plain, "--dtype") == "auto"
    # gpuMemoryUtilization reaches the CUDA engines only: here prefill (the engine's GPU),
    # not decode (its role's resources ask for none, so Auto runs it on the CPU)
    gpu = parse(engine={"gpuMemoryUtilization": "0.85",
                        "resources": {"limits": {"nvidia.com/gpu": 1}}},
                decode={"resources": {"limits": {"cpu": "4"}}})
    prefill = container(m.pod(gpu, "prefill", gpu.weights))["args"]
    decode = container(m.pod(gpu, "decode", gpu.weights))["args"]
    assert (_flag(prefill, "--device"), _flag(prefill, "--gpu-memory-utilization")) == (
        "cuda", "0.85")
    assert _flag(decode, "--device") == "cpu" and "--gpu-memory-utilization" not in decode
    # unset on CUDA: the engine's default, stated
    cuda = parse(engine={"device": "CUDA"})
    assert _flag(container(m.pod(cuda, "decode", cuda.weights))["args"],
                 "--gpu-memory-utilization") == "0.9"
    # each is part of the template: a change rolls the engines, never the routers
    variants = [parse(), s, parse(engine={"maxModelLen": 4096}),
                parse(engine={"dtype": "Float32"}),
                parse(engine={"kvCache": {"memory": "1Gi"}}), cuda,
                parse(engine={"device": "CUDA", "gpuMemoryUtilization": "0.5"})]
    assert len({m.template_hash(v, "decode") for v in variants}) == len(variants)
    assert len({m.template_hash(v, "router") for v in variants}) == 1
    # what the operator renders, tandem-engine takes; an abbreviation it refuses (one could
    # slip a flag past the operator's check of spec.engine.args)
    base = ["--model", "m", "--port", "1", "--admin-port", "2"]
    engine_main.build_parser().parse_args([*base, *prefill[prefill.index("--max-num-seqs"):]])
    with pytest.raises(SystemExit):
        engine_main.build_parser().parse_args([*base, "--max-model", "8"])


@pytest.mark.parametrize(("arg", "field"), [
    (["--max-model-len", "4096"], "spec.engine.maxModelLen"),
    (["--dtype=float16"], "spec.engine.dtype"),
    (["--gpu-memory-utilization", "0.5"], "spec.engine.gpuMemoryUtilization"),
    (["--kv-cache-memory-bytes", "1"], "spec.engine.kvCache.memory"),
    (["--quantization", "int8"], "spec.engine.quantization"),
    (["--model", "/elsewhere"], "spec.model.weights.uri"),
    (["--shutdown-grace=5"], "spec.refit.drainTimeoutSeconds"),
])
def test_engine_args_that_duplicate_a_field_name_the_field(arg: list[str], field: str) -> None:
    flag = arg[0].partition("=")[0]
    with pytest.raises(SpecError, match=rf"spec\.engine\.args\[1\] '{arg[0]}': the operator "
                                        rf"renders {flag} from {field}; set that instead"):
        parse(engine={"args": ["--kernels", *arg]})
    with pytest.raises(SpecError, match=r"renders --port from the pod's address, ports and "
                                        r"name; leave it out"):
        parse(engine={"args": ["--port", "1"]})


def test_engine_env_token_ucx_then_user_env() -> None:
    s = parse(engine={"env": [{"name": "A", "value": "1"},
                              {"name": "B", "valueFrom": {"fieldRef": {"fieldPath":
                                                                       "spec.nodeName"}}}]},
              kvTransfer={"ucx": {"transports": "rc,cuda_copy", "netDevices": "mlx5_0:1"}})
    env = container(m.pod(s, "prefill", s.weights))["env"]
    assert [e["name"] for e in env] == ["POD_IP", "POD_NAME", "POD_NAMESPACE", "HOME", "TMPDIR",
                                        "TANDEM_ADMIN_TOKEN", "TANDEM_ZMQ_SERVER_SECRET_KEY",
                                        "TANDEM_ZMQ_CLIENT_PUBLIC_KEY", "UCX_TLS",
                                        "UCX_NET_DEVICES", "A", "B"]
    assert env[0]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[5]["valueFrom"] == {"secretKeyRef": {"name": "pool-admin-token", "key": "token"}}
    assert env[8]["value"] == "rc,cuda_copy" and env[9]["value"] == "mlx5_0:1"
    plain = parse()
    assert "UCX_TLS" not in [e["name"] for e in container(m.pod(plain, "decode",
                                                                 plain.weights))["env"]]


def test_resources_and_placement_per_role() -> None:
    engine_res = {"requests": {"cpu": "1"}, "limits": {"memory": "4Gi"}}
    prefill_res = {"limits": {"nvidia.com/gpu": 1}}
    s = parse(engine={"resources": engine_res},
              prefill={"replicas": 1, "resources": prefill_res,
                       "nodeSelector": {"gpu": "h100"},
                       "tolerations": [{"key": "gpu", "operator": "Exists"}],
                       "affinity": {"nodeAffinity": {}}})
    prefill = m.pod(s, "prefill", s.weights)
    decode = m.pod(s, "decode", s.weights)
    assert container(prefill)["resources"] == prefill_res  # replaces engine.resources
    assert container(decode)["resources"] == engine_res
    assert prefill["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert prefill["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert prefill["spec"]["affinity"] == {"nodeAffinity": {}}
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert key not in decode["spec"]
    assert "resources" not in container(m.pod(parse(), "decode", s.weights))


def test_router_pod() -> None:
    s = parse()
    pod = m.pod(s, "router", s.weights)
    assert pod["metadata"]["generateName"] == "pool-router-"
    assert pod["metadata"]["labels"]["tandem.dev/role"] == "router"
    assert "tandem.dev/engine" not in pod["metadata"]["labels"]
    assert pod["spec"]["serviceAccountName"] == "pool-router"
    c = container(pod)
    assert c["command"] == ["tandem-router"]
    assert c["args"] == ["--discover-pool", "pool", "--namespace", "$(POD_NAMESPACE)",
                         "--model", "/models/llama", "--served-model-name", "llama",
                         "--host", "$(POD_IP)", "--port", "8000"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert [e["name"] for e in c["env"]] == ["POD_IP", "POD_NAME", "POD_NAMESPACE", "HOME",
                                             "TMPDIR", "TANDEM_ZMQ_SERVER_PUBLIC_KEY",
                                             "TANDEM_ZMQ_CLIENT_SECRET_KEY"]


def test_the_routers_bound_on_requests_in_flight_is_their_flag() -> None:
    s = parse(router={"maxNumRequests": 256})
    args = container(m.pod(s, "router", s.weights))["args"]
    assert args[args.index("--max-num-requests") + 1] == "256"
    assert m.template_hash(s, "router") != m.template_hash(parse(), "router")


def test_weights_volumes_are_mounted_into_engine_and_router_pods() -> None:
    """A real cluster keeps checkpoints on a volume: every engine and router pod mounts it
    (read-only unless said otherwise) where the weights URI points."""
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "llama-weights"}}]
    s = parse(engine={"volumes": volumes,
                      "volumeMounts": [{"name": "models", "mountPath": "/models"}]})
    for group in ("prefill", "decode", "router"):
        pod = m.pod(s, group, s.weights)
        assert pod["spec"]["volumes"] == [TMP_VOLUME, *volumes]
        assert container(pod)["volumeMounts"] == [
            TMP_MOUNT, {"readOnly": True, "name": "models", "mountPath": "/models"}]
        kubernetes_validate.validate(pod, "1.32", strict=True)
    assert m.pod(parse(), "decode", s.weights)["spec"]["volumes"] == [TMP_VOLUME]
    with pytest.raises(SpecError, match=r"volumeMounts entry .* names no volume .*models"):
        parse(engine={"volumes": volumes,
                      "volumeMounts": [{"name": "weights", "mountPath": "/models"}]})


def test_pvc_weights_mount_their_claim_read_only_where_the_uri_points() -> None:
    s = parse(model={"name": "llama", "weights": {"uri": "pvc://models/llama-3/v1",
                                                  "version": "v1"}})
    for group in ("prefill", "decode", "router"):
        pod = m.pod(s, group, s.weights)
        assert pod["spec"]["volumes"][-1] == {
            "name": "tandem-weights",
            "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
        assert container(pod)["volumeMounts"][-1] == {
            "name": "tandem-weights", "mountPath": "/weights/pvc/models", "readOnly": True}
        assert "initContainers" not in pod["spec"]
        kubernetes_validate.validate(pod, "1.32", strict=True)
    args = container(m.pod(s, "decode", s.weights))["args"]
    assert args[args.index("--model") + 1] == "/weights/pvc/models/llama-3/v1"
    # refits may read anything on the claim
    assert args[args.index("--weights-root") + 1] == "/weights/pvc/models"


def test_oci_weights_are_copied_from_the_model_image_by_the_first_init_container() -> None:
    image = "registry.example.com/models/llama-3:v1"
    s = parse(model={"name": "llama", "weights": {"uri": f"oci://{image}", "version": "v1"}},
              engine={"initContainers": [{"name": "warm", "command": ["true"]}]})
    for group in ("prefill", "decode", "router"):
        pod = m.pod(s, group, s.weights)
        copy, user = pod["spec"]["initContainers"]
        where = s.weights.path
        assert where.startswith("/weights/oci/")
        assert copy["image"] == image and user["name"] == "warm"
        assert copy["command"] == ["cp", "-R", "/model/.", f"{where}/"]
        assert copy["volumeMounts"] == [{"name": "tandem-weights", "mountPath": where}]
        assert copy["securityContext"] == CONTAINER_SECURITY
        assert pod["spec"]["volumes"][-1] == {"name": "tandem-weights", "emptyDir": {}}
        assert container(pod)["volumeMounts"][-1] == {
            "name": "tandem-weights", "mountPath": where, "readOnly": True}
        kubernetes_validate.validate(pod, "1.32", strict=True)


def test_weights_on_another_volume_are_a_new_template_on_the_same_one_a_refit() -> None:
    def spec(uri: str) -> PoolSpec:
        return parse(model={"name": "llama", "weights": {"uri": uri, "version": "v"}})

    same = [spec("pvc://models/a"), spec("pvc://models/b/c")]
    assert m.template_hash(same[0], "decode") == m.template_hash(same[1], "decode")
    files = [spec("file:///models/a"), spec("file:///elsewhere/b")]
    assert m.template_hash(files[0], "decode") == m.template_hash(files[1], "decode")
    others = [spec("pvc://models/a"), spec("pvc://archive/a"), spec("oci://r.io/m/x:v1"),
              spec("oci://r.io/m/x:v2"), files[0]]
    assert len({m.template_hash(o, "decode") for o in others}) == len(others)
    # routers keep theirs: they read the tokenizer once, as across a refit
    assert len({m.template_hash(o, "router") for o in others}) == 1


def test_refits_may_read_the_weights_mounts_and_the_listed_roots_only() -> None:
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "llama-weights"}}]
    mounts = [{"name": "models", "mountPath": "/models"}]
    on_volume = WeightsRef("file:///models/llama/v1", "v1")
    s = parse(engine={"volumes": volumes, "volumeMounts": mounts})
    assert m.weights_roots(s, on_volume) == ["/models"]
    assert m.weights_roots(s, WeightsRef("file:///opt/baked/v1", "v1")) == []
    listed = parse(engine={"volumes": volumes, "volumeMounts": mounts,
                           "weightsRoots": ["/scratch/ckpt", "/models"]})
    assert m.weights_roots(listed, on_volume) == ["/scratch/ckpt", "/models"]
    args = container(m.pod(listed, "decode", on_volume))["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--weights-root"] == [
        "/scratch/ckpt", "/models"]
    with pytest.raises(SpecError, match=r"spec.engine.weightsRoots\[0\] = 'rel' must be an "
                                        "absolute path"):
        parse(engine={"weightsRoots": ["rel"]})


def test_engine_image_defaults_to_the_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool without spec.engine.image runs the chart's engine image (TANDEM_ENGINE_IMAGE),
    else the locally built one of the operator's own version; its own image wins."""
    monkeypatch.setenv("TANDEM_ENGINE_IMAGE", "ghcr.io/me/tandem/engine:1.2.3")
    s = parse()
    assert s.engine.image == "ghcr.io/me/tandem/engine:1.2.3"
    assert {container(m.pod(s, g, s.weights))["image"] for g in ("prefill", "decode", "router")
            } == {"ghcr.io/me/tandem/engine:1.2.3"}
    assert parse(engine={"image": "other/engine:9"}).engine.image == "other/engine:9"
    monkeypatch.delenv("TANDEM_ENGINE_IMAGE")
    assert parse().engine.image == f"localhost/tandem/engine:{package_version('tandem')}"


def test_init_containers_run_in_engine_and_router_pods() -> None:
    """An init container fills a volume before the engine or router starts (the example
    pulls the model into an emptyDir); image and pull policy default to the engine's."""
    volumes = [{"name": "models", "emptyDir": {}}]
    pull = {"name": "pull-model", "command": ["tandem", "models", "pull", "smollm2-135m-instruct",
                                              "/models/m.gguf"],
            "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
    s = parse(engine={"image": "tandem/engine:9", "imagePullPolicy": "Always",
                      "volumes": volumes,
                      "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                      "initContainers": [pull, {"name": "check", "image": "busybox:1",
                                                "command": ["ls"], "args": ["/models"],
                                                "env": [{"name": "A", "value": "1"}]}]})
    for group in ("prefill", "decode", "router"):
        pod = m.pod(s, group, s.weights)
        # Like the main container: non-root, read-only root filesystem, /tmp for HOME.
        assert pod["spec"]["initContainers"] == [
            {**pull, "image": "tandem/engine:9", "imagePullPolicy": "Always",
             "env": TMP_ENV, "volumeMounts": [TMP_MOUNT, *pull["volumeMounts"]],
             "securityContext": CONTAINER_SECURITY},
            {"name": "check", "image": "busybox:1", "imagePullPolicy": "Always",
             "command": ["ls"], "args": ["/models"],
             "env": [*TMP_ENV, {"name": "A", "value": "1"}], "volumeMounts": [TMP_MOUNT],
             "securityContext": CONTAINER_SECURITY}]
        kubernetes_validate.validate(pod, "1.32", strict=True)
    assert "initContainers" not in m.pod(parse(), "decode", s.weights)["spec"]


@pytest.mark.parametrize(("init", "message"), [
    ([{"name": "a", "command": ["x"]}, {"name": "a", "command": ["y"]}],
     r"initContainers\[1\]\.name 'a' is used twice"),
    ([{"name": "a"}], r"initContainers\[0\]\.command is required"),
    ([{"name": "a", "command": "tandem models pull"}],
     r"initContainers\[0\]\.command must be a list"),
    ([{"name": "a", "command": ["x"], "volumeMounts": [{"name": "w", "mountPath": "/w"}]}],
     r"initContainers\[0\]\.volumeMounts entry .* names no volume"),
    ([{"name": f"c{i}", "command": ["x"]} for i in range(5)], "at most 4 are allowed"),
])
def test_init_container_errors_name_the_field(init: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(engine={"initContainers": init})


# ---- the template hash --------------------------------------------------------------------------


def test_the_template_hash_is_stable_across_processes() -> None:
    code = ("from tandem_operator.spec import PoolSpec; from tandem_operator import manifests;"
            "import json, sys; s = PoolSpec.from_body(json.loads(sys.argv[1]));"
            "print(*(manifests.template_hash(s, g) for g in ('prefill', 'decode', 'router')))")
    import json
    b = body(engine={"env": [{"name": "Z", "value": "1"}, {"name": "A", "value": "2"}]})
    runs = {subprocess.run([sys.executable, "-c", code, json.dumps(b)], capture_output=True,
                           text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(runs) == 1
    s = PoolSpec.from_body(b)
    assert runs.pop().split() == [m.template_hash(s, g) for g in ("prefill", "decode", "router")]


@pytest.mark.parametrize(("change", "groups"), [
    ({"engine": {"image": "tandem/engine:0.2.0"}}, {"prefill", "decode", "router"}),
    ({"engine": {"imagePullPolicy": "Always"}}, {"prefill", "decode", "router"}),
    ({"engine": {"resources": {"limits": {"cpu": "3"}}}}, {"prefill", "decode"}),
    ({"engine": {"env": [{"name": "X", "value": "1"}]}}, {"prefill", "decode"}),
    ({"engine": {"args": ["--seed", "3"]}}, {"prefill", "decode"}),
    ({"engine": {"kvCache": {"numBlocks": 64}}}, {"prefill", "decode"}),
    ({"engine": {"kvCache": {"blockSize": 64}}}, {"prefill", "decode"}),
    ({"engine": {"startupTimeoutSeconds": 600}}, {"prefill", "decode"}),
    ({"engine": {"rdma": {"ipcLock": True}}}, {"prefill", "decode"}),
    ({"pod": {"imagePullSecrets": [{"name": "regcred"}]}}, {"prefill", "decode", "router"}),
    ({"pod": {"labels": {"team": "ml"}}}, {"prefill", "decode", "router"}),
    ({"pod": {"annotations": {"example.com/owner": "ml"}}}, {"prefill", "decode", "router"}),
    ({"pod": {"priorityClassName": "high"}}, {"prefill", "decode", "router"}),
    ({"pod": {"runtimeClassName": "nvidia"}}, {"prefill", "decode", "router"}),
    ({"pod": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                             "whenUnsatisfiable": "ScheduleAnyway"}]}},
     {"prefill", "decode", "router"}),
    ({"router": {"nodeSelector": {"pool": "cpu"}}}, {"router"}),
    ({"router": {"affinity": {"podAntiAffinity": {}}}}, {"router"}),
    ({"engine": {"maxNumSeqs": 3}}, {"prefill", "decode"}),
    ({"engine": {"maxNumBatchedTokens": 64}}, {"prefill", "decode"}),
    ({"engine": {"threads": 4}}, {"prefill", "decode"}),
    ({"kvTransfer": {"pinTTLSeconds": 5}}, {"prefill", "decode"}),
    ({"kvTransfer": {"ucx": {"transports": "tcp"}}}, {"prefill", "decode"}),
    ({"engine": {"initContainers": [{"name": "pull", "command": ["true"]}]}},
     {"prefill", "decode", "router"}),
    ({"prefill": {"replicas": 1, "nodeSelector": {"a": "b"}}}, {"prefill"}),
    ({"decode": {"replicas": 1, "tolerations": [{"key": "k", "operator": "Exists"}]}},
     {"decode"}),
    ({"prefill": {"replicas": 0}}, {"decode"}),  # decode engines now run mixed
    ({"model": {"name": "other", "weights": {"uri": "file:///models/llama", "version": "v1"}}},
     {"prefill", "decode", "router"}),
    ({"engine": {"speculative": {"method": "Ngram"}}}, {"prefill", "decode"}),
    ({"engine": {"speculative": {"method": "Draft"}},
      "model": {"name": "llama", "weights": {"uri": "file:///models/llama", "version": "v1",
                                             "draft": {"uri": "file:///models/draft"}}}},
     {"prefill", "decode"}),
    # Not part of any pod template: weights (refit in place), counts, rollout, drain timeout.
    ({"model": {"name": "llama", "weights": {"uri": "file:///models/v2", "version": "v2"}}},
     set()),
    ({"prefill": {"replicas": 5}, "decode": {"replicas": 7}, "router": {"replicas": 3}}, set()),
    ({"rollout": {"maxSurge": 3, "maxUnavailable": 2}}, set()),
    ({"refit": {"drainTimeoutSeconds": 7, "strategy": "AllAtOnce"}}, set()),
    ({"router": {"replicas": 1, "service": {"type": "NodePort", "port": 80}}}, set()),
])
def test_what_the_template_hash_covers(change: dict[str, Any], groups: set[str]) -> None:
    base, changed = parse(), parse(**change)
    differs = {g for g in ("prefill", "decode", "router")
               if m.template_hash(base, g) != m.template_hash(changed, g)}
    assert differs == groups


def test_the_hash_differs_by_group() -> None:
    s = parse()
    assert len({m.template_hash(s, g) for g in ("prefill", "decode", "router")}) == 3


# ---- the pool's other objects -------------------------------------------------------------------


def test_admin_secret_round_trip() -> None:
    secret = m.admin_secret(parse(), "s3cr3t")
    assert secret["metadata"]["name"] == "pool-admin-token"
    assert base64.b64decode(secret["data"]["token"]) == b"s3cr3t"
    assert m.secret_token(secret) == "s3cr3t"
    assert m.secret_token({"stringData": {"token": "plain"}}) == "plain"
    assert m.secret_token({}) is None


def test_services() -> None:
    s = parse(router={"service": {"type": "NodePort", "port": 9000}})
    svc = m.router_service(s)
    assert svc["metadata"]["name"] == "pool"
    assert svc["spec"] == {"type": "NodePort",
                           "selector": {"tandem.dev/pool": "pool", "tandem.dev/role": "router"},
                           "ports": [{"name": "http", "port": 9000, "targetPort": "http",
                                      "protocol": "TCP"}]}
    headless = m.engines_service(s)
    assert headless["metadata"]["name"] == "pool-engines"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == {"tandem.dev/pool": "pool", "tandem.dev/engine": "true"}
    assert [p["name"] for p in headless["spec"]["ports"]] == ["zmq", "admin", "metrics"]
    assert m.router_endpoint(s) == "http://pool.ns.svc:9000/v1"


@pytest.mark.parametrize(("unavailable", "expected"), [(0, 1), (1, 1), (3, 3)])
def test_pod_disruption_budgets(unavailable: int, expected: int) -> None:
    s = parse(rollout={"maxSurge": 1, "maxUnavailable": unavailable})
    for group in ("prefill", "decode"):
        pdb = m.pod_disruption_budget(s, group)
        assert pdb["metadata"]["name"] == f"pool-{group}"
        assert pdb["spec"] == {"maxUnavailable": expected, "selector": {"matchLabels": {
            "tandem.dev/pool": "pool", "app.kubernetes.io/component": group}}}


def test_router_rbac() -> None:
    s = parse()
    assert m.router_service_account(s)["metadata"]["name"] == "pool-router"
    role = m.router_role(s)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    binding = m.router_role_binding(s)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "pool-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pool-router",
                                    "namespace": "ns"}]


def _every_object(s: PoolSpec) -> list[dict[str, Any]]:
    return [*m.support_objects(s), m.admin_secret(s, "t"),
            *(m.pod(s, g, s.weights) for g in ("prefill", "decode", "router"))]


def test_every_object_is_labelled_and_owned() -> None:
    s = parse()
    objects = _every_object(s)
    assert sorted(o["kind"] for o in objects) == sorted([
        "ServiceAccount", "Role", "RoleBinding", "Service", "Service", "PodDisruptionBudget",
        "PodDisruptionBudget", "NetworkPolicy", "NetworkPolicy", "Secret", "Pod", "Pod",
        "Pod"])
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"][0]["uid"] == "uid-1"
        assert meta["ownerReferences"][0]["controller"] is True
        labels = meta["labels"]
        assert labels["tandem.dev/pool"] == "pool"
        assert labels["app.kubernetes.io/managed-by"] == "tandem-operator"
        assert labels["app.kubernetes.io/instance"] == "pool"
        assert labels["app.kubernetes.io/component"] in ("prefill", "decode", "router", "engine")


@pytest.mark.parametrize("variant", [
    {},
    {"prefill": {"replicas": 0}},
    {"engine": {"resources": {"limits": {"cpu": "500m", "nvidia.com/gpu": 1}},
                "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                "kvCache": {"numBlocks": 64}},
     "decode": {"replicas": 2, "tolerations": [{"key": "g", "operator": "Exists",
                                                "effect": "NoSchedule"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [
                        {"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}},
     "router": {"service": {"type": "LoadBalancer", "port": 80}}},
], ids=["default", "mixed", "everything"])
def test_every_object_passes_the_kubernetes_schema(variant: dict[str, Any]) -> None:
    version = kubernetes_validate.latest_version()
    for obj in _every_object(parse(**variant)):
        kubernetes_validate.validate(obj, version, strict=True)


# ---- drift of existing objects ------------------------------------------------------------------


def test_drift_ignores_what_the_server_adds() -> None:
    s = parse(router={"service": {"type": "NodePort"}})
    desired = m.router_service(s)
    observed = copy.deepcopy(desired)
    observed["metadata"].update(uid="x", resourceVersion="5")
    observed["spec"]["clusterIP"] = "10.0.0.9"
    observed["spec"]["ports"][0]["nodePort"] = 31234
    del observed["spec"]["ports"][0]["protocol"]
    assert m.drift_patch(desired, observed) is None
    for obj in m.support_objects(s):
        assert m.drift_patch(obj, copy.deepcopy(obj)) is None


def test_drift_patches_only_managed_fields() -> None:
    before, after = parse(), parse(router={"service": {"type": "LoadBalancer", "port": 80}},
                                   rollout={"maxSurge": 1, "maxUnavailable": 2})
    assert m.drift_patch(m.router_service(after), m.router_service(before)) == {"spec": {
        "type": "LoadBalancer",
        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}
    assert m.drift_patch(m.pod_disruption_budget(after, "decode"),
                         m.pod_disruption_budget(before, "decode")) == {
        "spec": {"maxUnavailable": 2}}
    role = m.router_role(before)
    role["rules"] = []
    assert m.drift_patch(m.router_role(before), role) == {"rules": m.router_role(before)["rules"]}


# ---- speculative decoding -----------------------------------------------------------------------

DRAFT_WEIGHTS = {"uri": "file:///models/llama", "version": "v1",
                 "draft": {"uri": "file:///models/llama-draft/v1"}}


def _flags(args: list[str]) -> dict[str, str]:
    """The --speculative-* flags of a command line, flag -> value."""
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--speculative")}


@pytest.mark.parametrize(("speculative", "weights", "flags"), [
    ({"method": "Ngram"}, None,
     {"--speculative-method": "ngram", "--speculative-tokens": "4",
      "--speculative-ngram-min": "2", "--speculative-ngram-max": "4"}),
    ({"method": "Ngram", "numSpeculativeTokens": 8, "promptLookupMin": 1,
      "promptLookupMax": 6}, None,
     {"--speculative-method": "ngram", "--speculative-tokens": "8",
      "--speculative-ngram-min": "1", "--speculative-ngram-max": "6"}),
    ({"method": "MTP", "numSpeculativeTokens": 3, "disableByBatchSize": 8}, None,
     {"--speculative-method": "mtp", "--speculative-tokens": "3",
      "--speculative-disable-by-batch-size": "8"}),
    ({"method": "Draft"}, DRAFT_WEIGHTS,
     {"--speculative-method": "draft", "--speculative-tokens": "4",
      "--speculative-model": "/models/llama-draft/v1"}),
])
def test_speculative_flags_on_every_engine(speculative: dict[str, Any],
                                           weights: dict[str, Any] | None,
                                           flags: dict[str, str]) -> None:
    """Prefill engines get the flags too (they never speculate: uniform pods); the router
    none. The flags come among the operator's own, before spec.engine.args."""
    model = {"name": "llama", "weights": weights} if weights else None
    s = parse(engine={"speculative": speculative, "args": ["--seed", "3"]},
              **({"model": model} if model else {}))
    for group in ("prefill", "decode"):
        args = container(m.pod(s, group, s.weights))["args"]
        assert _flags(args) == flags
        assert args[-2:] == ["--seed", "3"]
        assert args.index("--kv-pin-ttl") < args.index("--speculative-method") < args.index(
            "--seed")
    assert _flags(container(m.pod(s, "router", s.weights))["args"]) == {}
    assert _flags(container(m.pod(parse(), "decode", s.weights))["args"]) == {}


def test_the_draft_checkpoint_is_annotated_and_its_mount_may_be_refit_from() -> None:
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "llama"}},
               {"name": "drafts", "persistentVolumeClaim": {"claimName": "drafts"}}]
    mounts = [{"name": "models", "mountPath": "/models"},
              {"name": "drafts", "mountPath": "/drafts"}]
    weights = {**DRAFT_WEIGHTS, "draft": {"uri": "file:///drafts/llama/v1"}}
    s = parse(model={"name": "llama", "weights": weights},
              engine={"speculative": {"method": "Draft"}, "volumes": volumes,
                      "volumeMounts": mounts})
    assert s.draft_uri == "file:///drafts/llama/v1"
    pod = m.pod(s, "decode", s.weights)
    args = container(pod)["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--weights-root"] == [
        "/models", "/drafts"]
    assert pod["metadata"]["annotations"][m.DRAFT_URI] == "file:///drafts/llama/v1"
    assert m.DRAFT_URI not in m.pod(s, "router", s.weights)["metadata"]["annotations"]
    assert m.DRAFT_URI not in m.pod(parse(), "decode", s.weights)["metadata"]["annotations"]
    kubernetes_validate.validate(pod, "1.32", strict=True)


def test_a_new_draft_is_refit_not_rolled() -> None:
    """The draft travels with the weights: another draft checkpoint is no new pod template
    (a refit reloads it), another method is."""
    base = parse(model={"name": "llama", "weights": DRAFT_WEIGHTS},
                 engine={"speculative": {"method": "Draft"}})
    moved = parse(model={"name": "llama", "weights": {
        "uri": "file:///models/llama-v2", "version": "v2",
        "draft": {"uri": "file:///models/llama-draft/v2"}}},
        engine={"speculative": {"method": "Draft"}})
    for group in ("prefill", "decode", "router"):
        assert m.template_hash(base, group) == m.template_hash(moved, group)


@pytest.mark.parametrize(("spec", "message"), [
    ({"engine": {"speculative": {"method": "Draft"}}},
     "engine.speculative.method Draft needs model.weights.draft.uri"),
    ({"model": {"name": "llama", "weights": DRAFT_WEIGHTS}},
     "model.weights.draft is read only by engine.speculative.method Draft"),
    ({"model": {"name": "llama", "weights": DRAFT_WEIGHTS},
      "engine": {"speculative": {"method": "Ngram"}}},
     "model.weights.draft is read only by engine.speculative.method Draft"),
    ({"model": {"name": "llama", "weights": {**DRAFT_WEIGHTS, "draft": {}}},
      "engine": {"speculative": {"method": "Draft"}}},
     r"spec.model.weights.draft.uri is required"),
    ({"model": {"name": "llama", "weights": {**DRAFT_WEIGHTS,
                                             "draft": {"uri": "s3://bucket/draft"}}},
      "engine": {"speculative": {"method": "Draft"}}},
     r"spec.model.weights.draft.uri 's3://bucket/draft': must be a file:// URI"),
    ({"engine": {"speculative": {}}},
     "spec.engine.speculative.method is required: one of Ngram, Draft, MTP"),
    ({"engine": {"speculative": {"method": "ngram"}}},
     "spec.engine.speculative.method = 'ngram' is not one of Ngram, Draft, MTP"),
    ({"engine": {"speculative": {"method": "Ngram", "numSpeculativeTokens": 17}}},
     r"spec.engine.speculative.numSpeculativeTokens = 17 is outside 1..16"),
    ({"engine": {"speculative": {"method": "MTP", "promptLookupMax": 8}}},
     r"spec.engine.speculative.promptLookupMax applies to method Ngram only"),
    ({"engine": {"speculative": {"method": "Ngram", "promptLookupMin": 6}}},
     r"spec.engine.speculative.promptLookupMax = 4 is below promptLookupMin = 6: raise "
     "promptLookupMax or lower promptLookupMin"),
    ({"engine": {"args": ["--speculative-method", "ngram"]}},
     r"spec.engine.args\[0\] '--speculative-method': the operator renders "
     r"--speculative-method from spec.engine.speculative.method; set that instead"),
    ({"engine": {"speculative": {"method": "Draft"}, "args": ["--speculative-model=/m"]},
      "model": {"name": "llama", "weights": DRAFT_WEIGHTS}},
     r"spec.engine.args\[0\] .*spec.model.weights.draft.uri"),
])
def test_speculative_errors_name_the_field_and_the_fix(spec: dict[str, Any],
                                                       message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse(**spec)


def test_a_refit_reloads_the_spec_draft_and_rolls_back_to_the_pods_draft() -> None:
    """The draft a refit loads is the new spec's; the one a rollback restores is the one the
    pool's engine pods were started with (their DRAFT_URI annotation)."""
    from tandem_engine.fleet import Phase
    from tandem_operator.plan import Observed, PodView
    from tandem_operator.refit import begin

    old = parse(model={"name": "llama", "weights": DRAFT_WEIGHTS},
                engine={"speculative": {"method": "Draft"}})
    pods = []
    for i, group in enumerate(("prefill", "decode")):
        raw = m.pod(old, group, old.weights, epoch=1)
        raw["metadata"]["name"] = f"pool-{group}-{i}"
        view = PodView.from_body(raw)
        assert view is not None and view.draft_uri == "file:///models/llama-draft/v1"
        pods.append(view)
    new = parse(model={"name": "llama", "weights": {
        "uri": "file:///models/llama-v2", "version": "v2",
        "draft": {"uri": "file:///models/llama-draft/v2"}}},
        engine={"speculative": {"method": "Draft"}})
    tx = begin(new, None, Observed(pods=tuple(pods)))
    assert (tx.previous, tx.target) == (old.weights, new.weights)
    assert (tx.previous_draft, tx.target_draft) == ("file:///models/llama-draft/v1",
                                                    "file:///models/llama-draft/v2")
    # A later refit starts from what the last one finished on, draft included.
    tx.phase = Phase.SUCCEEDED
    third = parse(model={"name": "llama", "weights": {
        "uri": "file:///models/llama-v3", "version": "v3",
        "draft": {"uri": "file:///models/llama-draft/v3"}}},
        engine={"speculative": {"method": "Draft"}})
    after = begin(third, tx, Observed(pods=tuple(pods)))
    assert (after.previous, after.previous_draft) == (new.weights, "file:///models/llama-draft/v2")
    # Pools without a draft name none on either side.
    plain = begin(parse(model={"name": "llama", "weights": {"uri": "file:///models/v2",
                                                            "version": "v2"}}),
                  None, Observed())
    assert (plain.target_draft, plain.previous_draft) == (None, None)
