"""The CPU-only cells of `tandem bench suite` on quantised GGUF files: Tandem against llama.cpp on the
same file, on a machine without a GPU.

`cpu-moe-q4km-L8`: `synthetic:qwen3-30b-a3b-L8` (the published widths, 8 layers, random routers);
`cpu-dense-q4km`: `synthetic:llama-3.2-1b` (a dense model, all 16 layers). Each is exported to BF16 GGUF
and quantised to Q4_K_M by llama.cpp's own quantiser (llama-cpp-python's API here: the CPU machines
have it), made once into the work folder (the export deleted after). Both engines load that file with
their default threads (Tandem's thread chooser measures its count; the llama.cpp backend does the same
inside Tandem), decode and prefill, taking turns. `backend auto` (engine/api.py `choose_backend`) runs
both files on Tandem (the dense one where the CPU has AVX2 or AVX-512); the dense cell is the figure that
rule reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.bench.suite_cell import Cell, Skip, alternate, probe, row

MODEL = "synthetic:qwen3-30b-a3b-L8"
DENSE = "synthetic:llama-3.2-1b"  # 1.0 B parameters with the borrowed 49,152-token vocabulary: 0.7 GB as Q4_K_M
QUANT = "Q4_K_M"


# The long chat's prompt: its KV (8 layers · 4 heads · 128 · K and V · fp16, both engines' CPU cache =
# 16 KiB a token, 64 MiB at 4K) is read every decode step beside ~0.2 GB of the file's weights, so decode
# attention weighs in
LONG_PROMPT = 4096


def cells() -> list[Cell]:
    return [Cell("cpu-moe-q4km-L8", "Qwen3-30B-A3B (8 layers, Q4_K_M) on the CPU: Tandem against llama.cpp, "
                 "both as backend auto could run them", "cpu", "decode ≥ llama.cpp: backend auto runs Tandem",
                 lambda ctx: decode_and_prefill(ctx, MODEL), in_quick=False),
            Cell("cpu-moe-q4km-L8-4k", f"The same file decoding after a {LONG_PROMPT}-token prompt (a long chat): "
                 "Tandem against llama.cpp", "cpu", "decode ≥ llama.cpp", cell_cpu_moe_long, in_quick=False),
            Cell("cpu-dense-q4km", "Llama-3.2-1B's shapes (dense, Q4_K_M) on the CPU: Tandem against llama.cpp, "
                 "both as backend auto could run them", "cpu", "decode ≥ llama.cpp: backend auto runs Tandem",
                 lambda ctx: decode_and_prefill(ctx, DENSE), in_quick=False)]


def quantised_file(ctx, model: str) -> Path:
    """`model`'s Q4_K_M file, made once: BF16 export, then llama.cpp's quantiser (the export deleted)."""
    from engine.bench import gguf_export
    from engine.bench.suite_files import export_bytes

    out = ctx.work / f"{model.split(':')[1]}-{QUANT}.gguf"
    if out.exists():
        return out
    try:
        import llama_cpp
    except ImportError as e:
        raise Skip("llama-cpp-python is not installed (it quantises the file and is the peer)") from e
    ctx.work.mkdir(parents=True, exist_ok=True)
    need = export_bytes(model) * 13 // 10  # the export and the quantised file beside it
    if shutil.disk_usage(ctx.work).free < need:
        raise Skip(f"making the {QUANT} file needs about {need / 1e9:.0f} GB of disk in {ctx.work}")
    bf16 = ctx.work / f"{model.split(':')[1]}-bf16.gguf"
    ctx.progress(f"[suite] exporting {model} to {bf16.name}")
    gguf_export.export(model, bf16, device="cpu", tokenizer_from=ctx.tokenizer_from)
    ctx.progress(f"[suite] quantising it to {QUANT}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{QUANT}")
    partial = out.with_name(out.name + ".partial")  # a quantise cut short is not taken for the file
    if llama_cpp.llama_model_quantize(str(bf16).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {bf16.name} to {QUANT}")
    partial.rename(out)
    bf16.unlink()
    return out


def _both(ctx, spec: dict, max_context: int, model: str) -> tuple[dict, str]:
    """Tandem's trees and llama.cpp on `model`'s file, taking turns: (each system's probe results, the
    rows' condition)."""
    path = quantised_file(ctx, model)
    threads = {"cpu_threads": ctx.threads} if ctx.threads else {}  # --threads: both engines; else their defaults
    base = {"model": str(path), "device": "cpu", "max_context": max_context, "max_batch": 1, **threads}
    tandem = {**base, "backend": "tandem"}
    llama = {**base, "backend": "llamacpp", "kv_policy": "resident", "expert_policy": "resident"}
    systems = {name: (lambda t=ctx.tree_of(name): probe(t.path, {**spec, "config": tandem}))
               for name in ctx.tandem_names()}
    systems["llama.cpp"] = lambda: probe(ctx.trees[0].path, {**spec, "config": llama})
    cond = f"{path.name}, {f'{ctx.threads} threads' if ctx.threads else 'default threads'}, greedy, EOS ignored"
    return alternate(ctx, systems), cond


def decode_and_prefill(ctx, model: str) -> list[dict]:
    """A short chat's decode and a 512-token prompt's prefill on `model`'s file, both engines."""
    spec = {"prefill": 64 if ctx.quick else 512, "decode_prompt": 32, "new_tokens": 24 if ctx.quick else 64,
            "seed": 0, "warmup": True, "warmup_tokens": 4}
    res, cond = _both(ctx, spec, 2048, model)
    info = {name: rs[-1].get("info") for name, rs in res.items()}
    return [row(ctx, "decode tok/s", f"{spec['new_tokens']} tokens after a {spec['decode_prompt']}-token prompt, "
                f"{cond}", {n: [r["decode_tok_s"] for r in rs] for n, rs in res.items()}, "llama.cpp", info=info),
            row(ctx, "prefill tok/s", f"{spec['prefill']}-token prompt, {cond}",
                {n: [r["prefill_tok_s"] for r in rs] for n, rs in res.items()}, "llama.cpp",
                target="prefill ≥ 50% of llama.cpp")]


def cell_cpu_moe_long(ctx) -> list[dict]:
    """Decode after a long prompt; that prompt's prefill is timed on the way."""
    n = LONG_PROMPT
    spec = {"decode_prompts": [n], "new_tokens": 16 if ctx.quick else 32, "seed": 0, "warmup": True,
            "warmup_tokens": 4}
    res, cond = _both(ctx, spec, n + 64, MODEL)
    info = {name: rs[-1].get("info") for name, rs in res.items()}
    return [row(ctx, "decode tok/s", f"{spec['new_tokens']} tokens after a {n}-token prompt, {cond}",
                {k: [r["decode_tok_s_by_prompt"][str(n)] for r in rs] for k, rs in res.items()}, "llama.cpp",
                info=info),
            row(ctx, "prefill tok/s", f"that {n}-token prompt, {cond}",
                {k: [r["prefill_tok_s_by_prompt"][str(n)] for r in rs] for k, rs in res.items()}, "llama.cpp",
                target="prefill ≥ 50% of llama.cpp")]

