"""The Helm chart, rendered by the real helm binary and checked offline.

`helm lint --strict` and `helm template` run for real (helm v4 from tests/kcluster/helm.py);
every rendered built-in object is validated strictly against the Kubernetes 1.32 OpenAPI
schemas by kubernetes-validate, the CRDs the chart ships must equal crds/ (their single source),
values.schema.json must refuse bad values with a message naming the key, and the RBAC must be
exactly the operator's needs, never a wildcard.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kcluster.helm import helm_binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
CRDS = ROOT / "crds"
RELEASE = "tandem"
NAMESPACE = "tandem-system"
KUBE_VERSION = "1.32"
NAMESPACED = ["--set", "watchNamespaces={team-a,team-b}"]

COMMON_LABELS = {
    "app.kubernetes.io/name": "tandem",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/component": "operator",
    "app.kubernetes.io/managed-by": "Helm",
    "app.kubernetes.io/part-of": "tandem",
    "app.kubernetes.io/version": "0.1.0",
    "helm.sh/chart": "tandem-0.1.0",
}


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )


def render(helm: Path, *values: str, crds: bool = False) -> list[dict[str, Any]]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values]
    done = run_helm(helm, *args, *(["--include-crds"] if crds else []))
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def cluster_wide(helm: Path) -> list[dict[str, Any]]:
    return render(helm)


@pytest.fixture(scope="module")
def namespaced(helm: Path) -> list[dict[str, Any]]:
    return render(helm, *NAMESPACED)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [obj] = by_kind(objects, kind)
    return obj


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


# --- lint and render -----------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_lint_strict(helm: Path, values: list[str]):
    done = run_helm(helm, "lint", "--strict", str(CHART), *values)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_kube_version_is_checked(helm: Path):
    # The CRD's CEL rules need 1.28. Without a cluster, helm template checks its own default
    # version (1.35 for helm 4.1), which the fixtures above rendered with; --kube-version
    # stands for the cluster's.
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.28.0-0"
    assert run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", "1.28.0"
                    ).returncode == 0
    done = run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", "1.27.9")
    assert done.returncode != 0
    assert "chart requires kubeVersion: >=1.28.0-0 which is incompatible with Kubernetes " \
        "v1.27.9" in done.stderr, done.stderr


def test_cluster_wide_objects(cluster_wide: list[dict[str, Any]]):
    kinds = sorted(obj["kind"] for obj in cluster_wide)
    assert kinds == [
        "ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
        "ServiceAccount",
    ]
    assert "--all-namespaces" in operator_container(cluster_wide)["args"]


def test_namespaced_objects(namespaced: list[dict[str, Any]]):
    kinds = sorted(obj["kind"] for obj in namespaced)
    assert kinds == [
        "ClusterRole", "ClusterRoleBinding", "Deployment", "KopfPeering", "KopfPeering",
        "Role", "Role", "RoleBinding", "RoleBinding", "Service", "ServiceAccount",
    ]
    for kind in ("Role", "RoleBinding", "KopfPeering"):
        assert {obj["metadata"]["namespace"] for obj in by_kind(namespaced, kind)} == {
            "team-a", "team-b",
        }
    args = operator_container(namespaced)["args"]
    assert "--all-namespaces" not in args
    assert args[:4] == ["--namespace", "team-a", "--namespace", "team-b"]


@pytest.mark.parametrize(
    ("values", "expected"), [([], 8), (NAMESPACED, 12)], ids=["cluster-wide", "namespaced"]
)
def test_builtin_objects_validate_strictly(helm: Path, values: list[str], expected: int):
    checked = 0
    for obj in render(helm, *values, crds=True):
        if obj["apiVersion"].startswith("kopf.dev/"):
            continue  # custom resources: checked against their CRD below
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")
        checked += 1
    assert checked == expected  # 3 CRDs and every templated built-in object


def test_strict_validation_catches_a_typo(cluster_wide: list[dict[str, Any]]):
    # Guards the test above: strict mode must reject a field Kubernetes does not know.
    deployment = one(cluster_wide, "Deployment")
    deployment = yaml.safe_load(yaml.safe_dump(deployment))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_peering_objects_match_their_crds(
    cluster_wide: list[dict[str, Any]], namespaced: list[dict[str, Any]]
):
    crds = {
        (crd["spec"]["group"], crd["spec"]["names"]["kind"]): crd
        for crd in yaml.safe_load_all((CRDS / "kopfpeerings.kopf.dev.yaml").read_text())
    }
    peerings = by_kind(cluster_wide, "ClusterKopfPeering") + by_kind(namespaced, "KopfPeering")
    assert len(peerings) == 3
    for obj in peerings:
        group, version = obj["apiVersion"].split("/")
        crd = crds[(group, obj["kind"])]
        assert [v["name"] for v in crd["spec"]["versions"]] == [version]
        assert ("namespace" in obj["metadata"]) == (crd["spec"]["scope"] == "Namespaced")
        assert set(obj) == {"apiVersion", "kind", "metadata"}


# --- CRDs: one source ----------------------------------------------------------------------------


def test_chart_crds_are_the_crds_folder():
    shipped = CHART / "crds"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in CRDS.iterdir())
    for path in CRDS.iterdir():
        assert (shipped / path.name).read_bytes() == path.read_bytes(), f"{path.name} drifted"


def test_rendered_crds_equal_the_crds_folder(helm: Path):
    rendered = [obj for obj in render(helm, crds=True) if obj["kind"] == "CustomResourceDefinition"]
    source = [
        doc for path in sorted(CRDS.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
    ]
    key = lambda crd: crd["metadata"]["name"]  # noqa: E731
    assert sorted(rendered, key=key) == sorted(source, key=key)


def test_packaged_chart_carries_the_crds(helm: Path, tmp_path: Path):
    # charts/tandem/crds links to crds/; the package must hold the files, not the link.
    done = run_helm(helm, "package", str(CHART), "--destination", str(tmp_path))
    assert done.returncode == 0, done.stderr
    [package] = tmp_path.glob("tandem-*.tgz")
    with tarfile.open(package) as tar:
        for path in CRDS.glob("*.yaml"):
            member = tar.getmember(f"tandem/crds/{path.name}")
            assert member.isfile()
            assert tar.extractfile(member).read() == path.read_bytes()


# --- values.schema.json --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["--set", "replicaCount=-1"], ["/replicaCount", "minimum"]),
        (["--set", "replicaCount=two"], ["/replicaCount", "integer"]),
        (["--set", "watchNamespaces={Team_A}"], ["/watchNamespaces/0", "pattern"]),
        (["--set", "metrics.port=70000"], ["/metrics/port", "maximum"]),
        (["--set", "image.pullPolicy=Sometimes"], ["/image/pullPolicy"]),
        (["--set", "registry=ghcr.io/me/"], ["/registry", "pattern"]),
        (["--set", "resources.limits.cpu=lots"], ["/resources/limits/cpu", "pattern"]),
        (["--set", "replicas=3"], ["replicas"]),  # a typo of replicaCount is not ignored
    ],
)
def test_values_schema_rejects(helm: Path, values: list[str], expected: list[str]):
    done = run_helm(helm, "template", RELEASE, str(CHART), *values)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr


def test_values_are_documented_in_place():
    # Each top-level key, with the comment lines right above it and its nested lines, is a
    # block; every block must explain itself.
    blocks: list[list[str]] = [[]]
    for row in (CHART / "values.yaml").read_text().splitlines():
        if re.match(r"[A-Za-z]", row) and blocks[-1] and not blocks[-1][-1].startswith("#"):
            blocks.append([])
        blocks[-1].append(row)
    keys = set(yaml.safe_load((CHART / "values.yaml").read_text()))
    documented = {
        re.match(r"(\w+):", row).group(1)
        for block in blocks
        if any(row.lstrip().startswith("#") for row in block)
        for row in block
        if re.match(r"\w+:", row)
    }
    assert keys - documented == set()


# --- labels --------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_labels_on_everything(helm: Path, values: list[str]):
    for obj in render(helm, *values, crds=True):
        labels = obj["metadata"].get("labels", {})
        if obj["kind"] == "CustomResourceDefinition":
            # crds/ is not templated: no release labels, but the app's own.
            assert labels["app.kubernetes.io/name"] == "tandem", obj["metadata"]["name"]
            assert labels["app.kubernetes.io/part-of"] == "tandem"
            continue
        assert labels == {**labels, **COMMON_LABELS}, (obj["kind"], labels)


def test_selectors_reach_the_operator_pods(cluster_wide: list[dict[str, Any]]):
    deployment = one(cluster_wide, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    service = one(cluster_wide, "Service")
    for wanted in (selector, service["spec"]["selector"]):
        assert wanted.items() <= pod_labels.items()
    # Pool pods the operator creates are prefill/decode/router: never selected by the chart.
    assert selector["app.kubernetes.io/component"] == "operator"
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"},
    ]


# --- RBAC ----------------------------------------------------------------------------------------

NAMESPACED_RULES = {
    ("tandem.dev", "inferencepools"): {"get", "list", "watch", "patch", "update"},
    ("tandem.dev", "inferencepools/status"): {"get", "patch", "update"},
    ("tandem.dev", "inferencepools/finalizers"): {"update"},
    ("", "pods"): {"create", "delete", "get", "list", "watch", "patch"},
    ("", "pods/status"): {"get"},
    ("", "services"): {"create", "get", "list", "watch", "patch", "update", "delete"},
    # the pools' admin-token Secrets: never updated or deleted (garbage collection does that)
    ("", "secrets"): {"create", "get", "list", "watch", "patch"},
    ("", "serviceaccounts"): {"create", "get", "list", "watch", "patch", "update", "delete"},
    ("policy", "poddisruptionbudgets"): {"create", "get", "list", "watch", "patch", "update",
                                         "delete"},
    # the pools' pod-template revisions (rollout.py)
    ("apps", "controllerrevisions"): {"create", "get", "list", "watch", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"create", "get", "list", "watch", "patch", "update",
                                             "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"create", "get", "list", "watch", "patch",
                                                    "update", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"create", "get", "list", "watch", "patch",
                                               "update", "delete"},
    ("monitoring.coreos.com", "podmonitors"): {"create", "get", "patch", "delete"},
    ("", "events"): {"create", "patch"},
}
SCANNING_RULES = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}


def grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames etc.
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize("values", [[], NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_rbac_has_no_wildcards(helm: Path, values: list[str]):
    for obj in render(helm, *values):
        for rule in obj.get("rules", []):
            for field in ("apiGroups", "resources", "verbs"):
                assert not any("*" in item for item in rule[field]), (obj["kind"], rule)


def test_cluster_wide_rbac_is_exactly_what_the_operator_needs(cluster_wide: list[dict[str, Any]]):
    assert grants(one(cluster_wide, "ClusterRole")) == {
        **NAMESPACED_RULES,
        **SCANNING_RULES,
        ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},
    }


def test_namespaced_rbac_is_exactly_what_the_operator_needs(namespaced: list[dict[str, Any]]):
    assert grants(one(namespaced, "ClusterRole")) == {
        **SCANNING_RULES,
        ("", "namespaces"): {"list", "watch"},
    }
    for role in by_kind(namespaced, "Role"):
        assert grants(role) == {
            **NAMESPACED_RULES,
            ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"},
        }


@pytest.mark.parametrize("values", [[], NAMESPACED], ids=["cluster-wide", "namespaced"])
def test_bindings_tie_the_operator_account_to_its_roles(helm: Path, values: list[str]):
    objects = render(helm, *values)
    account = one(objects, "ServiceAccount")
    pod_spec = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == account["metadata"]["name"]
    roles = {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"])
             for r in by_kind(objects, "ClusterRole") + by_kind(objects, "Role")}
    bindings = by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding")
    assert len(bindings) == len(roles)
    for binding in bindings:
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], namespace, ref["name"]) in roles
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"],
             "namespace": NAMESPACE},
        ]


# --- the operator Deployment ---------------------------------------------------------------------


def test_operator_deployment(cluster_wide: list[dict[str, Any]]):
    deployment = one(cluster_wide, "Deployment")
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = operator_container(cluster_wide)
    assert container["command"] == ["tandem-operator"]
    peering = one(cluster_wide, "ClusterKopfPeering")["metadata"]["name"]
    assert container["args"] == [
        "--all-namespaces", "--peering", peering, "--metrics-port", "9090",
        "--liveness-port", "8081", "--skip-weights-check",
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert set(container["resources"]) == {"requests", "limits"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 9090, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_images_follow_the_registry_and_the_app_version(helm: Path,
                                                       cluster_wide: list[dict[str, Any]]):
    """Both images are <registry>/tandem/{operator,engine}:<appVersion>, the names
    `make images` builds; the engine's reaches the operator as TANDEM_ENGINE_IMAGE."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

    def images(objects: list[dict[str, Any]]) -> tuple[str, str]:
        container = operator_container(objects)
        env = {e["name"]: e.get("value") for e in container["env"]}
        return container["image"], env["TANDEM_ENGINE_IMAGE"]

    assert images(cluster_wide) == (f"localhost/tandem/operator:{version}",
                                    f"localhost/tandem/engine:{version}")
    moved = render(helm, "--set", "registry=ghcr.io/me", "--set", "engineImage.tag=0.2.0")
    assert images(moved) == (f"ghcr.io/me/tandem/operator:{version}",
                             "ghcr.io/me/tandem/engine:0.2.0")


