#!/usr/bin/env bash
# Issue #39's aggregate on one GPU: chats × 32K decoding together under a 24 GB budget, writescope beside
# the fixed splits (gpu-centric r = 0, cpu-centric r = 1), for Qwen3-30B-A3B (48 layers) and DeepSeek-V2-Lite
# with their routed experts drawn as Q4_0 blocks. For 32 chats the placement planner keeps those experts
# on the GPU (16 GB and 8 GB) and spills the KV with writescope (tests/sched/test_placement_plan.py), so
# the step is the attention over the spilled KV, which is what the split decides; with BF16 experts the
# cached experts' misses dominated (h200/2026-12-02-aggregate/), and Qwen3's 96 GiB of KV at 32 chats
# did not fit beside 57 GiB of BF16 weights in host memory.
# POINTS lists model:chats in the order they run (default: 32 chats of each, then 8); each point is its
# own `tandem bench e2e` (one load), so a lease cut short keeps the points done. NEW_TOKENS (default 8):
# decode steps a point times; the stream graphs replay from the third, so 32 reads closer to steady state. AGG_S: the seconds the
# whole script may take. Started from the repository root like quantised.sh (lease_start.sh's carried
# wheels); RES under the call's output folder returns what ran.
source benchmarks/h200/lease_start.sh  # folders, log, wheels, native build, machine header
for point in ${POINTS:-qwen3-30b-a3b:32 deepseek-v2-lite:32 qwen3-30b-a3b:8 deepseek-v2-lite:8}; do
  model=${point%:*} chats=${point#*:}
  left=$((${AGG_S:-540} - SECONDS))
  [ $left -gt 60 ] || { step "no time for $point"; continue; }
  step "e2e $model-Q4_0, $chats chats x 32K (left $left s)"
  timeout $left python3 -m engine.cli bench e2e --kv-policies writescope,gpu-centric,cpu-centric \
    --batch-sizes $chats --contexts 32768 --new-tokens ${NEW_TOKENS:-8} --vram-budget-gb 24 --expert-policy resident \
    --model synthetic:$model-Q4_0 --json "$res/e2e-$model-Q4_0-$chats.json" >/dev/null 2>"$res/e2e-$model-$chats.log"
  echo "e2e $point rc $?" >>"$log"
  free -g >>"$log"
done
step ALL DONE
