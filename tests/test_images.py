"""The container images, checked statically (no registry here: the images cannot be built).

operator/Dockerfile must install the project with the `operator` extra and never torch, run as
the chart's uid with `tandem-operator` as its entrypoint; engine_image/Dockerfile must install
the pinned CPU torch before the `engine` extra and leave the command to the operator. The names
the Dockerfiles are built under (their documented `docker build -t`) must be the ones the chart
and the CRD default to, and every path they copy must reach the build context.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
OPERATOR_DOCKERFILE = ROOT / "operator" / "Dockerfile"
ENGINE_DOCKERFILE = ROOT / "engine_image" / "Dockerfile"
CHART = ROOT / "charts" / "tandem"
CRD = ROOT / "crds" / "inferencepools.tandem.dev.yaml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UID = "65532"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    text: str  # the rest, continuation lines joined, ARG defaults substituted


def parse(path: Path) -> list[Instruction]:
    """Dockerfile instructions; comment lines (also inside continuations) dropped."""
    out: list[Instruction] = []
    args: dict[str, str] = {}
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        pending = ""
        rest = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                      lambda m: args.get(m.group(1) or m.group(2), m.group(0)), rest.strip())
        if keyword.upper() == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        out.append(Instruction(keyword.upper(), rest))
    assert not pending, f"{path} ends inside a continuation line"
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    return instructions[starts[-1]:]


def pip_installs(instructions: list[Instruction]) -> list[list[str]]:
    """The arguments of every `pip install` in a RUN, in order."""
    found = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for command in re.split(r"&&|;", ins.text):
            words = shlex.split(command)
            for i, word in enumerate(words[:-1]):
                if Path(word).name in ("pip", "pip3") and words[i + 1] == "install":
                    found.append(words[i + 2:])
                    break
    return found


def installed_project_extras(installs: list[list[str]]) -> list[str]:
    """Extras of the project itself (`.[x,y]`) over every pip install."""
    extras = []
    for words in installs:
        for word in words:
            if match := re.fullmatch(r"\.\[([\w,-]+)\]", word):
                extras += match.group(1).split(",")
    return extras


def build_tag(path: Path) -> str:
    """The `-t` of the `docker build -f <this file>` line the header documents."""
    rel = path.relative_to(ROOT).as_posix()
    for line in path.read_text().splitlines():
        if "docker build" not in line:
            continue
        words = shlex.split(line.lstrip("# ").rstrip("\\"))
        if words[:2] == ["docker", "build"] and rel in words and "-t" in words:
            return words[words.index("-t") + 1]
    raise AssertionError(f"{rel} documents no `docker build -f {rel} -t NAME .` line")


def label(instructions: list[Instruction], key: str) -> str:
    for ins in final_stage(instructions):
        if ins.keyword == "LABEL":
            for pair in shlex.split(ins.text):
                name, _, value = pair.partition("=")
                if name == key:
                    return value
    raise AssertionError(f"no LABEL {key}")


def chart_app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


# --- the operator image --------------------------------------------------------------------------


def test_operator_image_installs_the_operator_extra_only():
    installs = pip_installs(parse(OPERATOR_DOCKERFILE))
    assert installed_project_extras(installs) == ["operator"]


def test_operator_image_never_installs_torch():
    instructions = parse(OPERATOR_DOCKERFILE)
    for words in pip_installs(instructions):
        assert not any(re.match(r"(torch|nixl)", w) for w in words), words
    for ins in instructions:
        assert "torch" not in ins.text.lower(), f"{ins.keyword} {ins.text}"
    # ...nor through the extra it installs.
    extra = PYPROJECT["project"]["optional-dependencies"]["operator"]
    names = {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in extra}
    assert not names & {"torch", "nixl-cu12", "numpy", "transformers"}, names


def test_operator_image_runs_tandem_operator_as_the_chart_uid():
    final = final_stage(parse(OPERATOR_DOCKERFILE))
    [entrypoint] = [ins for ins in final if ins.keyword == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint.text) == ["tandem-operator"]  # exec form
    assert "tandem-operator" in PYPROJECT["project"]["scripts"]
    users = [ins.text for ins in final if ins.keyword == "USER"]
    assert users[-1] == f"{UID}:{UID}"
    security = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == (UID, UID)


# --- the engine image ----------------------------------------------------------------------------


def test_engine_image_installs_cpu_torch_before_the_engine_extra():
    installs = pip_installs(parse(ENGINE_DOCKERFILE))
    torch_at = next(i for i, words in enumerate(installs) if any(
        w.startswith("torch==") for w in words))
    engine_at = next(i for i, words in enumerate(installs) if ".[engine]" in words)
    assert torch_at < engine_at
    torch = installs[torch_at]
    assert "torch==2.13.0" in torch
    assert torch[torch.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()  # the same pin as `make venv`
    assert installed_project_extras(installs) == ["engine"]


def test_engine_image_leaves_the_command_to_the_operator():
    instructions = parse(ENGINE_DOCKERFILE)
    assert not [ins for ins in instructions if ins.keyword in ("ENTRYPOINT", "CMD")]
    scripts = PYPROJECT["project"]["scripts"]
    manifests = (ROOT / "operator" / "tandem_operator" / "manifests.py").read_text()
    for command in ("tandem-engine", "tandem-router"):
        assert command in scripts
        assert f'["{command}"]' in manifests  # the pod command the operator sets
    assert [ins.text for ins in final_stage(instructions) if ins.keyword == "USER"][-1] == (
        f"{UID}:{UID}")


# --- names, versions and the build context -------------------------------------------------------


def test_image_names_match_the_chart_and_the_crd():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    operator = f"{values['image']['repository']}:{chart_app_version()}"
    assert build_tag(OPERATOR_DOCKERFILE) == operator
    crd = yaml.safe_load(CRD.read_text())
    [version] = crd["spec"]["versions"]
    engine = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert build_tag(ENGINE_DOCKERFILE) == engine["properties"]["image"]["default"]


@pytest.mark.parametrize("dockerfile", [OPERATOR_DOCKERFILE, ENGINE_DOCKERFILE],
                         ids=["operator", "engine"])
def test_image_version_is_the_project_version(dockerfile: Path):
    version = label(parse(dockerfile), "org.opencontainers.image.version")
    assert version == PYPROJECT["project"]["version"] == chart_app_version()
    assert build_tag(dockerfile).endswith(f":{version}")


def dockerignore() -> list[str]:
    rows = (ROOT / ".dockerignore").read_text().splitlines()
    return [r.strip() for r in rows if r.strip() and not r.lstrip().startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
               or fnmatch.fnmatch(Path(prefix).name, pattern.removeprefix("**/"))
               for prefix in prefixes for pattern in patterns if not pattern.startswith("!"))


@pytest.mark.parametrize("dockerfile", [OPERATOR_DOCKERFILE, ENGINE_DOCKERFILE],
                         ids=["operator", "engine"])
def test_copied_paths_reach_the_build_context(dockerfile: Path):
    patterns = dockerignore()
    copies = [ins for ins in parse(dockerfile) if ins.keyword == "COPY"
              and not ins.text.startswith("--from")]
    assert copies
    for ins in copies:
        *sources, _destination = shlex.split(ins.text)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not ignored(source.rstrip("/"), patterns), f"COPY {source}: .dockerignore'd"
    # Every package root pyproject.toml names is copied (setuptools looks in each).
    copied = {s.rstrip("/") for ins in copies for s in shlex.split(ins.text)[:-1]}
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]) <= copied
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied


def test_dockerignore_keeps_local_folders_out():
    patterns = dockerignore()
    for path in (".git", ".venv", "bench-models", ".demo-model", ".pytest_cache", ".hypothesis",
                 "engine_image/tandem_engine/__pycache__"):
        assert ignored(path, patterns), path
