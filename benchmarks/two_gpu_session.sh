#!/bin/bash
# Two-GPU device calls (issue 9), run from the repo root on a machine with two H200s; writes under $OUT.
#   bash benchmarks/two_gpu_session.sh tests tp        # correctness (NCCL + one-GPU suites, the example), TP bench
#   bash benchmarks/two_gpu_session.sh pp costmodel    # pipeline bench (M = 1..16), cost model on one GPU
# Phases: info tests example tp tpcg tpsp tpdtensor tpoverlap pp ppcg costmodel calib. Result tables land in $OUT/results.tgz, logs in $OUT/*.txt.
cd "$(dirname "$0")/.." || exit 1
# NVLink multicast must stay off on these shared hosts (NCCL, PyTorch symmetric memory, NVSHMEM).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/fxopt_out}
RES="$OUT/res"
mkdir -p "$RES"
SECONDS=0
TR="torchrun --standalone --nproc-per-node 2"

phase_info() {
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
}

phase_tests() {
  # One-GPU suite on GPU 1 (every @gpu test but the parallel ones), in parallel with the parallel suites.
  ( CUDA_VISIBLE_DEVICES=1 timeout 280 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu \
      -n 8 -p no:cacheprovider --ignore=tests/test_calibration.py --ignore=tests/test_parallel_gpu.py tests \
      > "$OUT/gpu_suite.txt" 2>&1; echo "gpu suite rc=$? at $SECONDS s" >> "$OUT/gpu_suite.txt" ) &
  # Parallel suites: 2 gloo ranks on one GPU (host-staged p2p), then 2 NCCL ranks on two GPUs.
  echo "== parallel suite, gloo, one GPU"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_parallel_gpu.py 2>&1 | tail -30
  echo "== parallel suite, NCCL, two GPUs (at $SECONDS s)"
  FXOPT_PARALLEL_TEST_PG=nccl timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_parallel_gpu.py 2>&1 | tail -30
  wait
  echo "== one-GPU suite"; tail -25 "$OUT/gpu_suite.txt"
}

phase_example() {
  timeout 150 $TR examples/tp_inference.py 2>&1 | grep -v "^W1" | tail -30
}

phase_tp() {
  # 2 blocks of Llama-3-8B size, prefill of 4096 tokens, decode of 8 sequences; lm_head cut by vocabulary.
  timeout 320 $TR benchmarks/tensor_parallel.py --layers 2 --seq 4096 --vocab-parallel --variants one,fxopt \
    --out "$RES" 2>&1 | grep -v "^W1" | tail -60
}

phase_tpcg() {
  # fxopt TP decode under mode="reduce-overhead", embedding cut and not (the session-5 run hung in this step);
  # Python stacks of both ranks every 50 s land in $RES/cg*/stacks_rank*.txt
  for e in "" "--vocab-parallel-embedding"; do
    d="$RES/cg${e:+_emb}"; mkdir -p "$d"
    FXOPT_HANG_DUMP_S=50 timeout 160 $TR benchmarks/tensor_parallel.py --layers 2 --seq 4096 --vocab-parallel $e \
      --variants fxopt --out "$d" 2>&1 | grep -v "^W1" | grep "timing\|Error\|error" | head -20
  done
}

phase_tpsp() {
  # fxopt TP with sequence parallelism, then with Inductor's micro-pipeline (async) TP on top, then the default
  # plan with small all-reduces lowered to one-shot symmetric-memory kernels (decode)
  for v in "--sequence-parallel" "--async-tp" "--one-shot-ar"; do
    d="$RES/sp${v#--}"; mkdir -p "$d"
    cg="--no-cudagraphs"; [ "$v" = "--one-shot-ar" ] && cg=""  # one-shot all-reduces matter for decode
    timeout 200 $TR benchmarks/tensor_parallel.py --layers 2 --seq 4096 --vocab-parallel $v --variants fxopt \
      $cg --out "$d" 2>&1 | grep -v "^W1" | grep "timing\|Error\|error\|plan" | head -20
  done
}

phase_tpdtensor() {
  # The DTensor plan alone (its Inductor compile ran past 3 minutes twice on 2026-11-29): give it the time it needs.
  mkdir -p "$RES/dtensor"
  timeout 540 $TR benchmarks/tensor_parallel.py --layers 2 --seq 4096 --vocab-parallel --variants dtensor \
    --no-cudagraphs --out "$RES/dtensor" 2>&1 | grep -v "^W1" | tail -40
}

phase_tpoverlap() {
  # fxopt TP with each row-parallel all-reduce cut into 2 and 4 token chunks (overlap with the next chunk's matmul)
  for c in 2 4; do
    mkdir -p "$RES/overlap$c"
    timeout 200 $TR benchmarks/tensor_parallel.py --layers 2 --seq 4096 --vocab-parallel --variants fxopt \
      --no-cudagraphs --overlap-chunks $c --out "$RES/overlap$c" 2>&1 | grep -v "^W1" | grep "timing\|Error"
  done
}

phase_pp() {
  # dim 2048 so that a micro-batch's stage work outweighs the host's per-kernel launch cost
  timeout 230 $TR benchmarks/pipeline_parallel.py --dim 2048 --layers 8 --seq 1024 --batch 16 --out "$RES" 2>&1 \
    | grep -v "^W1" | grep -v "UserWarning\|return func" | tail -40
}

phase_ppcg() {
  # the same training pipeline with every stage replayed from CUDA graphs (fxopt.pipeline(..., cuda_graphs=True))
  timeout 230 $TR benchmarks/pipeline_parallel.py --dim 2048 --layers 8 --seq 1024 --batch 16 --cuda-graphs \
    --out "$RES" 2>&1 | grep -v "^W1" | grep -v "UserWarning\|return func" | tail -40
}

phase_costmodel() {
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/pipeline_parallel.py --single-gpu --stages 2 --out "$RES" 2>&1 | tail -30
}

phase_calib() {
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/calibration_speed.py --out "$RES" 2>&1 | tail -40
}

for p in "${@:-info}"; do
  { echo "===== phase $p (start at $SECONDS s)"; "phase_$p"; echo "===== phase $p done at $SECONDS s"; } 2>&1 | tee -a "$OUT/session_log.txt"
done
tar czf "$OUT/results.tgz" -C "$RES" . && rm -rf "$RES"
