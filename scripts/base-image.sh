#!/usr/bin/env bash
# Make the images' Python base where the usual one (python:3.11-slim-bookworm) cannot be
# pulled: a Debian 12 root filesystem with Python 3.11, built by mmdebstrap from Debian's
# package mirror and imported into podman's local storage.
#
#   scripts/base-image.sh [IMAGE]          (default localhost/tandem/base:bookworm)
#   make images PYTHON_IMAGE=IMAGE         builds on it
#
# Idempotent: an image already in local storage is kept (FORCE=1 rebuilds it).
set -euo pipefail
image="${1:-localhost/tandem/base:bookworm}"
suite="${SUITE:-bookworm}"
if [[ "${FORCE:-0}" != 1 ]] && podman image exists "$image"; then
    echo "base image $image: already built (FORCE=1 to rebuild)"
    exit 0
fi
for tool in podman mmdebstrap; do
    command -v "$tool" >/dev/null || {
        echo "base-image: $tool not found; install it (Debian: apt-get install podman mmdebstrap)" >&2
        exit 1
    }
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# apt variant: a working apt in the image for later RUN steps; python3-venv for the venvs;
# ca-certificates for pip; no docs or man pages (dpkg path excludes) to keep it small.
mmdebstrap --variant=apt --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --aptopt='Acquire::Retries "3"' \
    "$suite" "$tmp/rootfs.tar"
podman import \
    --change 'CMD ["python3"]' \
    --change 'ENV LANG=C.UTF-8' \
    "$tmp/rootfs.tar" "$image"
echo "base image $image: $(podman image inspect --format '{{.Size}}' "$image") bytes"
