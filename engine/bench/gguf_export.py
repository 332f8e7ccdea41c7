"""`tandem export-gguf`: write a Tandem model as the GGUF file llama.cpp loads, so both run the same weights.

The writer is the inverse of Tandem's GGUF reader (engine/models/gguf_names.py): the same name map,
run backwards, and the metadata keys `moe_config_from_gguf` reads. Per family:

    Tandem family   llama.cpp arch   q/k rows                        top-k renormalisation in llama.cpp
    qwen3_moe       qwen3moe         as stored (NEOX RoPE)           always (the file must agree)
    olmoe           olmoe            as stored (NEOX RoPE)           never
    mixtral         llama            permuted (llama.cpp's NORM RoPE)  always
    gpt_oss         gpt-oss          as stored (NEOX RoPE)           its own: softmax over the chosen k
    qwen3_5_moe     qwen35moe        as stored (interleaved MRoPE)   always
    deepseek_v2     deepseek2        RoPE rows interleaved (NORM)    as the file says (false)

Three families have a module of their own (FAMILY_MODULES: checks, metadata keys and the layer
tensors the shared map lacks): gpt-oss's attention sinks, post-attention norm, expert biases, sliding
window and YaRN keys (engine/bench/gguf_export_gpt_oss.py; llama.cpp fixes its clamped SwiGLU, so a
model with other constants is refused), Qwen3.5-MoE's DeltaNet layers, shared expert and RoPE sections
(gguf_export_qwen3_5.py), DeepSeek-V2's latent attention, shared experts and YaRN (gguf_export_deepseek2.py).

Routed experts go out stacked per layer, `blk.N.ffn_{gate,up}_exps` (E, I, H) and `ffn_down_exps`
(E, H, I) in torch order (GGUF lists dims innermost first: {H, I, E}), split from the engine's fused
gate_up (E, 2I, H). As llama.cpp's converter does, 1-D tensors (norms) and the routers
(`ffn_gate_inp`) are F32; every other matrix is BF16 (or F32 with dtype="f32"). A synthetic preset
with quantised experts (`synthetic:qwen3-30b-a3b-Q4_0`) writes its experts' blocks as they are: a
48-layer file of 19 GB instead of 61, and llama.cpp reads the same blocks Tandem does.

Tokenizer. llama.cpp refuses a file without one, and synthetic models have none: the export copies
every `tokenizer.*` key of the built-in SmolLM2 GGUF (a GPT-2 BPE of 49152 tokens) and builds the
synthetic model with that vocabulary: `synthetic:qwen3-30b-a3b-L16` is exported as the preset with
`vocab_size=49152` (synthetic.config_for(name, vocab_size=…)); only the embedding and head change
shape. A model file of its own (a folder or GGUF) keeps its weights: it is exported with the
tokenizer of its own GGUF when it has one, else with SmolLM2's, which requires its vocabulary to be
49152 tokens (checked).

Same numbers as Tandem: synthetic weights depend on the device that draws them (CPU and CUDA
generators differ) and on the vocabulary size (the embedding is drawn first). For Tandem and
llama.cpp to run the same weights, run Tandem on the exported file itself (`--model FILE.gguf`).

Streaming: tensor infos are known up front from the model's shapes, so the header is written first
and each tensor is drawn (synthetic) or taken (loaded model), converted and appended, then dropped;
the host holds one tensor (a layer's expert stack: 0.8 GB for Qwen3-30B-A3B in bf16) at a time.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import ConfigError, ModelFileError, UnsupportedModelError
from engine.models import families
from engine.models.assemble import tensor_shapes
from engine.models.common import ModelArgs
from engine.models.gguf_names import gguf_expert_names, gguf_name
from engine.quant.blocks import QuantStack
from engine.runtime.chat import tokenizer_fields

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama", "llama": "llama", "gpt_oss": "gpt-oss",
             "qwen3_5_moe": "qwen35moe", "deepseek_v2": "deepseek2"}
# llama.cpp's graphs fix top-k renormalisation per architecture (build_moe_ffn's norm_w argument);
# gpt-oss routes its own way (a softmax over the k chosen logits) in both engines.
RENORMALISES = {"qwen3moe": True, "olmoe": False, "llama": True, "qwen35moe": True}
# the families whose tensors, checks or keys the shared map and metadata do not cover: their modules
FAMILY_MODULES = {"gpt-oss": "gguf_export_gpt_oss", "qwen35moe": "gguf_export_qwen3_5",
                  "deepseek2": "gguf_export_deepseek2"}
DTYPES = ("bf16", "f32")


@dataclass
class Piece:
    """One GGUF tensor: where its data comes from in the engine's tensors and how it is laid out."""
    gguf_name: str
    shape: tuple  # torch order
    ggml_type: gguf.GGMLQuantizationType  # noqa: F821 (imported lazily; annotations stay strings)
    hf_name: str
    rows: tuple[int, int] | None = None  # a slice of dim 1 (gate or up of a fused gate_up)
    permute_heads: int | None = None  # llama arch: q/k rows into llama.cpp's interleaved RoPE order
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None  # a family's own layout (qwen35moe)

    @property
    def nbytes(self) -> int:
        import gguf

        block_weights, block_bytes = gguf.GGML_QUANT_SIZES[self.ggml_type]  # BF16 (1, 2), F32 (1, 4)
        return int(np.prod(self.shape)) // block_weights * block_bytes


