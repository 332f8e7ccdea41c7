"""Tiny real model files for tests: a few layers, random weights, real configs and formats."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np

from engine.quant.matmul import INT8_KQUANT_ISAS

TINY = dict(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=48, ctx=256)


def write_tiny_llama_gguf(path: Path, arch: str = "llama", bad_shape: bool = False,
                          qtype=None, seed: int = 0) -> Path:
    """A 2-layer llama GGUF with F32 weights (or one tensor of `qtype` raw bytes)."""
    import gguf

    c = TINY
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["layers"])
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c["vocab"])
    hd = c["dim"] // c["heads"]

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    t("token_embd.weight", c["vocab"], c["dim"])
    t("output_norm.weight", c["dim"])
    for i in range(c["layers"]):
        t(f"blk.{i}.attn_norm.weight", c["dim"])
        t(f"blk.{i}.ffn_norm.weight", c["dim"])
        t(f"blk.{i}.attn_q.weight", c["heads"] * hd, c["dim"])
        t(f"blk.{i}.attn_k.weight", c["kv_heads"] * hd + (8 if bad_shape and i == 1 else 0), c["dim"])
        t(f"blk.{i}.attn_v.weight", c["kv_heads"] * hd, c["dim"])
        t(f"blk.{i}.attn_output.weight", c["dim"], c["heads"] * hd)
        t(f"blk.{i}.ffn_gate.weight", c["ffn"], c["dim"])
        t(f"blk.{i}.ffn_up.weight", c["ffn"], c["dim"])
        if qtype is not None and i == 0:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((c["dim"], c["ffn"] // block * size), dtype=np.uint8)
            w.add_tensor(f"blk.{i}.ffn_down.weight", raw, raw_dtype=qtype)
        else:
            t(f"blk.{i}.ffn_down.weight", c["dim"], c["ffn"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama_folder(path: Path, seed: int = 0) -> Path:
    """A 2-layer LlamaForCausalLM saved by transformers itself (config.json + model.safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = TINY
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["dim"], intermediate_size=c["ffn"],
                      num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                      num_key_value_heads=c["kv_heads"], max_position_embeddings=c["ctx"],
                      rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return path


def kill_hard(proc, after=lambda: None) -> None:
    """`after()` (the wait for the moment to strike), then kill -9 of a child process; the child is
    reaped whatever happens, so a failed wait never leaves it running."""
    try:
        after()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stepped_logits(engine, ids: list[int], prefill: int):
    """(T, V) float logits of a Tandem engine's model: `prefill` tokens in one step, then one decode
    step a token through its KV cache, so that prefill and decode paths are both compared."""
    import torch

    parts = engine.backend.parts
    kv, sid, rows = parts.kv, parts.kv.new_sequence(), []
    try:
        with torch.inference_mode():
            for chunk in [ids[:prefill]] + [[t] for t in ids[prefill:]]:
                positions = kv.begin_step([sid], len(chunk))
                tokens = torch.tensor([chunk], device=positions.device)  # (1, T) where the model runs
                rows.append(parts.model(tokens, positions, kv, last_only=False)[0])
                kv.end_step()
    finally:
        kv.free(sid)
    return torch.cat(rows).float().cpu()


# Logits of a model over GGUF blocks against the same file dequantised to float32, as a fraction of
# max |logit|. The int16 form of the activations (per 32 values, at most 2^-16 of the block's largest
# value) compounds to some 1e-4 over a tiny model's layers (observed 4e-5): held to 1e-3. AVX2's and
# AVX-512's K-quant products read them as int8 per 256 values (native/kquant_kernels.h: at most max|x_b|/254 a
# value, llama.cpp's Q8_K), 2^8 times coarser and over 8 times as many values a scale: observed up to
# 1.1e-2 of max |logit| on the tiny test models and 2.0e-2 on one random MoE layer: held to 4e-2.
INT16_LOGIT_TOL, INT8_LOGIT_TOL = 1e-3, 4e-2
# The native kernel tables whose K-quant products read the activations as int8 (quantize_acts8)
INT8_ISAS = set(INT8_KQUANT_ISAS)


def quant_logit_tolerance() -> float:
    """INT8_LOGIT_TOL where the active native kernels read K-quant activations as int8, else INT16's."""
    from engine.kernels import native

    nat = native.module()
    int8 = nat is not None and hasattr(nat, "quant_isa") and nat.quant_isa() in INT8_ISAS
    return INT8_LOGIT_TOL if int8 else INT16_LOGIT_TOL


def greedy_follows(quant, ref, prompt: list[int], n: int) -> bool:
    """Whether `quant`'s greedy continuation is `ref`'s, or leaves it only where the two tokens were a
    near tie in `ref`'s own logits (within quant_logit_tolerance() of max |logit|): the rounding of
    int8 activations may swap such a pair, and the continuations then go their own ways."""
    got, want = quant.generate_ids(prompt, n), ref.generate_ids(prompt, n)
    if got == want:
        return True
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:  # one stopped (end of sequence) where the other went on: not a near tie
        return False
    row = stepped_logits(ref, prompt + want[:i], len(prompt) + i)[-1]
    gap = float(row[want[i]] - row[got[i]])
    return 0.0 <= gap <= quant_logit_tolerance() * float(row.abs().max())
