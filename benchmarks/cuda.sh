#!/usr/bin/env bash
# The GPU checks and timings of docs/benchmarks.md, on one CUDA device, run from the repo root
# with frolic-tta importable (pip install -e . or PYTHONPATH=.).
#
#   bash benchmarks/cuda.sh          the CUDA tests and issue 36's checks: gpu_pipeline.py (ViT-B-16,
#                                    16,384 images in memory, K = 1,000, 16-mixed, against a plain
#                                    loop and a Lightning zero-shot module), finalize_syncs.py
#                                    (50,000 x 1,000 x 512, three worlds: phases, host syncs,
#                                    launches) and batch_path.py (the per-batch path's syncs);
#                                    sized for 8 minutes on an H100 (the limits add up to 8; not
#                                    yet run on a GPU)
#   bash benchmarks/cuda.sh all      also the earlier GPU benchmarks (finalize.py's ImageNet and
#                                    21k cases, precision, soft sums, overhead: about 7 minutes
#                                    more on an H100, 2026-11-26; the full 21k case about 35 s;
#                                    trace_21k: issue 35 item 2's 21k world, N = 200,000, printed
#                                    as it goes: 24 s on an H200, 2026-11-27; trace_21k_kept:
#                                    the same with the N x K logits held, and
#                                    trace_21k_balanced: finalize.py's 21k world, are not in "all")
#   bash benchmarks/cuda.sh STEP...  the named steps (the names below)
#
# Each step has its own time limit and the next one runs whatever happened. Every step's output
# goes to $LOGS/<step>.log (and $LOGS/steps.log); its last lines are printed; the *_cuda.json
# results are copied to $LOGS after each step. LOGS: $OUT/cuda_logs when $OUT is set, else
# benchmarks/results/cuda_logs.
LOGS=${LOGS:-${OUT:+$OUT/cuda_logs}}
LOGS=${LOGS:-benchmarks/results/cuda_logs}
PY=${PYTHON:-python3}
mkdir -p "$LOGS"
step() {  # step NAME SECONDS LINES COMMAND...
  local name=$1 limit=$2 lines=$3; shift 3
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit} s)"
  echo "== $name" >> "$LOGS/steps.log"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  cat "$LOGS/$name.log" >> "$LOGS/steps.log"
  echo "rc=$rc ($(date -u +%H:%M:%S))"
  grep -v "UserWarning\|warn(\|pytree" "$LOGS/$name.log" | tail -n "$lines"
  cp benchmarks/results/*_cuda.json "$LOGS"/ 2>/dev/null
}
run() {  # run STEP
  case $1 in
    tests) step tests 120 5 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
      tests/test_precision.py tests/test_flushed_exp.py ;;
    pipeline) step pipeline 210 20 "$PY" benchmarks/gpu_pipeline.py --device cuda ;;
    finalize_syncs) step finalize_syncs 120 70 "$PY" benchmarks/finalize_syncs.py --device cuda ;;
    batch_path) step batch_path 30 10 "$PY" benchmarks/batch_path.py --device cuda --n 16384 \
      --batch-size 256 --k 1000 --d 512 ;;
    finalize_imagenet) step finalize_imagenet 110 5 "$PY" benchmarks/finalize.py --device cuda \
      --exact --only "ImageNet, ViT-B-16" --only "ImageNet, ViT-B-16, balanced test prior" \
      --only "ImageNet, ViT-B-16, raw head labels (previous default)" \
      --only "ImageNet, ViT-B-16, float64 reference" ;;
    finalize_21k) step finalize_21k 240 5 "$PY" benchmarks/finalize.py --device cuda --only 21k \
      --n21k 200000 ;;
    trace_21k) step trace_21k 240 16 "$PY" benchmarks/trace_21k.py --device cuda ;;
    trace_21k_kept) step trace_21k_kept 150 16 "$PY" benchmarks/trace_21k.py --device cuda \
      --keep-logits ;;
    trace_21k_balanced) step trace_21k_balanced 150 16 "$PY" benchmarks/trace_21k.py \
      --device cuda --balanced --chunk-size 1024 ;;
    precision) step precision 45 5 "$PY" benchmarks/precision.py --device cuda ;;
    soft_sums) step soft_sums 80 5 "$PY" benchmarks/soft_sums.py --device cuda ;;
    overhead) step overhead 55 5 "$PY" benchmarks/overhead.py --device cuda --precision 16-mixed \
      --n 8192 --batch-size 256 ;;
    *) echo "unknown step $1" >&2; return 2 ;;
  esac
}
DEFAULT="tests pipeline finalize_syncs batch_path"
EARLIER="trace_21k finalize_imagenet finalize_21k precision soft_sums overhead"
if [ $# -eq 0 ]; then set -- $DEFAULT; elif [ "$1" = all ]; then set -- $DEFAULT $EARLIER; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, lightning, open_clip; print(torch.__version__, lightning.__version__, open_clip.__version__)"
for name in "$@"; do run "$name"; done
