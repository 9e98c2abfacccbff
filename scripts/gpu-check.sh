#!/usr/bin/env bash
# The GPU check, offline, on a machine with one NVIDIA GPU (make gpu-check), and the wheel
# bundle it installs from, made beforehand on a machine with network (make gpu-wheels).
#
#   scripts/gpu-check.sh wheels [PYVER] [CUDA]   # networked machine: fill gpu-wheels/
#   scripts/gpu-check.sh [gpu_check.py options]  # GPU machine: install, then run the check
#
# The GPU machine's own Python and CUDA torch are used as they are: the bundle never holds
# torch, and what the machine already has (numpy, transformers, httpx, ...) is not
# installed again. Only the distributions it lacks are unpacked, without dependencies and
# without an index, into .gpu-site/ (put first on PYTHONPATH). The checkout's own source is
# what runs (engine_image/ first on PYTHONPATH); the project's wheel in the bundle is
# installed only when the script runs outside a checkout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${GPU_WHEELS:-$ROOT/gpu-wheels}"
SITE="$ROOT/.gpu-site"
PY="${PYTHON:-python3}"
case " $* " in  # a dry run here: the checkout's .venv, unless PYTHON says otherwise
    *" --cpu-dry-run "*) [ -n "${PYTHON:-}" ] || [ ! -x "$ROOT/.venv/bin/python" ] ||
        PY="$ROOT/.venv/bin/python" ;;
esac

# What a GPU machine with the usual ML stack lacks for the engine (its server, the wire
# protocol, KV transfer). Not gguf (only GGUF checkpoints need it) nor kopf (the operator).
RUNTIME=(pyzmq msgspec fastapi starlette pydantic pydantic-core annotated-types annotated-doc
         typing-inspection typing-extensions opentelemetry-api importlib-metadata zipp
         uvicorn click h11 anyio idna)

wheels() {
    local pyver="${1:-3.12}" cuda="${2:-13}" pins=() name version
    # The versions this checkout's tests ran with, where its .venv has them.
    for name in "${RUNTIME[@]}"; do
        version="$("$ROOT/.venv/bin/python" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except Exception: pass" "$name" 2>/dev/null || true)"
        pins+=("$name${version:+==$version}")
    done
    # Only the NIXL build of the machine's CUDA major (the transfer backend picks it by
    # torch.version.cuda); each is ~60 MB, most of the bundle.
    pins+=("nixl-cu$cuda==1.5.1")
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$ROOT/.venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" "${pins[@]}"
    "$ROOT/.venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$ROOT"
    du -sh "$WHEELS"
    ls "$WHEELS"
}

install() {
    [ -d "$WHEELS" ] || { echo "gpu-check: no wheel bundle at $WHEELS: run" \
        "'make gpu-wheels PYVER=<this machine's python>' on a machine with network" \
        "and copy gpu-wheels/ here" >&2; exit 2; }
    "$PY" -c "import torch" 2>/dev/null || { echo "gpu-check: $PY has no torch; install" \
        "the machine's CUDA build of torch (Tandem needs torch>=2.5)" >&2; exit 2; }
    mkdir -p "$SITE"
    local missing=() wheel dist
    for wheel in "$WHEELS"/*.whl; do
        dist="$(basename "$wheel" | cut -d- -f1)"
        # Installed on the machine (or unpacked by an earlier run): keep that one.
        if ! PYTHONPATH="$SITE" "$PY" -c "import importlib.metadata as m, sys
m.version(sys.argv[1])" "$dist" 2>/dev/null; then
            missing+=("$wheel")
        fi
    done
    if [ -f "$ROOT/engine_image/tandem_engine/__init__.py" ]; then  # run the checkout
        local kept=() w
        for w in "${missing[@]}"; do [[ "$(basename "$w")" == tandem-* ]] || kept+=("$w"); done
        missing=("${kept[@]}")
    fi
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "gpu-check: installing ${#missing[@]} wheels into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${missing[@]}"
    fi
}

if [ "${1:-}" = wheels ]; then
    shift
    wheels "$@"
    exit 0
fi

start=$(date +%s)
case " $* " in
    *" --cpu-dry-run "*) ;;  # the CPU dry run needs no bundle: the checkout's .venv runs it
    *) install ;;
esac
export PYTHONPATH="$ROOT/engine_image:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
echo "gpu-check: install took $(( $(date +%s) - start )) s"
exec "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
