"""Grouped expert FFN over a slot pool: every GPU-side expert of a layer in one computation.

Rows of `xs` are (token, choice) pairs sorted by slot; `offs[s]` is the end row of slot s's group
(int32, cumulative), so empty groups take no rows and the whole pool is the weight operand: no
weight gather, no per-expert Python call. Rows at or past `offs[-1]` (pairs the CPU computes) are
left undefined; the caller masks them.

On CUDA, `torch._grouped_mm` does each matmul in one kernel (bf16, sm80+). Elsewhere — the CPU
standing in for the GPU in simulated runs, or a device/dtype the kernel lacks — a loop over the
non-empty groups runs instead; the caller passes those groups from the host so the loop needs no
sync (torch's CPU `_grouped_mm` would visit every slot of the pool, empty or not). `grouped_impl()`
says which one runs.
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


def uses_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and _probe(device, dtype)


def grouped_impl(device: torch.device, dtype: torch.dtype) -> str:
    return "grouped_mm" if uses_grouped_mm(device, dtype) else "group-loop"


def _loop_linear(xs: torch.Tensor, weight: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
    """xs: (S, K); weight: (G, N, K); groups: (g, start, end) of the non-empty groups → (S, N)."""
    out = xs.new_zeros((xs.shape[0], weight.shape[1]))  # rows outside every group stay zero
    for g, start, end in groups:
        torch.mm(xs[start:end], weight[g].T, out=out[start:end])
    return out


def groups_of(offs: torch.Tensor) -> list[tuple[int, int, int]]:
    """Non-empty (group, start, end) from cumulative ends (one host sync)."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out.append((g, start, end))
        start = end
    return out


MAX_GROUPS = 512  # torch._grouped_mm refused a 1024-group call on torch 2.11 (its limit is below that)


def _activate(h: torch.Tensor, form, rows: torch.Tensor | None) -> torch.Tensor:
    """The gate/up projection's output h (S, 2I) → the down projection's input (S, I): SwiGLU, or
    `form`'s activation after its per-expert bias (rows (S,): the expert of each row)."""
    if form is None:
        gate, up = h.chunk(2, dim=-1)  # (S, I) each
        return F.silu(gate) * up
    gate, up = (h + form.gate_up_bias[rows]).chunk(2, dim=-1)
    return form.activation(gate, up)


def _down_bias(y: torch.Tensor, form, rows: torch.Tensor | None) -> torch.Tensor:
    return y if form is None else y + form.down_bias[rows]  # (S, H)


def _grouped_ffn(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor,
                 form=None, rows: torch.Tensor | None = None) -> torch.Tensor:
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # (S, 2I)
    y = torch._grouped_mm(_activate(h, form, rows), down.transpose(1, 2), offs=offs)  # (S, H)
    return _down_bias(y, form, rows)


def grouped_expert_ffn(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor,
                       groups: list[tuple[int, int, int]] | None = None, form=None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """The expert FFN per group: xs (S, H); gate_up (G, 2I, H) gate rows first; down (G, H, I);
    offs (G,) int32 cumulative group ends; groups: the same as host triples, if known → (S, H).
    form (experts_torch.ClampedSwiGLU: biases and a clamped activation) needs rows (S,), the expert
    id of each row, to pick its biases; None: plain SwiGLU."""
    if uses_grouped_mm(xs.device, xs.dtype):
        G = gate_up.shape[0]
        if G <= MAX_GROUPS:
            return _grouped_ffn(xs, gate_up, down, offs, form, rows)
        # torch's grouped GEMM takes at most MAX_GROUPS groups: run the slot pool in windows of them
        groups = groups_of(offs) if groups is None else groups
        out = xs.new_zeros((xs.shape[0], down.shape[1]))
        for g0 in range(0, G, MAX_GROUPS):
            g1 = min(g0 + MAX_GROUPS, G)
            inside = [(s, e) for g, s, e in groups if g0 <= g < g1]
            if not inside:
                continue
            r0, r1 = inside[0][0], inside[-1][1]  # rows are sorted by group: one contiguous range
            out[r0:r1] = _grouped_ffn(xs[r0:r1], gate_up[g0:g1], down[g0:g1], offs[g0:g1] - r0, form,
                                      None if rows is None else rows[r0:r1])
        return out
    groups = groups_of(offs) if groups is None else groups
    h = _loop_linear(xs, gate_up, groups)  # (S, 2I)
    return _down_bias(_loop_linear(_activate(h, form, rows), down, groups), form, rows)


def moe_experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, form=None) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) as two grouped GEMMs over all experts of the layer:
    no per-expert launch and no host sync (so a CUDA graph can capture it) (the reference `experts_torch.moe_experts` has both).

    x: (N, H); ids, weights: (N, k); gate_up: (E, 2I, H); down: (E, H, I) on one CUDA device.
    """
    N, k = ids.shape
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)  # (N·k,) pairs sorted by expert
    tokens = order // k
    experts = torch.arange(gate_up.shape[0], device=ids.device, dtype=sorted_ids.dtype)  # (E,)
    # group ends by binary search, not bincount: bincount reads its input's max back to the host,
    # which a CUDA graph cannot capture
    offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # (E,) int32
    y = grouped_expert_ffn(x[tokens], gate_up, down, offs, form=form, rows=sorted_ids)  # (N·k, H); no host sync
    y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)
