#!/usr/bin/env bash
# The new families' GPU cells (gpt-oss-20b, Qwen3.5-35B-A3B cut to 16 layers) in one lease: each cell
# loads its file once for both contexts (2K and 32K) and measures decode and prefill beside llama.cpp.
# CONTEXTS=2048 keeps a short lease to 2K; QUANTISED=1 runs only the cells of the quantised files
# (MXFP4_MOE, Q4_K_M: what people download; the BF16 cells at 32K need more than one lease);
# QWEN3_5_CONTEXTS gives the Qwen3.5 Q4_K_M cells their own contexts. Carried in (ignored paths of the checkout):
#   .whl/                          wheels the machine lacks (gguf, platformdirs)
#   .llamacpp/llamacpp-src.tar.xz  llama.cpp's sources (engine.bench.llamacpp_build --prune)
#   .llamacpp/smollm2-vocab.gguf   the built-in GGUF's tokenizer.* keys alone
#   .lease/src.tar                 `git archive HEAD -o .lease/src.tar`, made before the lease: the
#                                  checkout's .git does not reach the machine, and uncommitted edits
#                                  must stay out of the run
# and started in the background, then polled (each poll copies RES into the call's output folder):
#   mkdir -p /tmp/src && tar -xf .lease/src.tar -C /tmp/src && cp -r .whl .llamacpp /tmp/src/ &&
#   (cd /tmp/src && COMMIT=<sha> RES=/tmp/lease setsid nohup bash benchmarks/h200/families.sh &)
# The disk (64 GB) holds one of the two exports (40 and 26 GB), so gpt-oss's is deleted before
# Qwen3.5's is made.
source benchmarks/h200/lease_start.sh  # folders, log, wheels, native build, machine header

llama_build llama-bench,llama-batched-bench,llama-quantize

# The tests run alone (beside the llama.cpp build only): the calibration test times the machine, and
# beside an export too its fitted per-token cost read 0 (it passes alone).
step CUDA tests
python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" \
  tests/models tests/kv tests/experts tests/hw tests/kernels 2>&1 | tail -30 >"$res/pytest-cuda.log"
tail -1 "$res/pytest-cuda.log" >>"$log"

step export gpt-oss
python3 -m engine.cli export-gguf --model synthetic:gpt-oss-20b --out "$work/gpt-oss-20b-random.gguf" \
  --device cuda --tokenizer-from .llamacpp/smollm2-vocab.gguf --quiet >>"$res/export.log" 2>&1
step waiting for llama.cpp
[ -n "$build" ] && { wait $build; echo "llama.cpp build rc $?" >>"$log"; }

suite() {  # suite NAME CELLS [CONTEXTS: this suite's, else $CONTEXTS]
  step "suite $1"
  local contexts=${3:-${CONTEXTS:-}}
  python3 -m engine.cli bench suite --work "$work" --llama-cpp-source .llamacpp/llamacpp-src.tar.xz \
    --tokenizer-from .llamacpp/smollm2-vocab.gguf --routing random --rounds 1 --cells "$2" \
    ${contexts:+--contexts "$contexts"} --json "$res/$1.json" >/dev/null 2>>"$res/suite.log"
  echo "suite $1 rc $?" >>"$log"
}
[ -n "${QUANTISED:-}" ] || suite gpt-oss gpu-gpt-oss-20b-24gb,gpu-gpt-oss-20b-8gb
suite gpt-oss-mxfp4 gpu-gpt-oss-20b-mxfp4-24gb,gpu-gpt-oss-20b-mxfp4-8gb  # quantised from that export
rm -f "$work"/gpt-oss-20b-random*.gguf
[ -n "${QUANTISED:-}" ] || suite qwen3.5 gpu-qwen3.5-L16-24gb,gpu-qwen3.5-L16-8gb
suite qwen3.5-q4km gpu-qwen3.5-L16-q4km-24gb,gpu-qwen3.5-L16-q4km-8gb ${QWEN3_5_CONTEXTS:-}  # quantised from that export
step ALL DONE
