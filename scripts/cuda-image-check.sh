#!/usr/bin/env bash
# Check a CUDA engine image as far as a machine without a GPU can: run its Python (chrooted
# into the image's filesystem, as the test kubelet runs images) and ask torch what it was
# built for and what it sees. Passes when torch is a CUDA build and reports no device (none
# is here); prints one JSON line either way.
#   scripts/cuda-image-check.sh localhost/tandem/engine:0.1.0-cu13
set -euo pipefail
image=${1:?usage: $0 IMAGE}
root=$(podman image mount "$image")
trap 'podman image unmount "$image" >/dev/null' EXIT
chroot "$root" /opt/tandem/bin/python -c '
import json, sys, torch
found = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
         "cuda_available": torch.cuda.is_available(), "devices": torch.cuda.device_count()}
print(json.dumps(found))
sys.exit(0 if found["cuda_build"] and not found["cuda_available"] else 1)
'
