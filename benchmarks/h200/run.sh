#!/usr/bin/env bash
# The GPU machine's run: the CUDA tests, then `tandem bench suite` (every cell the machine can run).
# From the repository root, with what the machine cannot download carried in:
#   .whl/                          wheels the machine lacks (e.g. gguf, platformdirs)
#   .llamacpp/llamacpp-src.tar.xz  llama.cpp's sources: python3 -m engine.bench.llamacpp_build
#                                  --source <llama-cpp-python sdist> --prune .llamacpp/llamacpp-src.tar.xz
#   .llamacpp/smollm2-vocab.gguf   the built-in GGUF's tokenizer.* keys alone, for the exports' tokenizer
#                                  (the built-in model's package does not travel to that machine)
#   OUT=h200-out bash benchmarks/h200/run.sh [suite flags, e.g. --cells gpu-kv-spill --rounds 5]
# A/B runs are the suite's own: `--against COMMIT` (a git worktree of that commit, alternated with
# this tree). No source is edited for a run. Exports and the llama.cpp build stay in $WORK between runs.
set -uo pipefail
out=${OUT:-h200-out}; mkdir -p "$out"
work=${WORK:-/tmp/tandem-suite}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
log="$out/run.log"
step() { echo "=== $* ($(date -u +%T))" | tee -a "$log"; }

step build native extension
python3 setup.py -q build_ext --inplace >>"$log" 2>&1 || echo "native build FAILED" | tee -a "$log"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv \
  | tee -a "$log"

step CUDA tests
# The same tests as CI, where CUDA makes them run instead of skip; those needing the built-in
# model's package (not on this machine) are deselected.
python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" \
  tests/models tests/kv tests/experts tests/hw tests/kernels 2>&1 | tail -40 | tee "$out/pytest-cuda.log"

step bench suite
python3 -m engine.cli bench suite --work "$work" --llama-cpp-source .llamacpp/llamacpp-src.tar.xz \
  --tokenizer-from .llamacpp/smollm2-vocab.gguf --json "$out/suite.json" "$@" > /dev/null 2>>"$log"
step done
