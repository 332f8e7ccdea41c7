"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next / Qwen3.5 (3 layers in 4).

Per value head the layer keeps a matrix state S (dk × dv) instead of a KV cache. For each token,
with q, k L2-normalised (q also scaled by dk^-½), a decay g ≤ 0 and a write strength β ∈ (0, 1):

    S ← e^g · S                   forget
    u = β · (v − Sᵀk)             the part of v that the state does not predict yet (the delta rule)
    S ← S + k uᵀ                  write it
    o = Sᵀq

q, k, v come out of one projection through a short causal depthwise convolution (kernel 4, SiLU),
whose last kernel−1 inputs are the second piece of state. The output is RMS-normalised per head,
gated by SiLU(z) of a second projection, and projected back. Key/query heads are shared by
n_v / n_k consecutive value heads.

Prefill uses the chunked (WY) form of the same recurrence: within a chunk of C tokens the writes
solve a unit lower-triangular system, so a chunk costs a few (C × C) and (C × d) matmuls and the
state is carried between chunks; decode (one token) runs the recurrence directly. On CUDA the
kernels of the maintained `fla` (flash-linear-attention) library are used when it is importable;
it is not a dependency of Tandem (the development machine and the GPU machine lack it), so the
torch code here is the path that runs and that the parity tests check. An fla whose kernels fail
(fla 0.5.2 does not build against triton 3.9) is dropped with a warning at its first call.

The state lives with the KV backend (engine/kv/recurrent.py), which keeps it per sequence: the
layer asks `kv.recurrent_state(index)` for its (conv, S) of the step's sequences and hands back
the new ones with `kv.set_recurrent_state(index, conv, S)`. States are fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("tandem")

CHUNK = 64  # tokens per chunk of the prefill form: (64 × 64) triangular solves, as fla's kernels use
L2_EPS = 1e-6  # q, k normalisation: x / sqrt(Σx² + eps), the reference's and fla's


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes (config: linear_num_key_heads, linear_num_value_heads, …)."""

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:  # channels through the convolution: q, k, v
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    def params(self, dim: int) -> int:
        """Weights of one layer (projections, convolution, decay and step parameters, the norm)."""
        value = self.n_v_heads * self.v_head_dim
        return (dim * self.conv_dim + dim * value + 2 * dim * self.n_v_heads + self.conv_dim * self.conv_kernel
                + 2 * self.n_v_heads + self.v_head_dim + value * dim)

    def state_bytes(self) -> int:
        """One sequence's fp32 state of one layer: S and the convolution's last inputs."""
        return 4 * (self.n_v_heads * self.k_head_dim * self.v_head_dim + self.conv_dim * (self.conv_kernel - 1))


def _fla():
    """fla's gated delta rule kernels, or None where they are not installed (they need triton)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # absent, or a triton that does not match: the torch path runs
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


