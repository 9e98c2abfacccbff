"""helm 4 install/upgrade/rollback/uninstall against the test cluster's API server.

helm 4 applies manifests with server-side apply and keeps its releases in protobuf-encoded
Secrets, so these tests pin down both paths of the API server as much as the charts. Helm
installs a chart's crds/ on first install and, as documented, never upgrades or deletes them,
and checks a chart's kubeVersion against the server's /version.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from kcluster.apiserver import SERVER_VERSION
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from kcluster.helm import helm_binary

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:  # noqa: F811
    """The shared per-test cluster (kcluster.fixtures), under a shorter name."""
    return test_cluster
PROJECT_CHART = REPO / "charts" / "tandem"
SYSTEM = "tandem-system"  # the operator's namespace in the README's install


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


def helm_process(helm: Path, cluster: TestCluster, *args: str,
                 namespace: str = "default") -> subprocess.CompletedProcess[str]:
    homes = {f"HELM_{kind}_HOME": str(cluster.folder / f"helm-{kind.lower()}")
             for kind in ("CACHE", "CONFIG", "DATA")}
    return subprocess.run([str(helm), *args, "--namespace", namespace], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, **homes, "KUBECONFIG": str(cluster.kubeconfig)})


def run_helm(helm: Path, cluster: TestCluster, *args: str, namespace: str = "default") -> str:
    done = helm_process(helm, cluster, *args, namespace=namespace)
    assert done.returncode == 0, f"helm {' '.join(args)} failed:\n{done.stderr}"
    return done.stdout


def released(cluster: TestCluster, release: str, kinds: str, namespace: str = "default"
             ) -> set[str]:
    """kind/name of every object labelled as part of the release."""
    out = cluster.kubectl("get", kinds, "-n", namespace, "-l",
                          f"app.kubernetes.io/instance={release}", "-o", "json").stdout
    return {f"{item['kind']}/{item['metadata']['name']}" for item in json.loads(out)["items"]}


def write_chart(folder: Path) -> Path:
    chart = folder / "mini"
    (chart / "templates").mkdir(parents=True)
    (chart / "crds").mkdir()
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: mini\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\nreplicas: 1\n")
    (chart / "crds" / "gadgets.yaml").write_text("""
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: gadgets.mini.test}
spec:
  group: mini.test
  scope: Namespaced
  names: {plural: gadgets, singular: gadget, kind: Gadget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec: {type: object, properties: {size: {type: integer, default: 1}}}
""")
    labels = "labels: {app.kubernetes.io/instance: {{ .Release.Name }}}"
    (chart / "templates" / "objects.yaml").write_text(f"""
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{{{ .Release.Name }}}}-config
  {labels}
data: {{greeting: {{{{ .Values.greeting | quote }}}}}}
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{{{ .Release.Name }}}}
  {labels}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{{{ .Release.Name }}}}
  {labels}
rules: [{{apiGroups: [""], resources: [pods], verbs: [get, list, watch]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{{{ .Release.Name }}}}
  {labels}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: {{{{ .Release.Name }}}}}}
subjects: [{{kind: ServiceAccount, name: {{{{ .Release.Name }}}}}}]
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{{{ .Release.Name }}}}
  {labels}
spec:
  replicas: {{{{ .Values.replicas }}}}
  selector: {{matchLabels: {{app: mini}}}}
  template:
    metadata: {{labels: {{app: mini}}}}
    spec:
      serviceAccountName: {{{{ .Release.Name }}}}
      containers: [{{name: main, image: "busybox:1"}}]
---
apiVersion: mini.test/v1
kind: Gadget
metadata:
  name: {{{{ .Release.Name }}}}
  {labels}
