#!/usr/bin/env bash
# DLRM's own script: its model-parallel all-to-all against the tables sharded by sparsync.shard (--shard) and
# sharded with their SGD in backward (--shard-fused), 4 ranks on loopback, the variants interleaved run by run
# (docs/results_dlrm.md, "Sharded tables in DLRM's own script"). Usage:
#   bash scripts/dlrm_shard_series.sh DLRM_DIR [OUT]   # RUNS=5 BATCHES=40 VARIANTS="none shard shard-fused" default
# DLRM_DIR: a checkout of facebookresearch/dlrm (its dlrm_s_pytorch.py needs tqdm on the path). NICE (default -10,
# needs root) is the runs' niceness. Prints each run's ms/it windows (10 iterations each) and its loss at the last
# iteration; the logs stay in OUT (default /tmp/dlrm_shard_series), the load averages before each run in OUT/loads.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
DLRM=${1:?usage: dlrm_shard_series.sh DLRM_DIR [OUT]}
OUT=${2:-/tmp/dlrm_shard_series}
mkdir -p "$OUT"
ARGS="--arch-embedding-size 100000-100000-100000-100000 --arch-sparse-feature-size 16 --arch-mlp-bot 13-512-256-64-16
--arch-mlp-top 512-256-1 --data-generation random --mini-batch-size 512 --num-batches ${BATCHES:-40} --dist-backend gloo
--print-time --print-freq 10 --numpy-rand-seed 7"
port=29911
for i in $(seq 1 "${RUNS:-5}"); do
  for v in ${VARIANTS:-none shard shard-fused}; do
    port=$((port + 1))
    flags="--hook none"
    [ "$v" = none ] || flags="$flags --$v"
    echo "run $i $v load $(cat /proc/loadavg)" | tee -a "$OUT/loads.txt"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 timeout 600 nice -n "${NICE:--10}" .venv/bin/torchrun --nproc-per-node 4 --master-port $port \
      examples/dlrm_reference.py "$DLRM" $flags -- $ARGS >"$OUT/run${i}_$v.log" 2>&1 || echo "  (exit $?)"
    echo "  $(grep -o '[0-9.]* ms/it' "$OUT/run${i}_$v.log" | tr '\n' ' ')" \
      "loss $(grep -o 'loss [0-9.]*' "$OUT/run${i}_$v.log" | tail -1 | cut -d' ' -f2)" | tee -a "$OUT/loads.txt"
  done
done
