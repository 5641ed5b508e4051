#!/bin/bash
# One-GPU device calls that check a session's work on the H200 (run from the repo root; writes under $OUT).
#   bash benchmarks/device_session.sh                  # demo, every @pytest.mark.gpu test, one-GPU parallel halves
#   bash benchmarks/device_session.sh fp8 calib        # 8-bit attention speed + accuracy, GPU calibration speed
#   GLUON_CHECKS="gluon_attention_bwd_check fp8_gluon_check gluon_w4a16_small_check" bash benchmarks/device_session.sh verify gluon
# Phases: demo tests parallel fp8 calib w4a16 w4sweep attn gluon verify route quick next ab pp route9 pp9 s10a s10b s10c s10d s10e s10f s11a s11b s11c s11d s11e s11f s11g s12a s12b s12c s12d s12e s12f s12g s13a s13t s13b s13c s13d s13e s13f s13g s14a s14b s14c s14d s14e s14f s14g s15a s15b s15c s15d s15e s15f s16a s16b s16c s16d s16e s16f s16g s17a s17b s17c s17d s19w s19wt s19x2 s19b s19c s19t s20a s20b s20x2 s20c s20d s20rest s20e s20f s20wt s20g s20h largem profile. Each has its own time limit; tables land in $OUT (at most 8 files come back,
# so the fp8 and calib tables are packed into $OUT/results.tgz).
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/fxopt_out}
RES="$OUT/res"
mkdir -p "$OUT" "$RES"
SECONDS=0

phase_demo() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout 170 python3 -m fxopt demo --device cuda 2>&1
}

phase_tests() {
  timeout 190 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
    --ignore=tests/test_calibration.py tests 2>&1 | tail -60
}

phase_parallel() {
  timeout 75 python3 benchmarks/tensor_parallel.py --local-compute --out "$OUT" 2>&1 | tail -25
  timeout 75 python3 benchmarks/pipeline_parallel.py --single-gpu --stages 2 --out "$OUT" 2>&1 | tail -25
}

phase_fp8() {
  # fp8 and int8 kernels against cuDNN / FA2 bf16, then the accuracy table with the kernels' columns
  timeout 300 python3 benchmarks/fp8_attention.py --dims 128 --out "$RES" 2>&1 | grep -v Warning | tail -30
  timeout 150 python3 benchmarks/fp8_accuracy.py --dims 128 --out "$RES" 2>&1 | tail -15
}

phase_w4a16() {
  # W4A16 correctness on the GPU (every tuner candidate), then the speed table
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_w4a16_kernels.py tests/test_w4a16_pass.py \
    2>&1 | tail -5
  timeout 240 python3 benchmarks/w4a16.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -48
}

phase_w4sweep() {
  # the tuner's candidates against the experimental swapd configs (dequantize before the dot) on the two main shapes
  timeout 420 python3 benchmarks/w4a16_sweep.py --out "$RES" --shapes 8192x8192,8192x28672 --ms 64,128,32,256,16 \
    --only swapd \
    2>&1 | grep -v "Warn\|warn" | tail -30
}

phase_attn() {
  # attention forward / fwd+bwd / decode table (autotuned over the config lists); tests run in phase "tests"
  timeout 300 python3 benchmarks/attention.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -60
}

phase_quick() {
  # the quick attention table (d = 256 included) and the W4A16 subset
  timeout 200 python3 benchmarks/attention.py --quick --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -20
  timeout 200 python3 benchmarks/w4a16.py --ms 1,16,64,256 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -24
}

phase_profile() {
  OUT="$RES" bash benchmarks/profile_kernels.sh
}

phase_gluon() {
  # the Gluon (sm_90) kernels' own checks: correctness against float64 references, then timing against the Triton
  # kernels and the anchors; each script has a watchdog (a wrong mbarrier phase hangs the GPU)
  mkdir -p "$RES/gluon"
  for s in ${GLUON_CHECKS:-gluon_attention_check gluon_attention_variant_check gluon_attention_bwd_check gluon_w4a16_check gluon_w4a16_async_check fp8_gluon_check}; do
    [ -f "benchmarks/$s.py" ] || continue
    echo "== $s (at $SECONDS s)"
    extra=""; [ "$s" = gluon_attention_bwd_check ] && extra="--variant 1,3"
    [ "$s" = fp8_gluon_check ] && extra="--bench-first --case-timeout 90"
    timeout ${GLUON_TIMEOUT:-200} python3 "benchmarks/$s.py" --quick $extra --out "$RES/gluon" > "$OUT/$s.txt" 2>&1
    echo "rc=$?"; grep -E "PASS$|FAIL|ERROR|\[check\] [0-9]+ / |correctness:|correctness (PASS|FAIL)|speedup|async check:|\[bench\]" "$OUT/$s.txt" | tail -12
  done
}

phase_verify() {
  # GPU checks of what session 7 prepared or routed without a full GPU test run (about 4 minutes):
  # the d = 256 Gluon forward (then add 256 to _GLUON_HEAD_DIMS), the rest of the Gluon W4A16 tests, the
  # tensor-core Hadamard quantization (then set _HAD_DOT_DEFAULT = "1" if the quant_tc columns win), the
  # overlap forward at S = 512
  timeout 150 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -p no:cacheprovider -k "gluon_forward" \
    tests/test_attention_kernels.py 2>&1 | tail -4
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -k "(test_gpu_gluon and (128 or 256)) or tensor_core or hadamard" \
    tests/test_w4a16_kernels.py tests/test_fp8_attention.py 2>&1 | tail -4
  timeout 100 python3 benchmarks/gluon_attention_variant_check.py 2>&1 | tail -7
  timeout 200 python3 benchmarks/fp8_attention.py --dims 128 --out "$RES" 2>&1 | grep -v Warning | tail -12
}

phase_route() {
  # GPU tests of what session 8 routed: the fp8 op on the Gluon kernel (and the tensor-core Hadamard default), the
  # d = 128 backward on Gluon variant 3 and the d = 256 Gluon forward, the small-M W4A16 candidate (M <= 16); then
  # the fp8 table (fp8_op now = Gluon kernel + tensor-core quantization) and the forward variants' timing
  timeout 200 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_attention.py \
    "tests/test_attention_kernels.py::test_gpu_gluon_backward_route" 2>&1 | tail -6
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider "tests/test_w4a16_kernels.py::test_gpu_gluon[1-False]" \
    "tests/test_w4a16_kernels.py::test_gpu_gluon[5-True]" "tests/test_w4a16_kernels.py::test_gpu_gluon[16-False]" \
    "tests/test_w4a16_kernels.py::test_gpu_gluon[16-True]" 2>&1 | tail -4
  timeout 120 python3 benchmarks/fp8_attention.py --dims 128 --out "$RES" 2>&1 | grep -v Warning | tail -14
  timeout 175 python3 benchmarks/gluon_attention_variant_check.py > "$OUT/variant_check.txt" 2>&1
  grep -v "PASS$" "$OUT/variant_check.txt" | grep -v "^\s*$" | tail -30
}

phase_next() {
  # session 9, call 1 (GPU checks of what session 8 prepared offline; at most 10 minutes):
  # the fused fp8 quantization (then _QUANT_FUSED_DEFAULT = "1" if bit-identical and quant_fused beats quant_tc),
  # the persistent and the ping-pong Gluon forward (route d = 128 to one if bit-identical and faster)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_attention.py -k "fused" 2>&1 | tail -4
  timeout 100 python3 benchmarks/fp8_attention.py --quant-only --out "$RES" 2>&1 | grep -v Warning | tail -16
  for vs in persistent,persistent_lpt pingpong; do  # two invocations: each one's compiles fit its watchdog
    timeout 175 env VCHECK_VARIANTS=$vs python3 benchmarks/gluon_attention_variant_check.py \
      > "$OUT/variant_check_${vs%%,*}.txt" 2>&1
    echo "variant check ($vs) rc=$?"; grep -v "PASS$" "$OUT/variant_check_${vs%%,*}.txt" | grep -v "^\s*$" | tail -16
  done
}

phase_ab() {
  # session 9, call 2: the decode split plans (set _DECODE_CTAS_PER_SM), then env A/B rows of the attention table
  # (Gluon backward below S = 2048; the d = 256 split-head-dim backward)
  timeout 110 python3 benchmarks/attention.py --decode-sweep --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -16
  timeout 100 env FXOPT_ATTN_GLUON_BWD_MIN_SEQ=1024 python3 benchmarks/attention.py --shapes 128x1024,128x2048 \
    --tag bwdfloor1024 --out "$RES" 2>&1 | grep "^|" | tail -6
  timeout 100 python3 benchmarks/attention.py --shapes 128x1024,128x2048 --tag bwdfloor2048 --out "$RES" 2>&1 \
    | grep "^|" | tail -6
  timeout 120 env FXOPT_ATTN_BWD_SPLIT_D=1 python3 benchmarks/attention.py --shapes 256x2048,256x8192 --tag splitd \
    --out "$RES" 2>&1 | grep "^|" | tail -6
  timeout 120 python3 benchmarks/attention.py --shapes 256x2048,256x8192 --tag splitd_off --out "$RES" 2>&1 \
    | grep "^|" | tail -6
}

