#!/usr/bin/env bash
# Issue #33's GPU cells on one Q4_K_M file (Qwen3-30B-A3B cut to 16 layers) in one lease: the CUDA
# tests of the quantised experts first, then each cell as its own suite run (a lease cut short keeps
# the records made so far). The suite quantises the BF16 export with the built `llama-quantize` once.
# Carried in and started as families.sh's header says, with this script in its place; CONTEXTS=2048
# keeps a short lease to 2K (CHATS=1 to one chat), ROUTING (default random: one export, one quantised file) adds zipf:1.0.
# Each carried .lease/base*.tar (`git archive BASE -o .lease/base-BASE.tar`) adds the GPU kernels' bench
# at BASE, its own tiles, beside this commit's: the A/B of a kernel change on the same machine.
# CELLS (default: the four below) names the suite cells; CELLS= runs the tests and kernel benches only.
# PREFILL_PROFILE=1 adds the profile of a resident 2,048-token prefill (2 layers, host and device time);
# DECODE_PROFILE=1 that of a resident decode step (4 layers: kernels a token, their time against the wall's).
# KERNEL_TESTS_ONLY=1 runs only the CUDA tests of the products over blocks, of the experts that run
# them and of the attention and KV cache, and no CPU tests or CPU kernel bench (a short lease).
source benchmarks/h200/lease_start.sh  # folders, log, wheels, native build, machine header
CELLS=${CELLS-gpu-q4km-L16-resident gpu-q4km-L16-8gb gpu-q4km-prefill-32k gpu-q4km-L16-cpu-experts}

if [ -n "$CELLS" ]; then
  llama_build llama-bench,llama-batched-bench,llama-quantize
fi

if [ -n "${KERNEL_TESTS_ONLY:-}" ]; then  # a short lease: the CUDA tests of the products over blocks alone
  step CUDA kernel tests  # (and of the experts resident or cached as blocks, which run them)
  python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_quant_moe_gpu.py \
    tests/kernels/test_quant_moe_gemm_gpu.py tests/kernels/test_quant_linear_gpu.py \
    tests/quant/test_gpu_quant_resident.py tests/quant/test_quant_fills.py \
    tests/kernels/test_attention_gpu_sdpa.py tests/kv 2>&1 | tail -30 >"$res/pytest-cuda.log"
  tail -1 "$res/pytest-cuda.log" >>"$log"
else
  step CUDA tests
  python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/quant tests/experts \
    tests/kernels/test_quant_moe_gpu.py tests/kernels/test_quant_moe_gemm_gpu.py tests/kernels/test_quant_linear_gpu.py \
    tests/kernels/test_dequant_gpu.py tests/kernels/test_moe_decode_gpu.py 2>&1 \
    | tail -30 >"$res/pytest-cuda.log"
  tail -1 "$res/pytest-cuda.log" >>"$log"
  step CPU kernel tests  # every ISA of this host's CPU (AVX-512, AMX): a machine without them skips those
  python3 -m pytest -q -p no:cacheprovider -m "not cuda" -k "not builtin" tests/quant/test_quant_kernels.py \
    tests/quant/test_kquant_paths.py tests/quant/test_quant_rows_product.py tests/quant/test_block_types.py \
    tests/quant/test_mxfp4_blocks.py tests/kernels/test_layer_ops_cpu.py tests/kernels/test_attention_native.py \
    tests/kernels/test_experts_cpu.py 2>&1 | tail -30 >"$res/pytest-cpu.log"
  tail -1 "$res/pytest-cpu.log" >>"$log"
fi

step GPU kernels over blocks  # the quantised decode GEMVs against BF16 and the copy bound, tile sweep
python3 -m engine.bench.quant_gpu --json "$res/quant-gpu.json" >>"$log" 2>&1
for tar in .lease/base*.tar; do  # none: the glob stays unmatched
  [ -f "$tar" ] || continue
  name=$(basename "$tar" .tar)
  step "GPU kernels over blocks at $name"  # its own tiles; the native build is this tree's
  mkdir -p "$work/$name" && tar -xf "$tar" -C "$work/$name" && cp engine/_native*.so "$work/$name/engine/"
  (cd "$work/$name" && PYTHONPATH=$PWD:/tmp/site python3 -m engine.bench.quant_gpu --no-sweep \
    --json "$res/quant-gpu-$name.json" >>"$log" 2>&1)
done

if [ -n "${PREFILL_PROFILE:-}" ]; then  # where a resident prefill over blocks spends host and device time
  step prefill profile
  python3 benchmarks/h200/2026-12-05-q4km-blocks-h100/prefill_profile.py "$work/prefill" 2 2048 \
    >"$res/prefill-profile.txt" 2>&1
fi

if [ -n "${DECODE_PROFILE:-}" ]; then  # kernels a decode token and the time between them
  step decode profile
  python3 benchmarks/h200/decode_profile.py "$work/decode" 4 64 >"$res/decode-profile-run.txt" 2>&1
  cp "$work/decode/decode.json" "$work/decode/decode-profile.txt" "$res/" 2>/dev/null
fi

[ -z "$CELLS" ] && { step ALL DONE; exit 0; }
step export L16  # the name the suite looks for; the suite quantises it
python3 -m engine.cli export-gguf --model synthetic:qwen3-30b-a3b-L16 --out "$work/qwen3-30b-a3b-L16-random.gguf" \
  --device cuda --tokenizer-from .llamacpp/smollm2-vocab.gguf --quiet >>"$res/export.log" 2>&1
step waiting for llama.cpp
[ -n "$build" ] && { wait $build; echo "llama.cpp build rc $?" >>"$log"; }
# after the build: llama.cpp's compile on every core slowed the threaded CPU set tenfold in one lease
if [ -z "${KERNEL_TESTS_ONLY:-}" ]; then
  step CPU kernels  # the K-quant products and a MoE layer's CPU set at 1–16 threads (the 16-thread figure)
  python3 -m engine.bench.quant_kernels --moe-threads 1,2,4,8,16 --json "$res/quant-kernels.json" >>"$log" 2>&1
fi

for cell in $CELLS; do
  step "suite $cell"
  python3 -m engine.cli bench suite --work "$work" --llama-cpp-source .llamacpp/llamacpp-src.tar.xz \
    --tokenizer-from .llamacpp/smollm2-vocab.gguf --routing "${ROUTING:-random}" --rounds 1 --cells "$cell" \
    ${CONTEXTS:+--contexts "$CONTEXTS"} ${CHATS:+--chats "$CHATS"} --json "$res/$cell.json" >/dev/null 2>>"$res/suite.log"
  echo "suite $cell rc $?" >>"$log"
done
step ALL DONE
