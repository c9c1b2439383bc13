#!/usr/bin/env bash
# Scratch (session 28, calls 4-5, docs/perf-log.md B70): where the backward main kernel's time goes at
# head dim 256, Nsight Compute over one flash3 call and one cuDNN call (tools/prof.py): the usual
# sections, the shared-memory and L2 counters per operation (read, write, reduction). From the
# repository root on the GPU machine, main's build.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=OFF > /dev/null 2>&1
cmake --build build -j16 --target flash3 > "$OUT/build.log" 2>&1 || { tail -5 "$OUT/build.log"; exit 1; }
export FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats"
timeout 200 ncu --profile-from-start off --clock-control none $S python3 tools/prof.py --pass bwd --hdim 256 --seqlen 2048 --causal 0 > "$OUT/ncu_bwd_d256_s2048_c0.txt" 2>&1
SM=l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
for d in 256 128; do
  timeout 120 ncu --profile-from-start off --clock-control none -k regex:bwd_kernel --metrics $SM python3 tools/prof.py --pass bwd --hdim $d --seqlen 2048 --causal 0 --only flash3 > "$OUT/ncu_smem_d$d.txt" 2>&1
done
M=lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,lts__t_requests_op_red.sum,lts__t_sectors_op_red.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_write.avg.pct_of_peak_sustained_elapsed,lts__t_requests_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum
for cfg in "256 2048 0" "128 2048 0" "256 4096 1"; do
  set -- $cfg
  timeout 150 ncu --profile-from-start off --clock-control none --metrics $M python3 tools/prof.py --pass bwd --hdim $1 --seqlen $2 --causal $3 > "$OUT/ncu_l2_d$1_s$2_c$3.txt" 2>&1
  grep -E "^  [a-zA-Z_].*\(|lts__t_sectors_op_red|lts__t_requests_op_red" "$OUT/ncu_l2_d$1_s$2_c$3.txt" | cut -c1-130
done
# Call 6 (B70's last part), with bwd_dq_red_hdim256_at_07e6742.patch applied and the build configured with
# -DFLASH3_EXP_PERSIST_AB (CMAKE_CUDA_FLAGS and CMAKE_CXX_FLAGS): the reds' L2 sectors against the bulk adds'.
#   M=lts__t_sectors_op_red.sum,lts__t_requests_op_red.sum,lts__t_sectors_op_red.avg.pct_of_peak_sustained_elapsed,...
#   FLASH3_EXP_DQ_RED=1 (or 0) ncu --profile-from-start off --clock-control none -k regex:bwd_kernel --metrics $M \
#     python3 tools/prof.py --pass bwd --hdim 256 --seqlen 2048 --causal 0 --only flash3