spec: {{}}
""")
    return chart


def test_helm_lifecycle_of_a_small_chart(tmp_path: Path, cluster: TestCluster,
                                         helm: Path) -> None:
    chart = write_chart(tmp_path)
    kinds = "configmaps,serviceaccounts,roles,rolebindings,deployments,gadgets"
    run_helm(helm, cluster, "install", "m", str(chart))
    assert released(cluster, "m", kinds) == {
        "ConfigMap/m-config", "ServiceAccount/m", "Role/m", "RoleBinding/m", "Deployment/m",
        "Gadget/m"}
    gadget = cluster.kubectl("get", "gadget", "m", "-o", "jsonpath={.spec.size}").stdout
    assert gadget == "1"  # the CRD's default applied to a resource the same chart created

    def greeting() -> str:
        return cluster.kubectl("get", "cm", "m-config",
                                    "-o", "jsonpath={.data.greeting}").stdout

    run_helm(helm, cluster, "upgrade", "m", str(chart), "--set", "greeting=bye",
             "--set", "replicas=3")
    assert greeting() == "bye"
    assert cluster.kubectl("get", "deploy", "m", "-o",
                                "jsonpath={.spec.replicas}").stdout == "3"
    run_helm(helm, cluster, "rollback", "m", "1")
    assert greeting() == "hello"
    history = run_helm(helm, cluster, "history", "m", "-o", "json")
    assert [r["status"] for r in json.loads(history)] == ["superseded", "superseded", "deployed"]

    run_helm(helm, cluster, "uninstall", "m")
    assert released(cluster, "m", kinds) == set()
    assert run_helm(helm, cluster, "list", "-q").strip() == ""
    crds = cluster.kubectl("get", "crd", "-o", "name").stdout.split()
    assert crds == ["customresourcedefinition.apiextensions.k8s.io/gadgets.mini.test"]


@pytest.mark.skipif(not (PROJECT_CHART / "Chart.yaml").is_file(), reason="no charts/tandem")
def test_helm_installs_upgrades_and_removes_the_project_chart(cluster: TestCluster,
                                                              helm: Path) -> None:
    # As the README installs it: into its own namespace, serving pools in every namespace.
    kinds = ("deployments,serviceaccounts,services,roles,rolebindings,clusterroles,"
             "clusterrolebindings")
    run_helm(helm, cluster, "install", "t", str(PROJECT_CHART), "--create-namespace",
             namespace=SYSTEM)
    objects = released(cluster, "t", kinds, SYSTEM)
    for kind in ("Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        assert any(name.startswith(f"{kind}/") for name in objects), (kind, objects)
    assert cluster.kubectl("get", "ipool").stderr.strip() == (
        "No resources found in default namespace.")
    operator = next(name for name in objects if name.startswith("Deployment/")).split("/")[1]
    [binding] = json.loads(cluster.kubectl("get", "clusterrolebindings", "-l",
                                           "app.kubernetes.io/instance=t", "-o", "json"
                                           ).stdout)["items"]
    assert binding["subjects"][0]["namespace"] == SYSTEM

    def replicas() -> str:
        return cluster.kubectl("get", "deploy", operator, "-n", SYSTEM,
                               "-o", "jsonpath={.spec.replicas}").stdout

    default = replicas()
    run_helm(helm, cluster, "upgrade", "t", str(PROJECT_CHART), "--set", "replicaCount=3",
             namespace=SYSTEM)
    assert replicas() == "3"
    run_helm(helm, cluster, "rollback", "t", "1", namespace=SYSTEM)
    assert replicas() == default

    run_helm(helm, cluster, "uninstall", "t", namespace=SYSTEM)
    assert released(cluster, "t", kinds, SYSTEM) == set()
    crds = cluster.kubectl("get", "crd", "-o", "name").stdout
    assert "inferencepools.tandem.dev" in crds  # helm keeps CRDs it installed from crds/


def test_helm_checks_the_charts_kube_version_against_the_test_server(
        tmp_path: Path, cluster: TestCluster, helm: Path) -> None:
    """helm reads the server's /version (the test API server says v1.32.0), not its own
    default (1.35): a chart that needs 1.33 is refused, one that needs 1.32 installs, and so
    does the project chart, which needs 1.28 (its CRD's CEL rules)."""
    chart = write_chart(tmp_path)
    metadata = (chart / "Chart.yaml").read_text()
    (chart / "Chart.yaml").write_text(metadata + 'kubeVersion: ">=1.33.0-0"\n')
    done = helm_process(helm, cluster, "install", "m", str(chart))
    assert done.returncode != 0
    assert (f"chart requires kubeVersion: >=1.33.0-0 which is incompatible with Kubernetes "
            f"{SERVER_VERSION['gitVersion']}") in done.stderr, done.stderr
    assert run_helm(helm, cluster, "list", "-q").strip() == ""

    (chart / "Chart.yaml").write_text(metadata + 'kubeVersion: ">=1.32.0-0"\n')
    run_helm(helm, cluster, "install", "m", str(chart))
    needs = yaml.safe_load((PROJECT_CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert needs == ">=1.28.0-0"
    run_helm(helm, cluster, "install", "t", str(PROJECT_CHART), "--create-namespace",
             namespace=SYSTEM)
    assert run_helm(helm, cluster, "list", "-q", namespace=SYSTEM).split() == ["t"]