# -- tokenizer ------------------------------------------------------------------------------------
# tokenizer_fields (engine/runtime/chat.py): every `tokenizer.*` key of the GGUF the export borrows

def tokenizer_vocab_size(fields: tuple[tuple, ...]) -> int:
    return len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))


def default_tokenizer() -> Path:
    from engine.models.builtin import smollm2_gguf

    return smollm2_gguf()


# -- the plan: GGUF tensors in file order ----------------------------------------------------------

def _family(arch: str):
    """The family's own export module (FAMILY_MODULES), or None."""
    module = FAMILY_MODULES.get(arch)
    return importlib.import_module(f"engine.bench.{module}") if module is not None else None


def _check_exportable(arch: str, args: ModelArgs, config: dict | None = None) -> None:
    family = _family(arch)
    if family is not None:
        family.check(args, config or {})
        if family.CHECKS_ALL:  # YaRN, windows and routing of its own: its check is the whole check
            return
    if args.rope_inv_freq is not None:
        raise UnsupportedModelError("this model uses scaled RoPE, which the GGUF export does not write",
                                    "export a model with plain RoPE")
    if args.sliding_window:
        raise UnsupportedModelError(f"this model uses a {args.sliding_window}-token sliding window, "
                                    f"which llama.cpp's {arch} graph does not apply", "export a model without one")
    if args.n_experts and args.norm_topk_prob != RENORMALISES[arch]:
        raise UnsupportedModelError(
            f"llama.cpp's {arch} graph {'always' if RENORMALISES[arch] else 'never'} renormalises the top-k expert "
            f"weights; this model's norm_topk_prob is {args.norm_topk_prob}", "the two would compute different models")


