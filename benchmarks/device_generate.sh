#!/usr/bin/env bash
# The end-to-end benchmark on a GPU machine: torchao from carried wheels (.whl/) when present, then
# benchmarks/generate.py with the given arguments; results and logs under $OUT (or benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 benchmarks/generate.py --out "$OUT" "$@"
