#!/usr/bin/env bash
# DLRM's own script under DDP, without and with sparsync's comm hook, 4 ranks on loopback, the variants
# interleaved run by run (docs/results_dlrm.md, "The hook's own cost"). Usage:
#   bash scripts/dlrm_hook_series.sh DLRM_DIR [OUT]      # RUNS=5 VARIANTS="none identity threshold" by default
# DLRM_DIR: a checkout of facebookresearch/dlrm (its dlrm_s_pytorch.py needs tqdm on the path).
# Prints each run's four ms/it windows; the logs stay in OUT (default /tmp/dlrm_hook_series).
set -euo pipefail
cd "$(dirname "$0")/.."
DLRM=${1:?usage: dlrm_hook_series.sh DLRM_DIR [OUT]}
OUT=${2:-/tmp/dlrm_hook_series}
mkdir -p "$OUT"
ARGS="--arch-embedding-size 100000-100000-100000-100000 --arch-sparse-feature-size 16 --arch-mlp-bot 13-512-256-64-16
--arch-mlp-top 512-256-1 --data-generation random --mini-batch-size 512 --num-batches 40 --dist-backend gloo
--print-time --print-freq 10 --numpy-rand-seed 7"
port=29711
for i in $(seq 1 "${RUNS:-5}"); do
  for v in ${VARIANTS:-none identity threshold}; do
    port=$((port + 1))
    echo "run $i $v load $(cat /proc/loadavg)" | tee -a "$OUT/loads.txt"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 timeout 600 .venv/bin/torchrun --nproc-per-node 4 --master-port $port \
      examples/dlrm_reference.py "$DLRM" --hook "$v" -- $ARGS >"$OUT/run${i}_$v.log" 2>&1 || echo "  (exit $?)"
    echo "  $(grep -o '[0-9.]* ms/it' "$OUT/run${i}_$v.log" | head -4 | tr '\n' ' ')" | tee -a "$OUT/loads.txt"
  done
done
