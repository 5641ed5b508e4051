#!/bin/bash
# Nsight Compute on the kernels whose speed is short of their targets (H200, one GPU). Writes $OUT/ncu_*.txt.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/fxopt_out}
mkdir -p "$OUT"
export FXOPT_ATTN_AUTOTUNE=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
prof() {  # name kernel-regex what
  timeout 90 ncu --clock-control none -k "regex:$2" --launch-skip 3 --launch-count 1 $SECTIONS \
    python3 benchmarks/profile_kernels.py "$3" > "$OUT/ncu_$1.txt" 2>&1
  rc=$?; echo "== $1 ($3): rc=$rc"; [ $rc -ne 0 ] && tail -5 "$OUT/ncu_$1.txt"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issued Ipc|No Eligible|Dynamic Shared|Waves Per SM" "$OUT/ncu_$1.txt" | head -16
}
# WHAT sets: default (the kernels short of their targets), "w4stalls" (stall reasons of the small-M W4A16 kernels),
# "s11" (session 10's open questions: why the 4k decode has a ~20 us fixed cost, what the fp8 step of ~2,500 cycles
# waits on, what bounds gemv1 at M = 1, the Gluon backward at d = 128 and the d = 64 persistent forward)
case "${1:-default}" in
  s11)
    prof decode4k_split "_attn_fwd_split" decode:8:32:4096:128
    prof decode4k_persistent "_decode_persistent_kernel" decode:8:32:4096:128:persistent
    prof w4_m1_gemv1_28672 "_w4a16_gemv1_kernel" w4a16:1:8192:28672:gemv1:1:128:7:4:1
    prof w4_m1_gemv1_8192 "_w4a16_gemv1_kernel" w4a16:1:8192:8192:gemv1:1:256:16:4:1
    prof fp8_fwd_d128 "_fp8_fa3_fwd_kernel" fp8:4:16:4096:128:0
    # the Gluon backward (variant 3 = _fa3_bwd_kernel_v1) with per-instruction stall samples and the real clock:
    # docs/notes_attention_bwd_issue_session10.md (read the samples on MEMBAR.ALL.CTA, WARPGROUP.DEPBAR,
    # SYNCS.PHASECHK and BAR.SYNC)
    timeout 120 ncu --clock-control none -k regex:_fa3_bwd_kernel_v1 --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section SourceCounters \
      --metrics sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active \
      --import-source no -o "$OUT/ncu_bwd_v3" python3 benchmarks/profile_kernels.py bwd:4:16:4096:128:0 \
      > "$OUT/ncu_bwd_d128_log.txt" 2>&1
    echo "== bwd_d128: rc=$?"
    if [ -f "$OUT/ncu_bwd_v3.ncu-rep" ]; then
      ncu -i "$OUT/ncu_bwd_v3.ncu-rep" > "$OUT/ncu_bwd_d128.txt" 2>&1
      ncu -i "$OUT/ncu_bwd_v3.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_bwd_v3_sass.csv" 2>&1
      rm -f "$OUT/ncu_bwd_v3.ncu-rep"
      grep -E "Duration|SM Frequency|Issue Slots Busy|Warp Cycles Per Issued|No Eligible" "$OUT/ncu_bwd_d128.txt" | head -8
    fi
    prof fwd_d64 "_fa3_fwd_persistent_kernel" attn:4:32:4096:64:0
    ;;
  s19)  # session 19: the issue-3 rows still short of a target, with pipe utilisation: d = 64 forward (exp-bound?)
    # causal and not against d = 128 causal at 4k, the d = 256 backward at 4k, the 4k decode's split and combine
    SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second"
    prof fwd_d64_4kc "_fa3_fwd_persistent" attn:4:32:4096:64:1
    prof fwd_d64_4k "_fa3_fwd_persistent" attn:4:32:4096:64:0
    prof fwd_d128_4kc "_fa3_fwd_persistent" attn:4:16:4096:128:1
    prof bwd_d256_4k "_fa3_bwd_kernel_d256" bwd:4:8:4096:256:0
    prof bwd_d256_8kc "_fa3_bwd_kernel_d256" bwd:2:8:8192:256:1
    prof decode4k_split "_attn_fwd_split" decode:8:32:4096:128
    prof decode4k_combine "combine" decode:8:32:4096:128
    ;;
  s16)  # session 16: why short causal forwards trail cuDNN (d = 128, S = 512, causal against not and against 4k
    # causal), and what bounds the M = 1 mma.sync W4A16 kernel (the tuner's pick at M = 1-8)
    prof fwd_d128_512c "_fa3_fwd_persistent_kernel" attn:32:16:512:128:1
    prof fwd_d128_512 "_fa3_fwd_persistent_kernel" attn:32:16:512:128:0
    prof fwd_d128_4kc "_fa3_fwd_persistent_kernel" attn:4:16:4096:128:1
    ;;
  s16w)
    prof w4_m1_mma_28672 "_w4a16_mma_kernel" w4mma:1:8192:28672:128:2:4:1
    prof w4_m1_mma_8192 "_w4a16_mma_kernel" w4mma:1:8192:8192:128:8:4:1
    prof w4_m8_mma_8192 "_w4a16_mma_kernel" w4mma:8:8192:8192:128:8:4:1
    ;;
  s18)  # session 18: what the Gluon W4A16 consumers wait on at M = 16 / 64 (the kernel runs at its compute-only probe's
    # time, not at its loads-only one: benchmarks/results/w4a16_gluon_probe.md); per-instruction stall samples
    for spec in w4g_m64:64:8192:8192:64:128:0 w4g_m16:16:8192:8192:16:128:0; do
      name=${spec%%:*}; what=w4gluon:${spec#*:}
      timeout 150 ncu --clock-control none -k regex:_w4a16_gluon_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --metrics sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
        --import-source no -o "$OUT/ncu_$name" python3 benchmarks/profile_kernels.py "$what" > "$OUT/ncu_${name}_log.txt" 2>&1
      echo "== $name: rc=$?"
      if [ -f "$OUT/ncu_$name.ncu-rep" ]; then
        ncu -i "$OUT/ncu_$name.ncu-rep" > "$OUT/ncu_$name.txt" 2>&1
        ncu -i "$OUT/ncu_$name.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_${name}_sass.csv" 2>&1
        rm -f "$OUT/ncu_$name.ncu-rep"
        grep -E "Duration|SM Frequency|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|DRAM Throughput|L2 Cache Throughput|Tensor" "$OUT/ncu_$name.txt" | head -12
      fi
    done
    ;;
  s18b)  # session 18: how evenly the SMs finish (SM active cycles min / avg / max against the elapsed cycles)
    for spec in w4g_m64:64:8192:8192:64:128:0 w4g_m64_compute:64:8192:8192:64:128:2 w4g_m16:16:8192:8192:16:128:0 \
        w4g_m64_28672:64:8192:28672:64:256:0; do
      name=${spec%%:*}; what=w4gluon:${spec#*:}
      timeout 100 ncu --clock-control none -k regex:_w4a16_gluon_kernel --launch-skip 3 --launch-count 1 \
        --metrics sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,gpu__time_duration.sum \
        python3 benchmarks/profile_kernels.py "$what" > "$OUT/ncu_${name}_smspread.txt" 2>&1
      echo "== $name: rc=$?"; grep -E "sm__cycles|gpu__time" "$OUT/ncu_${name}_smspread.txt"
    done
    ;;
  w4stalls)
    prof w4_m1_swapx_bn64_sk5 "_w4a16_swap_kernel" w4a16:1:8192:8192:swapx:16:64:5:4:3
    prof w4_m1_swapx_bn128_sk6 "_w4a16_swap_kernel" w4a16:1:8192:8192:swapx:16:128:6:4:3
    prof w4_m1_fm_sk5 "_swap_fm_kernel" w4fm:1:8192:8192:5
    ;;
  *)
    prof w4_m1_swapx "_w4a16_swap_kernel" w4a16:1:8192:8192:swapx:16:64:4:4:3
    prof w4_m1_gemv2 "_w4a16_gemv2_kernel" w4a16:1:8192:8192:gemv2:1:128:8:4:2
    prof w4_m1_28672 "_w4a16_swap_kernel" w4a16:1:8192:28672:swapx:16:128:5:4:3
    prof attn_fwd_d128 "_attn_fwd" attn:4:16:4096:128:0
    ;;
esac
