"""The suite's GPU cells: Tandem's default plan against llama.cpp on the same BF16 GGUF.

The model is `synthetic:qwen3-30b-a3b` cut to 16 layers (20 GB in BF16) or whole (48 layers, 61 GB),
exported once per routing into the suite's work folder; both engines read that file. llama.cpp is built
with CUDA from the llama.cpp sources given to the suite (`llama-bench` for one chat, `llama-batched-bench`
for four chats decoded together). engine/bench/suite_files.py makes those files and that build.

Tandem runs with no policy flags (kv_policy and expert_policy "auto": the placement planner decides),
under the cell's VRAM budget. llama.cpp runs its best setting that fits the same budget: all layers on
the GPU (`-ngl 99`, flash attention) and the routed experts of the first N layers in host memory
(`-ncmoe N`), N the smallest whose estimated VRAM fits (`fitting_ncmoe`). The KV-spill cell gives
llama.cpp `-nkvo` (its KV cache in host memory) as Tandem's planner may spill KV to the host.

Decode is measured after a prompt of the cell's context, untimed (llama-bench `-d`); 32 new tokens.
The new families' cells (gpt-oss, Qwen3.5, DeepSeek-V2-Lite) load each file once for both contexts
(`one_load_decode_cell`); Tandem's prefill of each prompt is timed on the way to its decode, llama.cpp's
by a second llama-bench run (`-p` the contexts, `-n 0`).

The Q4_K_M cells (issue #33) and gpt-oss's MXFP4 cells read the BF16 export quantised by llama.cpp's
own quantiser (suite_files.quantised_for), both systems on the same blocks. The Q4_K_M targets are
ratios to llama.cpp on that file: experts on the CPU ≥ 1.2×, 8 GB ≥ 1.5×, everything on the GPU ≥ 1×,
a 32K prefill under 8 GB ≥ 3×.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.bench.suite_cell import Cell, Ctx, Skip, alternate, probe, row
from engine.bench.suite_files import gguf_for, gguf_sizes, llama_binaries, mxfp4_for, quantised_for, run_tool

L16, L48 = "synthetic:qwen3-30b-a3b-L16", "synthetic:qwen3-30b-a3b"
L48_Q8 = L48 + "-Q8_0"  # the routed experts drawn and kept as Q8_0 blocks (engine/models/synthetic.expert_quant)
GPT_OSS = "synthetic:gpt-oss-20b"  # 24 layers, 32 experts top-4, biases, sinks, windows (40 GB in BF16)
# 16 of its 40 layers (4 full-attention, 12 Gated DeltaNet; 26 GB in BF16): the whole model's 65 GB
# export does not fit a one-GPU machine's 64 GB disk
QWEN3_5 = "synthetic:qwen3.5-35b-a3b-L16"
# 27 layers (the first dense), MLA (a 576-wide latent row cached per token and layer), 64 experts top-6
# plus 2 shared (31 GB in BF16)
DEEPSEEK_V2_LITE = "synthetic:deepseek-v2-lite"
NEW_TOKENS = 32
# VRAM llama.cpp needs beyond weights and KV (CUDA context, compute buffers, graph), for the fit
# estimate only: an allowance we set, not a measurement; a fit that is off shows as an OOM in the cell.
LLAMA_OVERHEAD_GIB = 1.5


def cells() -> list[Cell]:
    return [
        Cell("gpu-resident-L16", "Qwen3-30B-A3B (16 layers), everything on the GPU, same BF16 GGUF", "cuda",
             "decode ≥ 50% of llama.cpp", lambda ctx: decode_cell(ctx, L16, None, (2048, 32768), (1, 4))),
        Cell("gpu-hybrid-8gb-L16", "16 layers under an 8 GB VRAM budget, default plan vs best fitting -ncmoe", "cuda",
             "decode ≥ llama.cpp", lambda ctx: decode_cell(ctx, L16, 8.0, (2048, 32768), (1, 4)), routed=True),
        Cell("gpu-hybrid-24gb-L48", "48 layers under a 24 GB VRAM budget, default plan vs best fitting -ncmoe",
             "cuda", "decode ≥ llama.cpp", lambda ctx: decode_cell(ctx, L48, 24.0, (2048, 32768), (1, 4)),
             routed=True),
        # the 48 layers as one GGUF whose routed experts are Q8_0 (32 GB): the BF16 export's 61 GB do not
        # fit beside llama.cpp's build on a one-GPU machine's 64 GB disk; both systems read the blocks
        Cell("gpu-q8-24gb-L48", "48 layers, the same GGUF with Q8_0 experts for both, under a 24 GB VRAM budget, "
             "default plan vs best fitting -ncmoe", "cuda", "decode ≥ 1.3× llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, L48_Q8, 24.0, (2048, 32768)), routed=True),
        Cell("gpu-prefill-32k", "Prefill of a 32K prompt under 8 GB (16 layers) and 24 GB (48 layers)", "cuda",
             "prefill ≥ llama.cpp", prefill_cell, routed=True),
        Cell("gpu-gpt-oss-20b-24gb", "gpt-oss-20b (BF16 experts) under a 24 GB VRAM budget, default plan vs best "
             "fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, GPT_OSS, 24.0, (2048, 32768)), routed=True),
        Cell("gpu-gpt-oss-20b-8gb", "gpt-oss-20b (BF16 experts) under an 8 GB VRAM budget, default plan vs best "
             "fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, GPT_OSS, 8.0, (2048, 32768)), routed=True),
        # the MXFP4_MOE file a gpt-oss user downloads: experts in blocks on both sides of the PCIe link
        Cell("gpu-gpt-oss-20b-mxfp4-24gb", "gpt-oss-20b (MXFP4 experts, the same file for both) under a 24 GB "
             "VRAM budget, default plan vs best fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, GPT_OSS, 24.0, (2048, 32768), file_for=mxfp4_for), routed=True),
        Cell("gpu-gpt-oss-20b-mxfp4-8gb", "gpt-oss-20b (MXFP4 experts, the same file for both) under an 8 GB "
             "VRAM budget, default plan vs best fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, GPT_OSS, 8.0, (2048, 32768), file_for=mxfp4_for), routed=True),
        Cell("gpu-qwen3.5-L16-24gb", "Qwen3.5-35B-A3B (16 layers, BF16) under a 24 GB VRAM budget, default plan vs "
             "best fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, QWEN3_5, 24.0, (2048, 32768)), routed=True),
        Cell("gpu-qwen3.5-L16-8gb", "Qwen3.5-35B-A3B (16 layers, BF16) under an 8 GB VRAM budget, default plan vs "
             "best fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, QWEN3_5, 8.0, (2048, 32768)), routed=True),
        Cell("gpu-qwen3.5-L16-q4km-8gb", "Qwen3.5-35B-A3B (16 layers, the same Q4_K_M file for both) under an 8 GB "
             "VRAM budget, default plan vs best fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, QWEN3_5, 8.0, (2048, 32768), file_for=quantised_for),
             routed=True),
        Cell("gpu-qwen3.5-L16-q4km-24gb", "Qwen3.5-35B-A3B (16 layers, the same Q4_K_M file for both) under a 24 GB "
             "VRAM budget, default plan vs best fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, QWEN3_5, 24.0, (2048, 32768), file_for=quantised_for),
             routed=True),
        Cell("gpu-deepseek-v2-lite-24gb", "DeepSeek-V2-Lite (BF16) under a 24 GB VRAM budget, default plan vs best "
             "fitting -ncmoe", "cuda", "decode ≥ llama.cpp",
             lambda ctx: one_load_decode_cell(ctx, DEEPSEEK_V2_LITE, 24.0, (2048, 32768)), routed=True),
        Cell("gpu-kv-spill", "4 chats × 32K, 48 layers, 24 GB: KV beyond the budget, against llama.cpp -nkvo", "cuda",
             "decode ≥ 1.5× llama.cpp -nkvo", lambda ctx: decode_cell(ctx, L48, 24.0, (32768,), (4,), nkvo=True),
             routed=True),
        *quantised_cells(),
    ]


def quantised_cells() -> list[Cell]:
    """Issue #33's targets on one GPU, both systems on the same Q4_K_M file (16 layers)."""
    title, both = "Qwen3-30B-A3B (16 layers), same Q4_K_M GGUF: ", (2048, 32768)

    def decode(budget, **kw):
        return lambda ctx: one_load_decode_cell(ctx, L16, budget, both, file_for=quantised_for, **kw)

    return [
        # -ncmoe 16: the routed experts of all 16 layers in host memory, as Tandem's cpu-only keeps them
        Cell("gpu-q4km-L16-cpu-experts", title + "every routed expert on the CPU (Tandem expert_policy cpu-only, "
             "llama.cpp -ncmoe 16)", "cuda", "decode ≥ 1.2× llama.cpp -ngl 99 -ncmoe 16",
             decode(None, ncmoe=16, tandem={"expert_policy": "cpu-only"}, setting="routed experts on the CPU")),
        # beside: the same file with its experts dequantised to a BF16 store (the one-graph decode form
        # reads misses in place only from BF16): what the quantised store costs or gains on a GPU
        Cell("gpu-q4km-L16-8gb", title + "an 8 GB VRAM budget, default plan vs best fitting -ncmoe", "cuda",
             "decode ≥ 1.5× llama.cpp", decode(8.0, variants={"tandem, BF16 store": {"dtype": "bfloat16"}}),
             routed=True),
        Cell("gpu-q4km-L16-resident", title + "everything on the GPU (llama.cpp -ngl 99)", "cuda",
             "decode ≥ 1× llama.cpp", decode(None)),
        Cell("gpu-q4km-prefill-32k", title + "prefill of a 32K prompt under 8 GB", "cuda", "prefill ≥ 3× llama.cpp",
             lambda ctx: prefill_cell(ctx, ((L16, 8.0),), file_for=quantised_for), routed=True),
    ]


