#!/usr/bin/env bash
# Scratch (session 31): why head dim 64 causal reads 5% below non-causal at 16k (510 against 537
# TFLOP/s in session 30's call 6) while FlashAttention-3 reads 9% above (574 against 526).
# Nsight Compute over flash3's main kernel alone (tools/prof.py --only flash3), non-causal 16k,
# causal 16k and causal 4k: speed of light, warp states, L2 hit rate and sectors, tensor pipe.
# From the repository root on the GPU machine, main's build: `bash exp/ncu64_run.sh`.
# (Call 3 ran it with the same library build written out here; since then the build is exp_builds.sh's.)
source exp/exp_builds.sh  # $OUT, t0, b (copy exp_builds.sh to exp/ too)
b build ""
export FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python
S="--section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy"
M=lts__t_sector_hit_rate.pct,lts__t_sectors_op_read.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_write.sum,sm__pipe_tensor_op_hgmma_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_active.avg,smsp__inst_executed.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio
for cfg in "64 16384 0" "64 16384 1" "64 4096 1" "64 4096 0"; do
  set -- $cfg
  f="$OUT/ncu_d$1_s$2_c$3.txt"
  timeout 150 ncu --profile-from-start off --clock-control none -k regex:bwd_kernel $S --metrics $M \
    python3 tools/prof.py --pass bwd --hdim $1 --seqlen $2 --causal $3 --only flash3 > "$f" 2>&1
  echo "== hdim $1 seqlen $2 causal $3 rc=$? at $(( $(date +%s) - t0 )) s"
  grep -E "Duration|Memory Throughput|Compute \(SM\) Throughput|L2 Cache Throughput|hit_rate|sectors_op|hgmma|dram__bytes|Warp Cycles Per Issued|Issue Slots|sm__cycles_active|inst_executed|Grid Size|issue_stalled" "$f" | sed 's/  */ /g' | head -50
done
