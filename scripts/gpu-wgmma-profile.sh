#!/usr/bin/env bash
# Hopper's W4A16 wgmma kernel under Nsight Compute (the device tool; carry .whl): the
# four 64-row products of a Llama-3-8B layer, each launch twice (scripts/wgmma_profile.py).
#   scripts/gpu-wgmma-profile.sh [source]
# In $OUT: wgmma-ncu.txt (per launch: speed of light, shared memory's bank conflicts and
# wavefronts, the tensor pipe's use, warp states, issue slots) and wgmma-stalls.txt (the
# warps' stall reasons, cycles per issued instruction).
# With `source`, only the warps' stall samples per SASS instruction of gate|up's second
# launch and both of down's: $OUT/wgmma-sass.csv (ncu's source page) and the report.
# `--clock-control none`: the device notes ask that ncu leave the clocks alone.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
if [[ ${1:-} == source ]]; then
  timeout 300 ncu --clock-control none --kernel-name regex:lmd_w4a16_wgmma --launch-skip 5 \
    --launch-count 3 --section SourceCounters --section WarpStateStats -f -o "$out/wgmma-src" \
    python3 scripts/wgmma_profile.py >"$out/wgmma-src.log" 2>&1
  echo "ncu (source) rc $?"
  ncu -i "$out/wgmma-src.ncu-rep" --page source --csv --print-source sass >"$out/wgmma-sass.csv" 2>&1
  echo "source page rc $?, $(wc -l <"$out/wgmma-sass.csv") lines"
  exit 0
fi
metrics=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,\
sm__inst_executed_pipe_lsu.sum,\
smsp__inst_executed.sum,\
smsp__issue_active.avg.pct_of_peak_sustained_active
timeout 300 ncu --clock-control none --kernel-name regex:lmd_w4a16_wgmma \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section Occupancy --metrics "$metrics" \
  python3 scripts/wgmma_profile.py >"$out/wgmma-ncu.txt" 2>&1
echo "ncu rc $?"
# (The tensor pipe's use: ComputeWorkloadAnalysis's "highest-utilized pipeline" line;
# sm__pipe_tensor_op_gmma_cycles_active reads n/a on an H200.)
grep -E "lmd_w4a16_wgmma|Duration|bank_conflicts|wavefronts|highest-utilized|issue_active|Stall|Memory Throughput|Compute \(SM\)" \
  "$out/wgmma-ncu.txt" | head -120
# The warps' stall reasons (cycles a warp spent stalled for each, per instruction
# issued), in a run of their own: an unknown metric name fails only this one.
stalls=""
for reason in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle \
  not_selected selected dispatch_stall sleeping membar lg_throttle no_instruction \
  branch_resolving misc drain imc_miss tex_throttle; do
  stalls+="${stalls:+,}smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio"
done
timeout 200 ncu --clock-control none --kernel-name regex:lmd_w4a16_wgmma --metrics "$stalls" \
  python3 scripts/wgmma_profile.py >"$out/wgmma-stalls.txt" 2>&1
echo "ncu (stalls) rc $?"
grep -E "lmd_w4a16_wgmma|stalled|ERROR" "$out/wgmma-stalls.txt" | sed 's/smsp__average_warps_issue_//' | head -160