phase_pp() {
  # session 9, call 3: the fp8 Gluon kernel with warpgroup ping-pong (pingpong=True; must be bit-identical to the
  # default build; flip PINGPONG_DEFAULT if it wins), then the one-launch M <= 4 W4A16 kernel (opt-in "gemv1"; set
  # _GEMV1_DEFAULT = "1" if its test passes and it wins)
  timeout 200 python3 benchmarks/fp8_gluon_check.py --quick --bench-first --case-timeout 90 --out "$RES/gluon" \
    > "$OUT/fp8_gluon_check.txt" 2>&1
  echo "fp8_gluon_check rc=$?"; grep -E "\[bench\]|FAIL|HANG|pingpong" "$OUT/fp8_gluon_check.txt" | tail -12
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_w4a16_kernels.py -k gemv1 2>&1 | tail -4
  timeout 150 python3 benchmarks/w4a16.py --ms 1,2,4 --gemv1 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -16
  # the decode build the sweep (phase ab) liked best, through the GPU decode tests (edit the name first)
  timeout 60 env FXOPT_ATTN_DECODE_CFG=${DECODE_CFG:-bn64s3} python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_attention_kernels.py -k decode 2>&1 | tail -3
}

phase_route9() {
  # session 9, call 3: GPU tests of what session 9 routed (the persistent Gluon forward at d = 128, the fused fp8
  # quantization), the fp8 Gluon kernel with ping-pong, the d = 64 rows with the persistent Gluon forward routed
  timeout 150 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -p no:cacheprovider -k "gluon_forward" \
    tests/test_attention_kernels.py 2>&1 | tail -4
  timeout 150 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_attention.py \
    2>&1 | tail -4
  timeout 190 python3 benchmarks/fp8_gluon_check.py --quick --bench-first --case-timeout 90 --out "$RES/gluon" \
    > "$OUT/fp8_gluon_check.txt" 2>&1
  echo "fp8_gluon_check rc=$?"; grep -E "\[bench\]|FAIL|HANG|pingpong" "$OUT/fp8_gluon_check.txt" | tail -12
  timeout 100 env FXOPT_ATTN_GLUON_DIMS=64,128,256 python3 benchmarks/attention.py --shapes 64x1024,64x4096,64x16384 \
    --tag d64persistent --out "$RES" 2>&1 | grep "^|" | tail -8
}

phase_pp9() {
  # session 9, call 4: the one-launch M <= 4 W4A16 kernel (gemv1) test and timing, the quick attention table with
  # the session's routes
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_w4a16_kernels.py -k gemv1 2>&1 | tail -4
  timeout 150 python3 benchmarks/w4a16.py --ms 1,2,4 --gemv1 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -16
  timeout 200 python3 benchmarks/attention.py --quick --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -20
}

phase_s10a() {
  # session 10, call 1: what session 9 prepared offline for attention. The d = 256 Gluon backward (GPU test, then
  # its check + timing against Triton and cuDNN; route with FXOPT_ATTN_GLUON_BWD_DIMS=128,256 -> default if every
  # case passes and it wins at S >= 2048), the persistent stream-K decode (tests, then its timing table; route
  # FXOPT_ATTN_DECODE_PERSISTENT by default if it beats the split kernel at 4k without losing at 32k)
  timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_gluon_bwd256.py 2>&1 | tail -4
  timeout 200 python3 benchmarks/gluon_attention_bwd_check.py --quick --dims 256 --out "$RES/gluon" \
    > "$OUT/bwd256_check.txt" 2>&1
  echo "bwd256 check rc=$?"; grep -E "PASS$|FAIL|HANG|\[check\]|correctness|\[bench\]|speedup" "$OUT/bwd256_check.txt" | tail -14
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_decode.py 2>&1 | tail -3
  timeout 60 env FXOPT_ATTN_DECODE_PERSISTENT=1 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_attention_kernels.py -k decode 2>&1 | tail -3
  timeout 100 python3 benchmarks/decode_persistent.py --out "$RES" 2>&1 | grep "^|" | tail -40
}

phase_s10b() {
  # session 10, call 2: the forward options. persistent_pingpong (must be bit-identical to overlap; route d = 128
  # to it if faster than persistent), the bf16 poly_exp share (GPU test, then VCHECK_POLY timing: route d = 64 if a K
  # wins by more than the rounds' spread), the d = 64 op route's GPU test
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_kernels.py \
    -k "poly_exp or (gluon_forward and 64)" 2>&1 | tail -4
  timeout 175 env VCHECK_VARIANTS=persistent,persistent_pingpong \
    python3 benchmarks/gluon_attention_variant_check.py > "$OUT/variant_check_s10.txt" 2>&1
  echo "variant check rc=$?"; grep -v "PASS$" "$OUT/variant_check_s10.txt" | grep -v "^\s*$" | tail -20
  timeout 175 env VCHECK_TIMING_ONLY=1 VCHECK_VARIANTS=persistent VCHECK_POLY=2,4 \
    python3 benchmarks/gluon_attention_variant_check.py > "$OUT/variant_check_s10_poly.txt" 2>&1
  echo "variant check (poly) rc=$?"; grep -v "^\s*$" "$OUT/variant_check_s10_poly.txt" | tail -20
}

phase_s10e() {
  # the fp8 kernel's POLY_EXP share (GPU test, then the accuracy + speed A/B; POLY_EXP_DEFAULT = K if a K wins
  # without moving the error)
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gluon_poly.py 2>&1 | tail -3
  timeout 150 python3 benchmarks/fp8_poly_check.py --out "$RES" 2>&1 | grep -v Warn | tail -20
  # the quick attention table with whatever s10a-s10d routed
  timeout 250 python3 benchmarks/attention.py --quick --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -12
}

phase_s10c() {
  # session 10, call 3: op-level A/B rows of the Gluon backward at d = 64 (the split-dQ variant 3; the fb_fxopt
  # column against fb_fxopt_tritonbwd in the same row; FXOPT_ATTN_GLUON_BWD_VARIANT_D64=0 for the variant-0 kernel)
  # and d = 256 (run only if s10a's check passed)
  # d = 64 now routes to the split-dQ variant 3 (session 9, offline only): its GPU test first
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_gluon_bwd_d64.py -k "v1 or v3" \
    2>&1 | tail -3
  timeout 150 env FXOPT_ATTN_GLUON_BWD_DIMS=64,128 python3 benchmarks/attention.py --shapes 64x2048,64x4096,64x16384 \
    --tag d64gluonbwd --out "$RES" 2>&1 | grep "^|" | tail -8
  timeout 150 env FXOPT_ATTN_GLUON_BWD_DIMS=128,256 python3 benchmarks/attention.py --shapes 256x2048,256x8192 \
    --tag d256gluonbwd --out "$RES" 2>&1 | grep "^|" | tail -6
}

phase_s10d() {
  # session 10 or later: the Gluon backward variant 4 (named-barrier turns; route _GLUON_BWD_VARIANT = 4 if every
  # case passes and v4/v3 > 1 on the d = 128 rows with S >= 2048), the persistent fp8 Gluon kernel (bit-identical to
  # the default build required; PERSISTENT_DEFAULT = True if faster)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_gluon_bwd_v4.py 2>&1 | tail -3
  timeout 200 python3 benchmarks/gluon_attention_bwd_check.py --quick --variant 3,4 --out "$RES/gluon" \
    > "$OUT/bwd_v4_check.txt" 2>&1
  echo "bwd v4 check rc=$?"; grep -E "FAIL|HANG|\[check\]|correctness|v4/v3|^\|" "$OUT/bwd_v4_check.txt" | tail -14
  [ -f tests/test_fp8_gluon_persistent.py ] && timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_fp8_gluon_persistent.py 2>&1 | tail -3
  [ -f benchmarks/fp8_persistent_check.py ] && timeout 120 python3 benchmarks/fp8_persistent_check.py --out "$RES" \
    2>&1 | grep -v Warn | tail -12
}

phase_s10f() {
  # the gemv1 prefetch-2 candidates (session 9, offline only; tuner candidates at M = 1, no routing decision): the GPU
  # test of every gemv1 candidate, then the M <= 4 rows (does a " p2" label win the gemv1_config column?)
  # (listed only with FXOPT_W4A16_GEMV1_PREFETCH=1 until this test passes: then set _GEMV1_PREFETCH_DEFAULT = "1")
  timeout 200 env FXOPT_W4A16_GEMV1_PREFETCH=1 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider \
    tests/test_w4a16_kernels.py -k test_gpu_gemv1 2>&1 | tail -3
  timeout 200 env FXOPT_W4A16_GEMV1_PREFETCH=1 python3 benchmarks/w4a16.py --ms 1,2,4 --gemv1 --out "$RES" 2>&1 \
    | grep -v "Warn\|warn" | tail -16
}

