#!/usr/bin/env bash
# The GPU machine session behind benchmarks/h200/: one H200, 16 cores. Run from the repository root
# with the wheels the machine lacks in .whl/ (gguf, platformdirs). Two phases, each under 10 minutes:
#   bash benchmarks/h200/run.sh A    # build, CUDA tests, calibration, CPU kernels
#   bash benchmarks/h200/run.sh B    # hybrid KV, expert offloading, resident end-to-end
#   bash benchmarks/h200/run.sh C    # after fixes: CUDA tests again, expert offloading
#   bash benchmarks/h200/run.sh D    # resident experts as grouped GEMMs: CUDA tests, resident end-to-end
#   bash benchmarks/h200/run.sh E    # paged resident decode: kernel tests, resident KV and end-to-end, bench e2e
#   bash benchmarks/h200/run.sh F1   # llama.cpp CUDA build + the L16 GGUF export (needs .llamacpp/ carried:
#                                    #   the pruned source tarball and a vocab-only GGUF, see below)
#   bash benchmarks/h200/run.sh F2   # same weights, one run: llama-bench, Tandem, transformers (machine still warm:
#                                    #   the build and the GGUF live in /tmp, which a warm machine keeps between calls)
#   bash benchmarks/h200/run.sh F    # F1 then F2, skipping a build or export already there
#   bash benchmarks/h200/run.sh G    # whole-model decode per KV policy at 32K under 24 GB (bench e2e)
#   bash benchmarks/h200/run.sh H    # decode steps as CUDA graphs: tests, kernel profile, resident L16 graphs vs eager
#   bash benchmarks/h200/run.sh I    # F1, then the resident rows of F2 and transformers (same weights, one run)
#   bash benchmarks/h200/run.sh J    # native CPU kernels after the prefetch work; paged-kernel tile sweep
#   bash benchmarks/h200/run.sh K    # after the sweep's choice: resident L16 decode; hybrid KV attention at 32K
#   bash benchmarks/h200/run.sh L    # decode graph tests; the 48-layer resident upper bound through `tandem generate`
#   bash benchmarks/h200/run.sh M    # native expert kernel with 8-token tiles: tests, cpu-kernels at 15/16 threads
#   bash benchmarks/h200/run.sh N    # offloaded experts in graph pieces: tests, moe_ffn A/B, bench experts 2K (sampled)
#   bash benchmarks/h200/run.sh O    # decode graph tests (full log); host profile of offloaded decode (profile_offload.py)
#   bash benchmarks/h200/run.sh P    # O, then bench experts 2K per policy (sampled) again
#   bash benchmarks/h200/run.sh Q    # bench experts 2K, bs 1 and 4, every policy decoding from one prefill
#   bash benchmarks/h200/run.sh R    # after the shared-prefill fix: 2K and 32K at bs=1 from one prefill each
#   bash benchmarks/h200/run.sh S    # profile_offload.py for on-demand and adaptive with the executor's time split
#   bash benchmarks/h200/run.sh T    # whole-step graph for adaptive (zero-copy misses): tests, bench experts 2K bs 1 and 4
#   bash benchmarks/h200/run.sh T2   # the same at 32K, bs=1
#   bash benchmarks/h200/run.sh U    # zero-copy tests; in-place expert reads vs DMA; adaptive's two decode forms forced (L16)
#   bash benchmarks/h200/run.sh V    # misses filled on the way: tests, U's profile, bench experts 2K bs 1 and 4 shared
#   bash benchmarks/h200/run.sh W    # 32K bs=1 from one prefill; host profile of adaptive's pieces form (L16)
#   bash benchmarks/h200/run.sh X    # GPU side of cut layers inside the pieces: tests; bench experts 2K bs 1,4 and 32K bs 1
#   (Y: X's commands at commit af320ca, an in-graph lookahead prefetch since reverted: it was slower)
#   bash benchmarks/h200/run.sh Z    # expert kernel 5–8-token tiles A/B on one host (needs .k8-before/: the old
#                                    #   native/experts_kernel.h and common.h, untracked)
#   bash benchmarks/h200/run.sh AA   # hybrid KV step timeline at 32K (profile_kv.py), default and spinning OpenMP
#                                    #   threads; host split of adaptive's pieces form at bs=4 (profile_offload.py)
#   bash benchmarks/h200/run.sh AB   # profile_kv.py again, with the host-sync diagnosis and a cProfile per run
#   bash benchmarks/h200/run.sh AC   # hybrid KV with fewer host calls per layer: CUDA tests, profile_kv.py (default and
#                                    #   OMP_WAIT_POLICY=PASSIVE), bench kv at 32K twice (default, PASSIVE)
#   bash benchmarks/h200/run.sh AD   # AC's tests and profile after pairing extent-layers per ping-pong load; bench kv 32K twice
#   bash benchmarks/h200/run.sh AE   # block tables built once per CPU share: tests; bench kv 32K as is and with the GIL
#                                    #   switch interval at 0.1 ms; profile_kv.py with that interval
#   bash benchmarks/h200/run.sh AF   # bench kv 32K once more; whole-model decode per KV policy at 32K (G's command)
#   bash benchmarks/h200/run.sh AG   # unpinned write-backs per layer as each lands: tests; bench kv 32K (with warm-route prefill)
#   bash benchmarks/h200/run.sh AH   # streamed loads as one CUDA graph per layer: tests; bench kv 32K with graphs three
#                                    #   times and eagerly twice, interleaved; whole-model decode per KV policy at 32K
#   bash benchmarks/h200/run.sh AI   # AH after the graphs' pool fix: tests; bench kv 32K twice; routing at the model's
#                                    #   48 layers (bs=1); whole-model decode per KV policy at 32K, 32 new tokens
#   bash benchmarks/h200/run.sh AJ   # after the pool anchor and the generator restore: tests; bench kv 32K; AI's e2e
#   bash benchmarks/h200/run.sh AK   # a lone attention part is the result (no merge pass): tests; bench kv at the model's
#                                    #   48 layers, 32K, bs 1 and 4, twice; bench kv 32K (8 layers) once
#   (AL: the next layer's first load copied ahead, at commit e44b45b; reverted: no gain measured at bs=1)
#   bash benchmarks/h200/run.sh AL   # tests; bench kv 32K twice; 48 layers once
#   bash benchmarks/h200/run.sh AM   # AMX expert tiles: expert kernel tests on every ISA; cpu-kernels experts, vector
#                                    #   against AMX tiles per token count, and moe_ffn
#   (AN, AO: at commits b194554 and af245cc, with TANDEM_AMX_TILE_ROWS and TANDEM_AMX_PACK, since removed)
#   bash benchmarks/h200/run.sh AN   # AMX tiles of 16 and 8 rows: tests; experts vector against AMX alternated; moe_ffn
#                                    #   with and without AMX
#   bash benchmarks/h200/run.sh AO   # AMX tiles: rows 4 KiB apart against padded rows, in place against packed
#                                    #   (profile_amx.py); bench cpu-kernels experts with a fresh expert per call
#   bash benchmarks/h200/run.sh AP   # AMX from 9 tokens: tests; profile_amx.py; cpu-kernels experts; moe_ffn with and
#                                    #   without AMX, alternated twice
#   bash benchmarks/h200/run.sh AQ   # CUDA expert tests; adaptive pieces at bs 1 and 4 (L16) with the CPU sets' queue
#                                    #   time, default GIL switch interval and 0.2 ms
#   bash benchmarks/h200/run.sh AR   # the CPU set submitted before the fills: CUDA expert tests; adaptive pieces (L16)
#                                    #   new, old (at that time .ab-before/offload.py: the file at d0fa453), new;
#                                    #   bench experts 2K bs 1 and 4 from one prefill
#   bash benchmarks/h200/run.sh AS   # fewer device lookups on the decode path: CUDA tests; adaptive pieces (L16) new,
#                                    #   before (.ab-before/, untracked: engine/experts/{offload,cache,store,zero_copy}.py
#                                    #   and engine/kv/transport.py as at commit d0fa453), new;
#                                    #   bench experts 2K bs 1 and 4 from one prefill
#   bash benchmarks/h200/run.sh AT   # fills first again, device lookups cut: adaptive pieces (L16) against the files
#                                    #   before (.ab-before/), alternated twice
#   bash benchmarks/h200/run.sh AU   # the CPU set prepared by the driving thread and handed over before the fills:
#                                    #   adaptive pieces (L16) against .ab-before/ (engine/experts/offload.py and
#                                    #   engine/kernels/experts_cpu.py as at commit 053b1da), alternated twice;
#                                    #   bench experts 2K bs=4
#   bash benchmarks/h200/run.sh AV   # (not yet run) bench experts 2K bs 1 and 4 from one prefill, policies taking
#                                    #   turns three times: the median ratio, robust to the host's slow spells
#   bash benchmarks/h200/run.sh AW   # host topology; expert kernel DRAM vs in-cache roof (profile_roof.py); adaptive
#                                    #   pieces (L16) with 15 and 12 CPU-set threads and OMP_WAIT_POLICY=PASSIVE, alternated
#   bash benchmarks/h200/run.sh AX   # CPU sets on a native worker thread, built from the store's addresses, planned and
#                                    #   started before the bookkeeping: tests; adaptive pieces (L16) against .ab-before/
#                                    #   (engine/experts/{offload,cpu_set,store}.py, engine/sched/expert_cost.py and
#                                    #   engine/kernels/experts_cpu.py as at commit c958607), alternated twice; AV's bench
#   (AY: at commit a78e5f7, prefetches issued after the next piece's launch; reverted: no gain measured)
#   bash benchmarks/h200/run.sh AY   # graph pieces: prefetches issued after the next piece's launch: tests; adaptive pieces
#                                    #   (L16) against .ab-before/ (engine/experts/{offload,planner}.py and
#                                    #   engine/runtime/decode_graph.py as at commit a793c39), alternated twice; bench
#                                    #   experts 2K bs=4 from one prefill, three rounds
#   bash benchmarks/h200/run.sh AZ   # bench experts 32K, bs 1 and 4, from one prefill each (the issue's 32K rows)
#   bash benchmarks/h200/run.sh BA   # expert kernel on AMX tiles at every token count: DRAM against in-cache roof
#   bash benchmarks/h200/run.sh BB   # AMX tiles prefetching the next block row by row: expert kernel tests; AMX roof (every
#                                    #   token count) new, before (.ab-before/native/amx_experts.h as at commit 0a5127c), new
#   bash benchmarks/h200/run.sh BC   # profile_amx.py after BB: vector against AMX tiles, alternated, one host
#   bash benchmarks/h200/run.sh BD   # vector tiles with a 1- or 2-token last group at 5 and 6 tokens: expert kernel tests;
#                                    #   roof new, then before (.ab-before/native/{experts_kernel,common,amx_experts}.h as at
#                                    #   commit 3f38f1d) on one host
#   (BE–BJ: a third decode form, "graph-cpu", at commits bca3134..a87ae26: the one graph with part of each layer's
#   misses computed on the CPU by captured host nodes. Reverted: it beat neither of the other forms; RESULTS.md.)
#   bash benchmarks/h200/run.sh BE   # CUDA tests; adaptive (L16) with each decode form forced, 737 slots, then graph and
#                                    #   graph-cpu with 300 slots
#   bash benchmarks/h200/run.sh BF   # zero-copy tests; a host node's round trip in a graph and one CPU expert called
#                                    #   directly or from a host node (profile_host_node.py, at a87ae26): 15 threads,
#                                    #   OMP_WAIT_POLICY=ACTIVE, 8 threads
#   bash benchmarks/h200/run.sh BG   # the GPU's experts queued before the join: graph-cpu and graph forced (L16), 737 and
#                                    #   300 slots; graph-cpu at 300 slots with 12 threads
#   bash benchmarks/h200/run.sh BH   # host nodes with 4 cores left free: bench experts 32K, bs 1 and 4, from one prefill
#                                    #   each (AZ's command; the chooser timed graph, graph-cpu and pieces)
#   bash benchmarks/h200/run.sh BI   # bench experts 2K, bs 1 and 4, policies taking turns three times (AX's command)
#   bash benchmarks/h200/run.sh BJ   # graph-cpu sending the most-token misses to the CPU: graph-cpu and pieces forced
#                                    #   (L16), 300 and 737 slots
#   bash benchmarks/h200/run.sh BK   # adaptive pieces (L16, 737 slots) with OMP_WAIT_POLICY unset and ACTIVE, alternated
#                                    #   twice (the second pair ACTIVE first)
#   bash benchmarks/h200/run.sh BL   # expert kernel at 4–8 tokens: the avx512 table's fp32 FMA tiles against
#                                    #   the avx512bf16 table's VDPBF16PS tiles, 1 and 15 threads, alternated twice
#   bash benchmarks/h200/run.sh BM   # the GPU side of a cut layer launched before the CPU wait: CUDA tests; L16 pieces
#                                    #   alternated with .ab-before/ (the files before, untracked) twice; BI's bench
#   bash benchmarks/h200/run.sh BN   # after BM: L16 pieces with its cProfile texts; bench experts 32K bs 1 and 4 (AZ's)
#   bash benchmarks/h200/run.sh BO   # CPU sets grouped in C++ from the routing: tests; L16 pieces alternated with
#                                    #   .ab-before/ (offload.py as at 5cf02a8, untracked) twice; BI's bench
#   bash benchmarks/h200/run.sh BP   # BI's bench again, after the chooser's margin for the one graph
#   bash benchmarks/h200/run.sh BQ   # where pieces lose at bs=1 with a thrashing cache (32K-like): L16 at
#                                    #   300 slots, pieces and graph forced, bs=1 cProfile texts; bench experts 32K bs=1
#   BR–BV ran at commit e118384 (in-graph prefetch, reverted after them: RESULTS.md); they need its files.
#   bash benchmarks/h200/run.sh BR   # next-layer prefetch inside the one graph: CUDA tests; L16 737 slots graph forced,
#                                    #   alternated with .ab-before/ twice; 300 slots; bench experts 32K bs=1
#   bash benchmarks/h200/run.sh BS   # prefetch depth 1, 2, 4 per token, forked after the layer's experts: L16 graph
#                                    #   forced at 737 slots alternated with .ab-before/ twice; 300 slots depth 2 and before
#   bash benchmarks/h200/run.sh BT   # 48 layers, bs=1: 2K rounds with prefetch depth 2, then with .ab-before/; 32K depth 2
#   bash benchmarks/h200/run.sh BU   # the same 2K and 32K bs=1 runs with every predicted expert prefetched (depth 8)
#   bash benchmarks/h200/run.sh BV   # BU again after the copy kernel became a fixed grid of 4 programs per SM; depth 4 too
#   bash benchmarks/h200/run.sh BW   # sampling where the logits are: sampler tests; L16 737 slots graph forced, then
#                                    #   with .ab-before/ (sampling on the host)
#   bash benchmarks/h200/run.sh BX   # expert kernel at 4–8 tokens, AMX tiles from 5 tokens against the vector tiles,
#                                    #   alternated three times; the GPU's timeline of a 48-layer 2K bs=1 decode step
#                                    #   (profile_step_timeline.py) for adaptive and on-demand; BI's bench after BW
#   bash benchmarks/h200/run.sh BY   # the host's cores and threads (lscpu); expert kernel at 6, 8, 12 tokens on 4–15
#                                    #   threads, AMX tiles from 5 tokens against the vector tiles, OpenMP threads
#                                    #   unbound and spread over cores, twice
#   bash benchmarks/h200/run.sh BZ   # fewer kernels a decode layer (one q/k/v GEMM + one norm/RoPE kernel, residual add
#                                    #   fused with the next norm, attention output in the model dtype, the zero-copy
#                                    #   logs written by the claim kernel): CUDA tests; BX's timeline, then with
#                                    #   .ab-before/ (the files before, untracked); BI's bench; 2K bs=1 rounds before
#   bash benchmarks/h200/run.sh CA   # BZ's change A/B on one host: resident L16 bench e2e at 2K, bs 1 and 4, and 2K bs=1
#                                    #   rounds (on-demand, adaptive), each new / before / new
#   bash benchmarks/h200/run.sh CB   # after the chooser's probe runs: BI's bench (2K, bs 1 and 4, three rounds) and AZ's
#                                    #   (32K, bs 1 and 4, from one prefill each); ran at beac3d8, whose bench warm-up
#                                    #   was shorter than the probe (fixed after it)
#   bash benchmarks/h200/run.sh CC   # one probe run per form (9 steps, tried and reverted): BI's bench at bs=1 only
#   bash benchmarks/h200/run.sh CD   # the merged RMSNorm/RoPE kernels compiled; CB again with the warm-up covering the probe
#   bash benchmarks/h200/run.sh CE   # (at f977dff, since reverted) the CPU share inside the decode graph: tests; 32K bs=1 with
#                                    #   916 slots and 2K bs=1, on-demand and adaptive, two rounds each
#   bash benchmarks/h200/run.sh CF   # listed slots stay cached until claimed: tests on CUDA; CE's 32K bs=1 with the change and
#                                    #   before it (.ab-before/: zero_copy.py, cache.py, moe_decode_gpu.py of 5788309);
#                                    #   2K bs=1 rounds; the 2K bs=1 timeline with idle gaps by length
#   bash benchmarks/h200/run.sh CG   # decode a step ahead of the host: resident L16 bench e2e at 2K and 2K bs=1 rounds, new /
#                                    #   before (.ab-before/: generator.py, sampling.py of eb439c8) / new; 32K bs=1 at 916
#                                    #   slots; the 2K bs=1 timeline
#   bash benchmarks/h200/run.sh CH   # after the fix of the graph warm-up's claims (accounted as a step): tests on CUDA; 2K bs=1
#   bash benchmarks/h200/run.sh CI   # (wip/lagged-table) the table kept on the device, the host a step ahead of the log: tests
#                                    #   on CUDA; 2K bs=1 rounds and 32K bs=1 at 916 slots, new / before (.ab-before/:
#                                    #   zero_copy.py, cache.py, moe_decode_gpu.py of 8732d79); the 2K bs=1 timeline
#   bash benchmarks/h200/run.sh CJ   # where the GPU waits at 2K bs=1: the timeline with the long gaps' neighbours, the host's
#                                    #   time by function and its syncs, adaptive and on-demand; then adaptive with CI's
#                                    #   change (.ab-before/: zero_copy.py, cache.py, moe_decode_gpu.py of b3a0889)
#   bash benchmarks/h200/run.sh CK   # after the sampler's copies stopped waiting for the GPU (f67696f): CUDA tests; resident L16
#                                    #   e2e; 2K bs=1 rounds and 32K bs=1 at 916 slots with CI's lagged table (dbc0103) and
#                                    #   without (.ab-before/: zero_copy.py, cache.py, moe_decode_gpu.py of f67696f); the
#                                    #   lagged table's 2K bs=1 timeline
#   bash benchmarks/h200/run.sh CL   # the cells after CK's two changes (bfeb398): CUDA tests; 2K bs 1 and 4, three rounds; 32K bs=1
#                                    #   at 916 slots (the host reads the step in flight first there), two rounds
#   bash benchmarks/h200/run.sh CM   # the 32K bs=4 cell after CK's changes and the chooser's move (dc2ed76)
#   bash benchmarks/h200/run.sh CN   # the CPU mailbox (part of each layer's misses computed by a native worker inside the one
#                                    #   graph): CUDA tests; 32K bs=1 at 916 slots with TANDEM_GRAPH_CPU_SHARE unset (the cost
#                                    #   model's share), 0, 0.5 and 0.75; 2K bs=1 unset and 0
#   bash benchmarks/h200/run.sh CR   # the gate at 8% of the slots (CQ's 2.5% let a fresh cache's first steps send misses to the CPU):
#                                    #   2K bs=1, three rounds
#   bash benchmarks/h200/run.sh CQ   # the cells with the CPU share gated on the cache's churn (the default): CUDA tests; 2K bs 1
#                                    #   and 4, three rounds; 32K bs=1 at 916 slots, two rounds
#   bash benchmarks/h200/run.sh CP   # CO again after its fix (the bench's share write outside inference mode), narrowed: 2K bs 1
#                                    #   and 4 one round; 32K bs=1 at 916 slots two rounds
#   bash benchmarks/h200/run.sh CO   # the mailbox with floor(share · misses) (a lone miss stays on the link): CUDA tests; which
#                                    #   CPUs share a core (probe_siblings.py); 2K bs 1 and 4, shares 0 and 0.75, each first
#                                    #   after a policy switch once a round; 32K bs=1 at 916 slots, shares 0.99, 0.75, 0
#   bash benchmarks/h200/run.sh CS   # the one graph captured with and without the mailbox's kernels (the gate picks): CUDA
#                                    #   tests; 2K bs 1 and 4, three rounds; 2K bs=1 with TANDEM_GRAPH_CPU_SHARE=0, then
#                                    #   unset, three rounds each; 32K bs=1 at 916 slots, two rounds
#   bash benchmarks/h200/run.sh CT   # both one graphs captured at a size's first graph step: CUDA tests; 2K bs 1 and 4, three
#                                    #   rounds; the 32K bs=4 cell with the mailbox
#   bash benchmarks/h200/run.sh CU   # CT's fix (resident graphs have no one-graph table): CUDA tests; a quick calibration (the
#                                    #   engine's CPU kernels now); 2K bs 1 and 4, three rounds; 2K bs=1 alone, three rounds
#   bash benchmarks/h200/run.sh CV   # calibration's CPU attention step, the engine's kernel against torch's flash kernel
#                                    #   (probe_calib_attention.py): phase CU's A read 2.7 GB/s of KV
#   bash benchmarks/h200/run.sh CW   # the quick calibration twice (is CU's slow 16K KV point repeatable?)
#   bash benchmarks/h200/run.sh CX   # CW after the fix (each KV step size timed twice apart, the faster counts)
#   bash benchmarks/h200/run.sh CY   # (not run; CZ holds it) the dot-product instruction's own ceiling per thread, alone and
#                                    #   on every core (probe_dot_peak.py); the expert kernel's roof at 8 tokens beside it
#   (CZ: at commit 919e21b, with TANDEM_FMA_MIN_TOKENS, since removed; reverted: faster in cache, slower from DRAM)
#   bash benchmarks/h200/run.sh CZ   # bf16 weights through fp32 FMAs from 4 tokens on the dot-product tables: expert kernel
#                                    #   tests; probe_dot_peak.py; roof with VDPBF16PS against FMAs (AMX off) at 1-16
#                                    #   tokens, 1 and 15 threads, alternated twice; one layer's CPU set (moe) with
#                                    #   VDPBF16PS, the new default and FMAs everywhere, alternated twice
#   bash benchmarks/h200/run.sh DA   # host memory on transparent huge pages: the host's THP settings; tests (huge pages, the
#                                    #   expert store, expert kernels, CUDA expert tests); the dot-product ceiling with threads
#                                    #   unbound; roof, attention at 32K and one layer's CPU set with TANDEM_HUGE_PAGES=0 and 1,
#                                    #   alternated twice
#   bash benchmarks/h200/run.sh DB   # DA's A/B again, with the huge-page MiB each roof run got: roof at 15 threads, then the
#                                    #   STREAM read, attention at 32K and one layer's CPU set, TANDEM_HUGE_PAGES=0 and 1,
#                                    #   alternated three times
#   bash benchmarks/h200/run.sh DC   # the clock (a dependent add chain) beside the dot-product and FMA ceilings per thread
#                                    #   count, then the expert roof at 15 threads, then the probe again; bench experts 2K,
#                                    #   bs 1 and 4, adaptive, with the store on huge pages and not (TANDEM_HUGE_PAGES=1, 0)
#   bash benchmarks/h200/run.sh DD   # the CUDA tests (models, kv, experts, hw, kernels) with the expert store on huge pages;
#                                    #   probe_dot_peak.py with its mixed VDPBF16PS + FMA loop at 1, 8 and 15 threads
#   bash benchmarks/h200/run.sh DE   # a pinned store on huge pages on CUDA (tests/hw/test_hostmem.py); the zero-copy, CPU
#                                    #   mailbox, store and decode-graph tests on CUDA
#   bash benchmarks/h200/run.sh N2   # bench experts: 32K bs=1 from one prefill; 2K greedy; 2K without graphs
# .llamacpp/llamacpp-src.tar.xz: python3 -m engine.bench.llamacpp_build --source <llama-cpp-python sdist> --prune …
# .llamacpp/smollm2-vocab.gguf: the built-in GGUF's tokenizer.* keys alone (no tensors), for --tokenizer-from.
# Results land in $OUT (or ./h200-out). The built-in SmolLM2 file does not travel to that machine,
# so tests that need it are deselected there.
set -uo pipefail
phase=${1:?A, B, C, D, E, F, F1, F2, G, H, I, J, K, L, M, N or N2}
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
fi
if [ "$phase" = F1 ] || [ "$phase" = F ] || [ "$phase" = I ]; then
  if [ -z "$(find /tmp/tandem-llb -name llama-bench -type f 2>/dev/null)" ]; then
    step llama.cpp CUDA build
    timeout 560 python3 -m engine.bench.llamacpp_build --source .llamacpp/llamacpp-src.tar.xz \
      --build-dir /tmp/tandem-llb > "$out/llamacpp-build.log" 2>&1 &
    build=$!
  fi
  if [ ! -f /tmp/tandem-gguf/q16.gguf ]; then
    step export synthetic:qwen3-30b-a3b-L16 to GGUF
    mkdir -p /tmp/tandem-gguf
    timeout 300 python3 -m engine.cli export-gguf --model synthetic:qwen3-30b-a3b-L16 --out /tmp/tandem-gguf/q16.gguf \
      --device cuda --tokenizer-from .llamacpp/smollm2-vocab.gguf --quiet > "$out/export.json" 2>>"$log"
  fi
  ls -la /tmp/tandem-gguf | tee -a "$log"
  if [ "$phase" = I ]; then  # while llama.cpp compiles on the CPU
    step CUDA tests
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/kv/test_resident_paged.py \
      2>&1 | tail -15 | tee "$out/pytest-cuda.log"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/models tests/experts tests/kv \
      2>&1 | tail -15 | tee -a "$out/pytest-cuda.log"
  fi
  if [ -n "${build:-}" ]; then wait $build; echo "build rc=$?" | tee -a "$log"; fi