# ---- llama.cpp's fit and runs ---------------------------------------------------------------------

def fitting_ncmoe(sizes: dict, budget_gib: float, kv_tokens: int, kv_on_host: bool = False) -> int:
    """The smallest N whose layout (experts of the first N layers in host memory) fits the budget."""
    layers = sizes["expert_bytes"]
    fixed = sizes["other_bytes"] + (0 if kv_on_host else kv_tokens * sizes["kv_bytes_per_token"])
    fixed += LLAMA_OVERHEAD_GIB * 2**30
    for n in range(len(layers) + 1):
        if fixed + sum(layers[n:]) <= budget_gib * 2**30:
            return n
    raise Skip(f"llama.cpp cannot fit {budget_gib} GB even with every layer's experts on the CPU")


def llama_decode(bins: dict, gguf: Path, context: int, chats: int, ncmoe: int | None, nkvo: bool) -> float:
    """llama.cpp decode tok/s (all chats) after `context` tokens of prompt, one repetition."""
    if chats == 1:
        from engine.bench import llamacpp_bench

        rec = llamacpp_bench.run(bins["llama-bench"], gguf, n_gpu_layers=99, flash_attn=1, depth=context, n_prompt=0,
                                 n_gen=NEW_TOKENS, reps=1, n_cpu_moe=ncmoe, no_kv_offload=1 if nkvo else None)
        return rec["results"][0]["tok_s"]
    cmd = [bins["llama-batched-bench"], "-m", str(gguf), "-ngl", "99", "-fa", "on", "-c",
           str(chats * (context + NEW_TOKENS) + 256), "-npp", str(context), "-ntg", str(NEW_TOKENS),
           "-npl", str(chats), "--output-format", "jsonl"]
    cmd += ["-ncmoe", str(ncmoe)] if ncmoe else []
    cmd += ["-nkvo"] if nkvo else []
    return parse_batched(run_tool(cmd))["speed_tg"]


