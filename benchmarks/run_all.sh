#!/usr/bin/env bash
# Every benchmark on a GPU machine, each run writing its part of benchmarks/results/<script>.{md,json} (or $OUT/):
# the one-GPU tables, then the two-GPU ones where a second GPU is there. QUICK=1 passes --quick to the scripts that
# have it. quant_quality needs model checkpoints: set MODELS_DIR to run it. Logs: $OUT/<name>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
Q=${QUICK:+--quick}
failed=()
run() {  # run NAME COMMAND...
  local name=$1; shift
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1 || failed+=("$name")
  tail -n 3 "$OUT/$name.log"
}
run attention python3 benchmarks/attention.py --out "$OUT" $Q
run fp8_attention python3 benchmarks/fp8_attention.py --out "$OUT" $Q
run fp8_attention_accuracy python3 benchmarks/fp8_attention.py --accuracy --out "$OUT" $Q
run w4a16 python3 benchmarks/w4a16.py --out "$OUT" $Q
run calibration_speed python3 benchmarks/calibration_speed.py --out "$OUT" $Q
run generate bash benchmarks/device_generate.sh $Q
[ -n "${MODELS_DIR:-}" ] && run quant_quality python3 benchmarks/quant_quality.py --models-dir "$MODELS_DIR" --out "$OUT"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run tensor_parallel torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --out "$OUT" $Q
  run pipeline_parallel torchrun --nproc-per-node 2 benchmarks/pipeline_parallel.py --out "$OUT" $Q
  run distributed torchrun --nproc-per-node 2 benchmarks/distributed.py --mesh 1x1x2 --out "$OUT" $Q
else
  run tensor_parallel python3 benchmarks/tensor_parallel.py --local-compute --out "$OUT" $Q
  run pipeline_parallel python3 benchmarks/pipeline_parallel.py --single-gpu --out "$OUT" $Q
  run distributed python3 benchmarks/distributed.py --one-gpu --out "$OUT" $Q
fi
[ ${#failed[@]} -eq 0 ] && echo "all benchmarks ran" || { echo "failed: ${failed[*]} (see $OUT/<name>.log)"; exit 1; }