fi
if [ "$phase" = F2 ] || [ "$phase" = F ] || [ "$phase" = I ]; then
  lb=$(find /tmp/tandem-llb -name llama-bench -type f | head -1)
  g=/tmp/tandem-gguf/q16.gguf
  step llama-bench resident "$lb"
  timeout 150 python3 -m engine.bench.llamacpp_bench --llama-bench "$lb" -m $g -ngl 99 -fa 1 -d 2048,8192,32768 \
    -p 0 -n 32 -r 2 --note "all layers on the GPU (resident)" --json "$out/llamacpp-resident.json" > /dev/null 2>>"$log"
  step tandem resident on the same GGUF
  timeout 180 python3 -m engine.cli bench e2e --model $g --kv-policies resident --expert-policy resident \
    --batch-sizes 1,4 --contexts 2048,8192,32768 --new-tokens 32 --vram-budget-gb 0 \
    --json "$out/tandem-resident-q16.json" > /dev/null 2>>"$log"
  if [ "$phase" != I ]; then
  step llama-bench 8 GB: experts of 10 of 16 layers on the CPU
  timeout 200 python3 -m engine.bench.llamacpp_bench --llama-bench "$lb" -m $g -ngl 99 -ncmoe 10 -fa 1 \
    -d 2048,8192,32768 -p 0 -n 32 -r 2 --note "8 GB VRAM budget (24 GB scaled to 16 of 48 layers)" \
    --json "$out/llamacpp-ncmoe10.json" > /dev/null 2>>"$log"
  step tandem 8 GB budget on the same GGUF
  timeout 200 python3 -m engine.cli bench e2e --model $g --kv-policies writescope --expert-policy adaptive \
    --batch-sizes 1,4 --contexts 2048,8192,32768 --new-tokens 16 --vram-budget-gb 8 --cpu-threads 15 \
    --json "$out/tandem-8gb-q16.json" > /dev/null 2>>"$log"
  fi
  if [ "$phase" = F2 ] || [ "$phase" = I ]; then
    step transformers generate on the same shapes
    timeout 120 python3 -m engine.cli bench transformers --model synthetic:qwen3-30b-a3b-L16 --contexts 8192 \
      --batch-sizes 1 --new-tokens 32 --json "$out/transformers-q16.json" > /dev/null 2>>"$log"
  fi
