#!/usr/bin/env bash
# Scratch (prepared in session 31, not run): energy per FLOP, the first item of "Not tried yet
# (backward)" (docs/perf-log.md B79). Per sweep point, flash3's and cuDNN's backward kernels under
# Nsight Compute, counting what moves per call: L2 sectors by operation (read, write, reduction),
# L2 hit rate, DRAM bytes, shared-memory wavefronts (WGMMA operand reads included), instructions and
# tensor-pipe cycles; `exp/energy_table.py` (below) divides by each call's FLOPs, so that the bytes
# per FLOP where flash3 moves more than cuDNN stand out. From the repository root on the GPU machine:
# `bash exp/energy_ncu_run.sh` (~4-6 minutes: 7 points x 2 libraries, all kernels of one call each).
source exp/exp_builds.sh  # $OUT, t0, b (copy exp_builds.sh to exp/ too)
b build ""
export FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python
M=lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_hmma.sum,gpu__time_duration.sum
for cfg in "64 1 4096" "64 1 16384" "64 0 4096" "128 1 2048" "128 0 16384" "256 0 2048" "256 1 4096"; do
  set -- $cfg
  for impl in flash3 cudnn; do
    f="$OUT/ncu_${impl}_d$1_c$2_s$3.csv"
    timeout 120 ncu --profile-from-start off --clock-control none --csv --metrics $M \
      python3 tools/prof.py --pass bwd --hdim $1 --seqlen $3 --causal $2 --only $impl > "$f" 2>&1
    echo "== $impl hdim $1 causal $2 seqlen $3 rc=$? at $(( $(date +%s) - t0 )) s"
  done
done
python3 exp/energy_table.py "$OUT" | tee "$OUT/energy_table.txt"
