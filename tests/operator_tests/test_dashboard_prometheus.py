"""The Grafana dashboard against a real Prometheus scraping a real stack.

`tandem serve --demo --prefill 1 --decode 1` (engines on their read-only metrics ports, the
router on its API port) and `tandem-operator` reconciling a pool on the test API server are
scraped every second by Debian's Prometheus (2.42, `make test-tools` installs it). After a
short load (a repeated prompt for prefix-cache hits) and a `tandem refit` of the stack, every
query of every panel in charts/tandem/dashboards/tandem.json, its Grafana variables replaced
by what "All" means, must answer with at least one series and a number that is not NaN; and
every metric name a query or a variable uses must be one Prometheus has scraped, so a renamed
metric cannot hide behind an `or vector(0)` or an empty panel.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from kcluster.cluster import TestCluster
from kcluster.fixtures import test_cluster  # noqa: F401
from test_operator_cluster import (  # noqa: F401  (fixtures)
    Operator,
    cluster,
    free_port,
    operators,
    pool_manifest,
    wait_for,
    wait_serving,
    weights,
)
from test_serve import spawn_serve, wait_for_url

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "tandem" / "dashboards" / "tandem.json"
MODEL = "demo"
# What Grafana puts in place of its variables: "All" is the regex .*, which also matches a
# series without the label (the local stack's engines have no `pool`).
VARIABLES = {"$__rate_interval": "30s", "$__range": "5m", "$model_name": ".*", "$pool": ".*"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "offset", "bool", "inf", "nan"}
REPEATED = ("The lighthouse keeper climbed the spiral stairs every evening to light the lamp "
            "and watch the ships pass far out on the grey water")


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, variables replaced."""
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: a variable the test does not know"
            out.append((panel["title"], expr))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label names and
    the insides of matchers, ranges and groupings left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end():].lstrip().startswith("(") or match.group() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def variable_metrics(board: dict[str, Any]) -> set[str]:
    """Metric names the dashboard's query variables read (label_values(metric, label))."""
    names = set()
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) \
                else variable["query"]
            names |= set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", query))
    return names


def test_metric_names_of_an_expression() -> None:
    # Guards the name check below: names with colons, histograms, and nothing else.
    assert metric_names('histogram_quantile(0.9, sum by (le, role) (rate(vllm:ttft_bucket'
                        '{model_name=~".*", pool=~"a|b"}[30s])))') == {"vllm:ttft_bucket"}
    assert metric_names('sum(rate(a_total[5m])) / on (x) group_left (y) b or vector(0)'
                        ) == {"a_total", "b"}
    assert metric_names('count by (version, epoch) (w_info{kind="ready"}) > bool 0') \
        == {"w_info"}
    board = json.loads(DASHBOARD.read_text())
    assert variable_metrics(board) >= {"vllm:num_requests_running"}
    assert all(metric_names(expr) for _, expr in panel_queries(board))


# ---- the processes ------------------------------------------------------------------------------


