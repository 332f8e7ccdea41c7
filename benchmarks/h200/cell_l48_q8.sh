#!/usr/bin/env bash
# Issue #34's 24 GB / 48-layer cell beside llama.cpp on one GPU machine (`gpu-q8-24gb-L48`): the whole
# Qwen3-30B-A3B exported with Q8_0 experts (33 GB; the BF16 export's 60 GB do not fit a 64 GB disk beside
# llama.cpp's build), Tandem's default plan against llama.cpp's best fitting -ncmoe on that file, one chat,
# 2K and 32K. The export runs beside llama.cpp's build; the cell after both. CONTEXTS=2048 keeps a short
# lease to 2K; C_S: the seconds the whole script may take. Started like quantised.sh.
source benchmarks/h200/lease_start.sh  # folders, log, wheels, native build, machine header
llama_build llama-bench,llama-batched-bench
file="$work/qwen3-30b-a3b-Q8_0-random.gguf"  # the name the suite looks for (suite_files.export_path)
if [ ! -f "$file" ]; then
  step export the 48 layers with Q8_0 experts
  python3 -m engine.cli export-gguf --model synthetic:qwen3-30b-a3b-Q8_0 --out "$file" --device cuda \
    --tokenizer-from .llamacpp/smollm2-vocab.gguf --quiet >>"$res/export.log" 2>&1
fi
df -h / >>"$log"
step waiting for llama.cpp
[ -n "$build" ] && { wait $build; echo "llama.cpp build rc $?" >>"$log"; }
left=$((${C_S:-570} - SECONDS))
step "suite gpu-q8-24gb-L48 (left $left s)"
timeout $left python3 -m engine.cli bench suite --work "$work" --llama-cpp-source .llamacpp/llamacpp-src.tar.xz \
  --tokenizer-from .llamacpp/smollm2-vocab.gguf --routing random --rounds 1 --cells gpu-q8-24gb-L48 \
  ${CONTEXTS:+--contexts "$CONTEXTS"} --json "$res/gpu-q8-24gb-L48.json" >/dev/null 2>>"$res/suite.log"
echo "suite rc $?" >>"$log"
step ALL DONE