def llama_prefill(bins: dict, gguf: Path, n: int, ncmoe: int | None) -> float:
    from engine.bench import llamacpp_bench

    rec = llamacpp_bench.run(bins["llama-bench"], gguf, n_gpu_layers=99, flash_attn=1, n_prompt=n, n_gen=0, reps=1,
                             n_cpu_moe=ncmoe)
    return rec["results"][0]["tok_s"]


def parse_batched(stdout: str) -> dict:
    """llama-batched-bench's jsonl: one object per (pp, tg, pl); the last one."""
    rows = [json.loads(x) for x in stdout.splitlines() if x.strip().startswith("{")]
    if not rows:
        raise ValueError("llama-batched-bench printed no jsonl row")
    return rows[-1]


# ---- the cells ----------------------------------------------------------------------------------------

def _routings(ctx: Ctx, budget: float | None) -> list:
    return [None] if budget is None else list(ctx.routings)  # all resident: no cache, routing does not matter


def _asked_contexts(ctx: Ctx, contexts) -> list[int]:
    """The cell's contexts that --contexts asks for (all without it); Skip when none is."""
    asked = [c for c in contexts if ctx.contexts is None or c in ctx.contexts]
    if not asked:
        raise Skip(f"none of this cell's contexts was asked for (--contexts {','.join(map(str, ctx.contexts))})")
    return asked


