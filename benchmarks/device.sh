#!/usr/bin/env bash
# GPU benchmark suite (issue 14): one prepared run, under 5 minutes on one NVIDIA
# GPU (H100/H200 class). Measures, side by side, the fused KD loss (our Pallas
# kernel, our XLA path, materialized, Liger-Kernel, Cut Cross-Entropy, plain
# PyTorch), the attention paths, the paper-123m KD step with the 3.4B-layout
# teacher, the compile tier's step (compiled and run here beside python -m hldstudy.aot's
# compile-only figure for this chip and the planner) and the FP8 matmul path; see
# benchmarks/device_suite.py.
#
#   bash benchmarks/device.sh             # writes benchmarks/results/device.{json,md}
#   bash benchmarks/device.sh --dry-run   # every section at tiny shapes on CPU
#                                         # (also: HLDSTUDY_DEVICE_DRY=1)
#
# Needs only what a GPU machine typically has: python with jax[cuda], flax,
# optax, torch, triton. Runs from this source tree (PYTHONPATH, never
# `pip install -e`); the peers travel as wheels in benchmarks/wheels/ and are
# unpacked into a temporary directory on PYTHONPATH (no pip, no network).
# With no GPU it prints one line and exits 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
DRY=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && DRY=1; done
[[ "${HLDSTUDY_DEVICE_DRY:-0}" == "1" ]] && DRY=1

if [[ $DRY == 0 ]] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }; then
  echo "device.sh: no NVIDIA GPU on this machine (nvidia-smi lists none); nothing measured (--dry-run runs the sections on CPU)"
  exit 0
fi

PEERS="$(mktemp -d)"
trap 'rm -rf "$PEERS"' EXIT
shopt -s nullglob
for wheel in benchmarks/wheels/*.whl; do
  # A wheel is a zip: unpacking it is the whole install for pure-Python packages.
  "$PY" -m zipfile -e "$wheel" "$PEERS" || echo "device.sh: could not unpack $wheel (that peer is skipped)"
done
export PYTHONPATH="$PWD:$PEERS${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
[[ $DRY == 1 ]] && export JAX_PLATFORMS=cpu HLDSTUDY_DEVICE_DRY=1
[[ $DRY == 1 ]] && echo "device.sh: dry run (CPU, tiny shapes)"
[[ $DRY == 0 ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec "$PY" benchmarks/device_suite.py "$@"
