#!/usr/bin/env bash
# Which container builder `make images` uses, chosen by what works, not by which command
# exists: many machines ship a docker client with no daemon behind it.
#
#   scripts/builder.sh choose    print `docker` when its daemon answers (`docker info`),
#                                else `podman` (present, or to be installed by `ensure`)
#   scripts/builder.sh ensure B  make builder B usable: for podman, install it (and
#                                mmdebstrap, for the local base image) from Debian when absent;
#                                where that cannot be done, one message naming both builders
#                                and the fix, exit 1
#
# CONTAINER=docker|podman (make's variable) skips the choice; `ensure` still checks it.
set -euo pipefail

# A daemon that does not answer within this many seconds counts as absent.
DOCKER_INFO_TIMEOUT="${DOCKER_INFO_TIMEOUT:-10}"

docker_works() {
    command -v docker >/dev/null 2>&1 &&
        timeout "$DOCKER_INFO_TIMEOUT" docker info >/dev/null 2>&1
}

no_builder() {
    local why="$1"
    cat >&2 <<EOF
make images: no container builder can build here ($why).
  docker: $(if command -v docker >/dev/null 2>&1; then echo "the client is installed, but \`docker info\` gets no answer from a daemon"; else echo "not installed"; fi)
  podman: $(if command -v podman >/dev/null 2>&1; then echo "installed"; else echo "not installed"; fi)
Fix: install podman (Debian/Ubuntu, as root: apt-get install podman mmdebstrap), or start the
Docker daemon, then run make again; CONTAINER=docker|podman forces one.
EOF
    exit 1
}

choose() {
    if docker_works; then
        echo docker
    else
        echo podman
    fi
}

# Debian packages $@ are installed when missing, if this machine can (root and apt-get).
install_missing() {
    local need=()
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
    done
    [[ ${#need[@]} -eq 0 ]] && return 0
    if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        no_builder "${need[*]} missing and this is not root on a Debian/Ubuntu machine"
    fi
    echo "make images: installing ${need[*]} from Debian" >&2
    apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >&2 ||
        no_builder "apt-get install ${need[*]} failed"
}

ensure() {
    local builder="$1" local_base="${2:-}"
    case "$builder" in
        docker)
            docker_works || no_builder "CONTAINER=docker, but \`docker info\` gets no answer"
            ;;
        podman)
            if [[ -n "$local_base" ]]; then
                install_missing podman mmdebstrap
            else
                install_missing podman
            fi
            ;;
        *)
            echo "make images: CONTAINER=$builder is not a builder this project knows;" \
                 "use CONTAINER=docker or CONTAINER=podman" >&2
            exit 1
            ;;
    esac
}

case "${1:-}" in
    choose) choose ;;
    ensure) shift; ensure "$@" ;;
    *) echo "usage: $0 choose | ensure docker|podman [local-base]" >&2; exit 2 ;;
esac
