"""The files and binaries the suite's GPU cells (engine/bench/suite_gpu.py) need, each made once into
the suite's work folder, where later cells and later runs find it.

Both systems read the same GGUF, so what a cell measures is the engines, not their files. A synthetic
model is exported once per routing (engine/bench/routing.py): BF16, a quantised preset's experts written
as their blocks. The Q4_K_M cells (issue #33) and gpt-oss's MXFP4_MOE cells read that export quantised
by llama.cpp's own `llama-quantize` (`quantised_for`), as llama.cpp's users make their files, so both
systems run the same blocks; Tandem keeps offloaded experts in their blocks on the host. Each file is
checked against the free disk before it is made: a one-GPU machine's disk may not hold two exports.

llama.cpp is built with CUDA from the sources given to the suite (engine/bench/llamacpp_build), and
`gguf_sizes` reads from a file what llama.cpp's -ncmoe fit needs (`suite_gpu.fitting_ncmoe`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from engine.bench.suite_cell import Ctx, Skip

BENCH_TARGETS = ("llama-bench", "llama-batched-bench")
QUANT = "Q4_K_M"  # the quantised cells' type: the one issue #33 names
# Q4_K_M bytes over BF16's, for the disk check only: Q4_K (4.5 bits a weight) with Q6_K (6.56) for some
# ffn_down and attn_v layers and the head, about 4.9 of 16 bits; rounded up so the check errs safe
QUANT_OF_BF16 = 0.35


def gguf_for(ctx: Ctx, model: str, routing: str | None) -> Path:
    """The BF16 export of `model` under `routing`, made once into the work folder."""
    from engine.bench import gguf_export, routing as routing_mod

    out = export_path(ctx, model, routing)
    if not out.exists():
        need, free = export_bytes(model), shutil.disk_usage(ctx.work).free
        if need > free:  # the 48-layer export is 61 GB; a one-GPU machine's disk may not hold two
            raise Skip(f"the {model} export needs {need / 1e9:.0f} GB of disk, {free / 1e9:.0f} GB free "
                       f"(--work on a larger disk, or fewer --routing)")
        ctx.progress(f"[suite] exporting {model} ({routing_mod.label(routing)} routing) to {out.name}")
        gguf_export.export(model, out, device="cuda", routing=routing, tokenizer_from=ctx.tokenizer_from)
    return out


def export_path(ctx: Ctx, model: str, routing: str | None, qtype: str | None = None) -> Path:
    from engine.bench import routing as routing_mod

    return ctx.work / f"{model.split(':')[1]}-{routing_mod.label(routing)}{'-' + qtype if qtype else ''}.gguf"


def quantise_command(binary: str, src: Path, out: Path, qtype: str, threads: int) -> list[str]:
    """`llama-quantize IN OUT TYPE NTHREADS`: llama.cpp's own quantiser, as its users make their files."""
    return [str(binary), str(src), str(out), qtype, str(threads)]


def quantised_for(ctx: Ctx, model: str, routing: str | None, qtype: str = QUANT) -> Path:
    """`gguf_for`'s BF16 export quantised to `qtype` by `llama-quantize`, made once into the work folder.
    The BF16 export is deleted afterwards when the disk would not hold another export beside it."""
    out = export_path(ctx, model, routing, qtype)
    if out.exists():
        return out
    quantise = llama_binaries(ctx, (*BENCH_TARGETS, "llama-quantize"))["llama-quantize"]
    bf16 = export_bytes(model)
    need = int(QUANT_OF_BF16 * bf16) + (0 if export_path(ctx, model, routing).exists() else bf16)
    free = shutil.disk_usage(ctx.work).free
    if need > free:
        raise Skip(f"the {qtype} file of {model} (through its BF16 export) needs about {need / 1e9:.0f} GB of "
                   f"disk, {free / 1e9:.0f} GB free")
    src = gguf_for(ctx, model, routing)
    ctx.progress(f"[suite] quantising {src.name} to {qtype}")
    partial = out.with_name(out.name + ".partial")  # a quantise cut short is not taken for the file
    run_tool(quantise_command(quantise, src, partial, qtype, os.cpu_count() or 1))
    partial.rename(out)
    if shutil.disk_usage(ctx.work).free < bf16:
        src.unlink()
    return out