def test_ports_and_peering_follow_values(helm: Path):
    objects = render(
        helm, "--set", "metrics.port=9100", "--set", "livenessPort=8082",
        "--set", "peering.name=gpu-fleet", "--set", "replicaCount=3",
    )
    container = operator_container(objects)
    assert container["args"] == [
        "--all-namespaces", "--peering", "gpu-fleet", "--metrics-port", "9100",
        "--liveness-port", "8082", "--skip-weights-check",
    ]
    assert {p["containerPort"] for p in container["ports"]} == {9100, 8082}
    assert one(objects, "ClusterKopfPeering")["metadata"]["name"] == "gpu-fleet"
    assert one(objects, "Service")["spec"]["ports"][0]["port"] == 9100
    assert one(objects, "Deployment")["spec"]["replicas"] == 3


# --- the weights check ---------------------------------------------------------------------------

MODELS_VOLUME = {"name": "models", "persistentVolumeClaim": {"claimName": "models",
                                                             "readOnly": True}}
WEIGHTS_CHECK = {"weightsCheck": {"enabled": True, "volumes": [MODELS_VOLUME],
                                  "volumeMounts": [{"name": "models", "mountPath": "/models"}]}}


def values_file(tmp_path: Path, values: dict[str, Any]) -> list[str]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["--values", str(path)]


