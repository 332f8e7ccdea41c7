"""A decode step on the CPU as one native call per decoder layer.

At one token a layer of a small model is a few products of µs each, and as modules and torch
operations the layer paid about as much again in dispatch: the built-in model's token took 18.7 ms of
CPU time on an AVX2 core against llama.cpp's 12.7, and 11.2–13.0 as native layer calls
(benchmarks/dev-2core-avx2/cpu-time-builtin-*.json). Where the model, its weights and the KV allow,
each layer's step runs as one `DecodeLayer.step` (native/decode_layer.h): the same kernels the modules
call (block products, norms, RoPE, attention over the cache rows in place), in the same order. A MoE
layer whose experts are all quantised blocks in RAM (QuantResidentExperts) and whose router is the plain
softmax → top-k routes in the same call (native/moe_route.h): in Python the router, the top-k and the
grouping of the pairs were ~12% of a 2-thread decode token of Qwen3-30B-A3B's widths, serial while the
other thread waited. Other MoE layers end their call at the FFN's input and the executor runs their
experts. The embedding, the final norm and the head run as modules.

It is the CPU's counterpart of the CUDA decode graphs (engine/runtime/decode_graph.py) and sits in the
generator's same place: `step` returns the logits, or None for a step it does not take (a prompt
chunk, a sliding window that cuts the past), which then runs the modules as before. A batch of chats
is one call a layer too: the products take the B tokens at once, the attention each chat's rows.

    unsupported_reason(model, kv, device) -> str | None
    CPUDecodeSteps(model, kv).step(tokens (B, 1), positions (B, 1)) -> logits (B, V) fp32 | None
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import native
from engine.kv.resident import ResidentKV
from engine.models.common import Attention, Decoder, FeedForward
from engine.models.moe_ffn import MoEFeedForward, SoftmaxTopK
from engine.quant.experts import QuantResidentExperts
from engine.quant.matmul import native_max_tokens
from engine.quant.modules import QuantLinear


def unsupported_reason(model, kv, device: torch.device) -> str | None:
    """Why this model's decode steps cannot run as native layer calls here, or None when they can."""
    nat = native.module()
    if device.type != "cpu":
        return "not a CPU model"
    if nat is None or not hasattr(nat, "DecodeLayer"):
        return "the native extension is missing or older"
    if not isinstance(kv, ResidentKV):
        return f"the {kv.policy} KV places rows itself"
    if not isinstance(model, Decoder) or model.rope_cos is None or model.rope_cos.dtype != torch.float32:
        return "not a plain decoder with fp32 RoPE tables"
    a = model.args
    if a.attn_sinks or a.layer_windows is not None or a.attention_layers is not None or a.attn_output_gate:
        return "attention sinks, per-layer windows or linear-attention layers"
    if a.clip_qkv is not None or a.qk_norm_scope != "head" or a.o_bias:
        return "clipped q/k/v, whole-projection q/k norms or an o_proj bias"
    if a.head_dim % 16 or not 16 <= a.head_dim <= 256 or (a.rotary_dim or a.head_dim) % 2:
        return f"head_dim {a.head_dim} (the native attention takes multiples of 16 up to 256)"
    if kv.k.dtype not in native.DTYPE_CODES:
        return f"a {kv.k.dtype} KV cache"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or attn.qkv_blocks is None or not _cpu_blocks(attn.o_proj):
            return "attention weights not all in blocks on the CPU"
        if isinstance(mlp, FeedForward) and (mlp.gate_up_blocks is None or not _cpu_blocks(mlp.down_proj)):
            return "FFN weights not all in blocks on the CPU"
        if not isinstance(mlp, (FeedForward, MoEFeedForward)):
            return f"an FFN of kind {type(mlp).__name__}"
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if attn.q_norm is not None:
            norms += [attn.q_norm.weight, attn.k_norm.weight]
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return "norm weights not contiguous fp32"
    return None


def _cpu_blocks(m) -> bool:
    return isinstance(m, QuantLinear) and m.qweight.blocks.device.type == "cpu" and m.bias is None


def routed_experts(mlp: MoEFeedForward) -> dict | None:
    """`DecodeLayer.set_routed`'s arguments for a MoE layer whose step can route in the native call
    (plain softmax → top-k, no shared experts, quantised experts of one layout in RAM; copies of one FFN
    are computed once per token there, as the executor computes them), else None."""
    ex, layer, gate = mlp.experts, mlp.expert_layer, mlp.gate
    if not isinstance(ex, QuantResidentExperts) or ex.tables[layer] is None or layer in ex.forms:
        return None
    if not isinstance(mlp.route, SoftmaxTopK) or mlp.route_options or mlp.shared_experts is not None or gate.bias is not None:
        return None
    w = gate.weight
    if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
        return None
    blocks, types = ex.tables[layer]
    gate_type, up_type, down_type = types
    return dict(router=w.data_ptr(), n_experts=w.shape[0], top_k=mlp.top_k,
                renormalise=mlp.route.renormalises(bool(mlp.renormalise)),
                group=ex.groups[layer].numpy().astype(np.int64), blocks=np.ascontiguousarray(blocks, dtype=np.int64),
                gate_type=gate_type, up_type=up_type, down_type=down_type, inter=ex.gate_up[layer].shape[1] // 2,
                max_tokens=native_max_tokens(types))  # the executor's own bound on its native set