phase_s11a() {
  # session 11, call 1: Nsight Compute on what session 10 could not explain from timings (profile_kernels.sh "s11"):
  # the 4k decode's ~20 us fixed cost (split vs persistent kernel), the fp8 step (~2,500 cycles against ~1,000 of
  # MMA, MUFU or issue each), gemv1 at M = 1, the Gluon backward at d = 128 and the d = 64 persistent forward.
  # ncu's text lands in $RES/profiles (results.tgz); read the stall reasons and DRAM throughput before building more.
  mkdir -p "$RES/profiles"
  OUT="$RES/profiles" timeout 560 bash benchmarks/profile_kernels.sh s11
}

phase_s11b() {
  # session 11: the d = 64 persistent3 forward (3 consumer warpgroups; GPU tests, then its variant check against
  # float64 and timing next to persistent: route _GLUON_FWD_VARIANT[64] = "persistent3" if every case passes and it
  # wins the d = 64 rows), the d = 256 backward route from S = 1024 (GPU test), then the quick table with session
  # 10's routes (d = 256 Gluon backward)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_gluon_wg3.py 2>&1 | tail -3
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_gluon_bwd256.py -k route 2>&1 | tail -2
  timeout 175 env VCHECK_VARIANTS=persistent,persistent3 \
    python3 benchmarks/gluon_attention_variant_check.py > "$OUT/variant_check_s11_wg3.txt" 2>&1
  echo "variant check rc=$?"; grep -v "PASS$" "$OUT/variant_check_s11_wg3.txt" | grep -v "^\s*$" | tail -16
  timeout 200 python3 benchmarks/attention.py --quick --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -12
}

phase_s11c() {
  # session 11: the opt-in W4A16 mma.sync register-operand kernel (w4a16_mma.py). GPU tests, then the M <= 8 rows
  # with its candidates listed and timed (mma_* columns): _MMA_DEFAULT = "1" if the tests pass and it wins rows
  timeout 240 env FXOPT_W4A16_MMA=1 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_w4a16_mma.py \
    2>&1 | tail -3
  timeout 300 python3 benchmarks/w4a16.py --ms 1,2,4,8,16 --gemv1 --mma --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -20
}

phase_s11d() {
  # session 11: the instruction-count cuts of session 10 (offline only until here). fp8: MMA_ROWSUM (row sum of P by
  # a small wgmma; model 817 -> ~920 TFLOP/s) and LAZY_RESCALE: GPU tests, then fp8_rowsum_check (accuracy table +
  # timing; MMA_ROWSUM_DEFAULT = True if accurate and >= +3% on all four rows). bf16: mma_rowsum for the persistent
  # forward (GPU tests, then the variant check with VCHECK_ROWSUM=1)
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gluon_rowsum.py 2>&1 | tail -3
  timeout 200 python3 benchmarks/fp8_rowsum_check.py --out "$RES" 2>&1 | grep -v Warn | tail -20
  [ -f tests/test_attention_gluon_rowsum.py ] && timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_attention_gluon_rowsum.py 2>&1 | tail -3
  timeout 170 env VCHECK_ROWSUM=1 VCHECK_VARIANTS=persistent,persistent3 VCHECK_TIMING_ONLY=1 \
    python3 benchmarks/gluon_attention_variant_check.py \
    > "$OUT/variant_check_s11_rowsum.txt" 2>&1
  echo "variant check (rowsum) rc=$?"; grep -v "PASS$" "$OUT/variant_check_s11_rowsum.txt" | grep -v "^\s*$" | tail -14
}

phase_s11e() {
  # session 11: where the step time goes, by leaving one stage out (timing-only ablation builds; results wrong by
  # design, gated by environment variables): the Gluon backward at d = 128 (variant 3: dQ reductions, the fence,
  # the dQ wgmma, exp2, the warpgroup exchange; docs/notes_attention_bwd_issue_session10.md says how to read them)
  # and the fp8 forward (exp2, row max, rescale, PV, QK, P cast)
  timeout 250 env FXOPT_ATTN_AUTOTUNE=0 python3 benchmarks/gluon_bwd_ablation.py --out "$RES" 2>&1 | grep -v Warn | tail -16
  [ -f benchmarks/fp8_ablation.py ] && timeout 250 python3 benchmarks/fp8_ablation.py --out "$RES" 2>&1 | grep -v Warn \
    | tail -16
}

phase_s11f() {
  # session 11, last call: the d = 64 route rule for persistent3 (timing at 16k tokens per batch, S = 1k-16k, causal
  # and not, against persistent; correctness was checked in s11b), then the backward ablation of s11e
  timeout 230 env VCHECK_TIMING_ONLY=1 VCHECK_D64_SWEEP=1 VCHECK_BUDGET_S=190 VCHECK_VARIANTS=persistent,persistent3 \
    python3 benchmarks/gluon_attention_variant_check.py > "$OUT/variant_check_s11_d64sweep.txt" 2>&1
  echo "d64 sweep rc=$?"; grep "x$\|x  " "$OUT/variant_check_s11_d64sweep.txt" | tail -12
  timeout 250 env FXOPT_ATTN_AUTOTUNE=0 python3 benchmarks/gluon_bwd_ablation.py --out "$RES" 2>&1 | grep -v Warn | tail -16
}

phase_s11g() {
  # session 11: the ablations put the dQ global reductions at 30-34% of the backward step (bit 1), so the dQ
  # reducer-warp kernel (attention_gluon_bwd_dqw.py, from docs/patches/exp-dqw.patch) is timed against variant 3;
  # then the op-level persistent3 route test at d = 64 and the dqw GPU tests
  timeout 200 python3 benchmarks/gluon_bwd_dqw_check.py --out "$RES" 2>&1 | grep -v Warn | tail -20
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_gluon_wg3.py -k op_routes 2>&1 | tail -3
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/test_attention_gluon_bwd_dqw.py 2>&1 | tail -4
}

phase_s12a() {
  # session 12: the routes of session 11 at full length range. The op-level backward route test (d = 128, now the
  # dQ reducer-warp kernel; session 11 ran 3 of its 8 cases), then fwd and fwd+bwd at d = 128 and d = 64 for S = 512-16k
  # with cuDNN and FA2 in the same run (the 0.9x fwd+bwd target at d = 128 was met on the quick rows only)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_kernels.py -k "gpu_gluon_backward_route" \
    2>&1 | tail -3
  timeout 370 python3 benchmarks/attention.py --shapes 128x512,128x1024,128x2048,128x4096,128x8192,128x16384 \
    --tag d128_s12 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -14
}

phase_s12b() {
  timeout 380 python3 benchmarks/attention.py --shapes 64x512,64x1024,64x2048,64x4096,64x8192,64x16384 \
    --tag d64_s12 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -14
  timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_attention_gluon_bwd_dqw.py \
    tests/test_attention_gluon_wg3.py 2>&1 | tail -3
}

phase_s12c() {
  # session 12: the fp8 mma_rowsum build with the ones-tile fill fixed (ptxas 12.8 miscompiled the fp32 -> e4m3
  # splat; found offline in session 11): GPU tests + fp8_rowsum_check (lift the refusal and flip MMA_ROWSUM_DEFAULT
  # if accurate and >= 3% faster on all rows); then the W4A16 mma L2-prefetch tiles (GPU test, M = 1 / 4 / 16 rows)
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gluon_rowsum.py 2>&1 | tail -3
  timeout 200 python3 benchmarks/fp8_rowsum_check.py --out "$RES" 2>&1 | grep -v Warn | tail -16
  timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_w4a16_mma.py -k "l2_prefetch" 2>&1 | tail -3
  timeout 150 python3 benchmarks/w4a16.py --ms 1,4,16 --mma --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -14
}

phase_s12d() {
  # session 12: variant 5 (dQ reducer warp) at d = 64, built offline in session 11: GPU tests (d = 64 and 128), the
  # kernel check against variant 3, then through the op against the Triton backward (route d = 64 to Gluon variant 5
  # if it wins the rows: _GLUON_BWD_HEAD_DIMS / _GLUON_BWD_DQW_DIMS defaults)
  timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_attention_gluon_bwd_dqw.py 2>&1 | tail -3
  timeout 200 python3 benchmarks/gluon_bwd_dqw_check.py --dims 64 --out "$RES" 2>&1 | grep -v Warn | tail -12
  timeout 220 env FXOPT_ATTN_GLUON_BWD_DIMS=64,128,256 FXOPT_ATTN_GLUON_BWD_DQW_DIMS=64,128 python3 benchmarks/attention.py \
    --shapes 64x2048,64x4096,64x16384 --tag d64dqw --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -10
}