def plan(arch: str, args: ModelArgs, shapes: dict[str, tuple], dtype: str = "bf16",
         expert_quant: str | None = None) -> list[Piece]:
    """The GGUF tensors of a model with these engine tensor shapes, in the order of `shapes`;
    `expert_quant` (Q4_0, Q8_0): the routed experts come as blocks of that type (a quantised synthetic
    preset's QuantStacks) and are written as they are."""
    import gguf

    matrix_type = gguf.GGMLQuantizationType.BF16 if dtype == "bf16" else gguf.GGMLQuantizationType.F32
    expert_type = gguf.GGMLQuantizationType[expert_quant] if expert_quant else matrix_type
    f32 = gguf.GGMLQuantizationType.F32
    pieces = []
    own_pieces = _own_pieces(arch)
    for hf_name, shape in shapes.items():
        own = own_pieces(hf_name, shape, args, matrix_type, f32) if own_pieces is not None else None
        if own is not None:
            pieces.extend(own)
        elif hf_name.endswith(".mlp.experts.gate_up_proj"):  # (E, 2I, H) → gate (E, I, H), up (E, I, H)
            names = gguf_expert_names(int(hf_name.split(".")[2]))
            E, two_i, H = shape
            half = two_i // 2
            pieces.append(Piece(names["gate"], (E, half, H), expert_type, hf_name, rows=(0, half)))
            pieces.append(Piece(names["up"], (E, half, H), expert_type, hf_name, rows=(half, two_i)))
        elif hf_name.endswith(".mlp.experts.down_proj"):  # (E, H, I)
            pieces.append(Piece(gguf_expert_names(int(hf_name.split(".")[2]))["down"], shape, expert_type, hf_name))
        else:
            name = gguf_name(hf_name)
            kind = name.split(".")[2] if name.startswith("blk.") else ""
            ggml_type = f32 if len(shape) == 1 or kind == "ffn_gate_inp" or name.endswith(".bias") else matrix_type
            heads = None
            if arch == "llama" and kind == "attn_q" and name.endswith(".weight"):
                heads = args.n_heads
            elif arch == "llama" and kind == "attn_k" and name.endswith(".weight"):
                heads = args.n_kv_heads
            pieces.append(Piece(name, shape, ggml_type, hf_name, permute_heads=heads))
    return pieces


def _own_pieces(arch: str):
    """The family's mapping of the tensors the shared name map lacks (hf_name, shape, args,
    matrix type, F32) → pieces or None, where it has one."""
    family = _family(arch)
    if family is None:
        return None
    table = family.LAYER_TENSORS
    return lambda hf_name, shape, args, matrix_type, f32: _layer_pieces(table, hf_name, shape, args, matrix_type, f32)