fi
if [ "$phase" = J ]; then
  step tests: native kernels, decode graphs
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_native.py tests/kernels/test_experts_cpu.py \
    tests/models/test_decode_graph.py 2>&1 | tail -15 | tee "$out/pytest.log"
  step bench cpu-kernels
  timeout 300 python3 -m engine.cli bench cpu-kernels --thread-counts 1,2,8,15,16 --lengths 8k,32k --batches 1,4 \
    --tokens 1,2,4,8 --quick --repeats 7 --json "$out/cpu-kernels.json" > /dev/null 2>>"$log"
  step paged kernel sweep
  timeout 150 python3 benchmarks/h200/tune_paged.py --json "$out/tune-paged.json" 2>&1 | grep -v Warn | tee -a "$log"
fi
if [ "$phase" = M ]; then
  step tests: native expert kernel
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py tests/experts/test_expert_executor.py \
    2>&1 | tail -5 | tee "$out/pytest.log"
  step bench cpu-kernels
  timeout 200 python3 -m engine.cli bench cpu-kernels --thread-counts 15,16 --lengths 32k --batches 1,4 \
    --tokens 1,2,4,8 --quick --repeats 7 --json "$out/cpu-kernels.json" > /dev/null 2>>"$log"
fi
bench_experts() {  # name, then flags on top of the shared ones
  local name=$1; shift
  step bench experts "$name"
  timeout 420 python3 -m engine.cli bench experts --vram-budget-gb 24 --cpu-threads 15 --new-tokens 32 "$@" \
    --json "$out/experts-$name.json" > /dev/null 2>>"$log"
  echo "rc=$?" | tee -a "$log"
}
if [ "$phase" = N ]; then
  step tests: moe_decode, decode graphs, CPU expert sets, offloaded experts on CUDA
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_decode_gpu.py tests/models/test_decode_graph.py \
    tests/kernels/test_experts_cpu.py 2>&1 | tail -8 | tee "$out/pytest.log"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts 2>&1 | tail -5 | tee -a "$out/pytest.log"
  step bench cpu-kernels moe: per-expert loop vs one call, default OpenMP waiting, then ACTIVE
  timeout 120 python3 -m engine.cli bench cpu-kernels --sections moe --thread-counts 15 --repeats 21 \
    --json "$out/cpu-kernels-moe.json" > /dev/null 2>>"$log"
  OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000 timeout 120 python3 -m engine.cli bench cpu-kernels --sections moe \
    --thread-counts 15 --repeats 21 --json "$out/cpu-kernels-moe-active.json" > /dev/null 2>>"$log"
  bench_experts 2k-sample --batch-sizes 1,4 --contexts 2048
fi
if [ "$phase" = O ] || [ "$phase" = P ]; then
  step tests: moe_decode, decode graphs
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_decode_gpu.py tests/models/test_decode_graph.py \
    > "$out/pytest.log" 2>&1; tail -3 "$out/pytest.log"
  step profile offloaded decode, L16, 737 slots
  timeout 300 python3 benchmarks/h200/profile_offload.py synthetic:qwen3-30b-a3b-L16 737 "$out" 2>>"$log" | tee -a "$log"
fi
if [ "$phase" = P ]; then
  bench_experts 2k-sample --batch-sizes 1,4 --contexts 2048
fi
if [ "$phase" = Q ]; then
  bench_experts 2k-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = R ]; then
  bench_experts 2k-32k-bs1-shared --batch-sizes 1 --contexts 2048,32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = S ]; then
  step profile offloaded decode, L16, 737 slots: on-demand and adaptive
  timeout 150 python3 benchmarks/h200/profile_offload.py synthetic:qwen3-30b-a3b-L16 737 "$out" on-demand,adaptive \
    2>>"$log" | tee -a "$log"
fi
if [ "$phase" = Z ]; then
  for v in after before; do
    [ $v = before ] && cp .k8-before/experts_kernel.h .k8-before/common.h native/
    python3 setup.py -q build_ext --inplace --force >>"$log" 2>&1 || echo "native build FAILED" | tee -a "$log"
    step bench cpu-kernels experts, $v
    timeout 100 python3 -m engine.cli bench cpu-kernels --sections experts --thread-counts 15 --tokens 1,2,4,5,8,12 \
      --quick --repeats 9 --json "$out/cpu-kernels-experts-$v.json" > /dev/null 2>>"$log"
  done
