#!/usr/bin/env bash
# The new families' GPU cells (gpt-oss-20b, Qwen3.5-35B-A3B cut to 16 layers) in one lease, in the
# order that keeps a partial lease useful: every cell at 2K first, then the 32K contexts.
# Run from the repository root in the background (the lease polls RES), with carried in:
#   .whl/                          wheels the machine lacks (gguf, platformdirs)
#   .llamacpp/llamacpp-src.tar.xz  llama.cpp's sources (engine.bench.llamacpp_build --prune)
#   .llamacpp/smollm2-vocab.gguf   the built-in GGUF's tokenizer.* keys alone
#   RES=/tmp/lease WORK=/tmp/lease/work setsid bash benchmarks/h200/families.sh &
# (from a `git archive` of the commit, so that uncommitted edits in the checkout stay out of it).
# The disk (64 GB) holds one of the two exports (40 and 26 GB), so gpt-oss's is deleted before
# Qwen3.5's is made.
set -uo pipefail
res=${RES:-/tmp/lease}; work=${WORK:-$res/work}; mkdir -p "$res" "$work"
log="$res/progress.log"
step() { echo "=== $* ($(date -u +%T))" | tee -a "$log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$log" 2>&1 || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1

step start "${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
python3 setup.py -q build_ext --inplace >>"$res/build.log" 2>&1 || step "native build FAILED"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,driver_version --format=csv >>"$log"
free -g >>"$log"; df -h / >>"$log"

step llama.cpp build starts in the background
python3 -m engine.bench.llamacpp_build --source .llamacpp/llamacpp-src.tar.xz --build-dir "$work/llamacpp" \
  --targets llama-bench,llama-batched-bench >"$res/llamacpp-build.log" 2>&1 &
build=$!

step CUDA tests
python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" \
  tests/models tests/kv tests/experts tests/hw tests/kernels 2>&1 | tail -30 >"$res/pytest-cuda.log"
tail -1 "$res/pytest-cuda.log" >>"$log"

step export gpt-oss
python3 -m engine.cli export-gguf --model synthetic:gpt-oss-20b --out "$work/gpt-oss-20b-random.gguf" \
  --device cuda --tokenizer-from .llamacpp/smollm2-vocab.gguf --quiet >>"$res/export.log" 2>&1
step waiting for llama.cpp
wait $build; echo "llama.cpp build rc $?" >>"$log"

suite() {  # suite NAME CELLS CONTEXTS
  step "suite $1"
  python3 -m engine.cli bench suite --work "$work" --llama-cpp-source .llamacpp/llamacpp-src.tar.xz \
    --tokenizer-from .llamacpp/smollm2-vocab.gguf --routing random --rounds 1 --cells "$2" --contexts "$3" \
    --json "$res/$1.json" >/dev/null 2>>"$res/suite.log"
  echo "suite $1 rc $?" >>"$log"
}
suite gpt-oss-2k gpu-gpt-oss-20b-24gb,gpu-gpt-oss-20b-8gb 2048
rm -f "$work/gpt-oss-20b-random.gguf"
suite qwen3.5-2k gpu-qwen3.5-L16-24gb,gpu-qwen3.5-L16-8gb 2048
suite qwen3.5-32k gpu-qwen3.5-L16-24gb,gpu-qwen3.5-L16-8gb 32768
rm -f "$work/qwen3.5-35b-a3b-L16-random.gguf"
suite gpt-oss-32k gpu-gpt-oss-20b-24gb,gpu-gpt-oss-20b-8gb 32768
step ALL DONE