class CPUDecodeSteps:
    """Native layer plans over a model's weights and a ResidentKV's cache: they hold the tensors'
    addresses, so they are rebuilt whenever weights or the KV are (the backend does, as for graphs)."""

    def __init__(self, model: Decoder, kv: ResidentKV):
        nat, a = native.module(), model.args
        self.model, self.kv = model, kv
        self.x = torch.empty(1, a.dim)  # (B, H) the residual stream of the step's tokens, grown to B
        self.normed = torch.empty(1, a.dim)  # (B, H) norm₂ of it: a MoE layer's expert input
        self.plans, self.moe, self.routed = [], [], []  # routed: the layer's call adds its experts itself
        rotary = a.rotary_dim or a.head_dim
        empty = np.zeros((0, 4), dtype=np.int64)  # no matrices: a MoE layer's FFN half
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            dense = isinstance(mlp, FeedForward)
            self.plans.append(nat.DecodeLayer(
                dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, rotary=rotary,
                ffn=mlp.down_proj.qweight.shape[1] if dense else 0, kv_slots=kv.k.shape[1],
                norm_eps=a.norm_eps, qk_norm_eps=attn.q_norm.eps if attn.q_norm is not None else 0.0,
                scale=a.head_dim ** -0.5, norm1=layer.input_layernorm.weight.data_ptr(),
                norm2=layer.post_attention_layernorm.weight.data_ptr(),
                q_norm=attn.q_norm.weight.data_ptr() if attn.q_norm is not None else 0,
                k_norm=attn.k_norm.weight.data_ptr() if attn.k_norm is not None else 0,
                qkv=attn.qkv_blocks.native_parts,
                qkv_bias=attn.qkv_bias.data_ptr() if attn.qkv_bias is not None else 0,
                o=attn.o_proj.qweight.native_parts,
                gate_up=mlp.gate_up_blocks.native_parts if dense else empty,
                down=mlp.down_proj.qweight.native_parts if dense else empty,
                k_cache=kv.k[i].data_ptr(), v_cache=kv.v[i].data_ptr(), kv_dtype=native.DTYPE_CODES[kv.k.dtype]))
            routed = None if dense else routed_experts(mlp)
            if routed is not None:
                self.plans[-1].set_routed(**routed)
            self.moe.append(None if dense else mlp)
            self.routed.append(routed is not None)
        self.steps = self.eager_steps = 0

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """tokens (B, 1) on the host, positions (B, 1) from kv.begin_step → logits (B, V) fp32, or None
        for a step the native calls do not take (the caller runs the modules)."""
        rows = self.kv.decode_rows() if tokens.shape[1] == 1 else None
        if rows is None:
            self.eager_steps += 1
            return None
        writes, runs, offsets = rows
        m, B = self.model, tokens.shape[0]
        if self.x.shape[0] < B:
            self.x, self.normed = torch.empty(B, self.model.args.dim), torch.empty(B, self.model.args.dim)
        x, normed = self.x[:B], self.normed[:B]  # (B, H) each
        x.copy_(m.model.embed_tokens(tokens).view(B, -1))
        pos = positions[:, 0]
        cos, sin = m.rope_cos[pos], m.rope_sin[pos]  # (B, rotary), gathered rows
        pointers, threads = (x.data_ptr(), normed.data_ptr(), cos.data_ptr(), sin.data_ptr()), native.threads()
        for plan, moe in zip(self.plans, self.moe):
            if plan.step(*pointers, writes, runs, offsets, threads):
                if moe is not None:  # routed in the call: the executor's count of routed tokens
                    moe.experts.tokens_routed += B * moe.top_k
            elif moe is not None:  # the routed experts of norm₂(x), added to x
                x += moe(normed.view(B, 1, -1)).view(B, -1)
        self.steps += 1
        return m.lm_head(m.model.norm(x)).float()  # (B, V)

    def telemetry(self) -> dict:
        return {"layers": len(self.plans), "routed_layers": sum(self.routed), "native_steps": self.steps,
                "module_steps": self.eager_steps}

    def close(self) -> None:
        self.plans = self.moe = self.routed = []