fi
zero_copy_tests() {
  step tests: moe_decode, zero-copy decode, decode graphs, offloaded experts on CUDA
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_decode_gpu.py tests/experts/test_zero_copy.py \
    tests/models/test_decode_graph.py tests/experts/test_expert_executor.py > "$out/pytest.log" 2>&1; tail -3 "$out/pytest.log"
  grep -E "^(FAILED|ERROR)|Error" "$out/pytest.log" | head -20 | tee -a "$log"
}
if [ "$phase" = T ]; then
  zero_copy_tests
  bench_experts 2k-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = T2 ]; then
  bench_experts 32k-bs1-shared --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = X ]; then
  zero_copy_tests
  bench_experts 2k-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --policies on-demand,cpu-only,adaptive
  bench_experts 32k-bs1-shared --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = W ]; then
  bench_experts 32k-bs1-shared --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
  step profile offloaded decode, L16, 737 slots: adaptive in pieces, on-demand
  timeout 200 python3 benchmarks/h200/profile_offload.py synthetic:qwen3-30b-a3b-L16 737 "$out" adaptive,on-demand pieces \
    2>>"$log" | tee -a "$log"
fi
if [ "$phase" = V ]; then
  step tests: moe_decode, zero-copy decode, decode graphs
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_decode_gpu.py tests/experts/test_zero_copy.py \
    tests/models/test_decode_graph.py > "$out/pytest.log" 2>&1; tail -3 "$out/pytest.log"
  grep -E "^(FAILED|ERROR)|Error" "$out/pytest.log" | head -20 | tee -a "$log"
  step profile zero-copy reads and decode forms
  timeout 200 python3 benchmarks/h200/profile_zero_copy.py "$out" 2>>"$log" | tee -a "$log"
  bench_experts 2k-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = U ]; then
  step tests: zero-copy decode, decode graphs
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/experts/test_zero_copy.py \
    tests/models/test_decode_graph.py > "$out/pytest.log" 2>&1; tail -3 "$out/pytest.log"
  grep -E "^(FAILED|ERROR)|Error" "$out/pytest.log" | head -20 | tee -a "$log"
  step profile zero-copy reads and decode forms
  timeout 300 python3 benchmarks/h200/profile_zero_copy.py "$out" 2>>"$log" | tee -a "$log"
fi
if [ "$phase" = AA ]; then
  step profile hybrid KV step, 32K, bs 1 and 4
  timeout 240 python3 benchmarks/h200/profile_kv.py "$out/kv-default" 2>>"$log" | tee -a "$log"
  step the same with OMP_WAIT_POLICY=ACTIVE
  OMP_WAIT_POLICY=ACTIVE timeout 200 python3 benchmarks/h200/profile_kv.py "$out/kv-active" 2>>"$log" | tee -a "$log"
  step profile offloaded decode, L16, 737 slots: adaptive in pieces
  timeout 200 python3 benchmarks/h200/profile_offload.py synthetic:qwen3-30b-a3b-L16 737 "$out/offload" adaptive pieces \
    2>>"$log" | tail -20 | tee -a "$log"
fi
if [ "$phase" = AB ]; then
  step profile hybrid KV step, 32K, bs 1 and 4, host syncs
  timeout 300 python3 benchmarks/h200/profile_kv.py "$out" 2>>"$log" | cut -c1-1500 | tee -a "$log"
fi
kv_tests() {
  step tests: hybrid KV on CUDA, merge kernel
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kv/test_kv_inplace.py tests/kv/test_kv_kernels.py \
    > "$out/pytest.log" 2>&1; tail -3 "$out/pytest.log"
  grep -E "^(FAILED|ERROR)|Error" "$out/pytest.log" | head -20 | tee -a "$log"
}
bench_e2e_32k() {  # $1: new tokens per sequence
  step bench e2e at 32K, $1 new tokens
  timeout 300 python3 -m engine.cli bench e2e --kv-policies writescope,gpu-centric,cpu-centric --batch-sizes 1,4 \
    --contexts 32768 --new-tokens "$1" --vram-budget-gb 24 --cpu-threads 15 --json "$out/e2e-32k.json" \
    > /dev/null 2> "$out/e2e-32k.log"; grep "\[e2e\]" "$out/e2e-32k.log" | tee -a "$log"
}
bench_kv_32k() {  # $1: record name; the rest: more flags for the run
  local name=$1; shift
  step bench kv at 32K, $name
  timeout 240 python3 -m engine.cli bench kv "$@" --policies writescope,gpu-centric,cpu-centric --layers 8 \
    --lengths 32768 --batch-sizes 1,4,16 --json "$out/kv-32k-$name.json" 2>>"$log" | tail -12 | tee -a "$log"
}
if [ "$phase" = AC ]; then
  kv_tests
  step profile hybrid KV step, default
  timeout 200 python3 benchmarks/h200/profile_kv.py "$out/kv-default" 2>>"$log" | cut -c1-700 | tee -a "$log"
  step profile hybrid KV step, OMP_WAIT_POLICY=PASSIVE
  OMP_WAIT_POLICY=PASSIVE timeout 200 python3 benchmarks/h200/profile_kv.py "$out/kv-passive" 2>>"$log" | cut -c1-700 \
    | tee -a "$log"
  bench_kv_32k default
  OMP_WAIT_POLICY=PASSIVE bench_kv_32k passive
fi
if [ "$phase" = AD ]; then
  kv_tests
  step profile hybrid KV step, default
  timeout 200 python3 benchmarks/h200/profile_kv.py "$out/kv-default" 2>>"$log" | cut -c1-700 | tee -a "$log"
  bench_kv_32k run1
  bench_kv_32k run2
fi
if [ "$phase" = AE ]; then
  kv_tests
  bench_kv_32k default
  step bench kv at 32K, switch interval 0.1 ms
  timeout 240 python3 -c "import runpy, sys; sys.setswitchinterval(1e-4); runpy.run_module('engine.cli', run_name='__main__')" \
    bench kv --policies writescope,gpu-centric,cpu-centric --layers 8 --lengths 32768 --batch-sizes 1,4,16 \
    --json "$out/kv-32k-switch.json" 2>>"$log" | tail -3 | tee -a "$log"
  step profile hybrid KV step, switch interval 0.1 ms
  SWITCH_INTERVAL=1e-4 timeout 200 python3 benchmarks/h200/profile_kv.py "$out/kv-switch" 2>>"$log" | cut -c1-700 | tee -a "$log"
fi
if [ "$phase" = AF ]; then
  bench_kv_32k final
  bench_e2e_32k 8
fi
if [ "$phase" = AG ]; then
  kv_tests
  bench_kv_32k per-layer-writeback
fi
if [ "$phase" = AH ]; then
  kv_tests
  for run in 1 2 3; do
    bench_kv_32k graphs-$run
    [ $run -lt 3 ] && bench_kv_32k eager-$run --no-stream-graphs
  done
  bench_e2e_32k 8
fi
if [ "$phase" = AI ]; then
  kv_tests
  bench_kv_32k graphs-1
  bench_kv_32k graphs-2
  step bench kv at 32K, 48 layers, bs=1: routing at full model depth
  timeout 240 python3 -m engine.cli bench kv --policies writescope,gpu-centric,cpu-centric --layers 48 \
    --lengths 32768 --batch-sizes 1 --json "$out/kv-32k-L48.json" 2>>"$log" | tail -3 | tee -a "$log"
  bench_e2e_32k 32
fi
if [ "$phase" = AJ ]; then
  kv_tests
  bench_kv_32k graphs-3
  bench_e2e_32k 32
fi
if [ "$phase" = AK ]; then
  kv_tests
  for run in 1 2; do
    step bench kv at 32K, 48 layers, bs 1 and 4, run $run
    timeout 240 python3 -m engine.cli bench kv --policies writescope,gpu-centric,cpu-centric --layers 48 \
      --lengths 32768 --batch-sizes 1,4 --json "$out/kv-32k-L48-$run.json" 2>>"$log" | tail -3 | tee -a "$log"
  done
  bench_kv_32k lone-part
fi
if [ "$phase" = AM ]; then
  grep -o -w -E "amx_(tile|bf16|int8)|avx512_bf16" /proc/cpuinfo | sort | uniq -c | tee -a "$log"
  step tests: native expert kernels on every ISA here, the decode graphs failed capture
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py \
    "tests/models/test_decode_graph.py::test_a_failed_capture_falls_back_to_eager_steps" > "$out/pytest.log" 2>&1
  tail -3 "$out/pytest.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20 | tee -a "$log"
  step bench cpu-kernels: experts, vector and AMX tiles per token count
  timeout 300 python3 -m engine.cli bench cpu-kernels --sections stream,experts,moe --thread-counts 15 \
    --tokens 1,2,3,4,5,6,8,12,16,32,64,128 --moe-tokens 1,4,8,16 --quick --repeats 9 \
    --json "$out/cpu-kernels-amx.json" > /dev/null 2>>"$log"
  python3 - "$out/cpu-kernels-amx.json" <<'PY' 2>&1 | tee -a "$log"
import json, sys
r = json.load(open(sys.argv[1]))
print("isa", r["native"]["isa"], "stream", [(s["threads"], s["read_GBps"]) for s in r.get("stream", [])])
for p in r["experts"]["points"]:
    print(p["tokens"], p.get("native_GBps"), "vector", p.get("native_vector_GBps"), "amx", p.get("native_amx_GBps"),
          "torch", p["torch_GBps"])
print(json.dumps(r["summary"]))
PY
fi
experts_table() {  # $1: a cpu-kernels record
  python3 - "$1" <<'PY' 2>&1 | tee -a "$log"
import json, sys
r = json.load(open(sys.argv[1]))
print("isa", r["native"]["isa"], "stream", [(s["threads"], s["read_GBps"]) for s in r.get("stream", [])])
for p in (r.get("experts") or {}).get("points", []):
    print(p["tokens"], p.get("native_GBps"), "vector", p.get("native_vector_GBps"), "amx", p.get("native_amx_GBps"),
          "torch", p["torch_GBps"])
print(json.dumps(r["summary"]))
PY
}
if [ "$phase" = AN ]; then
  step tests: native expert kernels on every ISA here, AMX tiles of 16 and of 8 rows
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py > "$out/pytest.log" 2>&1
  TANDEM_AMX_TILE_ROWS=8 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py \
    -k "amx or moe or token" >> "$out/pytest.log" 2>&1
  grep -E "passed|failed" "$out/pytest.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20 | tee -a "$log"
  for rows in 16 8; do
    step bench cpu-kernels experts, AMX tiles of $rows rows against vector tiles, alternated
    TANDEM_AMX_TILE_ROWS=$rows timeout 200 python3 -m engine.cli bench cpu-kernels --sections stream,experts \
      --thread-counts 15 --tokens 1,2,4,5,6,8,12,16,32,128 --quick --repeats 9 \
      --json "$out/cpu-kernels-amx-rows$rows.json" > /dev/null 2>>"$log"
    experts_table "$out/cpu-kernels-amx-rows$rows.json"
  done
  for min in 100000 5; do
    step bench cpu-kernels moe, AMX from $min tokens per expert
    TANDEM_AMX_MIN_TOKENS=$min timeout 150 python3 -m engine.cli bench cpu-kernels --sections moe --thread-counts 15 \
      --moe-tokens 1,4,8,16 --repeats 15 --json "$out/cpu-kernels-moe-amx$min.json" > /dev/null 2>>"$log"
    experts_table "$out/cpu-kernels-moe-amx$min.json"
  done
