#!/usr/bin/env bash
# Make .venv-torchrec: torchrec, its fbgemm-gpu-cpu and the torch they were released with, for the torchrec rows
# of `sparsync bench dlrm` (sparsync_bench.torchrec_runner runs in it as a subprocess). Apart from .venv
# because torchrec pins its own torch; idempotent, quick when already done; CI never runs it.
# Versions (override by environment): torchrec and FBGEMM share release numbers and each pairs with one torch
# release (FBGEMM's compatibility table: 1.5 with torch 2.10, one minor each release since), so 1.8 with 2.13,
# the torch .venv has. The newest, torchrec 1.9.2 with fbgemm-gpu-cpu 1.9.0, pairs with torch 2.14, whose CPU
# build the registry does not serve; on 2.13 fbgemm_gpu does not load (docs/results_dlrm.md has the error).
# torch is pinned to its CPU build (+cpu): a bare `torch` pulls a multi-GB CUDA build.
# torchrec's wheel requires `fbgemm-gpu` (the CUDA build) by name, so it goes in with --no-deps and its other
# requirements are listed here; fbgemm-gpu-cpu provides the same `fbgemm_gpu` module.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TORCHREC_VENV:-.venv-torchrec}
TORCH=${TORCHREC_TORCH:-2.13.0+cpu}
FBGEMM=${TORCHREC_FBGEMM:-1.8.0}
TORCHREC=${TORCHREC_VERSION:-1.8.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==$TORCH" >"$pin"
# pip's quiet install, less the notes about this machine's empty local indexes
pipq() { "$VENV/bin/pip" install -q -c "$pin" "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
if ! "$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec" 2>/dev/null; then
  echo "torchrec_env: installing torch==$TORCH, fbgemm-gpu-cpu==$FBGEMM, torchrec==$TORCHREC into $VENV"
  pipq "torch==$TORCH" "fbgemm-gpu-cpu==$FBGEMM" numpy
  pipq --no-deps "torchrec==$TORCHREC"  # says "torchrec requires fbgemm-gpu": fbgemm-gpu-cpu stands in
  pipq tensordict "torchmetrics==1.0.3" tqdm pyre-extensions
fi
# loads, or says why (torchrec 1.9.2 with fbgemm-gpu-cpu 1.9.0 on torch 2.13: an undefined torch symbol)
"$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec
print('torchrec_env: torch', torch.__version__, 'torchrec', getattr(torchrec, '__version__', '?'))"
