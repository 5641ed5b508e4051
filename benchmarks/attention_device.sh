#!/bin/bash
# One device call for the attention kernels: `bash benchmarks/attention_device.sh 1|2` (writes under $OUT).
# 1: GPU tests (first config only) + quick benchmark + config exploration.  2: GPU tests + full benchmark.
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn_out}
mkdir -p "$OUT"
LOG=$OUT/run.log
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$LOG"
if [ "$1" = 1 ]; then
  SECONDS=0
  timeout 100 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest tests/test_attention_kernels.py -m gpu -q -n 8 \
      -p no:cacheprovider 2>&1 | tail -60 | tee -a "$LOG"
  echo "== tests took $SECONDS s" | tee -a "$LOG"
  timeout 75 python3 benchmarks/attention.py --quick --out "$OUT" 2>&1 | tee -a "$LOG"
  echo "== quick done at $SECONDS s" | tee -a "$LOG"
  EXPLORE_BUDGET_S=$((250 - SECONDS)) timeout $((280 - SECONDS)) python3 benchmarks/attention.py --explore \
      --out "$OUT" 2>&1 | tee -a "$LOG"
  echo "== explore done at $SECONDS s" | tee -a "$LOG"
else
  SECONDS=0
  timeout 80 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest tests/test_attention_kernels.py -m gpu -q -n 13 \
      -p no:cacheprovider 2>&1 | tail -40 | tee -a "$LOG"
  echo "== tests took $SECONDS s" | tee -a "$LOG"
  timeout $((292 - SECONDS)) python3 benchmarks/attention.py --out "$OUT" 2>&1 | tee -a "$LOG"
  echo "== bench done at $SECONDS s" | tee -a "$LOG"
fi