fi
if [ "$phase" = AO ]; then
  step tests: AMX tiles with packed rows
  TANDEM_AMX_PACK=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py -k "amx or moe" \
    > "$out/pytest.log" 2>&1; tail -2 "$out/pytest.log" | tee -a "$log"
  for pack in 0 1; do
    step AMX against vector tiles, rows as stored and padded, pack=$pack
    TANDEM_AMX_PACK=$pack timeout 150 python3 benchmarks/h200/profile_amx.py "$out/profile-amx-pack$pack.json" \
      2>&1 | tee -a "$log"
  done
  step bench cpu-kernels experts, a fresh expert per call
  timeout 200 python3 -m engine.cli bench cpu-kernels --sections stream,experts --thread-counts 15 \
    --tokens 1,2,4,5,8,16 --quick --repeats 9 --json "$out/cpu-kernels-experts.json" > /dev/null 2>>"$log"
  experts_table "$out/cpu-kernels-experts.json"
fi
if [ "$phase" = AP ]; then
  step tests: native expert kernels on every ISA here
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py > "$out/pytest.log" 2>&1
  tail -2 "$out/pytest.log" | tee -a "$log"
  step AMX against vector tiles, alternated
  timeout 150 python3 benchmarks/h200/profile_amx.py "$out/profile-amx.json" 2>&1 | tee -a "$log"
  step bench cpu-kernels experts, a fresh expert per call
  timeout 200 python3 -m engine.cli bench cpu-kernels --sections stream,experts --thread-counts 15 \
    --tokens 1,2,4,5,8,9,12,16,32 --quick --repeats 9 --json "$out/cpu-kernels-experts.json" > /dev/null 2>>"$log"
  experts_table "$out/cpu-kernels-experts.json"
  for round in 1 2; do
    for min in 100000 9; do
      step bench cpu-kernels moe, AMX from $min tokens per expert, round $round
      TANDEM_AMX_MIN_TOKENS=$min timeout 150 python3 -m engine.cli bench cpu-kernels --sections moe --thread-counts 15 \
        --moe-tokens 1,4,8,12,16 --repeats 15 --json "$out/cpu-kernels-moe-amx$min-$round.json" > /dev/null 2>>"$log"
      experts_table "$out/cpu-kernels-moe-amx$min-$round.json"
    done
  done
fi
if [ "$phase" = AQ ]; then
  step tests: offloaded experts on CUDA
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts > "$out/pytest.log" 2>&1
  tail -2 "$out/pytest.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head | tee -a "$log"
  for si in default 2e-4; do
    step profile offloaded decode, L16, 737 slots: adaptive in pieces, switch interval $si
    env=""; [ $si != default ] && env="SWITCH_INTERVAL=$si"
    env $env timeout 200 python3 benchmarks/h200/profile_offload.py synthetic:qwen3-30b-a3b-L16 737 "$out/offload-$si" \
      adaptive pieces 2>>"$log" | cut -c1-900 | tee -a "$log"
  done
fi
profile_pieces() {  # $1: record name; adaptive in pieces on L16, 737 slots, bs 1 and 4 (json only)
  step profile offloaded decode, L16, 737 slots: adaptive in pieces, $1
  timeout 200 python3 benchmarks/h200/profile_offload.py synthetic:qwen3-30b-a3b-L16 737 "/tmp/profile-$1" adaptive pieces \
    2>>"$log" | cut -c1-700 | tee -a "$log"
  cp "/tmp/profile-$1/profile-offload.json" "$out/profile-offload-$1.json"
}
if [ "$phase" = AR ]; then
  step tests: offloaded experts on CUDA
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts > "$out/pytest.log" 2>&1
  tail -2 "$out/pytest.log" | tee -a "$log"
  profile_pieces cpu-first-1
  cp engine/experts/offload.py /tmp/offload-new.py; cp .ab-before/offload.py engine/experts/offload.py
  profile_pieces fills-first
  cp /tmp/offload-new.py engine/experts/offload.py
  profile_pieces cpu-first-2
  bench_experts 2k-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
ab_swap() {  # put the tree of files under .ab-before/ in place; the files replaced go to /tmp/ab-saved
  (cd .ab-before && find . -type f) | while read -r f; do
    mkdir -p "/tmp/ab-saved/$(dirname "$f")"; cp "$f" "/tmp/ab-saved/$f"; cp ".ab-before/$f" "$f"
  done
}
ab_restore() {
  (cd /tmp/ab-saved && find . -type f) | while read -r f; do cp "/tmp/ab-saved/$f" "$f"; done
}
ab_pieces() {  # $1: the change's name; L16 pieces with the change, then with .ab-before/, twice
  for round in 1 2; do
    profile_pieces "$1-$round"
    ab_swap; profile_pieces before-$round; ab_restore
  done
}
experts_cuda_tests() {  # $@: test files run whole after the CUDA-marked tests of tests/experts
  step tests: offloaded experts on CUDA, then "$@"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts > "$out/pytest.log" 2>&1
  timeout 200 python3 -m pytest -q -p no:cacheprovider "$@" >> "$out/pytest.log" 2>&1
  grep -E "passed|failed|^(FAILED|ERROR)" "$out/pytest.log" | tail -8 | tee -a "$log"
}
bench_2k_rounds() {  # bench experts 2K, bs 1 and 4, the policies taking turns three times (phase AX's command)
  bench_experts 2k-shared-rounds --batch-sizes 1,4 --contexts 2048 --shared-prefill --rounds 3 \
    --policies on-demand,cpu-only,adaptive
}
if [ "$phase" = AS ]; then
  step tests: offloaded experts, hybrid KV, decode graphs on CUDA
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts tests/kv/test_kv_inplace.py \
    tests/models/test_decode_graph.py \
    > "$out/pytest.log" 2>&1; tail -2 "$out/pytest.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head | tee -a "$log"
  profile_pieces new-1
  ab_swap; profile_pieces before; ab_restore; git diff --stat | tail -1 | tee -a "$log"
  profile_pieces new-2
  bench_experts 2k-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = AT ]; then
  step tests: offloaded experts on CUDA
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts > "$out/pytest.log" 2>&1
  tail -2 "$out/pytest.log" | tee -a "$log"
  ab_pieces final
fi
if [ "$phase" = AU ]; then
  ab_pieces prepared
  bench_experts 2k-shared-bs4 --batch-sizes 4 --contexts 2048 --shared-prefill --policies on-demand,adaptive
fi
if [ "$phase" = AV ]; then  # not yet run
  bench_2k_rounds
fi
if [ "$phase" = AW ]; then
  step host topology
  { lscpu; nproc; } 2>&1 | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|L[123]|NUMA|Flags)" | cut -c1-300 | tee -a "$log"
  step expert kernel: DRAM against in-cache roof
  timeout 200 python3 benchmarks/h200/profile_roof.py "$out/profile-roof.json" 2>&1 | tee -a "$log"
  for round in 1 2; do
    profile_pieces t15-$round
    (export CPU_THREADS=12; profile_pieces t12-$round)
    (export OMP_WAIT_POLICY=PASSIVE; profile_pieces passive-$round)
  done
fi
if [ "$phase" = AX ]; then
  experts_cuda_tests tests/kernels/test_experts_cpu.py tests/experts/test_expert_executor.py tests/experts/test_expert_store.py
  ab_pieces worker
  bench_2k_rounds
fi
if [ "$phase" = AY ]; then
  experts_cuda_tests tests/models/test_decode_graph.py tests/experts/test_expert_executor.py
  ab_pieces deferred
  bench_experts 2k-shared-bs4-rounds --batch-sizes 4 --contexts 2048 --shared-prefill --rounds 3 \
    --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = AZ ]; then
  bench_experts 32k-shared --batch-sizes 1,4 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = BA ]; then
  step expert kernel on AMX tiles from 1 token: DRAM against in-cache roof
  TANDEM_AMX_MIN_TOKENS=1 ROOF_THREADS=15 ROOF_TOKENS=1,2,4,5,8,12,16 timeout 200 \
    python3 benchmarks/h200/profile_roof.py "$out/profile-roof-amx.json" 2>&1 | tee -a "$log"
  step the same on the vector tiles below 9 tokens
  ROOF_THREADS=15 ROOF_TOKENS=1,4,5,8 timeout 200 python3 benchmarks/h200/profile_roof.py "$out/profile-roof.json" \
    2>&1 | tee -a "$log"
fi
if [ "$phase" = BB ]; then
  step tests: native expert kernels, AMX included
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py > "$out/pytest.log" 2>&1
  grep -E "passed|failed|^(FAILED|ERROR)" "$out/pytest.log" | tail -8 | tee -a "$log"
  amx_roof() {
    step AMX roof, $1
    TANDEM_AMX_MIN_TOKENS=1 ROOF_THREADS=15 ROOF_TOKENS=1,4,5,8,12,16 timeout 120 \
      python3 benchmarks/h200/profile_roof.py "$out/profile-roof-amx-$1.json" 2>&1 | tee -a "$log"
  }
  amx_roof new-1
  ab_swap; python3 setup.py -q build_ext --inplace --force >>"$log" 2>&1; amx_roof before
  ab_restore; python3 setup.py -q build_ext --inplace --force >>"$log" 2>&1; amx_roof new-2
fi
if [ "$phase" = BC ]; then
  step expert kernel: vector against AMX tiles, alternated three times
  timeout 150 python3 benchmarks/h200/profile_amx.py "$out/profile-amx.json" 2>&1 | tee -a "$log"
fi
if [ "$phase" = BD ]; then
  step tests: native expert kernels
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_experts_cpu.py > "$out/pytest.log" 2>&1
  grep -E "passed|failed|^(FAILED|ERROR)" "$out/pytest.log" | tail -4 | tee -a "$log"
  step roof, narrow last group
  ROOF_THREADS=15 ROOF_TOKENS=4,5,6,8 timeout 60 python3 benchmarks/h200/profile_roof.py "$out/profile-roof-new.json" 2>&1 | tee -a "$log"
  ab_swap; python3 setup.py -q build_ext --inplace --force >>"$log" 2>&1
  step roof, before
  ROOF_THREADS=15 ROOF_TOKENS=4,5,6,8 timeout 60 python3 benchmarks/h200/profile_roof.py "$out/profile-roof-before.json" 2>&1 | tee -a "$log"
  ab_restore
  # A second A/B followed on the same machine, in the other order (before, then new), rebuilt each
  # time: profile-roof-before-2.json and profile-roof-new-2.json.