def _asked_chats(ctx: Ctx, chats_list) -> list[int]:
    """The cell's chat counts that --chats asks for (all without it); Skip when none is."""
    asked = [c for c in chats_list if ctx.chats is None or c in ctx.chats]
    if not asked:
        raise Skip(f"none of this cell's chat counts was asked for (--chats {','.join(map(str, ctx.chats))})")
    return asked


def decode_cell(ctx: Ctx, model: str, budget: float | None, contexts, chats_list, nkvo: bool = False) -> list[dict]:
    from engine.bench import routing as routing_mod

    contexts, chats_list = _asked_contexts(ctx, contexts), _asked_chats(ctx, chats_list)
    bins = llama_binaries(ctx)
    rows = []
    for routing in _routings(ctx, budget):
        gguf = gguf_for(ctx, model, routing)
        sizes = gguf_sizes(gguf) if budget else None
        for context in contexts:
            for chats in chats_list:
                ncmoe = fitting_ncmoe(sizes, budget, chats * (context + NEW_TOKENS), nkvo) if budget else None
                config = {"model": str(gguf), "backend": "tandem", "max_context": context + NEW_TOKENS + 64,
                          "max_batch": chats, **({"vram_budget_gb": budget} if budget else {})}
                spec = {"config": config, "decode_prompt": context, "new_tokens": NEW_TOKENS, "batch": chats}
                systems = {n: (lambda t=ctx.tree_of(n): probe(t.path, spec)) for n in ctx.tandem_names()}
                systems["llama.cpp"] = lambda c=context, k=chats, m=ncmoe: {
                    "decode_tok_s": llama_decode(bins, gguf, c, k, m, nkvo)}
                res = alternate(ctx, systems)
                flags = "-ngl 99 -fa" + (f" -ncmoe {ncmoe}" if ncmoe else "") + (" -nkvo" if nkvo else "")
                rows.append(row(ctx, "decode tok/s (all chats)",
                                f"{context // 1024}K context, {chats} chat{'s' * (chats > 1)}, "
                                f"{'VRAM ' + format(budget, 'g') + ' GB' if budget else 'all on the GPU'}",
                                {n: [r["decode_tok_s"] for r in rs] for n, rs in res.items()}, "llama.cpp",
                                routing=routing_mod.label(routing), llama_flags=flags,
                                plan={n: rs[-1].get("plan") for n, rs in res.items() if n != "llama.cpp"}))
    return rows


