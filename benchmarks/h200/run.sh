#!/usr/bin/env bash
# The GPU machine session behind benchmarks/h200/: one H200, 16 cores. Run from the repository root
# with the wheels the machine lacks in .whl/ (gguf, platformdirs). Two phases, each under 10 minutes:
#   bash benchmarks/h200/run.sh A    # build, CUDA tests, calibration, CPU kernels
#   bash benchmarks/h200/run.sh B    # hybrid KV, expert offloading, resident end-to-end
#   bash benchmarks/h200/run.sh C    # after fixes: CUDA tests again, expert offloading
#   bash benchmarks/h200/run.sh D    # resident experts as grouped GEMMs: CUDA tests, resident end-to-end
#   bash benchmarks/h200/run.sh E    # paged resident decode: kernel tests, resident KV and end-to-end, bench e2e
# Results land in $OUT (or ./h200-out). The built-in SmolLM2 file does not travel to that machine,
# so tests that need it are deselected there.
set -uo pipefail
phase=${1:?A, B, C, D or E}
out=${OUT:-h200-out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
log="$out/phase-$phase.log"
step() { echo "=== $* ($(date -u +%T))" | tee -a "$log"; }
tandem() { python3 -m engine.cli "$@"; }

step build native extension
python3 setup.py -q build_ext --inplace >>"$log" 2>&1 || echo "native build FAILED" | tee -a "$log"
python3 - <<'PY' 2>&1 | tee -a "$log"
import torch, transformers
from engine.kernels import native, attention_native
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "native", attention_native.implementation())
PY
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv | tee -a "$log"

if [ "$phase" = A ]; then
  step CUDA tests
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m cuda -k "not builtin" tests/models tests/kv tests/experts tests/hw tests/kernels \
    2>&1 | tail -40 | tee "$out/pytest-cuda.log"
  step calibrate full
  timeout 200 python3 -m engine.cli calibrate --full --model synthetic:qwen3-30b-a3b --cpu-threads 15 \
    --json "$out/calibrate-full.json" 2>&1 | tail -60 | tee -a "$log"
  step bench cpu-kernels
  timeout 200 python3 -m engine.cli bench cpu-kernels --thread-counts 1,4,8,15,16 --lengths 2k,8k,32k,64k \
    --batches 1,4 --json "$out/cpu-kernels.json" > /dev/null 2>>"$log"
elif [ "$phase" = E ]; then
  step paged kernel and CUDA tests
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    2>&1 | tail -15 | tee "$out/pytest-paged.log"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/models tests/kv \
    2>&1 | tail -15 | tee "$out/pytest-cuda.log"
  step bench kv resident
  timeout 100 python3 -m engine.cli bench kv --policies resident --layers 8 --lengths 2048,8192,32768 \
    --batch-sizes 1,4,16 --json "$out/kv-resident-paged.json" > /dev/null 2>>"$log"
  for bs in 1 4; do
    step resident synthetic:qwen3-30b-a3b bs=$bs 8K
    timeout 100 python3 -m engine.cli generate --model synthetic:qwen3-30b-a3b --device cuda --random-prompt 8064 \
      --max-new-tokens 64 --greedy --batch $bs --max-batch $bs --max-context 8192 --quiet \
      --stats-json "$out/resident-paged-bs$bs.json" > /dev/null 2>>"$log"
  done
  step bench e2e
  timeout 330 python3 -m engine.cli bench e2e --kv-policies writescope,gpu-centric,cpu-centric,resident \
    --batch-sizes 1,4 --contexts 2048,8192,32768 --new-tokens 8 --vram-budget-gb 24 --cpu-threads 15 \
    --json "$out/e2e.json" > /dev/null 2>>"$log"
elif [ "$phase" = D ]; then
  step CUDA tests
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts tests/models \
    2>&1 | tail -30 | tee "$out/pytest-cuda.log"
  for bs in 1 4; do
    step resident synthetic:qwen3-30b-a3b bs=$bs 8K
    timeout 100 python3 -m engine.cli generate --model synthetic:qwen3-30b-a3b --device cuda --random-prompt 8064 \
      --max-new-tokens 64 --greedy --batch $bs --max-batch $bs --max-context 8192 --quiet \
      --stats-json "$out/resident-grouped-decode-bs$bs.json" > /dev/null 2>>"$log"
  done
elif [ "$phase" = C ]; then
  step CUDA tests
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts \
    2>&1 | tail -40 | tee "$out/pytest-cuda.log"
  step bench experts
  timeout 330 python3 -m engine.cli bench experts --batch-sizes 1,4 --contexts 2048 --new-tokens 32 \
    --vram-budget-gb 24 --cpu-threads 15 --json "$out/experts.json" > /dev/null 2>>"$log"
else
  step bench kv
  timeout 230 python3 -m engine.cli bench kv --layers 8 --lengths 2048,8192,32768 --batch-sizes 1,4,16 \
    --json "$out/kv.json" > /dev/null 2>>"$log"
  step bench experts
  timeout 200 python3 -m engine.cli bench experts --batch-sizes 1,4 --contexts 2048 --new-tokens 32 \
    --vram-budget-gb 24 --cpu-threads 15 --json "$out/experts.json" > /dev/null 2>>"$log"
  for bs in 1 4; do
    step resident synthetic:qwen3-30b-a3b bs=$bs 8K
    timeout 100 python3 -m engine.cli generate --model synthetic:qwen3-30b-a3b --device cuda --random-prompt 8064 \
      --max-new-tokens 64 --greedy --batch $bs --max-batch $bs --max-context 8192 --quiet \
      --stats-json "$out/resident-bs$bs.json" > /dev/null 2>>"$log"
  done
fi
step done
ls -la "$out" | tee -a "$log"
