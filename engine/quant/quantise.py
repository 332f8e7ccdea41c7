"""Float weights into GGUF's 32-weight blocks with torch ops, on any device: Q8_0 and Q4_0, rounded
as ggml's reference quantisers round, byte for byte what gguf's numpy quantiser writes.

What synthetic presets with quantised experts are made with (`synthetic:NAME-Q4_0`, models/synthetic.py):
a 48-layer Qwen3-30B-A3B's 57 GB of experts quantised on the GPU as they are generated, where numpy
would take minutes and a BF16 export for llama.cpp's quantiser would need 61 GB of disk.
Layouts (engine/quant/blocks.py): Q8_0 is d (fp16) then 32 int8; Q4_0 is d then 16 bytes whose low
nibbles are weights 0–15 and high nibbles 16–31, each stored as q + 8.
"""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.quant.blocks import BLOCK, QTYPES

QUANTISERS = ("Q8_0", "Q4_0")  # the types this module writes
CODES = {t.name: code for code, t in QTYPES.items()}


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf, which ggml's reference uses (torch.round rounds half to even), computed as gguf does:
    floor(|x| + 0.5) would round 0.49999997 up, since |x| + 0.5 rounds to 1.0 in fp32."""
    a = x.abs()
    whole = torch.floor(a)
    return torch.sign(x) * (whole + torch.floor(2 * (a - whole)))


def quantise(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w (..., K) float, K a multiple of 32 → uint8 (..., K/32 · block bytes) on w's device."""
    if qtype not in QUANTISERS:
        raise ConfigError(f"no quantiser for {qtype}", f"choose one of {', '.join(QUANTISERS)}")
    *lead, K = w.shape
    if K % BLOCK:
        raise ConfigError(f"rows of {K} weights are not whole blocks of {BLOCK}", "use a width that 32 divides")
    x = w.float().reshape(-1, BLOCK)  # (n_blocks, 32), fp32 as ggml computes
    if qtype == "Q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = _round_half_away(x * inv).to(torch.int8).view(torch.uint8)  # (n_blocks, 32)
    else:  # Q4_0: the weight of largest magnitude, with its sign, maps to -8
        peak = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
        d = peak / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        nibbles = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)  # (n_blocks, 32)
        q = nibbles[:, :16] | (nibbles[:, 16:] << 4)  # (n_blocks, 16)
    scale = d.to(torch.float16).view(torch.uint8)  # (n_blocks, 2): fp16 d, little-endian
    return torch.cat([scale, q], dim=1).reshape(*lead, -1)