def _layer_pieces(table: dict, hf_name: str, shape: tuple, args: ModelArgs, matrix_type, f32) -> list | None:
    """The GGUF pieces of a layer tensor the family names or re-lays itself: `table` maps the name
    after `model.layers.N.` to [(GGUF kind, F32?, layout (tensor, args) → tensor, or None)]."""
    parts = hf_name.split(".")
    rest = ".".join(parts[3:])
    if parts[:2] != ["model", "layers"] or rest not in table:
        return None
    out = []
    for kind, is_f32, fn in table[rest]:
        out_shape = tuple(fn(torch.empty(shape, device="meta"), args).shape) if fn is not None else shape
        transform = (lambda t, fn=fn: fn(t, args)) if fn is not None else None
        out.append(Piece(f"blk.{parts[2]}.{kind}", out_shape, f32 if is_f32 else matrix_type, hf_name,
                         transform=transform))
    return out


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half q/k rows → llama.cpp's interleaved pairs per head (the inverse of the reader's
    `_unpermute`). w: (n_heads·hs, in)."""
    out_dim, in_dim = w.shape
    return w.reshape(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _piece_array(piece: Piece, t) -> np.ndarray:
    """The bytes of one GGUF tensor as a host array (bf16 as its int16 bit pattern; a QuantStack's
    blocks as they are, (E, rows, row bytes) uint8)."""
    if isinstance(t, QuantStack):
        blocks = np.stack([np.asarray(e.blocks) for e in t.experts])  # (E, N, row bytes)
        if piece.rows is not None:
            blocks = blocks[:, piece.rows[0]:piece.rows[1]]
        if blocks.shape[:2] != tuple(piece.shape[:2]) or blocks.size != piece.nbytes:
            raise ModelFileError(f"tensor {piece.hf_name}: blocks of shape {blocks.shape} for {piece.shape} "
                                 f"{piece.ggml_type.name}", "the model's tensors do not match its config")
        return np.ascontiguousarray(blocks)
    if piece.rows is not None:
        t = t[:, piece.rows[0]:piece.rows[1]]
    if piece.permute_heads is not None:
        t = _permute(t, piece.permute_heads)
    if piece.transform is not None:
        t = piece.transform(t)
    if tuple(t.shape) != tuple(piece.shape):
        raise ModelFileError(f"tensor {piece.hf_name} has shape {tuple(t.shape)}, the plan says {piece.shape}",
                             "the model's tensors do not match its config")
    if piece.ggml_type.name == "BF16":
        return t.to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy()
    return t.to(torch.float32).contiguous().cpu().numpy()


# -- writing --------------------------------------------------------------------------------------

def _metadata(w, arch: str, args: ModelArgs, config: dict, name: str, dtype: str) -> None:
    import gguf

    w.add_name(name)
    w.add_type("model")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bf16" else gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(args.n_layers)
    w.add_context_length(args.max_position)
    w.add_embedding_length(args.dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_key_length(args.head_dim)
    if arch != "deepseek2":  # MLA's values are the latent part of the cached row: written there
        w.add_value_length(args.head_dim)
    w.add_rope_dimension_count(args.rotary_dim or args.head_dim)  # qwen3moe asserts all of it; qwen35moe a quarter
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_layer_norm_rms_eps(float(args.norm_eps))
    w.add_vocab_size(args.vocab_size)
    if args.n_experts:
        w.add_expert_count(args.n_experts)
        w.add_expert_used_count(args.top_k)
        w.add_expert_weights_norm(bool(args.norm_topk_prob))
    if arch == "qwen3moe":
        w.add_feed_forward_length(args.ffn_dim or args.expert_ffn_dim)  # dense FFN size; unused when all layers route
        w.add_expert_feed_forward_length(args.expert_ffn_dim)
    elif (family := _family(arch)) is not None:
        family.metadata(w, args, config)
    else:  # olmoe and llama (Mixtral) size their experts by feed_forward_length; a dense llama its FFN
        w.add_feed_forward_length(args.expert_ffn_dim if args.n_experts else args.ffn_dim)
    if args.clip_qkv:
        w.add_clamp_kqv(float(args.clip_qkv))


def write_gguf(out: Path, *, family: str, config: dict, args: ModelArgs, tensors: Iterable[tuple[str, torch.Tensor]],
               tokenizer: tuple[tuple, ...], dtype: str = "bf16", name: str = "tandem export",
               progress: Callable[[str, float], None] | None = None, expert_quant: str | None = None) -> dict:
    """Write the model whose engine tensors `tensors` yields (in `tensor_shapes(args)` order) to `out`.

    Returns {"bytes", "seconds", "tensors"}. The file is written to a temporary name and renamed at
    the end, so a failed export leaves no half file under `out`.
    """
    import gguf

    if dtype not in DTYPES:
        raise ConfigError(f"unknown export dtype '{dtype}'", f"use one of: {', '.join(DTYPES)}")
    if family not in GGUF_ARCH:
        raise UnsupportedModelError(f"family '{family}' has no GGUF export",
                                    f"exportable families: {', '.join(sorted(GGUF_ARCH))}")
    arch = GGUF_ARCH[family]
    _check_exportable(arch, args, config)
    vocab = tokenizer_vocab_size(tokenizer)
    if vocab != args.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab} tokens but the model's vocabulary is {args.vocab_size}",
                          "llama.cpp needs them equal: export with a tokenizer of the model's size")
    shapes = tensor_shapes(args)
    pieces = plan(arch, args, shapes, dtype, expert_quant)

    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(str(tmp), arch)
    _metadata(w, arch, args, config, name, dtype)
    for key, value, vtype, sub in tokenizer:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for p in pieces:
        w.add_tensor_info(p.gguf_name, p.shape, np.dtype(np.int16 if p.ggml_type.name == "BF16" else np.float32),
                          p.nbytes, raw_dtype=p.ggml_type)
    total = sum(p.nbytes for p in pieces)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        by_source: dict[str, list[Piece]] = {}
        for p in pieces:
            by_source.setdefault(p.hf_name, []).append(p)
        order = [p.hf_name for p in pieces]
        written, done = 0, 0
        for hf_name, t in tensors:
            if hf_name not in by_source:
                raise ModelFileError(f"tensor {hf_name} is not part of the model's shape",
                                     "the tensors do not match the config")
            for p in by_source.pop(hf_name):
                if order[written] != hf_name:  # the file's data must follow its tensor infos
                    raise ModelFileError(f"tensor {hf_name} came out of order (expected {order[written]})",
                                         "yield tensors in tensor_shapes order")
                w.write_tensor_data(_piece_array(p, t))
                written += 1
                done += p.nbytes
            del t
            if progress is not None:
                progress(hf_name, done / total)
        if by_source:
            missing = sorted(by_source)
            raise ModelFileError(f"tensors {missing[:4]} were never provided", "the model is incomplete")
        w.close()
        tmp.replace(out)
    finally:
        w.close()
        if tmp.exists():
            tmp.unlink()
    return {"bytes": out.stat().st_size, "seconds": time.perf_counter() - t0, "tensors": len(pieces)}


def export(model: str, out: str | Path, *, dtype: str = "bf16", device: str = "cpu", seed: int | None = None,
           tokenizer_from: str | Path | None = None, progress: Callable[[str, float], None] | None = None,
           routing: str | None = None) -> dict:
    """Export `model` (synthetic:…, a model folder or a .gguf) to the GGUF file `out`.

    Synthetic models are drawn tensor by tensor on `device` (bf16, as Tandem draws them) with the
    tokenizer's vocabulary size; other models are read with Tandem's loader. Returns the writer's
    stats plus the model's description. `routing` ("zipf[:s]", synthetic models only) rescales each
    layer's router rows for Zipf-skewed expert popularity (engine/bench/routing.py); both engines
    then read that skewed model from the file.
    """
    from engine.bench import routing as routing_mod

    skew = routing_mod.parse(routing)
    if skew is not None and not model.startswith("synthetic:"):
        raise ConfigError(f"routing '{routing}' applies to synthetic models only", "leave routing out")
    from engine.models import synthetic

    own_tokenizer = None
    if model.startswith("synthetic:"):
        tokenizer = tokenizer_fields(Path(tokenizer_from) if tokenizer_from else default_tokenizer())
        config = synthetic.config_for(model, vocab_size=tokenizer_vocab_size(tokenizer))
        family = families.for_model_type(config["model_type"], Path(model)).NAME
        kwargs = {} if seed is None else {"seed": seed}
        tensors = synthetic.generate(model, config, device=torch.device(device), dtype=torch.bfloat16, **kwargs)
    else:
        from engine.models.loader import load_checkpoint

        ckpt = load_checkpoint(model, torch.float32 if dtype == "f32" else torch.bfloat16)
        if ckpt.gguf_file is not None and tokenizer_from is None:
            own_tokenizer = ckpt.tokenizer_dir / ckpt.gguf_file
        tokenizer = tokenizer_fields(Path(tokenizer_from or own_tokenizer or default_tokenizer()))
        config, family = ckpt.config, ckpt.family
        tensors = ((k, ckpt.tensors[k]) for k in tensor_shapes(families.get(family).args_from_config(config)))
    args = families.get(family).args_from_config(config)
    if skew is not None:
        tensors = _skewed(tensors, skew, args.top_k, kwargs.get("seed", 0))
    quant = synthetic.expert_quant(model) if model.startswith("synthetic:") else None
    stats = write_gguf(Path(out), family=family, config=config, args=args, tensors=tensors, tokenizer=tokenizer,
                       dtype=dtype, name=f"tandem export of {model}", progress=progress, expert_quant=quant)
    return {**stats, "model": model, "arch": GGUF_ARCH[family], "dtype": dtype, "vocab_size": args.vocab_size,
            "layers": args.n_layers, "experts": args.n_experts, "device": device,
            "routing": routing_mod.label(routing)}


def _skewed(tensors, s: float, top_k: int, seed: int):
    """The routers (`model.layers.N.mlp.gate.weight`) rescaled for Zipf(s) popularity, the rest as drawn."""
    from engine.bench.routing import skew_router

    for name, t in tensors:
        if name.endswith(".mlp.gate.weight"):
            layer = int(name.split(".")[2])
            t = skew_router(t.float().cpu(), s, layer, top_k, seed).to(device=t.device, dtype=t.dtype)
        yield name, t