_FLA = None  # resolved at the first CUDA call: (chunk, recurrent) or False


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _repeat_heads(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """(B, T, nk, d) → (B, T, nk·repeat, d), each head `repeat` times in a row (what repeat_interleave
    gives, by a broadcast: no size computed on the device, so a CUDA graph can capture it)."""
    B, T, n, d = x.shape
    return x.unsqueeze(3).expand(B, T, n, repeat, d).reshape(B, T, n * repeat, d)


def delta_rule_step(q, k, v, g, beta, state):
    """One token. q, k: (B, nv, dk) normalised and q scaled; v: (B, nv, dv); g, beta: (B, nv);
    state: (B, nv, dk, dv) fp32 → o (B, nv, dv), new state."""
    B, nv, dk, dv = state.shape
    state = state * g.exp()[..., None, None]  # (B, nv, dk, dv): a new tensor, updated in place below
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # (B, nv, dv): Sᵀk
    u = (v - predicted) * beta.unsqueeze(-1)
    # S += k uᵀ as one batched rank-1 product into S (no (dk × dv) temporary per head)
    state.view(B * nv, dk, dv).baddbmm_(k.reshape(B * nv, dk, 1), u.reshape(B * nv, 1, dv))
    return (q.unsqueeze(-2) @ state).squeeze(-2), state  # (B, nv, dv): Sᵀq


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """T tokens, C at a time. q, k: (B, nv, T, dk); v: (B, nv, T, dv); g, beta: (B, nv, T);
    state: (B, nv, dk, dv) fp32 → o (B, nv, T, dv), final state.

    Within a chunk, with γ the cumulative log decay from the chunk's start (γ_t = Σ_{s≤t} g_s) and
    S₀ the state before it, the writes u solve (I + A) U = β·V − β·e^γ·K S₀ where
    A[t, s] = β_t e^{γ_t−γ_s} k_t·k_s for s < t; then o_t = e^{γ_t} S₀ᵀq_t + Σ_{s≤t} e^{γ_t−γ_s} (q_t·k_s) u_s
    and the state after the chunk is e^{γ_C} S₀ + Σ_s e^{γ_C−γ_s} k_s u_sᵀ.
    """
    T = q.shape[2]
    out = []
    for start in range(0, T, chunk):
        sl = slice(start, min(start + chunk, T))
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]  # (B, nv, C, d) / (B, nv, C)
        gamma = g[:, :, sl].cumsum(-1)  # (B, nv, C)
        C = qc.shape[2]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # s ≤ t
        # e^{γ_t − γ_s} on and below the diagonal; above it masked before exp (those would overflow)
        decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # (B, nv, C, C)
        strict = (kc @ kc.transpose(-1, -2)) * decay * bc.unsqueeze(-1)  # (B, nv, C, C) A, diagonal included
        system = strict.masked_fill(causal.logical_not() | torch.eye(C, dtype=torch.bool, device=q.device), 0.0)
        system = system + torch.eye(C, dtype=q.dtype, device=q.device)  # I + A
        rhs = vc * bc.unsqueeze(-1) - (kc * (bc * gamma.exp()).unsqueeze(-1)) @ state  # (B, nv, C, dv)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # (B, nv, C, dv)
        inter = (qc * gamma.exp().unsqueeze(-1)) @ state  # (B, nv, C, dv): what S₀ holds
        intra = ((qc @ kc.transpose(-1, -2)) * decay) @ u  # (B, nv, C, dv): this chunk's writes
        out.append(inter + intra)
        last = gamma[:, :, -1:]  # (B, nv, 1)
        state = state * last.exp().unsqueeze(-1) + (kc * (last - gamma).exp().unsqueeze(-1)).transpose(-1, -2) @ u
    return torch.cat(out, dim=2), state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's dv, then × SiLU(z) (in fp32, as the reference)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(x.dtype)) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear-attention layer; `state_index` numbers these layers (0, 1, …) for
    the KV backend's recurrent states. Parameter names are the checkpoints' (`linear_attn.*`)."""

    def __init__(self, dim: int, shape: DeltaNetShape, eps: float, state_index: int):
        super().__init__()
        self.shape, self.state_index = shape, state_index
        value = shape.n_v_heads * shape.v_head_dim
        self.in_proj_qkv = nn.Linear(dim, shape.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, value, bias=False)
        self.in_proj_b = nn.Linear(dim, shape.n_v_heads, bias=False)  # β = σ(b)
        self.in_proj_a = nn.Linear(dim, shape.n_v_heads, bias=False)  # g = −e^{A_log} · softplus(a + dt_bias)
        self.conv1d = nn.Conv1d(shape.conv_dim, shape.conv_dim, shape.conv_kernel, groups=shape.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(shape.n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(shape.n_v_heads))
        self.norm = GatedRMSNorm(shape.v_head_dim, eps)
        self.out_proj = nn.Linear(value, dim, bias=False)

    def forward(self, x: torch.Tensor, kv) -> torch.Tensor:
        B, T, _ = x.shape
        s = self.shape
        conv_state, state = kv.recurrent_state(self.state_index)  # (B, C, K−1), (B, nv, dk, dv); None: fresh
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # (B, C, T)
        if conv_state is None:
            conv_state = mixed.new_zeros(B, s.conv_dim, s.conv_kernel - 1)
        window = torch.cat((conv_state.to(mixed.dtype), mixed), dim=-1)  # (B, C, K−1+T): the past inputs first
        new_conv = window[:, :, -(s.conv_kernel - 1):].float()
        mixed = F.silu(F.conv1d(window, self.conv1d.weight, groups=s.conv_dim))  # (B, C, T)
        q, k, v = mixed.transpose(1, 2).split([s.n_k_heads * s.k_head_dim] * 2 + [s.n_v_heads * s.v_head_dim], -1)
        q = q.reshape(B, T, s.n_k_heads, s.k_head_dim)
        k = k.reshape(B, T, s.n_k_heads, s.k_head_dim)
        v = v.reshape(B, T, s.n_v_heads, s.v_head_dim)
        beta = self.in_proj_b(x).sigmoid()  # (B, T, nv)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # (B, T, nv) fp32
        if state is None:
            state = torch.zeros(B, s.n_v_heads, s.k_head_dim, s.v_head_dim, device=x.device, dtype=torch.float32)
        o, state = self._delta_rule(q, k, v, g, beta, state)  # (B, T, nv, dv)
        z = self.in_proj_z(x).reshape(B, T, s.n_v_heads, s.v_head_dim)
        kv.set_recurrent_state(self.state_index, new_conv, state)
        return self.out_proj(self.norm(o, z).reshape(B, T, -1))

    def _delta_rule(self, q, k, v, g, beta, state):
        """q, k: (B, T, nk, dk); v: (B, T, nv, dv); g, beta: (B, T, nv) → o (B, T, nv, dv) in v's
        dtype, the new state (B, nv, dk, dv) fp32."""
        global _FLA
        dtype, T = v.dtype, q.shape[1]
        repeat = self.shape.n_v_heads // self.shape.n_k_heads
        q, k = _repeat_heads(q, repeat), _repeat_heads(k, repeat)  # (B, T, nv, dk)
        if q.is_cuda:
            if _FLA is None:
                _FLA = _fla() or False
            if _FLA:
                chunked, recurrent = _FLA
                run = recurrent if T == 1 else chunked
                q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # (v is a view of the conv's output)
                try:
                    o, new_state = run(q, k, v, g=g, beta=beta, initial_state=state.contiguous(),
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
                    return o.to(dtype), new_state.float()  # (B, T, nv, dv), (B, nv, dk, dv) fp32
                except Exception as e:  # an fla whose kernels do not build with this triton: the torch path, said once
                    log.warning("fla's gated delta rule failed (%s: %s); the torch implementation runs instead",
                                type(e).__name__, e)
                    _FLA = False
        q, k, v, beta = (t.transpose(1, 2).float() for t in (q, k, v, beta))  # (B, nv, T, d) / (B, nv, T)
        g = g.transpose(1, 2)
        q = _l2norm(q) * q.shape[-1] ** -0.5
        k = _l2norm(k)
        if T == 1:
            o, state = delta_rule_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], state)
            o = o.unsqueeze(2)
        else:
            o, state = delta_rule_chunked(q, k, v, g, beta, state)
        return o.transpose(1, 2).to(dtype), state
