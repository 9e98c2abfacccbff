#!/usr/bin/env bash
# The environment that runs torch as on a CPU of another kind than this one, for the
# second pass of the numerics-sensitive tests (`make test`): a test that holds only on one
# CPU (AVX2, AVX-512, AMX round differently) then fails on every machine, not only on the
# unlucky one.
#
#   scripts/other-isa.sh      prints VAR=VALUE words for `env`
#
# A machine with AVX-512 (and maybe AMX) runs as an AVX2 CPU without them: three dispatchers
# are capped, oneDNN (the engine's packed fp32 and bf16 matmuls), ATen's own vectorised
# kernels (norms, softmax, reductions) and MKL (transformers' fp32 matmuls). An AVX2-only
# machine runs its matmuls as an SSE4.1 CPU's (oneDNN and MKL); ATen stays at AVX2, the
# least torch.compile's CPU backend (the flex attention path) accepts.
set -euo pipefail
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    echo "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"
else
    echo "ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2"
fi
