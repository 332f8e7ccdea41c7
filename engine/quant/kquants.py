"""The K-quants' 256-weight super-blocks (ggml's Q4_K, Q5_K, Q6_K) and their dequantisation with torch.

    Q4_K  144 bytes: d (fp16), dmin (fp16), scales[12], qs[128]
    Q5_K  176 bytes: d, dmin, scales[12], qh[32], qs[128]
    Q6_K  210 bytes: ql[128], qh[64], sc[16] (int8), d (fp16, last)

Q4_K/Q5_K: 8 sub-blocks of 32 weights, sub-block j with a 6-bit scale sc_j and min m_j packed in
`scales` (`_scale_min`); w = (d·sc_j)·q − dmin·m_j, q = the nibbles of qs[32·(j//2) + l] (low for even
j, high for odd), for Q5_K with bit j of qh[l] on top. Q6_K: 16 groups of 16 weights with int8 scales;
w = (d·sc)·(q − 32), q's low 4 bits from ql and top 2 from qh (the order is in `_q6k_values`).

The native kernels (native/kquant_kernels.h) read a super-block as its 8 sub-blocks of 32 against
the activations' 32-blocks; this module is their torch fallback and gives gguf's values bit for bit:
d·sc·q is exact in fp32 (an fp16 mantissa of 11 bits times ≤ 14 bits), so only Q4_K/Q5_K's "− dmin·m"
rounds, once, as gguf's does.
"""

from __future__ import annotations

import torch

QK_K = 256  # weights per super-block


def _half(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (…, 2) → fp32 (…, 1)."""
    return b.contiguous().view(torch.float16).float()


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scales (…, 12) uint8 → sc, m (…, 8) int: sub-blocks 0–3 in the low 6 bits of bytes 0–3 (scale)
    and 4–7 (min); 4–7 in bytes 8–11's nibbles (scale low, min high) with their top 2 bits in the top
    bits of bytes 0–3 (scale) and 4–7 (min)."""
    s = scales.int()
    low_sc, low_m, nib = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([low_sc & 63, (nib & 0x0F) | ((low_sc >> 2) & 0x30)], dim=-1)
    m = torch.cat([low_m & 63, (nib >> 4) | ((low_m >> 2) & 0x30)], dim=-1)
    return sc, m


def _nibble_subblocks(qs: torch.Tensor) -> torch.Tensor:
    """qs (…, 128) → q (…, 8, 32): 32 bytes a sub-block pair, low nibbles the even sub-block."""
    pairs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([pairs & 0x0F, pairs >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32).int()


def _q6k_values(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """ql (…, 128), qh (…, 64) → q − 32 (…, 16, 16): half h's sub-block p (of 4) takes the low (p < 2)
    or high nibbles of ql[64h + 32·(p % 2) + l] and bits 2p, 2p+1 of qh[32h + l]."""
    lead = ql.shape[:-1]
    lo = ql.reshape(*lead, 2, 1, 64)
    low = torch.cat([lo & 0x0F, lo >> 4], dim=-2).reshape(*lead, 2, 4, 32)  # [h, p]: p = 2·nibble + ql half
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qh.device).reshape(4, 1)
    top = (qh.reshape(*lead, 2, 1, 32) >> shifts) & 3  # (…, 2, 4, 32)
    return ((low | (top << 4)).int() - 32).reshape(*lead, 16, 16)


def dequantize_kquant_torch(b: torch.Tensor, name: str) -> torch.Tensor:
    """Super-blocks b (rows, n, bytes) uint8 of type `name` → fp32 (rows, n, 256)."""
    lead = b.shape[:-1]
    if name == "Q6_K":
        q = _q6k_values(b[..., 0:128], b[..., 128:192])  # (rows, n, 16, 16)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()  # (rows, n, 16)
        scale = _half(b[..., 208:210]) * sc  # (rows, n, 16): exact
        return (scale[..., None] * q.float()).reshape(*lead, QK_K)
    if name not in ("Q4_K", "Q5_K"):
        raise ValueError(f"{name} is not a K-quant kept in blocks")
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # (rows, n, 1)
    sc, m = _scale_min(b[..., 4:16])  # (rows, n, 8)
    q = _nibble_subblocks(b[..., -128:])  # (rows, n, 8, 32)
    if name == "Q5_K":
        qh = b[..., 16:48].reshape(*lead, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8, device=b.device).reshape(8, 1)) & 1).int() << 4)  # bit j: sub-block j
    scale = (d * sc.float())[..., None]  # (rows, n, 8, 1)
    offset = (dmin * m.float())[..., None]
    return (scale * q.float() - offset).reshape(*lead, QK_K)