phase_s12e() {
  # session 12: where the d = 256 backward's step goes (timing-only ablation bits of _fa3_bwd_kernel_d256, added
  # offline in session 11; a dQ reducer-warp path there needs shared memory the kernel does not have: worth it only
  # if bit 1 saves a large share of the step)
  timeout 280 env FXOPT_ATTN_AUTOTUNE=0 python3 benchmarks/gluon_bwd_ablation.py --dim 256 --out "$RES" 2>&1 \
    | grep -v Warn | tail -16
}

phase_s12f() {
  # session 12: s12a found variant 5 failing to compile at run time (GROUP = 1 arrives as a constexpr; the op fell
  # back to the Triton backward, so the d = 128 table measured Triton). After the fix: the route test, the dqw GPU
  # tests (d = 64 and 128), the d = 128 table again, and the d = 64 op A/B (Gluon variant 5 against Triton)
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_kernels.py -k "gpu_gluon_backward_route" \
    2>&1 | tail -3
  timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_attention_gluon_bwd_dqw.py 2>&1 | tail -3
  timeout 170 python3 benchmarks/attention.py --shapes 128x512,128x1024,128x2048,128x4096,128x8192,128x16384 \
    --tag d128_s12 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -13
  timeout 130 env FXOPT_ATTN_GLUON_BWD_DIMS=64,128,256 FXOPT_ATTN_GLUON_BWD_DQW_DIMS=64,128 python3 benchmarks/attention.py \
    --shapes 64x2048,64x4096,64x16384 --tag d64dqw --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -7
}

phase_s12g() {
  # session 12, last call: the op's backward route test at d = 128 and 64 (variant 5 at both since the fix; first
  # config of each Triton tuner), then the d = 64 table with d = 64 routed to variant 5 from S = 4096
  timeout 150 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_attention_kernels.py \
    -k "gpu_gluon_backward_route" 2>&1 | tail -3
  timeout 170 python3 benchmarks/attention.py --shapes 64x512,64x1024,64x2048,64x4096,64x8192,64x16384 \
    --tag d64_s12 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -13
}

phase_s13a() {
  # session 13, first call: every GPU test (session 12 found the routed d = 128 backward failing to compile at run
  # time, unnoticed for a session: the op fell back to Triton), then the short-sequence backward A/B. Below S = 2048
  # (4096 at d = 64) the op runs the Triton backward, and fwd+bwd is 0.32-0.88x cuDNN there (attention_d128_s12.md);
  # with the floor at 512 the fb_fxopt column is the Gluon backward (variant 5) and fb_fxopt_tritonbwd the Triton one,
  # same run (lower _GLUON_BWD_MIN_SEQ / _GLUON_BWD_MIN_SEQ_BY_DIM where Gluon wins). The GPU tests include the
  # strided-input backward (test_gpu_bwd_grads_like_strided_inputs, the route test's bshd_view cases): if they pass,
  # make FXOPT_ATTN_GLUON_BWD_STRIDED default to 1 (real models pass [B, S, H, D] transposed views)
  timeout 280 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
    tests/test_attention_kernels.py tests/test_attention_gluon_bwd_dqw.py tests/test_attention_gluon_bwd256.py \
    tests/test_attention_gluon_wg3.py 2>&1 | grep -v "Warn\|warn" | tail -8
  timeout 230 env FXOPT_ATTN_GLUON_BWD_MIN_SEQ=512 python3 benchmarks/attention.py \
    --shapes 128x512,128x1024,128x2048,64x512,64x1024,64x2048,64x4096 --tag bwdfloor512 --out "$RES" 2>&1 \
    | grep -v "Warn\|warn" | tail -16
}

phase_s13t() {
  # session 13: the whole one-GPU test suite (last run whole in session 5; since then each session ran the tests of
  # its own features, and session 12 found a route broken for a session). Its own call: up to 560 s.
  timeout 560 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider \
    -p no:warnings -rfE --ignore=tests/test_calibration.py tests 2>&1 | tail -40
}

phase_s13b() {
  # session 13: the op-level forward against the Gluon kernel alone at d = 128 (fwd_fxopt 2.5-7% under fwd_gluon in
  # both session 12 tables, same kernel and arguments; at d = 64 equal; fwd_fxopt always ran right after cuDNN then):
  # with common.round_order (a new predecessor each round) and six rounds, to tell an order effect from a real
  # cost; then the d = 256 rows and the d = 256 backward ablation (phase s12e)
  timeout 150 env FXOPT_BENCH_ROUNDS=6 python3 benchmarks/attention.py --shapes 128x4096,128x16384 --tag fwd_rounds6 \
    --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -6
  timeout 170 python3 benchmarks/attention.py --shapes 256x1024,256x4096,256x16384 --tag d256_s13 --out "$RES" 2>&1 \
    | grep -v "Warn\|warn" | tail -8
  phase_s12e
}

phase_s13c() {
  # session 13, after s13t (9 failures: 8 bf16 mma_rowsum causal cases, opt-in; the known fp8 rowsum bound): the first
  # failing bf16 case in full; where the short-S fwd+bwd time goes, per kernel (ours / cuDNN / FA2); the forward
  # with six rounds (phase s13b's first half)
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings -x --tb=short \
    "tests/test_attention_gluon_rowsum.py::test_gpu_mma_rowsum_matches_float64[gqa_4_2_causal-persistent_d128-bf16]" \
    2>&1 | tail -25
  timeout 150 python3 benchmarks/attention_breakdown.py --shapes 128x512,128x1024,128x2048 --bwd route --tag route \
    --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep -v "^ .*  0\.[0-9]%" | head -90
  timeout 60 python3 benchmarks/attention_breakdown.py --shapes 128x512,128x1024 --bwd gluon --tag gluon --out "$RES" \
    2>&1 | grep "fxopt" -A6 | head -40
  timeout 150 env FXOPT_BENCH_ROUNDS=6 python3 benchmarks/attention.py --shapes 128x4096,128x16384 --tag fwd_rounds6 \
    --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -6
}

phase_s13d() {
  # session 13: the rowsum tests with the unit-roundoff lse bounds; the op's host time per call (s13c found the
  # S = 512 fwd+bwd at 0.67-0.74 ms of kernels but 1.5-1.9 ms per call in attention.py), Triton and Gluon backward
  timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_attention_gluon_rowsum.py tests/test_fp8_gluon_rowsum.py 2>&1 | tail -6
  timeout 90 python3 benchmarks/attention_host_overhead.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | head -120
  timeout 60 env FXOPT_ATTN_GLUON_BWD_MIN_SEQ=0 python3 benchmarks/attention_host_overhead.py 2>&1 \
    | grep "us per call"
}

phase_s13e() {
  # session 13: s13d had the op's fwd+bwd at 1.2-1.3 ms of host time per call against 0.37 ms for its two kernel
  # launches (0.24-0.27 ms for cuDNN's whole fwd+bwd): is it the autograd engine's device thread, the custom op's
  # autograd layer, or the launchers? (A/B: kernel launches from a second thread, a plain autograd.Function)
  timeout 120 python3 benchmarks/attention_host_overhead.py --experiment --out "$RES" 2>&1 | grep "experiment\]"
}

phase_s13f() {
  # session 13, last call: fwd+bwd also replayed from CUDA graphs (fbg_* columns: GPU time; s13c-e found the eager
  # op host-bound at short S), the eager path now a plain autograd.Function (_EagerFlashAttention); the Gluon
  # backward from S = 512 (fb_fxopt) against the Triton one (fb_fxopt_tritonbwd), d = 128 and 64, S = 512-4096
  timeout 215 env FXOPT_ATTN_GLUON_BWD_MIN_SEQ=512 python3 benchmarks/attention.py \
    --shapes 128x512,128x1024,128x2048,128x4096,64x1024,64x2048 --tag fbgraph_floor512 \
    --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -20
}

phase_s13g() {
  # session 13: host time of the Gluon launches with the descriptor layouts cached (attention_gluon.host_layout)
  # against uncached, same run
  timeout 75 python3 benchmarks/attention_host_overhead.py --layout-ab --out "$RES" 2>&1 | grep "layout_ab\]"
}

phase_s14a() {
  # session 14, first call (prepared in session 13): the host-layout A/B (s13g), the fp8 rowsum test with its new lse
  # bound (not yet run), the CUDA-graph training step (reduce-overhead) and the learned-bias / eager-path tests on
  # the GPU, then the d = 128 rows with graph columns (fwdg_* / fbg_*) at every S
  phase_s13g
  timeout 200 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_fp8_gluon_rowsum.py tests/test_attention_models.py tests/test_attention_eager_path.py 2>&1 | tail -8
  timeout 280 python3 benchmarks/attention.py --shapes 128x512,128x1024,128x2048,128x4096,128x8192,128x16384 \
    --tag d128_s14 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -14
}

