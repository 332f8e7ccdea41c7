"""Attention on the compute device, returning output and natural-log LSE for an exact merge.

    attend_dense(q, k, v, scale, causal)     every key visible (or causal over the queries' own keys)
    attend_padded(q, k, v, excluded, scale)  row b sees only its first lengths[b] keys (the D-window)

Shapes: q (b, nh, T, hs); k, v (b, n_kv, S, hs), any strides with a contiguous last dim (views
into the ping-pong buffers and the D-window). GQA by passing fewer KV heads: query head h reads KV
head h // (nh / n_kv). Outputs: o (b, nh, T, hs) fp32, lse (b, nh, T) fp32.

On CUDA in bf16/fp16, dense attention is PyTorch's flash kernel (its LSE is natural-log). The
padded form and every other case use an fp32 matmul path; on the CPU (simulate mode) dense
attention is the same fp32-accurate kernel the CPU side uses.

    sdpa(q, k, v, mask, causal, scale)       torch's SDPA (GQA), never its cuDNN backend: the KV
                                             caches' prefill and chunked-prefill attention
    flash_causal(q, k, v, window, sinks)     causal, bottom-right, optionally within a sliding window and
                                             with sinks, through flash (CUDA)
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kernels import attention_cpu

log = logging.getLogger("tandem")
_FLASH_DTYPES = (torch.bfloat16, torch.float16)
# SDPA's backends for prefill, cuDNN left out: it builds an execution plan for every new (queries, keys)
# shape, and a chat's prompts and chunks are new shapes nearly every turn. On an H100 (torch 2.11) one
# layer's prefill of a 1,500-token prompt after prompts of other lengths took 1.19 s with it and 27 ms
# without; its warm speed was no better (benchmarks/h200/2026-12-05-q4km-blocks-h100).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def is_causal_bias(mask) -> bool:
    """Whether mask is torch's causal bias (torch.nn.attention.bias.CausalBias). A plain tensor or None is
    told apart without importing that module, which imports torch._dynamo (~1.6 s of a model's load)."""
    if mask is None or type(mask) is torch.Tensor:
        return False
    from torch.nn.attention.bias import CausalBias

    return isinstance(mask, CausalBias)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """q (B, nh, T, hs), k, v (B, n_kv, S, hs), mask (·, ·, T, S) bool (True: visible), torch's causal
    bias (`causal_lower_right`: a chunk after earlier ones), or None → (B, nh, T, hs)."""
    global _bias_failed
    bias = is_causal_bias(mask)
    if bias and _bias_failed is not None:
        mask, bias = mask._materialize(q.device), False
    # (the CPU has no cuDNN, and a CPU decode step calls this every layer: no backend context there)
    with sdpa_kernel(_SDPA_BACKENDS) if q.is_cuda else nullcontext():
        try:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                    scale=scale, enable_gqa=True)
        except RuntimeError as e:  # a torch whose kernels refuse the bias here: the boolean mask, from now on
            if not bias:
                raise
            _bias_failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("chunked prefill attends with a boolean mask from now on: SDPA refused the causal "
                        "bias (%s)", _bias_failed)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask._materialize(q.device),
                                                                    scale=scale, enable_gqa=True)


_bias_failed: str | None = None  # why SDPA refused the bottom-right causal bias in this process


def flash_supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether SDPA's flash kernel takes queries of this device, dtype and head width."""
    return device.type == "cuda" and dtype in _FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256


def _flash_ok(q: torch.Tensor) -> bool:
    return flash_supports(q.device, q.dtype, q.shape[-1])


def flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention aligned at the bottom right through torch's flash forward (queries that
    `flash_supports` takes): query i of T, at position S − T + i, sees the keys up to its own, and
    within `window` only the last `window` of them (FA2's sliding window, as transformers'), with no
    (nh, T, S) scores and no mask; sinks (nh,) join the softmax through its LSE (`sink_scale`).
    q (B, nh, T, hs); k, v (B, n_kv, S, hs) in q's dtype, last dim contiguous → (B, nh, T, hs)."""
    T, S, hs = q.shape[2], k.shape[2], q.shape[3]
    o, lse = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, T, S, 0.0, True, False,
        scale=hs ** -0.5, window_size_left=None if window is None else window - 1,
        window_size_right=None if window is None else 0)[:2]  # o (B, T, nh, hs), lse (B, nh, T)
    if sinks is not None:
        o = o * sink_scale(lse.transpose(1, 2), sinks).unsqueeze(-1).to(o.dtype)
    return o.transpose(1, 2)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          key_mask: torch.Tensor | None = None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scores, any device. key_mask (b, 1, 1, S): True where a key is excluded."""
    b, nh, T, hs = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    g = nh // n_kv
    qg = q.float().reshape(b, n_kv, g * T, hs) * scale  # head h = kv·g + j
    s = torch.matmul(qg, k.float().transpose(-1, -2))  # (b, n_kv, g·T, S)
    if key_mask is not None:
        s.masked_fill_(key_mask, float("-inf"))
    if causal:
        future = torch.ones((T, S), dtype=torch.bool, device=q.device).triu(1 + S - T)  # (T, S)
        s.view(b, n_kv, g, T, S).masked_fill_(future, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, n_kv, g·T)
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.matmul(p, v.float())  # (b, n_kv, g·T, hs)
    o = torch.where(torch.isfinite(lse).unsqueeze(-1), o, 0.0)  # a row without keys: 0 with lse −inf, not NaN
    return o.view(b, nh, T, hs), lse.view(b, nh, T)


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
                 fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32=False lets the flash path return its output in q's dtype (one kernel fewer, for a
    caller that merges in fp32 itself); other paths return fp32 either way."""
    # Flash's causal mask is aligned top-left (query i sees keys 0..i), ours bottom-right: only
    # T == S agrees; and an empty key set is the math path's job (lse −inf, output 0).
    if _flash_ok(q) and k.dtype == q.dtype and k.shape[2] > 0 and (not causal or q.shape[2] == k.shape[2]):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return (res[0].float() if fp32 else res[0]), res[1]
    if q.device.type == "cpu":
        return attention_cpu.attend_view(q, k, v, scale, causal)
    return _math(q, k, v, scale, causal=causal)