def one_load_decode_cell(ctx: Ctx, model: str, budget: float | None, contexts, *, file_for=None,
                         ncmoe: int | None = None, tandem: dict | None = None, setting: str | None = None,
                         variants: dict[str, dict] | None = None) -> list[dict]:
    """One chat's decode at each context, each system loading the file once for all of them: the new
    families' files take minutes to load, a load per context would double the cell. Both systems are set
    up for the largest context (Tandem plans for it; llama.cpp's -ncmoe fits its KV), as a user who sets
    that context and then chats shorter would have them. `file_for(ctx, model, routing)` makes the file
    (default `gguf_for`: the BF16 export); `ncmoe` fixes llama.cpp's -ncmoe instead of fitting it to the
    budget (no budget and no `ncmoe`: everything on the GPU); `tandem` adds fields to Tandem's config (a
    policy the question names); `setting` says in each row what the systems were given (default: the
    budget); `variants` adds systems, each this tree's Tandem with more config fields (in the record
    beside the others, not the ratio)."""
    from engine.bench import llamacpp_bench, routing as routing_mod

    contexts = _asked_contexts(ctx, contexts)
    bins = llama_binaries(ctx)
    setting = setting or (f"VRAM {budget:g} GB" if budget else "all on the GPU")
    rows = []
    for routing in _routings(ctx, budget):
        gguf = (file_for or gguf_for)(ctx, model, routing)
        n_cpu_moe = ncmoe if ncmoe is not None or budget is None else \
            fitting_ncmoe(gguf_sizes(gguf), budget, max(contexts) + NEW_TOKENS)
        config = {"model": str(gguf), "backend": "tandem", "max_context": max(contexts) + NEW_TOKENS + 64,
                  "max_batch": 1, **({"vram_budget_gb": budget} if budget else {}), **(tandem or {})}
        spec = {"config": config, "decode_prompts": contexts, "new_tokens": NEW_TOKENS, "batch": 1}

        def llama(m=n_cpu_moe, g=gguf) -> dict:
            flags = {"n_gpu_layers": 99, "flash_attn": 1, "reps": 1, "n_cpu_moe": m or None}
            # two runs: one -p and -d list would cross every prompt with every depth
            decode = llamacpp_bench.run(bins["llama-bench"], g, depth=contexts, n_prompt=0, n_gen=NEW_TOKENS, **flags)
            prefill = llamacpp_bench.run(bins["llama-bench"], g, n_prompt=contexts, n_gen=0, **flags)
            return {"decode_tok_s_by_prompt": {str(r["n_depth"]): r["tok_s"] for r in decode["results"]},
                    "prefill_tok_s_by_prompt": {str(r["n_prompt"]): r["tok_s"] for r in prefill["results"]}}

        systems = {n: (lambda t=ctx.tree_of(n): probe(t.path, spec)) for n in ctx.tandem_names()}
        for name, fields in (variants or {}).items():
            systems[name] = lambda f=fields: probe(ctx.trees[0].path, {**spec, "config": {**config, **f}})
        systems["llama.cpp"] = llama
        res = alternate(ctx, systems)
        flags = "-ngl 99 -fa 1" + (f" -ncmoe {n_cpu_moe}" if n_cpu_moe else "")
        plan = {n: rs[-1].get("plan") for n, rs in res.items() if n != "llama.cpp"}
        # where each Tandem's time went (its last round's counters, every context of the load together)
        counters = {n: rs[-1].get("stats") for n, rs in res.items() if n != "llama.cpp"}
        for context in contexts:
            for metric, key, what in (("decode tok/s", "decode_tok_s_by_prompt", "context"),
                                      ("prefill tok/s", "prefill_tok_s_by_prompt", "prompt")):
                rows.append(row(ctx, metric, f"{context // 1024}K {what}, 1 chat, {setting} "
                                f"(both set up for {max(contexts) // 1024}K)",
                                {n: [r[key].get(str(context)) for r in rs] for n, rs in res.items()}, "llama.cpp",
                                routing=routing_mod.label(routing), llama_flags=flags, plan=plan,
                                counters=counters))
    return rows


def prefill_cell(ctx: Ctx, setups=((L16, 8.0), (L48, 24.0)), file_for=None) -> list[dict]:
    """A 32K prompt's prefill for each (model, VRAM budget) of `setups`, on `file_for(ctx, model,
    routing)`'s file (default `gguf_for`: the BF16 export)."""
    from engine.bench import routing as routing_mod

    bins = llama_binaries(ctx)
    rows, n, skipped, file_for = [], 32768, [], file_for or gguf_for
    for model, budget in setups:
        for routing in ctx.routings:
            try:
                gguf = file_for(ctx, model, routing)
            except Skip as e:  # the 48-layer export may not fit the disk: keep the 16-layer rows
                skipped.append(str(e))
                continue
            ncmoe = fitting_ncmoe(gguf_sizes(gguf), budget, n)
            # one chat of 32K, as llama-bench's one sequence (one sequence's KV, whatever the plan would hold)
            spec = {"config": {"model": str(gguf), "backend": "tandem", "vram_budget_gb": budget,
                               "max_context": n + 64, "max_batch": 1}, "prefill": n}
            systems = {name: (lambda t=ctx.tree_of(name): probe(t.path, spec)) for name in ctx.tandem_names()}
            systems["llama.cpp"] = lambda g=gguf, m=ncmoe: {"prefill_tok_s": llama_prefill(bins, g, n, m)}
            res = alternate(ctx, systems)
            rows.append(row(ctx, "prefill tok/s", f"32K prompt, {model.split(':')[1]}, VRAM {budget:g} GB",
                            {k: [r["prefill_tok_s"] for r in rs] for k, rs in res.items()}, "llama.cpp",
                            routing=routing_mod.label(routing), llama_flags=f"-ngl 99 -fa 1 -ncmoe {ncmoe}"))
    if not rows:
        raise Skip("; ".join(skipped))
    return rows
