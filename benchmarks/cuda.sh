#!/usr/bin/env bash
# The GPU checks and timings of docs/benchmarks.md, on one CUDA device, run from the repo root
# with frolic-tta importable (pip install -e . or PYTHONPATH=.). About 5 minutes on an H100
# (2026-11-26; the full 21k case takes about 35 s there).
# Each step has its own time limit and the next one runs whatever happened; its output goes to $LOGS/steps.log.
LOGS=${LOGS:-benchmarks/results/cuda_logs}
PY=${PYTHON:-python3}
mkdir -p "$LOGS"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date -u +%H:%M:%S))"
  echo "== $name" >> "$LOGS/steps.log"
  timeout "$limit" "$@" >> "$LOGS/steps.log" 2>&1
  echo "rc=$? ($(date -u +%H:%M:%S))"; tail -n 5 "$LOGS/steps.log"
  cp benchmarks/results/*_cuda.json "$LOGS"/ 2>/dev/null
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, lightning, open_clip; print(torch.__version__, lightning.__version__, open_clip.__version__)"
step tests 100 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_precision.py tests/test_flushed_exp.py
step finalize_imagenet 110 "$PY" benchmarks/finalize.py --device cuda --exact \
  --only "ImageNet, ViT-B-16" --only "ImageNet, ViT-B-16, balanced test prior" \
  --only "ImageNet, ViT-B-16, raw head labels (previous default)" \
  --only "ImageNet, ViT-B-16, float64 reference"
step finalize_21k 240 "$PY" benchmarks/finalize.py --device cuda --only 21k --n21k 200000
step precision 45 "$PY" benchmarks/precision.py --device cuda
step soft_sums 80 "$PY" benchmarks/soft_sums.py --device cuda
step overhead 55 "$PY" benchmarks/overhead.py --device cuda --precision 16-mixed --n 8192 --batch-size 256