phase_s14c() {
  # session 14: variant 6 (dQ reductions by TMA reduce-add) on the H200: its GPU tests (d = 64 / 128 against float64,
  # dK / dV bit-identical to variant 3), then the kernel A/B variant 3 / 5 / 6 at S = 1k-16k, then the pending tests
  timeout 150 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_attention_gluon_bwd_dqw.py -k "v6_tma" 2>&1 | tail -6
  timeout 230 python3 benchmarks/gluon_bwd_dqw_check.py --dims 128,64 --seqs 1024,2048,4096,16384 --rounds 3 \
    --kernels dqw,dqtma --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -24
  timeout 170 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_fp8_gluon_rowsum.py tests/test_attention_models.py tests/test_attention_eager_path.py 2>&1 | tail -8
}

phase_s14d() {
  # session 14, after variant 6 became the default: the d = 128 and d = 64 rows with graph columns at every S
  timeout 290 python3 benchmarks/attention.py --shapes 128x512,128x1024,128x2048,128x4096,128x8192,128x16384 \
    --tag d128_s14 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -14
  timeout 250 python3 benchmarks/attention.py --shapes 64x512,64x1024,64x2048,64x4096,64x8192,64x16384 \
    --tag d64_s14 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -14
}

phase_s14e() {
  # session 14: the d = 256 kernel's dQ-by-TMA build (variant 6: dQ tiles in the ring slot's dead Q / dO bytes):
  # GPU tests (9 cases against float64, dK / dV bit-identical to the REDG build), the kernel check / A/B, then the
  # d = 256 rows through the op with it routed
  timeout 150 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_attention_gluon_bwd256.py 2>&1 | tail -6
  timeout 200 python3 benchmarks/gluon_attention_bwd_check.py --quick --dims 256 --variant 6 --out "$RES" 2>&1 \
    | grep -E "bench\]|FAIL|PASS|Error" | tail -24
  timeout 220 env FXOPT_ATTN_GLUON_BWD_D256_TMA=1 python3 benchmarks/attention.py --shapes 256x1024,256x4096,256x16384 \
    --tag d256_s14_tma --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -8
}

phase_s14f() {
  # session 14: d = 256 variant 6 now lets the producer warp issue the dQ reduces (variant 7 = the consumer-issued
  # build of s14e): GPU tests of both, the kernel check / A/B of both, then the d = 256 rows with variant 6 routed
  timeout 150 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_attention_gluon_bwd256.py 2>&1 | tail -6
  timeout 200 python3 benchmarks/gluon_attention_bwd_check.py --quick --dims 256 --variant 6,7 --out "$RES" 2>&1 \
    | grep -E "bench\]|FAIL|Error" | tail -24
  timeout 220 env FXOPT_ATTN_GLUON_BWD_D256_TMA=1 python3 benchmarks/attention.py --shapes 256x1024,256x4096,256x16384 \
    --tag d256_s14 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -8
}

phase_s14g() {
  # session 14, last call: the op-level GPU tests with variant 6 the default at d = 64 / 128 / 256 (routes, models,
  # eager path), then the d = 256 rows at S = 512 with the Gluon floor at 512
  timeout 230 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_attention_kernels.py tests/test_attention_models.py tests/test_attention_eager_path.py \
    tests/test_attention_gluon_bwd256.py -k "route or model or eager or llama or d256" 2>&1 | tail -8
  timeout 60 python3 benchmarks/attention.py --shapes 256x512 --tag d256_512_s14 --out "$RES" 2>&1 \
    | grep -v "Warn\|warn" | tail -4
}