fi
profile_form() {  # $1: slots, $2: form, $3: record tag (optional); adaptive on L16, bs 1 and 4 (json only)
  local name="$1-$2${3:+-$3}"
  step profile offloaded decode, L16, $1 slots: adaptive, $2 forced ${3:-}
  timeout 200 python3 benchmarks/h200/profile_offload.py synthetic:qwen3-30b-a3b-L16 "$1" "/tmp/profile-$name" adaptive "$2" \
    2>>"$log" | cut -c1-400 | tee -a "$log"
  cp "/tmp/profile-$name/profile-offload.json" "$out/profile-offload-$name.json"
}
if [ "$phase" = BE ]; then
  step tests: host-node CPU experts, zero-copy decode, decode graphs, moe_decode on CUDA
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/experts/test_graph_cpu.py tests/experts/test_zero_copy.py \
    tests/models/test_decode_graph.py tests/kernels/test_moe_decode_gpu.py > "$out/pytest.log" 2>&1
  grep -E "passed|failed|^(FAILED|ERROR)" "$out/pytest.log" | tail -8 | tee -a "$log"
  for form in graph graph-cpu pieces; do profile_form 737 $form; done
  for form in graph graph-cpu; do profile_form 300 $form; done
fi
if [ "$phase" = BF ]; then
  step tests: zero-copy decode with host nodes
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/experts/test_zero_copy.py > "$out/pytest.log" 2>&1
  grep -E "passed|failed|^(FAILED|ERROR)" "$out/pytest.log" | tail -4 | tee -a "$log"
  step host node and CPU expert costs, 15 threads
  timeout 150 python3 benchmarks/h200/profile_host_node.py "$out/host-node-15.json" 2>&1 | tee -a "$log"
  step the same, OMP_WAIT_POLICY=ACTIVE
  OMP_WAIT_POLICY=ACTIVE timeout 150 python3 benchmarks/h200/profile_host_node.py "$out/host-node-15-active.json" 2>&1 | tee -a "$log"
  step the same, 8 threads
  THREADS=8 timeout 150 python3 benchmarks/h200/profile_host_node.py "$out/host-node-8.json" 2>&1 | tee -a "$log"
fi
if [ "$phase" = BG ]; then
  for slots in 737 300; do profile_form $slots graph-cpu; profile_form $slots graph; done
  CPU_THREADS=12 profile_form 300 graph-cpu threads12
fi
if [ "$phase" = BH ]; then
  bench_experts 32k-shared --batch-sizes 1,4 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = BI ]; then
  bench_2k_rounds
fi
if [ "$phase" = BJ ]; then
  for slots in 300 737; do profile_form $slots graph-cpu; profile_form $slots pieces; done
fi
if [ "$phase" = BK ]; then
  for v in default ACTIVE ACTIVE default; do
    if [ $v = ACTIVE ]; then export OMP_WAIT_POLICY=ACTIVE; else unset OMP_WAIT_POLICY; fi
    profile_form 737 pieces "$v-$((++bk_run))"
  done
  unset OMP_WAIT_POLICY
fi
if [ "$phase" = BL ]; then
  for round in 1 2; do
    for isa in avx512bf16 avx512; do
      step expert kernel roof, $isa table, round $round
      TANDEM_NATIVE_ISA=$isa ROOF_THREADS=1,15 ROOF_TOKENS=4,5,6,8 timeout 120 \
        python3 benchmarks/h200/profile_roof.py "$out/profile-roof-$isa-$round.json" 2>&1 | tee -a "$log"
    done
  done
fi
if [ "$phase" = BM ]; then
  experts_cuda_tests tests/models/test_decode_graph.py tests/experts/test_zero_copy.py tests/experts/test_expert_executor.py
  ab_pieces early
  bench_2k_rounds
fi
if [ "$phase" = BO ]; then
  experts_cuda_tests tests/models/test_decode_graph.py tests/experts/test_expert_executor.py tests/kernels/test_experts_cpu.py
  ab_pieces routed
  bench_2k_rounds
fi
if [ "$phase" = BP ]; then
  bench_2k_rounds
fi
prefetch_depth() {  # $1: PREFETCH_PER_TOKEN for the runs that follow (edits zero_copy.py in this copy only; e118384)
  sed -i "s/^PREFETCH_PER_TOKEN = .*/PREFETCH_PER_TOKEN = $1/" engine/experts/zero_copy.py
}
if [ "$phase" = BW ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py 2>&1 | tail -1 | tee "$out/pytest.log"
  profile_form 737 graph gpu-sampling
  ab_swap; profile_form 737 graph before; ab_restore
fi
if [ "$phase" = BX ]; then
  for round in 1 2 3; do
    for amx in 99 5; do
      step expert kernel roof, AMX tiles from $amx tokens, round $round
      TANDEM_AMX_MIN_TOKENS=$amx ROOF_THREADS=1,15 ROOF_TOKENS=4,5,6,7,8 timeout 120 \
        python3 benchmarks/h200/profile_roof.py "$out/profile-roof-amx$amx-$round.json" 2>&1 | tee -a "$log"
    done
  done
  tar czf "$out/roofs.tgz" -C "$out" $(cd "$out" && ls profile-roof-*.json) && rm "$out"/profile-roof-*.json
  step GPU timeline of a decode step, 48 layers, 2K, bs=1
  timeout 300 python3 benchmarks/h200/profile_step_timeline.py "$out/timeline-2k-bs1.json" 2>>"$log" | tee -a "$log"
  bench_2k_rounds
fi
run_tests() {  # $1: what they test; the rest: pytest's arguments (the full log in $out/pytest.log)
  local what=$1; shift
  step tests: "$what"
  timeout 400 python3 -m pytest -q -p no:cacheprovider "$@" > "$out/pytest.log" 2>&1
  grep -E "passed|failed|^(FAILED|ERROR)" "$out/pytest.log" | tail -8 | tee -a "$log"
}
timeline_2k_bs1() {  # the step timeline of adaptive (or $2), 48 layers, 2K, bs=1, with the GPU's idle gaps by length;
  # $1: a tag for the record's name (optional)
  step GPU timeline of a decode step, 48 layers, 2K, bs=1, ${2:-adaptive}, with idle gaps by length ${1:-}
  timeout 200 python3 benchmarks/h200/profile_step_timeline.py "$out/timeline-2k-bs1${1:+-$1}.json" synthetic:qwen3-30b-a3b \
    ${2:-adaptive} 2>>"$log" | grep -v "host_by_function\|USDT" | cut -c1-1200 | tee -a "$log"
}
e2e_resident_l16() {  # $1: the record's name; resident L16 decode at 2K, bs 1 and 4 (phase CA's command)
  step resident synthetic:qwen3-30b-a3b-L16 bench e2e, $1
  timeout 150 python3 -m engine.cli bench e2e --model synthetic:qwen3-30b-a3b-L16 --kv-policies resident \
    --expert-policy resident --batch-sizes 1,4 --contexts 2048 --new-tokens 32 --vram-budget-gb 0 \
    --json "$out/e2e-resident-L16-$1.json" 2>&1 | grep "\[e2e\]" | tee -a "$log"
}
if [ "$phase" = CS ]; then
  run_tests "the CPU mailbox, the one graph, decode graphs, on CUDA" tests/experts/test_cpu_mailbox.py \
    tests/experts/test_zero_copy.py tests/models/test_decode_graph.py
  bench_2k_rounds
  export TANDEM_GRAPH_CPU_SHARE=0
  bench_experts 2k-bs1-rounds-share-0 --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
  unset TANDEM_GRAPH_CPU_SHARE
  bench_experts 2k-bs1-rounds --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
  bench_experts 32k-bs1-916 --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill --rounds 2 \
    --policies on-demand,adaptive
fi
if [ "$phase" = DE ]; then
  run_tests "huge pages on CUDA; zero copy, CPU mailbox, store, decode graphs" tests/hw/test_hostmem.py \
    tests/experts/test_zero_copy.py tests/experts/test_cpu_mailbox.py tests/experts/test_expert_store.py \
    tests/models/test_decode_graph.py
fi
if [ "$phase" = DD ]; then
  run_tests "CUDA: models, kv, experts, hw, kernels (the expert store on huge pages)" -m cuda -k "not builtin" \
    tests/models tests/kv tests/experts tests/hw tests/kernels
  step clock, dot-product, FMA and mixed ceilings per thread
  timeout 120 python3 benchmarks/h200/probe_dot_peak.py "$out/dot-peak.json" 1,8,15 2>&1 | tee -a "$log"
fi
if [ "$phase" = DC ]; then
  step clock, dot-product and FMA ceilings per thread
  timeout 120 python3 benchmarks/h200/probe_dot_peak.py "$out/dot-peak-1.json" 1,4,8,12,15,16 2>&1 | tee -a "$log"
  step expert roof at 15 threads
  ROOF_THREADS=15 ROOF_TOKENS=1,4,6,8 timeout 200 python3 benchmarks/h200/profile_roof.py "$out/roof.json" 2>&1 | tail -5 \
    | tee -a "$log"
  step clock, dot-product and FMA ceilings per thread, again
  timeout 120 python3 benchmarks/h200/probe_dot_peak.py "$out/dot-peak-2.json" 1,8,15 2>&1 | tee -a "$log"
  for hp in 1 0; do
    TANDEM_HUGE_PAGES=$hp bench_experts 2k-hp$hp --batch-sizes 1,4 --contexts 2048 --shared-prefill --rounds 2 --policies adaptive
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(json.dumps(r.get('summary'))[:900]); print([(k, v) for k, v in r.items() if 'store' in k])" \
      "$out/experts-2k-hp$hp.json" 2>&1 | tee -a "$log"
  done
fi
if [ "$phase" = DB ]; then
  for round in 1 2 3; do
    for hp in 0 1; do
      step expert roof at 15 threads, TANDEM_HUGE_PAGES=$hp, round $round
      TANDEM_HUGE_PAGES=$hp ROOF_THREADS=15 ROOF_TOKENS=1,2,4,5,6,8 timeout 200 python3 benchmarks/h200/profile_roof.py \
        "$out/roof-hp$hp-$round.json" 2>&1 | tail -7 | tee -a "$log"
      step STREAM read, attention 32K, one layer\'s CPU set, TANDEM_HUGE_PAGES=$hp, round $round
      TANDEM_HUGE_PAGES=$hp timeout 200 python3 -m engine.cli bench cpu-kernels --sections stream,attention,moe \
        --thread-counts 15 --lengths 32k --batches 1,4 --moe-tokens 1,2,4,8 --repeats 9 --no-torch \
        --json "$out/cpu-kernels-hp$hp-$round.json" > /dev/null 2>>"$log"
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print('huge pages', r['huge_pages'], 'read', [s['read_GBps'] for s in r['stream']], 'attention', [(a['batch'], a['native_GBps']) for a in r['attention']], 'moe ms', [(k.split('_')[1], v['moe_ffn_ms']) for k, v in r['summary'].items() if k.startswith('moe_')])" \
        "$out/cpu-kernels-hp$hp-$round.json" 2>&1 | tee -a "$log"
    done
  done
  tar czf "$out/roofs.tgz" -C "$out" $(cd "$out" && ls roof-*.json) && rm -f "$out"/roof-*.json
fi
if [ "$phase" = DA ]; then
  step transparent huge pages on this host
  for f in enabled defrag; do echo "$f: $(cat /sys/kernel/mm/transparent_hugepage/$f)"; done | tee -a "$log"
  run_tests "huge pages, the expert store, expert kernels; CUDA expert tests" tests/hw/test_hostmem.py \
    tests/experts/test_expert_store.py tests/kernels/test_experts_cpu.py
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/experts 2>&1 | tail -4 | tee -a "$log"
  step the dot-product instruction\'s ceiling per thread, threads unbound
  DOT_PEAK_UNBOUND=1 timeout 120 python3 benchmarks/h200/probe_dot_peak.py "$out/dot-peak-unbound.json" 1,4,8,15 2>&1 | tee -a "$log"
  for round in 1 2; do
    for hp in 0 1; do
      step expert roof, TANDEM_HUGE_PAGES=$hp, round $round
      TANDEM_HUGE_PAGES=$hp ROOF_THREADS=1,15 ROOF_TOKENS=1,2,4,5,6,8 timeout 200 python3 benchmarks/h200/profile_roof.py \
        "$out/roof-hp$hp-$round.json" 2>&1 | tail -12 | tee -a "$log"
      step attention 32K and one layer\'s CPU set, TANDEM_HUGE_PAGES=$hp, round $round
      TANDEM_HUGE_PAGES=$hp timeout 200 python3 -m engine.cli bench cpu-kernels --sections attention,moe --thread-counts 15 \
        --lengths 32k --batches 1,4 --moe-tokens 1,2,4,8 --repeats 9 --no-torch --json "$out/cpu-kernels-hp$hp-$round.json" \
        > /dev/null 2>>"$log"
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print('huge pages', r['huge_pages'], [(a['batch'], a['native_GBps']) for a in r['attention']], json.dumps(r['summary'])[:600])" \
        "$out/cpu-kernels-hp$hp-$round.json" 2>&1 | tee -a "$log"
    done
  done
fi
if [ "$phase" = CZ ]; then
  run_tests "native expert kernels on every ISA here, VDPBF16PS and FMA products" tests/kernels/test_experts_cpu.py
  step the dot-product instruction\'s ceiling per thread
  timeout 120 python3 benchmarks/h200/probe_dot_peak.py "$out/dot-peak.json" 1,4,8,12,15,16 2>&1 | tee -a "$log"
  for round in 1 2; do
    for v in dp fma; do
      if [ $v = dp ]; then f=100000 a=9; else f=1 a=100000; fi
      step expert roof, $v: FMAs from $f tokens, AMX from $a, round $round
      TANDEM_FMA_MIN_TOKENS=$f TANDEM_AMX_MIN_TOKENS=$a ROOF_THREADS=1,15 ROOF_TOKENS=1,2,4,5,6,8,12,16 timeout 200 \
        python3 benchmarks/h200/profile_roof.py "$out/roof-$v-$round.json" 2>&1 | tail -16 | tee -a "$log"
    done
  done
  for round in 1 2; do
    for v in dp4 fma4 fma1; do
      case $v in dp4) f=100000 a=9;; fma4) f=4 a=9;; fma1) f=1 a=100000;; esac
      step bench cpu-kernels moe, FMAs from $f tokens, AMX from $a, round $round
      TANDEM_FMA_MIN_TOKENS=$f TANDEM_AMX_MIN_TOKENS=$a timeout 150 python3 -m engine.cli bench cpu-kernels --sections moe \
        --thread-counts 15 --moe-tokens 1,2,4,6,8,12,16 --repeats 15 --json "$out/cpu-kernels-moe-$v-$round.json" \
        > /dev/null 2>>"$log"
      experts_table "$out/cpu-kernels-moe-$v-$round.json"
    done
  done
