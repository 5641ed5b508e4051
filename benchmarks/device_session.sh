#!/bin/bash
# One device call that checks a session's work on the H200 (run from the repo root, writes under $OUT):
# the demo on CUDA, every @pytest.mark.gpu test, and the one-GPU halves of the parallel benchmarks.
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/fxopt_out}
mkdir -p "$OUT"
SECONDS=0
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout 170 python3 -m fxopt demo --device cuda 2>&1
  echo "== demo done at $SECONDS s"; } 2>&1 | tee "$OUT/demo_cuda.txt"
{ timeout 190 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
    --ignore=tests/test_calibration.py tests 2>&1 | tail -60
  echo "== gpu tests done at $SECONDS s"; } 2>&1 | tee "$OUT/gpu_tests.txt"
{ timeout 75 python3 benchmarks/tensor_parallel.py --local-compute --out "$OUT" 2>&1 | tail -25
  echo "== tp done at $SECONDS s"
  timeout 75 python3 benchmarks/pipeline_parallel.py --single-gpu --stages 2 --out "$OUT" 2>&1 | tail -25
  echo "== pp done at $SECONDS s"; } 2>&1 | tee "$OUT/parallel_log.txt"