phase_s15b() {
  # session 15, on a two-GPU machine: the whole one-GPU suite (s13t) on GPU 1 and cores 8-31, while the host-path
  # profile (s15a) runs alone on GPU 0 and cores 0-3 (a quiet CPU for host timings)
  ( CUDA_VISIBLE_DEVICES=1 taskset -c 8-31 timeout 560 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 \
      python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:warnings -rfE --ignore=tests/test_calibration.py \
      tests > "$OUT/gpu_suite.txt" 2>&1; echo "gpu suite rc=$? at $SECONDS s" >> "$OUT/gpu_suite.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-3 bash -c "$(declare -f phase_s15a phase_s13g); RES=$RES; phase_s15a"
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== one-GPU suite"; tail -40 "$OUT/gpu_suite.txt"
}

phase_s15c() {
  # session 15, two GPUs: launch plans (fxopt.kernels.launch_plan). GPU 1 / cores 8-31: the whole one-GPU suite
  # with plans on (the default). GPU 0 / cores 0-3 (quiet host): the plan GPU tests, the host-time A/B with plans
  # on / off, then the short-S rows of the attention table (eager columns are the host-bound ones)
  ( CUDA_VISIBLE_DEVICES=1 taskset -c 8-31 timeout 560 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 \
      python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:warnings -rfE --ignore=tests/test_calibration.py \
      tests > "$OUT/gpu_suite.txt" 2>&1; echo "gpu suite rc=$? at $SECONDS s" >> "$OUT/gpu_suite.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-3 timeout 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider -p no:warnings -rfE \
    tests/test_launch_plan_gpu.py 2>&1 | grep -v "^$" | tail -30
  taskset -c 0-3 timeout 120 python3 benchmarks/attention_host_overhead.py \
    --plans-ab 1x1x128x128,32x16x512x128,32x16x512x64,16x16x512x256 --out "$RES" 2>&1 | grep "plans_ab\|stats"
  taskset -c 0-3 timeout 260 python3 benchmarks/attention.py --shapes 128x512,128x1024,64x512,64x1024,256x512,256x1024 \
    --tag short_plans_s15 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -16
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== one-GPU suite"; grep -v "PytestBenchmark\|warner(" "$OUT/gpu_suite.txt" | tail -30
}

phase_s15d() {
  # session 15: after the plan templates stopped holding the recorded call's tensors (s15c: the tiny-Llama
  # reduce-overhead step failed on 5 untracked tensors in the cudagraph pool; attention.py died on a broken capture)
  timeout 200 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -s -m gpu -p no:cacheprovider -p no:warnings -rfE \
    tests/test_launch_plan_gpu.py "tests/test_attention_models.py::test_gpu_tiny_llama_training_step_under_cuda_graphs" \
    2>&1 | grep -v "^$" | tail -25
  timeout 120 python3 benchmarks/attention.py --shapes 128x512 --tag diag_s15 --out "$RES" 2>&1 \
    | grep -v "Warn\|warn" | tail -40
}

phase_s15e() {
  # session 15: short-S rows with launch plans (128 x 512 is in s15d) and the host profile of the op with plans on
  timeout 260 python3 benchmarks/attention.py --shapes 64x512,256x512,128x1024 --tag short_plans_s15 --out "$RES" \
    2>&1 | grep -v "Warn\|warn" | grep "^|"
  timeout 120 python3 benchmarks/attention_host_overhead.py --out "$RES" 2>&1 | grep -v "Warn\|warn" \
    | grep -A22 "profile eager Function, by tottime\|torch.profiler eager" | head -60
}

phase_s15f() {
  # session 15, last call: the plan GPU tests after the allocation layout change (whole-view results allocated in
  # their shape, workspaces from one buffer) and the faster key; the host A/B; the d = 128 / 256 S = 512 rows
  timeout 100 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings -rfE \
    tests/test_launch_plan_gpu.py "tests/test_attention_models.py::test_gpu_tiny_llama_training_step_under_cuda_graphs" \
    2>&1 | tail -4
  timeout 45 python3 benchmarks/attention_host_overhead.py --plans-ab 32x16x512x128 --out "$RES" 2>&1 \
    | grep "plans_ab\|stats"
  for sh in 128x512 256x512; do
    timeout 80 python3 benchmarks/attention.py --shapes $sh --tag short_plans_s15f_$sh --out "$RES" \
      2>&1 | grep -v "Warn\|warn" | grep "^|" | tail -2
  done
}

phase_s19w() {
  # prepared in session 18 (docs/notes_session18.md, "4b"), one GPU, at most 500 s: the opt-in Gluon W4A16 PDL and
  # register-major split-K workspace against the float reference (plus every inflight / four-consumer case), every
  # listed candidate with both opt-ins through the op, then the per-call decomposition with both (K = 256 rows:
  # the epilogue directly). The tuner table with both listed is phase s19wt (a second call: 600 s per call)
  timeout 150 env FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings -rfE \
    tests/test_w4a16_gluon_inflight.py 2>&1 | tail -6
  FXOPT_W4A16_GLUON_REGMAJOR=1 FXOPT_W4A16_GLUON_PDL=1 timeout 150 env FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q \
    -m gpu -p no:cacheprovider -p no:warnings -rfE tests/test_w4a16_kernels.py -k test_gpu_gluon 2>&1 | tail -4
  timeout 200 python3 benchmarks/w4a16_gluon_probe.py --ms 16,32,64 --tiles 128x2,256x2 --probes 0,1 --fixed --pdl \
    --regmajor --out "$RES" 2>&1 | grep "^|" | cut -c1-260
}

phase_s19wt() {
  # the tuner's table at M = 16-128 with the session-18 opt-ins listed (labels "ws=regmajor" / "pdl"): keep what wins
  # by >= 3% on a shape and make it a default candidate (writes w4a16_subset.*)
  FXOPT_W4A16_GLUON_REGMAJOR=1 FXOPT_W4A16_GLUON_PDL=1 timeout 500 python3 benchmarks/w4a16.py --ms 16,32,64,128 \
    --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" | cut -d'|' -f2-9,14 | tail -20
}

side_by_side() {  # GPU0_PHASE GPU1_PHASE: one phase per GPU of a two-GPU host (cores 0-15 / 16-31); GPU 1 writes
  # its tables to $RES/gpu1 and its log to $OUT/gpu1.txt, printed after GPU 0's phase
  ( export CUDA_VISIBLE_DEVICES=1 RES="$RES/gpu1"; mkdir -p "$RES"
    taskset -c 16-31 bash -c "$(declare -f "phase_$2"); phase_$2" > "$OUT/gpu1.txt" 2>&1
    echo "$2 rc=$? at $SECONDS s" >> "$OUT/gpu1.txt" ) &
  CUDA_VISIBLE_DEVICES=0 RES="$RES" taskset -c 0-15 bash -c "$(declare -f "phase_$1"); phase_$1"
  wait
  echo "== GPU 1: $2"; cat "$OUT/gpu1.txt"
}

phase_s20x2() {  # s20a (GPU 0) and s20b (GPU 1) in one call
  side_by_side s20a s20b
}

phase_s19x2() {  # session 19: both session-18 calls in one, s19w (opt-in GPU tests, probes) and s19wt (tuner table)
  side_by_side s19w s19wt
}

phase_s20d() {  # session 20, two GPUs: the whole W4A16 table with the fused-only default (GPU 0), every GPU test
  # but the attention-kernel files and the GPU calibration (GPU 1: W4A16, FP8, attention pass and models, parallel)
  side_by_side s20c s20rest
}

phase_s20rest() {
  timeout 500 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider \
    -p no:warnings -rfE --ignore=tests/test_calibration.py --ignore=tests/test_attention_kernels.py \
    --ignore=tests/test_attention_gluon_wg3.py --ignore=tests/test_attention_gluon_rowsum.py \
    --ignore=tests/test_attention_gluon_bwd256.py --ignore=tests/test_attention_gluon_bwd_d64.py \
    --ignore=tests/test_attention_gluon_bwd_dqw.py --ignore=tests/test_attention_gluon_bwd_v4.py \
    --ignore=tests/test_attention_decode.py tests 2>&1 | tail -12
}

phase_s20e() {
  # session 20 (one GPU, ~200 s): why the fused Gluon tiles trail cuBLAS at M = 4096 (issue 5's 0.95x target with
  # the fused-only default): BM 256 (the tuner's pick; ptxas serializes every wgmma, C7512) against BM 128 "async"
  # (one wgmma in flight), full kernel / loads only / compute only / mma only (no dequantization)
  timeout 500 python3 benchmarks/w4a16_gluon_probe.py --ms 4096 --probes 0,1,2,4 \
    --large 256/default/32,256/default/64,128/async/64,128/async/32 --out "$RES" 2>&1 | grep -v "Warn\|warn" \
    | grep "^{" | cut -c1-400
}

phase_s20f() {  # session 20, two GPUs: the whole W4A16 table with the two-round tuner (GPU 0); the W4A16 GPU tests
  # with tuning ON (GPU 1: the tuner's two rounds run in every op call of a new shape)
  side_by_side s20c s20wt
}

phase_s20wt() {
  timeout 540 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE tests/test_w4a16_kernels.py \
    tests/test_w4a16_pass.py 2>&1 | tail -6
}

phase_s20g() {  # session 20, one GPU (~500 s): s20wt with a shorter limit, then the M <= 16 rows with the two-round tuner
  timeout 300 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE tests/test_w4a16_kernels.py \
    tests/test_w4a16_pass.py 2>&1 | tail -6
  timeout 240 python3 benchmarks/w4a16.py --ms 1,2,4,8,16 --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" \
    | cut -d'|' -f2-9,14 | tail -22
}

phase_s20h() {  # session 20, one GPU (~250 s): the back-to-back small-M tuner timing, its GPU tests, then the M <= 16 rows
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings -rfE tests/test_w4a16_kernels.py \
    -k "streamed or tuner_file" 2>&1 | tail -3
  timeout 200 python3 benchmarks/w4a16.py --ms 1,2,4,8,16 --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" \
    | cut -d'|' -f2-9,14 | tail -22
}

phase_s20c() {
  # prepared in session 19 (one GPU, ~330 s): the whole W4A16 table on the final code, tinygemm now timed at every M
  # (the session-19 table skipped it above M = 256); run it after settling the dequant + cuBLAS question (s20b)
  timeout 560 python3 benchmarks/w4a16.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" | cut -d'|' -f2-9,14 \
    | tail -46
}

phase_s20b() {
  # prepared in session 19 (one GPU, ~400 s): can W4A16 drop the dequant + cuBLAS path (issue 5: "never writing a
  # 16-bit weight to memory")? The GPU test of the fused-only and large-M Gluon opt-ins, then the M = 256-4096 rows
  # fused-only (FXOPT_W4A16_DEQUANT_MATMUL=0, Gluon listed above 256) against the default table's rows (w4a16.md)
  timeout 150 env FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings -rfE \
    tests/test_w4a16_kernels.py -k "large_m_and_fused_only or tuner_file or op_realistic" 2>&1 | tail -4
  FXOPT_W4A16_DEQUANT_MATMUL=0 FXOPT_W4A16_GLUON_LARGE_M=1 timeout 400 python3 benchmarks/w4a16.py \
    --ms 256,1024,4096 --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" | cut -d'|' -f2-9,14 | tail -14
}

phase_s20a() {
  # prepared in session 19 for the next session (one GPU, ~200 s): the attention GPU tests added after the s19t run
  # (head dims 112 / 160 / 192 cases of test_gpu_forward_backward, the bf16 property test, one tuning per length
  # bucket); issue 3 can be resolved once these pass (docs/notes_attention.md, session-19 section)
  timeout 400 env FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_attention_kernels.py -k "gpu_forward_backward or gpu_property or autotune_once" 2>&1 | tail -8
}

phase_s19t() {
  # session 19, two GPUs, final code: every @pytest.mark.gpu test but the GPU calibration. GPU 1 / cores 16-31: the
  # attention kernel files; GPU 0 / cores 0-15: the rest (attention pass and models, FP8, W4A16, launch plans, parallel)
  ( export CUDA_VISIBLE_DEVICES=1
    taskset -c 16-31 timeout 470 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 12 \
      -p no:cacheprovider -p no:warnings -rfE tests/test_attention_kernels.py tests/test_attention_gluon_wg3.py \
      tests/test_attention_gluon_rowsum.py tests/test_attention_gluon_bwd256.py tests/test_attention_gluon_bwd_d64.py \
      tests/test_attention_gluon_bwd_dqw.py tests/test_attention_gluon_bwd_v4.py tests/test_attention_decode.py \
      > "$OUT/gpu_suite_attn.txt" 2>&1
    echo "attention kernel suite rc=$? at $SECONDS s" >> "$OUT/gpu_suite_attn.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 timeout 470 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 12 \
    -p no:cacheprovider -p no:warnings -rfE --ignore=tests/test_calibration.py \
    --ignore=tests/test_attention_kernels.py --ignore=tests/test_attention_gluon_wg3.py \
    --ignore=tests/test_attention_gluon_rowsum.py --ignore=tests/test_attention_gluon_bwd256.py \
    --ignore=tests/test_attention_gluon_bwd_d64.py --ignore=tests/test_attention_gluon_bwd_dqw.py \
    --ignore=tests/test_attention_gluon_bwd_v4.py --ignore=tests/test_attention_decode.py tests \
    > "$OUT/gpu_suite_rest.txt" 2>&1
  echo "rest suite rc=$? at $SECONDS s" >> "$OUT/gpu_suite_rest.txt"
  unset CUDA_VISIBLE_DEVICES
  wait
  for f in gpu_suite_attn gpu_suite_rest; do echo "== $f"; grep -v "PytestBenchmark\|warner(" "$OUT/$f.txt" | tail -12; done
}

phase_s19c() {
  # session 19, two GPUs, final code: fresh tables for the closing note. GPU 0 / cores 0-15: the whole attention
  # table. GPU 1 / cores 16-31: the FP8 attention speed and accuracy tables (phase fp8)
  ( export CUDA_VISIBLE_DEVICES=1 RES="$RES/gpu1"; mkdir -p "$RES"
    taskset -c 16-31 bash -c "$(declare -f phase_fp8); phase_fp8" > "$OUT/gpu1.txt" 2>&1
    echo "fp8 rc=$? at $SECONDS s" >> "$OUT/gpu1.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 timeout 470 python3 benchmarks/attention.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" \
    | cut -c1-200 | tail -40
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== GPU 1: fp8"; cat "$OUT/gpu1.txt" | cut -c1-250 | tail -45
}

phase_s19b() {
  # session 19, two GPUs, the register-major workspace now the default (fxopt/kernels/w4a16.py _gluon_configs).
  # GPU 1 / cores 16-31: the whole W4A16 table (every M; benchmarks/results/w4a16.md). GPU 0 / cores 0-15: the
  # register-major GPU tests, then every W4A16 GPU test (tuner candidates, pass) with 6 workers
  ( export CUDA_VISIBLE_DEVICES=1 RES="$RES/gpu1"; mkdir -p "$RES"
    taskset -c 16-31 timeout 540 python3 benchmarks/w4a16.py --out "$RES" > "$OUT/gpu1.txt" 2>&1
    echo "w4a16 table rc=$? at $SECONDS s" >> "$OUT/gpu1.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-15 timeout 200 env FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider \
    -p no:warnings -rfE tests/test_w4a16_gluon_inflight.py -k "regmajor or pdl" 2>&1 | tail -4
  taskset -c 0-15 timeout 320 env FXOPT_W4A16_NO_TUNE=1 python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider \
    -p no:warnings -rfE tests/test_w4a16_kernels.py tests/test_w4a16_pass.py 2>&1 | tail -6
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== GPU 1: W4A16 table"; grep -v "Warn\|warn" "$OUT/gpu1.txt" | grep "^|\|rc=" | cut -d'|' -f2-9,14 | tail -50
}

phase_s17d() {
  # session 17, two GPUs, final code. GPU 1 / cores 8-31: the one-GPU suite except the three Gluon forward kernel
  # files (143 / 143 with the packed P cast in s17a, the same code as today's default). GPU 0 / cores 0-3: the W4A16
  # table (the PDL tile's second split on 8192 x 28672). In the session-17 run the table printed nothing (most likely cut by its
  # 330 s limit: the tuner compiles every candidate on 4 cores while the suite holds the others; it then ran in 39 s on
  # the warm machine, tuner cache filled); give it the whole host, or more time, on a cold machine
  ( CUDA_VISIBLE_DEVICES=1 taskset -c 8-31 timeout 480 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 \
      python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:warnings -rfE --ignore=tests/test_calibration.py \
      --ignore=tests/test_attention_kernels.py --ignore=tests/test_attention_gluon_wg3.py \
      --ignore=tests/test_attention_gluon_rowsum.py tests > "$OUT/gpu_suite.txt" 2>&1
    echo "gpu suite rc=$? at $SECONDS s" >> "$OUT/gpu_suite.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-3 timeout 330 python3 benchmarks/w4a16.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" \
    | cut -d'|' -f2-9 | tail -46
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== one-GPU suite"; grep -v "PytestBenchmark\|warner(" "$OUT/gpu_suite.txt" | tail -30
}

phase_s17c() {
  # session 17, two GPUs. GPU 0 / cores 0-3: the whole attention table (P cast late now on by default in the
  # persistent forward). GPU 1 / cores 8-31: the read-rate probe with the TMA ring and cuBLAS rows, then the mma
  # W4A16 GPU tests (timed out at 150 s in s17a)
  ( export CUDA_VISIBLE_DEVICES=1
    taskset -c 8-31 timeout 150 python3 benchmarks/w4a16_layout_probe.py --bns 128,256 --warps 4 --out "$RES" \
      > "$OUT/gpu1.txt" 2>&1
    echo "probe rc=$? at $SECONDS s" >> "$OUT/gpu1.txt"
    taskset -c 8-31 timeout 280 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -p no:warnings -rfE \
      tests/test_w4a16_mma.py > "$OUT/gpu_tests.txt" 2>&1
    echo "mma tests rc=$? at $SECONDS s" >> "$OUT/gpu_tests.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-3 timeout 450 python3 benchmarks/attention.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" \
    | cut -c1-330 | tail -40
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== probe"; grep -v "^{" "$OUT/gpu1.txt" | tail -5; grep "tma\|cublas\|flat" "$RES/w4a16_layout_probe.md"
  echo "== mma tests"; grep -v "PytestBenchmark\|warner(" "$OUT/gpu_tests.txt" | tail -8
}

phase_s17b() {
  # session 17, two GPUs. GPU 1 / cores 8-31: the packed-weight read-rate probe (row-major [K/8, N] against
  # column panels [N/BN, K/8, BN], and a flat read). GPU 0 / cores 0-3: the whole W4A16 table with today's tuner
  ( export CUDA_VISIBLE_DEVICES=1
    taskset -c 8-31 timeout 200 python3 benchmarks/w4a16_layout_probe.py --warps 4,8 --out "$RES" > "$OUT/gpu1.txt" 2>&1
    echo "probe rc=$? at $SECONDS s" >> "$OUT/gpu1.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-3 timeout 420 python3 benchmarks/w4a16.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" | cut -c1-250 \
    | tail -48
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== probe"; cat "$RES/w4a16_layout_probe.md" 2>/dev/null || tail -20 "$OUT/gpu1.txt"
}

phase_s17a() {
  # prepared in session 16 for the next device session (x2): GPU 0 / cores 0-3 the A/B of the persistent forward
  # with P cast late (FXOPT_ATTN_GLUON_CAST_LATE=1: no PRMT half-swaps; persistent3 d = 64 step 452 -> 419
  # instructions offline), base / cast-late twice, bit identity against the first process. GPU 1 / cores 8-31: the
  # Gluon forward GPU tests with cast-late on, then the W4A16 register-cap A/B (s16g) and the mma GPU tests
  ( export CUDA_VISIBLE_DEVICES=1
    taskset -c 8-31 timeout 200 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_ATTN_GLUON_CAST_LATE=1 python3 -m pytest -q -m gpu \
      -n 12 -p no:cacheprovider -p no:warnings -rfE tests/test_attention_kernels.py tests/test_attention_gluon_wg3.py \
      tests/test_attention_gluon_rowsum.py > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests rc=$? at $SECONDS s" >> "$OUT/gpu_tests.txt"
    taskset -c 8-31 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings -rfE \
      tests/test_w4a16_mma.py >> "$OUT/gpu_tests.txt" 2>&1
    echo "mma tests rc=$? at $SECONDS s" >> "$OUT/gpu_tests.txt"
    taskset -c 8-31 bash -c "$(declare -f phase_s16g); RES=$RES; phase_s16g" > "$OUT/gpu1_regcap.txt" 2>&1 ) &
  export CUDA_VISIBLE_DEVICES=0
  for side in base castlate base2 castlate2; do
    case $side in base*) c=0;; *) c=1;; esac
    taskset -c 0-3 timeout 110 env FXOPT_ATTN_GLUON_CAST_LATE=$c python3 benchmarks/attention_fwd_ab.py \
      --label $side --ref /tmp/fxopt_fwd_ab --out "$RES" 2>&1 | grep "^|\|Error" | tail -20
  done
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== GPU tests"; grep -v "PytestBenchmark\|warner(" "$OUT/gpu_tests.txt" | tail -15
  echo "== W4A16 register cap"; cat "$OUT/gpu1_regcap.txt"
}

phase_s16g() {
  # session 16, last call: the register cap on the M <= 8 mma.sync W4A16 tile (more resident CTAs for a
  # latency-bound loop), M = 1 / 8 on the four shapes
  timeout 150 python3 benchmarks/w4a16_mma_regcap_ab.py --caps 96 --ms 1,8 --out "$RES" 2>&1 | grep -v "Warn\|warn" \
    | grep "^|\|Error\|error" | tail -14
}

phase_s16f() {
  # session 16, two GPUs, Nsight Compute (profile_kernels.sh sets s16 / s16w, one per GPU): the short causal
  # forward against the non-causal one and the 4k causal one; the M = 1 / 8 mma.sync W4A16 kernel
  ( export CUDA_VISIBLE_DEVICES=1; OUT="$RES" bash benchmarks/profile_kernels.sh s16w > "$OUT/prof_w4.txt" 2>&1 ) &
  export CUDA_VISIBLE_DEVICES=0
  OUT="$RES" bash benchmarks/profile_kernels.sh s16 2>&1
  unset CUDA_VISIBLE_DEVICES
  wait
  cat "$OUT/prof_w4.txt"
}

phase_s16e() {
  # session 16, two GPUs: the persistent Gluon forward's unmasked loop unrolled by two (FXOPT_ATTN_GLUON_UNROLL2,
  # then default 64,128; opt-in since). GPU 0 / cores 0-3: the build A/B, rolled / unrolled / rolled / unrolled (graph-timed, bit
  # identity against the first process). GPU 1 / cores 8-31: the Gluon forward GPU tests with the unrolled default,
  # then the d = 64 / 128 rows of the attention table with it
  ( export CUDA_VISIBLE_DEVICES=1
    taskset -c 8-31 timeout 240 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider \
      -p no:warnings -rfE tests/test_attention_kernels.py tests/test_attention_gluon_rowsum.py \
      tests/test_attention_gluon_wg3.py tests/test_launch_plan_gpu.py tests/test_attention_models.py \
      > "$OUT/gpu_tests.txt" 2>&1; echo "gpu tests rc=$? at $SECONDS s" >> "$OUT/gpu_tests.txt"
    taskset -c 8-31 timeout 200 python3 benchmarks/attention.py --shapes 64x1024,64x4096,64x16384,128x1024,128x4096,128x16384 \
      --tag unroll2_s16 --out "$RES" > "$OUT/gpu1_table.txt" 2>&1; echo "table done at $SECONDS s" >> "$OUT/gpu1_table.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  for side in rolled unrolled rolled2 unrolled2; do
    case $side in rolled*) u="";; *) u="64,128";; esac
    taskset -c 0-3 timeout 110 env FXOPT_ATTN_GLUON_UNROLL2="$u" python3 benchmarks/attention_fwd_ab.py --label $side \
      --ref /tmp/fxopt_fwd_ab --out "$RES" 2>&1 | grep "^|\|Error" | tail -20
  done
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== GPU tests"; grep -v "PytestBenchmark\|warner(" "$OUT/gpu_tests.txt" | tail -15
  echo "== table"; grep "^|\|done" "$OUT/gpu1_table.txt" | cut -c1-330 | tail -16
}

phase_s16d() {
  # session 16, two GPUs, final code. GPU 0 / cores 0-3: the whole attention table (the folded causal mask changed
  # every causal row; d = 64 causal below 1k keys now on the Triton forward). GPU 1 / cores 8-31: the mask A/B with
  # graph-timed rows (s16c timed the direct Gluon call eagerly: host-bound at S = 512), then the fp8 table
  ( export CUDA_VISIBLE_DEVICES=1
    for m in old new; do
      taskset -c 8-31 timeout 100 python3 benchmarks/attention_mask_ab.py --mask $m --tag _s16 --ref /tmp/fxopt_ab \
        --out "$RES" > "$OUT/gpu1.txt.$m" 2>&1
    done
    taskset -c 8-31 timeout 330 python3 benchmarks/fp8_attention.py --dims 128 --out "$RES" > "$OUT/gpu1.txt.fp8" 2>&1
    echo "gpu1 done at $SECONDS s" >> "$OUT/gpu1.txt.fp8" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-3 timeout 450 python3 benchmarks/attention.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" \
    | cut -c1-330 | tail -40
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== mask A/B"; grep -h "^|\|Error" "$OUT/gpu1.txt.old" "$OUT/gpu1.txt.new"
  echo "== fp8"; grep -v "Warn\|warn" "$OUT/gpu1.txt.fp8" | tail -22
}

phase_s16c() {
  # session 16, two GPUs: the causal mask with the Sk bound folded in (one compare per element). GPU 1 / cores 8-31:
  # the GPU tests of every kernel whose mask changed (Gluon / Triton forward, fp8 Gluon / Triton). GPU 0 / cores 0-3:
  # the mask A/B (old, new, old again: drift), then the short causal rows of the attention table
  ( CUDA_VISIBLE_DEVICES=1 taskset -c 8-31 timeout 420 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 12 \
      -p no:cacheprovider -p no:warnings -rfE tests/test_attention_kernels.py tests/test_attention_gluon_wg3.py \
      tests/test_attention_gluon_rowsum.py tests/test_fp8_attention.py tests/test_fp8_gluon_persistent.py \
      tests/test_fp8_gluon_poly.py tests/test_fp8_gluon_rowsum.py tests/test_attention_models.py \
      > "$OUT/gpu_tests.txt" 2>&1; echo "gpu tests rc=$? at $SECONDS s" >> "$OUT/gpu_tests.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  for m in old new old; do
    taskset -c 0-3 timeout 120 python3 benchmarks/attention_mask_ab.py --mask $m --ref /tmp/fxopt_ab --out "$RES" 2>&1 \
      | grep "^|\|Error\|error" | tail -10
  done
  taskset -c 0-3 timeout 200 python3 benchmarks/attention.py --shapes 64x512,128x512,128x1024,256x512 \
    --tag causal_mask_s16 --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" | cut -c1-420 | tail -10
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== GPU tests"; grep -v "PytestBenchmark\|warner(" "$OUT/gpu_tests.txt" | tail -25
}

phase_s16b() {
  # session 16, two GPUs: GPU 1 / cores 8-31 the whole one-GPU suite with the final plan code (the W4A16 plan tests
  # included); GPU 0 / cores 0-3 (quiet host for the eager columns) the whole attention table with plans
  ( CUDA_VISIBLE_DEVICES=1 taskset -c 8-31 timeout 540 env FXOPT_ATTN_AUTOTUNE=0 FXOPT_W4A16_NO_TUNE=1 \
      python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:warnings -rfE --ignore=tests/test_calibration.py \
      tests > "$OUT/gpu_suite.txt" 2>&1; echo "gpu suite rc=$? at $SECONDS s" >> "$OUT/gpu_suite.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  taskset -c 0-3 timeout 420 python3 benchmarks/attention.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" \
    | cut -c1-400 | tail -40
  unset CUDA_VISIBLE_DEVICES
  wait
  echo "== one-GPU suite"; grep -v "PytestBenchmark\|warner(" "$OUT/gpu_suite.txt" | tail -30
}

phase_s16a() {
  # prepared in session 15 (device time spent): the launch-plan GPU tests with the final code (s15f cut the
  # tiny-Llama reduce-overhead test at its 100 s limit), the opt-in W4A16 plans (tests/test_w4a16_launch_plan_gpu.py:
  # if they pass, set w4a16._LAUNCH_PLANS on by default), the eager-path tests; then the whole attention table with
  # plans (its eager columns at every S; attention.md still has session 14's)
  timeout 200 env FXOPT_ATTN_AUTOTUNE=0 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -p no:warnings -rfE \
    tests/test_launch_plan_gpu.py tests/test_w4a16_launch_plan_gpu.py tests/test_attention_eager_path.py \
    "tests/test_attention_models.py::test_gpu_tiny_llama_training_step_under_cuda_graphs" 2>&1 | tail -12
  timeout 380 python3 benchmarks/attention.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | grep "^|" | tail -40
}

phase_s15a() {
  # prepared in session 14 for the next device session: where the eager op's host time goes (cProfile of the custom
  # op and of the eager autograd.Function path, wall time per launch path) and the descriptor-layout cache A/B
  timeout 150 python3 benchmarks/attention_host_overhead.py --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -150
  phase_s13g
}

phase_s14b() {
  # session 14: d = 64 and d = 256 rows with graph columns
  timeout 280 python3 benchmarks/attention.py --shapes 64x512,64x1024,64x2048,64x4096,64x8192,64x16384 \
    --tag d64_s14 --out "$RES" 2>&1 | grep -v "Warn\|warn" | tail -14
  timeout 250 python3 benchmarks/attention.py --shapes 256x1024,256x4096,256x16384 --tag d256_s14 --out "$RES" \
    2>&1 | grep -v "Warn\|warn" | tail -8
}

phase_largem() {
  # the opt-in split-K M = 256 Gluon W4A16 tiles (FXOPT_W4A16_GLUON_LARGEM=1; keep them if the test passes and the
  # M = 256 rows improve): the GPU test, then the M = 64 / 256 rows with them listed
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_w4a16_kernels.py -k "largem" 2>&1 | tail -4
  timeout 240 env FXOPT_W4A16_GLUON_LARGEM=1 python3 benchmarks/w4a16.py --ms 256 --out "$RES" 2>&1 \
    | grep -v "Warn\|warn" | tail -12
}

phase_calib() {
  timeout 330 python3 benchmarks/calibration_speed.py --out "$RES" 2>&1 | grep -v "it/s\]$" | tail -30
}

for p in "${@:-demo tests parallel}"; do
  for q in $p; do
    { echo "===== phase $q (start at $SECONDS s)"; "phase_$q"; echo "===== phase $q done at $SECONDS s"; } 2>&1 \
      | tee -a "$OUT/session_log.txt"
  done
done
if [ -n "$(ls -A "$RES")" ]; then tar czf "$OUT/results.tgz" -C "$RES" .; fi
rm -rf "$RES"