class Prometheus:
    """A real Prometheus on 127.0.0.1:port with a 1 s scrape and rule evaluation interval,
    static targets (each job's series get `labels`, as a PodMonitor's relabelling gives a
    pool's pods theirs) and rule files."""

    def __init__(self, tmp: Path, targets: dict[str, list[str]],
                 labels: dict[str, str] | None = None, rules: tuple[Path, ...] = ()) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("no prometheus binary: `make test-tools` (apt-get install prometheus)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        static = {"labels": labels} if labels else {}
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                             "evaluation_interval": "1s"},
                  "rule_files": [str(r) for r in rules],
                  "scrape_configs": [
                      {"job_name": job, "honor_labels": True,
                       "static_configs": [{"targets": hosts, **static}]}
                      for job, hosts in targets.items()]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        self.process = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.expected = sum(len(hosts) for hosts in targets.values())
        self.client = httpx.Client(base_url=f"{self.url}/api/v1", timeout=10)

    def api(self, path: str, **params: str) -> Any:
        rsp = self.client.get(path, params=params)
        assert rsp.status_code == 200, rsp.text
        return rsp.json()["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def scrapes(self) -> float:
        """Scrapes so far of the target scraped least."""
        counts = self.query("min(count_over_time(up[1h]))")
        return float(counts[0]["value"][1]) if counts else 0.0

    def wait_all_up(self) -> None:
        def ready() -> bool:  # its API answers 503 until the TSDB has started
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(f"Prometheus ready (log: {self.log})", ready, timeout=30)

        def up() -> bool:
            try:
                found = self.query("up == 1")
            except httpx.HTTPError:
                return False
            return len(found) == self.expected
        wait_for(f"Prometheus scraping {self.expected} targets (log: {self.log})", up,
                 timeout=20)

    def wait_scrapes(self, more: int) -> None:
        target = self.scrapes() + more
        wait_for(f"{more} more scrapes", lambda: self.scrapes() >= target, timeout=20)

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """`tandem serve --demo --prefill 1 --decode 1`, started (not yet ready)."""
    port, folder = free_port(), tmp_path / "stack"
    folder.mkdir()
    # Refits may load from the demo folder only, unless a weights root adds the stack's.
    proc = spawn_serve(folder, "--demo", "--demo-dir", str(folder / "demo"), "--prefill", "1",
                       "--decode", "1", "--port", str(port), "--served-model-name", MODEL,
                       "--weights-root", str(folder))
    try:
        yield proc, port, folder
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:  # the engines stop within a second; their processes may linger for seconds
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()  # the children get SIGTERM from the kernel (die_with_parent)
                proc.wait()


def wait_serving_stack(proc: subprocess.Popen, port: int, folder: Path) -> dict[str, Any]:
    wait_for_url(proc)
    return json.loads((folder / f"tandem-{port}" / "stack.json").read_text())


def host_port(url: str) -> str:
    return httpx.URL(url).netloc.decode()


def send_load(port: int) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    for prompt in (REPEATED, REPEATED, REPEATED, "Seven bridges", "A letter arrived"):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
        assert done.choices[0].text is not None
    stream = client.completions.create(model=MODEL, prompt=REPEATED, max_tokens=8, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) is not None


def refit(port: int, folder: Path) -> None:
    """Refit the stack to "v2": a copy of its checkpoint beside it (in a weights root), as
    the metrics care about versions and transitions, not about the weights."""
    v2 = shutil.copytree(folder / "demo", folder / "v2")
    done = subprocess.run(
        [sys.executable, "-m", "tandem_engine.cli.main", "refit", "--port", str(port),
         "--uri", v2.resolve().as_uri(), "--version", "v2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(folder)})
    assert done.returncode == 0, done.stdout + done.stderr


# ---- the test -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_dashboard_query_answers_from_a_real_prometheus(
        cluster: TestCluster, operators: Callable[..., Operator],  # noqa: F811
        weights: Path, serve: tuple[subprocess.Popen, int, Path],  # noqa: F811
        tmp_path: Path) -> None:
    board = json.loads(DASHBOARD.read_text())
    proc, port, folder = serve
    # The operator reconciles a pool (the test plays kubelet) while the engines load.
    operator_port = free_port()
    operators("--standalone", "--metrics-port", str(operator_port), "--liveness-port", "0")
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(weights))
    wait_serving(cluster, {"prefill": 1, "decode": 1, "router": 1})
    stack = wait_serving_stack(proc, port, folder)

    prometheus = Prometheus(tmp_path, {
        "engine": [host_port(e["metrics_url"]) for e in stack["engines"]],
        "router": [f"127.0.0.1:{port}"],
        "operator": [f"127.0.0.1:{operator_port}"],
    })
    try:
        prometheus.wait_all_up()
        prometheus.wait_scrapes(1)  # every counter has a sample from before the load
        send_load(port)
        refit(port, folder)
        prometheus.wait_scrapes(3)

        scraped = set(prometheus.api("label/__name__/values"))
        queries = panel_queries(board)
        used = variable_metrics(board).union(*(metric_names(e) for _, e in queries))
        assert used - scraped == set(), "names no exporter has: see docs/metrics.md"

        empty, nan = [], []
        for title, expr in queries:
            result = prometheus.query(expr)
            values = [float(r["value"][1]) for r in result]
            if not result:
                empty.append(f"{title}: {expr}")
            elif all(math.isnan(v) for v in values):
                nan.append(f"{title}: {expr}")
        assert empty == [], "queries without a series:\n" + "\n".join(empty)
        assert nan == [], "queries that are only NaN:\n" + "\n".join(nan)

        # The load and the refit show where they should.
        hits = prometheus.query('sum(vllm:prefix_cache_hits_total{model_name="demo"})')
        assert float(hits[0]["value"][1]) > 0
        versions = prometheus.query("count by (version) (tandem_weights_info)")
        assert {r["metric"]["version"] for r in versions} == {"v2"}
        refits = prometheus.query(
            'sum(increase(tandem_refits_total{outcome="succeeded"}[5m]))')
        assert float(refits[0]["value"][1]) > 0
    finally:
        prometheus.stop()
        print(f"---- prometheus (tail) ----\n{prometheus.log.read_text()[-3000:]}")