fi
if [ "$phase" = CY ]; then
  step the dot-product instruction\'s ceiling per thread
  timeout 120 python3 benchmarks/h200/probe_dot_peak.py "$out/dot-peak.json" 1,4,8,12,15,16 2>&1 | tee -a "$log"
  step expert kernel roof at 6 and 8 tokens
  ROOF_THREADS=1,4,8,12,15 ROOF_TOKENS=6,8 timeout 200 python3 benchmarks/h200/profile_roof.py "$out/roof.json" \
    2>&1 | tail -12 | tee -a "$log"
fi
if [ "$phase" = CW ] || [ "$phase" = CX ]; then
  for i in 1 2; do
    step calibrate quick $i
    timeout 120 python3 -m engine.cli calibrate --quick --model synthetic:qwen3-30b-a3b --cpu-threads 15 \
      --profile-path "$out/hw-profile-$i.json" --quiet 2>&1 | grep -A2 "KV  \|experts  " | tee -a "$log"
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); e = next(iter(d['shapes'].values()))['kv']['by_batch']['1']; print('cpu', e['cpu_points']); print('gpu', e['gpu_points'])" \
      "$out/hw-profile-$i.json" | tee -a "$log"
  done
fi
if [ "$phase" = CV ]; then
  step calibration\'s CPU attention step, engine against torch
  timeout 240 python3 benchmarks/h200/probe_calib_attention.py "$out/calib-attention.json" 2>&1 | cut -c1-400 | tee -a "$log"
fi
if [ "$phase" = CU ]; then
  run_tests "the CPU mailbox, the one graph, decode graphs, calibration, on CUDA" tests/experts/test_cpu_mailbox.py \
    tests/experts/test_zero_copy.py tests/models/test_decode_graph.py tests/hw/test_calibrate.py
  step calibrate quick
  timeout 120 python3 -m engine.cli calibrate --quick --model synthetic:qwen3-30b-a3b --cpu-threads 15 \
    --profile-path "$out/hw-profile.json" --quiet 2>&1 | tail -40 | tee -a "$log"
  bench_2k_rounds
  bench_experts 2k-bs1-rounds --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
fi
if [ "$phase" = CT ]; then
  run_tests "the CPU mailbox, the one graph, decode graphs, on CUDA" tests/experts/test_cpu_mailbox.py \
    tests/experts/test_zero_copy.py tests/models/test_decode_graph.py
  bench_2k_rounds
  bench_experts 32k-bs4 --batch-sizes 4 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = CR ]; then
  bench_experts 2k-bs1-rounds --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = CQ ]; then
  run_tests "the CPU mailbox, the one graph, on CUDA" tests/experts/test_cpu_mailbox.py tests/experts/test_zero_copy.py
  bench_2k_rounds
  bench_experts 32k-bs1-916 --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill --rounds 2 \
    --policies on-demand,adaptive
fi
if [ "$phase" = CP ]; then
  run_tests "the CPU mailbox, the one graph, on CUDA" tests/experts/test_cpu_mailbox.py tests/experts/test_zero_copy.py
  step which CPUs share a core
  timeout 90 python3 benchmarks/h200/probe_siblings.py "$out/siblings.json" 2>&1 | tee -a "$log"
  bench_experts 32k-bs1-916-shares --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill \
    --rounds 2 --policies on-demand,adaptive:0.99,adaptive:0.75,adaptive:0
  bench_experts 2k-shares --batch-sizes 1,4 --contexts 2048 --shared-prefill \
    --policies on-demand,adaptive:0,adaptive:0.75,cpu-only,adaptive:0.75,adaptive:0
fi
if [ "$phase" = CO ]; then
  run_tests "the CPU mailbox, the one graph, on CUDA" tests/experts/test_cpu_mailbox.py tests/experts/test_zero_copy.py
  step which CPUs share a core
  timeout 60 python3 benchmarks/h200/probe_siblings.py "$out/siblings.json" 2>&1 | tail -3 | tee -a "$log"
  bench_experts 2k-shares-rounds --batch-sizes 1,4 --contexts 2048 --shared-prefill --rounds 2 \
    --policies on-demand,adaptive:0,adaptive:0.75,cpu-only,adaptive:0.75,adaptive:0
  bench_experts 32k-bs1-916-shares --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill \
    --rounds 2 --policies on-demand,adaptive:0.99,adaptive:0.75,adaptive:0
fi
if [ "$phase" = CN ]; then
  run_tests "the CPU mailbox, the one graph, moe_decode, the sampler, pinned copies, on CUDA" \
    tests/experts/test_cpu_mailbox.py tests/experts/test_zero_copy.py tests/kernels/test_moe_decode_gpu.py \
    tests/kernels/test_cuda_streams.py tests/test_sampling.py
  bench_experts 32k-bs1-916-share-model --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill \
    --policies on-demand,adaptive
  for share in 0 0.5 0.75; do
    export TANDEM_GRAPH_CPU_SHARE=$share
    bench_experts 32k-bs1-916-share-$share --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill \
      --policies adaptive
  done
  unset TANDEM_GRAPH_CPU_SHARE
  bench_experts 2k-bs1-share-model --batch-sizes 1 --contexts 2048 --shared-prefill --policies on-demand,adaptive
  export TANDEM_GRAPH_CPU_SHARE=0
  bench_experts 2k-bs1-share-0 --batch-sizes 1 --contexts 2048 --shared-prefill --policies adaptive
  unset TANDEM_GRAPH_CPU_SHARE
fi
if [ "$phase" = CM ]; then
  bench_experts 32k-bs4 --batch-sizes 4 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = CL ]; then
  run_tests "the sampler, the one graph a step ahead of its log, decode graphs, on CUDA" tests/test_sampling.py \
    tests/experts/test_zero_copy.py tests/models/test_decode_graph.py
  bench_2k_rounds
  bench_experts 32k-bs1-916 --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill --rounds 2 \
    --policies on-demand,adaptive
fi
if [ "$phase" = CK ]; then
  run_tests "the sampler without syncs, the lagged table, on CUDA" tests/test_sampling.py tests/experts/test_zero_copy.py \
    tests/kernels/test_moe_decode_gpu.py tests/models/test_decode_graph.py
  e2e_resident_l16 sampler-nosync
  for v in lagged main; do
    [ $v = main ] && ab_swap
    bench_experts 2k-bs1-$v --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 2 --policies on-demand,adaptive
    bench_experts 32k-bs1-916-$v --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill \
      --policies on-demand,adaptive
    [ $v = main ] && ab_restore
  done
  timeline_2k_bs1 lagged adaptive
fi
if [ "$phase" = CJ ]; then
  timeline_2k_bs1 main adaptive,on-demand
  ab_swap; timeline_2k_bs1 lagged adaptive; ab_restore
fi
if [ "$phase" = CI ]; then
  run_tests "the table kept on the device, on CUDA" tests/experts/test_zero_copy.py tests/kernels/test_moe_decode_gpu.py
  for v in new before; do
    [ $v = before ] && ab_swap
    bench_experts 2k-bs1-$v --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 2 --policies on-demand,adaptive
    bench_experts 32k-bs1-916-$v --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill \
      --policies on-demand,adaptive
    [ $v = before ] && ab_restore
  done
  timeline_2k_bs1
fi
if [ "$phase" = CH ]; then
  run_tests "offloaded experts in one graph after the warm-up fix, decode graphs, on CUDA" \
    tests/experts/test_zero_copy.py tests/models/test_decode_graph.py
  bench_experts 2k-bs1 --batch-sizes 1 --contexts 2048 --shared-prefill --policies on-demand,adaptive