def padding_mask(lengths: torch.Tensor, n_keys: int) -> torch.Tensor:
    """lengths (b,) int64 → (b, 1, 1, n_keys) bool, True for the keys past each row's length."""
    excluded = torch.arange(n_keys, device=lengths.device)[None, :] >= lengths[:, None]  # (b, S)
    return excluded[:, None, None, :]


def attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, excluded: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """excluded: padding_mask(lengths, S), built once per step; every row must keep at least one key."""
    return _math(q, k, v, scale, key_mask=excluded)


def sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (gpt-oss) after the fact: a learned logit s_h per head joins the softmax's
    denominator with a zero value, so an output over the real keys, with their LSE, becomes
    o · e^lse / (e^lse + e^s) = o · σ(lse − s). lse (…, nh) fp32, sinks (nh,) → the factor (…, nh)."""
    return torch.sigmoid(lse - sinks.float())


SINK_PAD = 8  # extra head dims that carry the sink logit; keeps hs a multiple of 8 for the fused kernels


def sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA whose softmax also holds each head's sink logit, exactly: the sink is one extra key at
    the front that every query sees, with a zero value, and a score of s_h. The score comes from two
    extra head dims (q carries s_h/scale split into a high and a low part in q's dtype, the sink key
    carries 1, 1; every real key 0, 0), so GQA needs no per-query-head keys and the real scores are
    untouched.

    q (B, nh, T, hs); k, v (B, n_kv, S, hs); sinks (nh,); mask (B|1, 1, T, S) bool, True = visible,
    or None or torch's bottom-right causal bias for causal (query i sees keys ≤ S − T + i): the boolean
    mask is built, except on CUDA where flash takes q: there `flash_causal` attends over the real keys
    and its LSE puts the sink in after the fact, with no (nh, T, S) scores and no copy of the keys
    → (B, nh, T, hs).
    """
    if (mask is None or is_causal_bias(mask)) and _flash_ok(q) and k.dtype == q.dtype and k.shape[2] > 0:
        return flash_causal(q, k, v, sinks=sinks)
    B, nh, T, hs = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    scale = hs ** -0.5
    target = sinks.float() / scale  # (nh,)
    hi = target.to(q.dtype)
    lo = (target - hi.float()).to(q.dtype)
    q_extra = q.new_zeros((B, nh, T, SINK_PAD))
    q_extra[..., 0] = hi[None, :, None]
    q_extra[..., 1] = lo[None, :, None]
    sink_key = k.new_zeros((B, n_kv, 1, hs + SINK_PAD))
    sink_key[..., hs:hs + 2] = 1.0
    q2 = torch.cat((q, q_extra), dim=-1)  # (B, nh, T, hs + pad)
    k2 = torch.cat((sink_key, torch.cat((k, k.new_zeros((B, n_kv, S, SINK_PAD))), dim=-1)), dim=2)  # (B, n_kv, 1+S, ·)
    v2 = torch.cat((v.new_zeros((B, n_kv, 1, hs)), v), dim=2)  # (B, n_kv, 1+S, hs)
    if mask is None or is_causal_bias(mask):
        i = torch.arange(T, device=q.device)[:, None]
        j = torch.arange(S, device=q.device)[None, :]
        mask = (j <= S - T + i)[None, None]  # (1, 1, T, S)
    visible = torch.ones((*mask.shape[:-1], 1), dtype=torch.bool, device=mask.device)
    mask2 = torch.cat((visible, mask), dim=-1)  # (·, 1, T, 1+S): the sink is always visible
    return sdpa(q2, k2, v2, mask2, scale=scale)
