"""Grouped expert FFN over a slot pool: every GPU-side expert of a layer in one computation.

Rows of `xs` are (token, choice) pairs sorted by slot; `offs[s]` is the end row of slot s's group
(int32, cumulative), so empty groups cost nothing and the whole pool is the weight operand: no
weight gather, no per-expert Python call. Rows at or past `offs[-1]` (pairs the CPU computes) are
left undefined; the caller masks them.

`torch._grouped_mm` does it in one kernel per matmul (CUDA bf16 on sm80+, and on the CPU in newer
torch). Where it is unavailable for the device and dtype, a loop over the non-empty groups runs
instead (one host sync for the offsets) and `grouped_impl()` says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs, and agrees with mm, on this device and dtype with the pool's
    slot-major strides (decided once per process)."""
    key = (device.type, dtype)
    if key not in _SUPPORT:
        ok = False
        if hasattr(torch, "_grouped_mm"):
            try:
                g, h, i = 3, 32, 16
                pool = torch.randn(g, 3 * h * i, device=device).to(dtype)  # (G, P) like a slot pool
                w = pool[:, :2 * i * h].unflatten(1, (2 * i, h))  # (G, 2I, H)
                x = torch.randn(8, h, device=device).to(dtype)
                offs = torch.tensor([3, 3, 8], dtype=torch.int32, device=device)
                out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # (8, 2I)
                ref = torch.cat([x[:3] @ w[0].T, x[3:8] @ w[2].T])
                ok = bool(torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=5e-2))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _SUPPORT[key] = ok
    return _SUPPORT[key]


def grouped_impl(device: torch.device, dtype: torch.dtype) -> str:
    return "grouped_mm" if _probe(torch.device(device), dtype) else "group-loop"


def _grouped_linear(xs: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """xs: (S, K) sorted by group; weight: (G, N, K) (F.linear layout); offs: (G,) → (S, N)."""
    if _probe(xs.device, xs.dtype):
        return torch._grouped_mm(xs, weight.transpose(1, 2), offs=offs)
    out = xs.new_zeros((xs.shape[0], weight.shape[1]))  # (S, N): rows past offs[-1] stay zero
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(xs[start:end], weight[g].T, out=out[start:end])
        start = end
    return out


def grouped_expert_ffn(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       offs: torch.Tensor) -> torch.Tensor:
    """SwiGLU per group: xs (S, H); gate_up (G, 2I, H) gate rows first; down (G, H, I);
    offs (G,) int32 cumulative group ends → (S, H)."""
    h = _grouped_linear(xs, gate_up, offs)  # (S, 2I)
    gate, up = h.chunk(2, dim=-1)  # (S, I) each
    return _grouped_linear(F.silu(gate) * up, down, offs)  # (S, H)