def mxfp4_for(ctx: Ctx, model: str, routing: str | None) -> Path:
    """`quantised_for` with llama.cpp's MXFP4_MOE: the experts in MXFP4, the rest as that type puts them."""
    return quantised_for(ctx, model, routing, "MXFP4_MOE")


def export_bytes(model: str) -> int:
    """Bytes of a synthetic model's tensors as its export writes them (BF16, and a quantised preset's
    experts in their blocks): the GGUF's size, near enough (its header is small)."""
    from engine.bench import gguf_export
    from engine.models import families, synthetic
    from engine.models.assemble import tensor_shapes

    config = synthetic.config_for(model, vocab_size=49152)  # the borrowed SmolLM2 tokenizer's size
    family = families.for_model_type(config["model_type"], Path(model))
    args = family.args_from_config(config)
    pieces = gguf_export.plan(gguf_export.GGUF_ARCH[family.NAME], args, tensor_shapes(args),
                              expert_quant=synthetic.expert_quant(model))
    return sum(p.nbytes for p in pieces)


def llama_binaries(ctx: Ctx, targets: tuple = BENCH_TARGETS) -> dict:
    from engine.bench import llamacpp_build

    build_dir = ctx.work / "llamacpp"
    found = {t: p for t in targets for p in build_dir.glob(f"build-cuda/bin/{t}")}
    if len(found) == len(targets):
        return {t: str(p) for t, p in found.items()}
    if not ctx.llama_source:
        raise Skip("llama.cpp CUDA build missing and no --llama-cpp-source given")
    ctx.progress("[suite] building llama.cpp (CUDA)")
    built = llamacpp_build.build(Path(ctx.llama_source), build_dir, targets=targets)
    if not built.get("cuda"):
        raise Skip("llama.cpp built without CUDA (no nvcc)")
    return built["binaries"]


def gguf_sizes(path: Path) -> dict:
    """Bytes of the routed experts per layer, of everything else, and the KV shape, from the file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    experts, other = {}, 0
    for t in reader.tensors:
        if "_exps" in t.name:
            layer = int(t.name.split(".")[1])
            experts[layer] = experts.get(layer, 0) + int(t.n_bytes)
        else:
            other += int(t.n_bytes)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def field(key):
        f = reader.fields[f"{arch}.{key}"]
        return int(f.parts[f.data[0]][0])

    heads_kv, dim, heads = field("attention.head_count_kv"), field("embedding_length"), field("attention.head_count")
    head_dim = field("attention.key_length") if f"{arch}.attention.key_length" in reader.fields else dim // heads
    kv_layers = field("block_count")
    if f"{arch}.full_attention_interval" in reader.fields:  # Qwen3.5: the other layers keep a recurrent state
        kv_layers //= field("full_attention_interval")
    elif f"{arch}.attention.sliding_window" in reader.fields:  # gpt-oss: the window layers' cache is the window
        kv_layers -= kv_layers // 2
    kv_per_token = 2 * heads_kv * head_dim * 2 * kv_layers  # K and V in f16
    if f"{arch}.attention.key_length_mla" in reader.fields:  # deepseek2's MLA caches the K rows only
        kv_per_token //= 2
    return {"expert_bytes": [experts[i] for i in sorted(experts)], "other_bytes": other,
            "kv_bytes_per_token": kv_per_token}


def run_tool(cmd: list[str]) -> str:
    """Run one of llama.cpp's tools; its stdout, or RuntimeError with the end of its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return proc.stdout