fi
if [ "$phase" = CG ]; then
  run_tests "decode graphs and offloaded experts on CUDA" tests/experts/test_zero_copy.py tests/models/test_decode_graph.py
  for v in new before new2; do
    [ $v = before ] && ab_swap
    e2e_resident_l16 $v
    [ $v != new2 ] && bench_experts 2k-bs1-$v --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 2 \
      --policies on-demand,adaptive
    [ $v = before ] && ab_restore
  done
  bench_experts 32k-bs1-916 --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill \
    --policies on-demand,adaptive
  timeline_2k_bs1
fi
if [ "$phase" = CF ]; then
  run_tests "listed slots keep their experts until claimed, on CUDA" tests/experts/test_zero_copy.py \
    tests/experts/test_expert_cache.py tests/kernels/test_moe_decode_gpu.py tests/models/test_decode_graph.py
  for v in new before; do
    [ $v = before ] && ab_swap
    bench_experts 32k-bs1-916-$v --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill --rounds 2 \
      --policies on-demand,adaptive
    [ $v = before ] && ab_restore
  done
  bench_experts 2k-bs1 --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 2 --policies on-demand,adaptive
  timeline_2k_bs1
fi
if [ "$phase" = CE ]; then  # at commit f977dff (the graph-cpu form, since reverted)
  run_tests "the CPU share inside the decode graph, on CUDA" tests/experts/test_graph_cpu_set.py \
    tests/experts/test_zero_copy.py tests/kernels/test_moe_decode_gpu.py tests/models/test_decode_graph.py
  bench_experts 32k-bs1-916 --batch-sizes 1 --contexts 32768 --expert-cache-slots 916 --shared-prefill --rounds 2 \
    --policies on-demand,adaptive
  bench_experts 2k-bs1 --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 2 --policies on-demand,adaptive
fi
if [ "$phase" = CD ]; then
  run_tests "the merged RMSNorm and RoPE kernels compiled" tests/kernels/test_qkv_rope_gpu.py \
    tests/kernels/test_rmsnorm_gpu.py tests/kernels/test_rope_route_gpu.py
  bench_2k_rounds
  bench_experts 32k-shared --batch-sizes 1,4 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = CC ]; then
  bench_experts 2k-bs1-rounds --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = CB ]; then
  bench_2k_rounds
  bench_experts 32k-shared --batch-sizes 1,4 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = CA ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qkv_rope_gpu.py 2>&1 | tail -1 | tee "$out/pytest.log"
  for v in new before new2; do
    [ $v = before ] && ab_swap
    e2e_resident_l16 $v
    bench_experts 2k-bs1-$v --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
    [ $v = before ] && ab_restore
  done
fi
if [ "$phase" = BZ ]; then
  experts_cuda_tests tests/kernels/test_qkv_rope_gpu.py tests/kernels/test_rmsnorm_gpu.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_moe_decode_gpu.py tests/kv/test_resident_paged.py tests/models/test_decode_graph.py \
    tests/models/test_cuda_parity.py tests/experts/test_zero_copy.py
  step GPU timeline of a decode step, 48 layers, 2K, bs=1
  timeout 200 python3 benchmarks/h200/profile_step_timeline.py "$out/timeline-2k-bs1.json" 2>>"$log" | tee -a "$log"
  ab_swap
  step the same, before
  timeout 200 python3 benchmarks/h200/profile_step_timeline.py "$out/timeline-2k-bs1-before.json" 2>>"$log" | tee -a "$log"
  ab_restore
  bench_2k_rounds
  ab_swap; bench_experts 2k-bs1-before --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
  ab_restore
fi
if [ "$phase" = BY ]; then
  step the host CPU topology
  lscpu | tee -a "$log"; lscpu -e | tee -a "$log"
  for round in 1 2; do
    for bind in unbound cores; do
      for amx in 99 5; do
        step expert kernel roof, AMX tiles from $amx tokens, threads $bind, round $round
        if [ $bind = cores ]; then export OMP_PLACES=cores OMP_PROC_BIND=spread; else unset OMP_PLACES OMP_PROC_BIND; fi
        TANDEM_AMX_MIN_TOKENS=$amx ROOF_THREADS=4,8,12,15 ROOF_TOKENS=6,8,12 timeout 120 \
          python3 benchmarks/h200/profile_roof.py "$out/profile-roof-amx$amx-$bind-$round.json" 2>&1 | tee -a "$log"
      done
    done
  done
  unset OMP_PLACES OMP_PROC_BIND
  tar czf "$out/roofs.tgz" -C "$out" $(cd "$out" && ls profile-roof-*.json) && rm "$out"/profile-roof-*.json
fi
if [ "$phase" = BV ]; then
  for depth in 8 4; do
    prefetch_depth $depth
    bench_experts 2k-bs1-depth$depth --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
  done
  prefetch_depth 8
  bench_experts 32k-bs1-depth8 --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,adaptive
fi
if [ "$phase" = BU ]; then
  prefetch_depth 8
  bench_experts 2k-bs1-depth8 --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
  bench_experts 32k-bs1-depth8 --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,adaptive
fi
if [ "$phase" = BT ]; then
  prefetch_depth 2
  bench_experts 2k-bs1-depth2 --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
  ab_swap; bench_experts 2k-bs1-before --batch-sizes 1 --contexts 2048 --shared-prefill --rounds 3 --policies on-demand,adaptive
  ab_restore
  bench_experts 32k-bs1-depth2 --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,adaptive
fi
if [ "$phase" = BS ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/experts/test_zero_copy.py tests/models/test_decode_graph.py \
    > "$out/pytest.log" 2>&1; tail -1 "$out/pytest.log" | tee -a "$log"
  for round in 1 2; do
    for depth in 1 2 4; do prefetch_depth $depth; profile_form 737 graph depth$depth-$round; done
    ab_swap; profile_form 737 graph before-$round; ab_restore
  done
  prefetch_depth 2; profile_form 300 graph depth2
  ab_swap; profile_form 300 graph before; ab_restore
  tar czf "$out/profiles.tgz" -C "$out" $(cd "$out" && ls profile-offload-*.json) && rm "$out"/profile-offload-*.json
fi
if [ "$phase" = BR ]; then
  experts_cuda_tests tests/experts/test_zero_copy.py tests/models/test_decode_graph.py tests/kernels/test_moe_decode_gpu.py
  for round in 1 2; do
    profile_form 737 graph prefetch-$round
    ab_swap; profile_form 737 graph before-$round; ab_restore
  done
  profile_form 300 graph prefetch
  bench_experts 32k-bs1-shared --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
  tar czf "$out/profiles.tgz" -C "$out" $(cd "$out" && ls profile-offload-*.json) && rm "$out"/profile-offload-*.json
fi
if [ "$phase" = BQ ]; then
  for form in pieces graph; do
    profile_form 300 $form
    cp "/tmp/profile-300-$form/profile-adaptive-bs1.txt" "$out/profile-300-$form-bs1.txt"
  done
  bench_experts 32k-bs1-shared --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = BN ]; then
  profile_pieces diag
  cp /tmp/profile-diag/profile-adaptive-bs*.txt "$out/"
  bench_experts 32k-shared --batch-sizes 1,4 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = AL ]; then
  kv_tests
  bench_kv_32k ahead-1
  step bench kv at 32K, 48 layers, bs 1 and 4
  timeout 200 python3 -m engine.cli bench kv --policies writescope,gpu-centric,cpu-centric --layers 48 \
    --lengths 32768 --batch-sizes 1,4 --json "$out/kv-32k-L48.json" 2>>"$log" | tail -3 | tee -a "$log"
  bench_kv_32k ahead-2
fi
if [ "$phase" = N2 ]; then
  bench_experts 32k-bs1-shared --batch-sizes 1 --contexts 32768 --shared-prefill --policies on-demand,cpu-only,static,adaptive
  bench_experts 2k-greedy-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --decode greedy --policies on-demand,cpu-only,adaptive
  bench_experts 2k-eager-shared --batch-sizes 1,4 --contexts 2048 --shared-prefill --no-cuda-graphs --policies on-demand,cpu-only,adaptive
fi
if [ "$phase" = L ]; then
  step tests: decode graphs
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/models/test_decode_graph.py 2>&1 | tail -5 | tee "$out/pytest.log"
  for bs in 1 4; do
    step resident synthetic:qwen3-30b-a3b bs=$bs 8K, CUDA graphs
    timeout 100 python3 -m engine.cli generate --model synthetic:qwen3-30b-a3b --device cuda --random-prompt 8064 \
      --max-new-tokens 64 --greedy --batch $bs --max-batch $bs --max-context 8192 --quiet \
      --stats-json "$out/resident-graphs-bs$bs.json" > /dev/null 2>>"$log"
  done
fi
if [ "$phase" = K ]; then
  step tests: paged kernel, decode graphs
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py tests/models/test_decode_graph.py \
    tests/kv/test_resident_paged.py 2>&1 | tail -15 | tee "$out/pytest.log"
  step resident synthetic:qwen3-30b-a3b-L16 bench e2e
  timeout 150 python3 -m engine.cli bench e2e --model synthetic:qwen3-30b-a3b-L16 --kv-policies resident \
    --expert-policy resident --batch-sizes 1,4 --contexts 2048,8192,32768 --new-tokens 32 --vram-budget-gb 0 \
    --json "$out/e2e-resident-L16-graphs.json" 2>&1 | grep "\[e2e\]" | tee -a "$log"
  step bench kv at 32K: writescope against both fixed splits, native CPU kernel
  timeout 240 python3 -m engine.cli bench kv --policies writescope,gpu-centric,cpu-centric --layers 8 --lengths 32768 \
    --batch-sizes 1,4,16 --json "$out/kv-32k.json" > /dev/null 2>>"$log"
fi
if [ "$phase" = H ]; then
  step CUDA tests: paged kernel, decode graphs, family parity
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/kv/test_resident_paged.py \
    2>&1 | tail -15 | tee "$out/pytest-graphs.log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda -k "not builtin" tests/models tests/experts tests/kv \
    2>&1 | tail -15 | tee -a "$out/pytest-graphs.log"
  step profile of eager decode steps
  timeout 150 python3 benchmarks/h200/profile_decode.py --context 8192 --batch 1 --json "$out/profile-bs1.json" \
    2>&1 | tail -30 | tee -a "$log"
  for mode in graphs eager; do
    step resident synthetic:qwen3-30b-a3b-L16 bench e2e, $mode
    flag=""; [ $mode = eager ] && flag=--no-cuda-graphs
    timeout 200 python3 -m engine.cli bench e2e --model synthetic:qwen3-30b-a3b-L16 --kv-policies resident \
      --expert-policy resident --batch-sizes 1,4 --contexts 2048,8192,32768 --new-tokens 32 --vram-budget-gb 0 \
      $flag --json "$out/e2e-resident-L16-$mode.json" > /dev/null 2>>"$log"
  done
fi
if [ "$phase" = G ]; then
  step bench e2e at 32K
  timeout 260 python3 -m engine.cli bench e2e --kv-policies writescope,gpu-centric,cpu-centric --batch-sizes 1,4 \
    --contexts 32768 --new-tokens 8 --vram-budget-gb 24 --cpu-threads 15 --json "$out/e2e-32k.json" \
    > /dev/null 2> "$out/e2e-32k.log"
fi
if [ "$phase" = E ]; then
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
elif [ "$phase" = B ]; then
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
