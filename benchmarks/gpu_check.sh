#!/usr/bin/env bash
# tinyformer's check of a GPU machine: parity with the CPU, training MFU and tokens/s (124M and 350M shapes),
# decode tokens/s, and a one-rank distributed smoke test; a short table comes last. About 5 minutes on an
# H100/H200, nothing downloaded, nothing installed: the machine's python3 (with torch) runs tinyformer from src/.
#
#   bash benchmarks/gpu_check.sh                                        # from the repository root
#   bash benchmarks/gpu_check.sh --device cpu --tiny --peak-flops 1e11  # a dry run of every step on CPU
#
# Arguments go to benchmarks/gpu_check.py (--help). When $OUT names a folder (one that is brought back), the
# output is also written to $OUT/gpu_check.log and the results to $OUT/gpu_check.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/tinyformer-inductor}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
args=("$@")
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  timeout "${GPU_CHECK_TIMEOUT:-570}" "$PYTHON" benchmarks/gpu_check.py "${args[@]}" --json "$OUT/gpu_check.json" \
    2>&1 | tee "$OUT/gpu_check.log"
else
  exec timeout "${GPU_CHECK_TIMEOUT:-570}" "$PYTHON" benchmarks/gpu_check.py "${args[@]}"
fi