def test_weights_check_is_skipped_by_default(cluster_wide: list[dict[str, Any]]):
    # The operator pod cannot see model files it does not mount: without the volume it would
    # find no config.json and start no pool.
    container = operator_container(cluster_wide)
    assert "--skip-weights-check" in container["args"]
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    pod = one(cluster_wide, "Deployment")["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]


def test_weights_check_mounts_the_model_volume_read_only(helm: Path, tmp_path: Path):
    objects = render(helm, *values_file(tmp_path, WEIGHTS_CHECK))
    container = operator_container(objects)
    assert "--skip-weights-check" not in container["args"]
    # The engines' path (file:///models/... -> /models/...), never writable by the operator.
    assert container["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "models", "mountPath": "/models", "readOnly": True},
    ]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["volumes"][1:] == [MODELS_VOLUME]
    for obj in objects:
        if not obj["apiVersion"].startswith("kopf.dev/"):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    done = run_helm(helm, "lint", "--strict", str(CHART), *values_file(tmp_path, WEIGHTS_CHECK))
    assert done.returncode == 0, done.stdout + done.stderr


def test_weights_check_volumes_are_left_out_while_disabled(helm: Path, tmp_path: Path):
    values = {"weightsCheck": {**WEIGHTS_CHECK["weightsCheck"], "enabled": False}}
    container = operator_container(render(helm, *values_file(tmp_path, values)))
    assert "--skip-weights-check" in container["args"]
    assert [m["name"] for m in container["volumeMounts"]] == ["tmp"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"volumeMounts": []}, ["/weightsCheck/volumeMounts", "minItems"]),
        ({"volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": False}]},
         ["/weightsCheck/volumeMounts/0/readOnly"]),
        ({"volumeMounts": [{"name": "models"}]}, ["/weightsCheck/volumeMounts/0", "mountPath"]),
        ({"volumeMounts": [{"name": "models", "mountPath": "models"}]},
         ["/weightsCheck/volumeMounts/0/mountPath", "pattern"]),
        ({"volumes": [{"persistentVolumeClaim": {"claimName": "models"}}]},
         ["/weightsCheck/volumes/0", "name"]),
        ({"enable": True}, ["enable"]),  # a typo of enabled is not ignored
    ],
)
def test_weights_check_schema_rejects(helm: Path, tmp_path: Path, change: dict[str, Any],
                                      expected: list[str]):
    values = {"weightsCheck": {**WEIGHTS_CHECK["weightsCheck"], **change}}
    done = run_helm(helm, "template", RELEASE, str(CHART), *values_file(tmp_path, values))
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"volumeMounts": [{"name": "model", "mountPath": "/models"}]},
         'weightsCheck.volumeMounts: "model" names no volume in weightsCheck.volumes [models]'),
        ({"volumes": [{**MODELS_VOLUME, "name": "tmp"}],
          "volumeMounts": [{"name": "tmp", "mountPath": "/models"}]},
         'weightsCheck.volumes: the name "tmp" is taken'),
    ],
    ids=["unknown-volume", "tmp-clash"],
)
def test_weights_check_mounts_must_name_their_volumes(helm: Path, tmp_path: Path,
                                                      change: dict[str, Any], expected: str):
    values = {"weightsCheck": {**WEIGHTS_CHECK["weightsCheck"], **change}}
    done = run_helm(helm, "template", RELEASE, str(CHART), *values_file(tmp_path, values))
    assert done.returncode != 0
    assert expected in done.stderr, done.stderr
