#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): run it whenever a GPU machine is at hand, at most ~8 minutes.
#   1. the `cuda` tests (tests/compress/test_compress_device.py: each compressor's results against the host's;
#      tests/test_cuda.py: NCCL at P = 1; 2 and 4 gloo ranks sharing the one GPU), and the
#      collectives grid under NCCL's rules (CPU tensors, as CI runs it) as a control;
#   2. every compressor's kernels on the GPU against a device memcpy of the same bytes (25M float32);
#   3. `bench embedding` at P = 8 on the machine's CPU cores (one core per rank): --net 1gbit where `ip` and
#      `tc` work, else loopback (the summary says which);
#   4. DCT-DP against uncompressed sparsync on the MLPerf DLRM at P = 8 (bench dlrm).
# Prints a summary; writes $OUT/summary.txt and every log and figure in $OUT/gpu_check.tar.gz (two files: the
# device tool brings back at most 8). $OUT defaults to results/gpu_check. No network needed: the machine's
# python3 must hold torch (with CUDA), numpy, pytest, pytest-timeout, hypothesis, rich and matplotlib; the bench
# steps also import pyzmq, which the device tool's image lacks: carry it as a wheel in .whl/ (installed first if
# present; see docs/gpu.md for the command). COMMIT=<sha> names the commit in the
# summary (the tree may travel without .git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_check}
PY=${PYTHON:-python3}
LOGS="$OUT/gpu_check"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/sparsync-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/sparsync-site"
fi
# The C kernels serve CPU tensors only; build them if a compiler is there (else the torch kernels run).
"$PY" setup.py -q build_ext --inplace >"$LOGS/build.txt" 2>&1 || echo "C kernels not built (see build.txt)"

summary="$OUT/summary.txt"
{
  echo "sparsync GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
  echo "cpu cores: $(nproc)"
} | tee "$summary"

STEPS=${STEPS:-cuda_tests nccl_rules kernels embedding dlrm}  # a subset, e.g. for a dry run without a GPU
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log to $LOGS/NAME.txt, one summary line
  local name=$1 limit=$2
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s; last line: $(tail -n 1 "$LOGS/$name.txt")" | tee -a "$summary"
}

step cuda_tests 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/compress/test_compress_device.py
step nccl_rules 70 "$PY" -m pytest -q -p no:cacheprovider tests/collectives/test_collectives.py -k "P3-nccl and grid"
step kernels 60 "$PY" -m sparsync_bench.gpu_kernels --device cuda --out "$LOGS/kernels.json"
[ -f "$LOGS/kernels.txt" ] && tee -a "$summary" <"$LOGS/kernels.txt"

net=loopback
if ip netns add sparsync-probe 2>/dev/null && ip netns del sparsync-probe && command -v tc >/dev/null; then
  net=1gbit
fi
netargs=()
[ "$net" = 1gbit ] && netargs=(--net 1gbit)
echo "bench embedding P=8 on $net" | tee -a "$summary"
step embedding 100 "$PY" -m sparsync_bench.cli bench embedding --procs 8 "${netargs[@]}" --dims 16,64,128 \
  --zipf 0.9,1.1,1.3 --hot low --repeats 5 --methods torch_coo,torch_ddp,auto --no-progress --out "$LOGS/embedding"
step dlrm 90 "$PY" -m sparsync_bench.cli bench dlrm --procs 8 "${netargs[@]}" --mlp mlperf --dim 128 --steps 20 \
  --methods sparsync,sparsync_dct --out "$LOGS/dlrm"
for f in embedding dlrm; do
  [ -f "$LOGS/$f.md" ] && { echo "--- $f.md"; cat "$LOGS/$f.md"; } >>"$summary"
done
cp "$summary" "$LOGS/"
tar czf "$OUT/gpu_check.tar.gz" -C "$OUT" gpu_check && rm -rf "$LOGS"
echo "wrote $summary and $OUT/gpu_check.tar.gz"
