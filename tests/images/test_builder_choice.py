"""`make images` picks its container builder by what works (scripts/builder.sh).

A fresh machine of this project's kind ships a docker client with no daemon; choosing by
which command exists made `make test` stop at "Cannot connect to the Docker daemon". These
tests put stand-ins for docker, podman and apt-get on a PATH that holds nothing else of the
kind, and run the real script and the real Makefile against them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "builder.sh"
BASH = shutil.which("bash") or "/bin/bash"
MAKE = shutil.which("make")


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A PATH folder with the few real tools the script needs and no builder at all."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("timeout", "id", "cat", "sed", "sh", "env", "dirname", "chmod", "bash"):
        real = shutil.which(tool)
        assert real, tool
        (folder / tool).symlink_to(real)
    return folder


def _run(bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env={"PATH": str(bin_dir), "HOME": "/nonexistent", **env})


def test_a_docker_client_without_a_daemon_is_not_chosen(bin_dir: Path) -> None:
    _stub(bin_dir, "docker", 'if [ "$1" = info ]; then echo "Cannot connect to the Docker '
                             'daemon" >&2; exit 1; fi')
    assert _run(bin_dir, "choose").stdout.strip() == "podman"


def test_a_docker_whose_daemon_answers_is_chosen_over_podman(bin_dir: Path) -> None:
    _stub(bin_dir, "docker", 'if [ "$1" = info ]; then echo "Server Version: 28"; fi')
    _stub(bin_dir, "podman", "exit 0")
    assert _run(bin_dir, "choose").stdout.strip() == "docker"


def test_a_docker_daemon_that_hangs_counts_as_absent(bin_dir: Path) -> None:
    _stub(bin_dir, "docker", "sleep 30")
    done = _run(bin_dir, "choose", DOCKER_INFO_TIMEOUT="1")
    assert done.stdout.strip() == "podman"


@pytest.mark.skipif(os.geteuid() != 0, reason="the install path runs as root only")
def test_ensure_installs_podman_and_mmdebstrap_when_absent(bin_dir: Path, tmp_path: Path) -> None:
    calls = tmp_path / "apt-calls"
    # apt-get's stand-in records its arguments and "installs" the named tools.
    _stub(bin_dir, "apt-get", f'echo "$@" >> {calls}\n'
                              'if [ "$1" = install ]; then for t in "$@"; do case $t in -*|install)'
                              ' ;; *) printf "#!/bin/sh\\n" > "$(dirname "$0")/$t"; chmod +x '
                              '"$(dirname "$0")/$t";; esac; done; fi')
    done = _run(bin_dir, "ensure", "podman", "local-base")
    assert done.returncode == 0, done.stderr
    assert "install -y -q podman mmdebstrap" in calls.read_text()
    assert (bin_dir / "podman").exists() and (bin_dir / "mmdebstrap").exists()
    # Present tools are not installed again.
    calls.unlink()
    assert _run(bin_dir, "ensure", "podman", "local-base").returncode == 0
    assert not calls.exists()


def test_where_nothing_can_build_one_message_names_both_and_the_fix(bin_dir: Path) -> None:
    _stub(bin_dir, "docker", "exit 1")
    done = _run(bin_dir, "ensure", "podman")  # no apt-get here
    assert done.returncode == 1
    message = done.stderr
    assert "docker info" in message and "podman: not installed" in message
    assert "apt-get install podman mmdebstrap" in message and "CONTAINER=" in message


def test_a_forced_docker_without_a_daemon_is_refused_with_the_fix(bin_dir: Path) -> None:
    _stub(bin_dir, "docker", "exit 1")
    done = _run(bin_dir, "ensure", "docker")
    assert done.returncode == 1 and "CONTAINER=docker" in done.stderr
    assert "apt-get install podman" in done.stderr


def test_an_unknown_builder_is_named(bin_dir: Path) -> None:
    done = _run(bin_dir, "ensure", "buildah")
    assert done.returncode == 1 and "CONTAINER=buildah" in done.stderr


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
@pytest.mark.parametrize(("daemon", "builder"), [(False, "podman"), (True, "docker")])
def test_make_images_builds_with_the_builder_that_works(bin_dir: Path, daemon: bool,
                                                        builder: str) -> None:
    _stub(bin_dir, "docker", "exit 0" if daemon else "exit 1")
    _stub(bin_dir, "podman", "exit 0")
    done = subprocess.run([MAKE, "-n", "images"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PATH": str(bin_dir), "HOME": "/nonexistent"})
    assert done.returncode == 0, done.stderr
    builds = [line for line in done.stdout.splitlines() if " build " in line]
    assert len(builds) == 2 and all(line.startswith(f"{builder} build") for line in builds)
