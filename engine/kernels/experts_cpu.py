"""Routed-expert SwiGLU FFN on the CPU, reading the weights in place from host memory.

    expert_ffn(x (n, H), gate_up (2I, H), down (H, I)) -> y (n, H) in x's dtype

The fused layout of transformers 5.x (gate rows first; see experts_torch.py, the reference). The
native kernel reads each weight once per call, splits the rows over the threads, and does bf16
dot products with AVX512_BF16 where the CPU has it; with bf16 weights the activations are rounded to
bf16 (as torch's bf16 path does), with fp32 weights everything stays fp32.

Which kernel runs is a measured choice per token count: the native one streams weights faster at
decode sizes, while torch's oneDNN (AMX on CPUs that have it) wins once enough tokens make the
product compute-bound. `set_native_max_tokens` moves the crossover (calibration measures it with
`tandem bench cpu-kernels`); above it, and without the extension, torch runs.
"""

from __future__ import annotations

import torch

from engine.errors import KernelInputError
from engine.kernels import native
from engine.kernels.experts_torch import expert_ffn as expert_ffn_torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest token count sent to the native kernel; above it torch runs. The default is the crossover
# measured on the development machine (AMD Zen 4, AVX512_BF16, no AMX, one thread): native ahead up to
# 16 tokens, torch from 64. `tandem bench cpu-kernels` reports each machine's crossover
# (experts.crossover_tokens); calibration sets it with set_native_max_tokens.
_native_max_tokens = 16


def set_native_max_tokens(n: int) -> None:
    global _native_max_tokens
    _native_max_tokens = int(n)


def native_max_tokens() -> int:
    return _native_max_tokens


def implementation(n_tokens: int = 1) -> str:
    """Which kernel expert_ffn runs for n_tokens: 'native-<isa>' or 'torch'."""
    isa = native.isa()
    return f"native-{isa}" if isa and n_tokens <= _native_max_tokens else "torch"


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, out: torch.Tensor | None = None,
               threads: int | None = None) -> torch.Tensor:
    """x: (n, H); gate_up: (2·I, H); down: (H, I) → y (n, H) in x's dtype (written into `out` if given)."""
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in _DTYPES or t.dim() != 2:
            raise KernelInputError(f"{name} must be a 2-D fp32/bf16/fp16 CPU tensor, got "
                                   f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    n, H = x.shape
    two_i = gate_up.shape[0]
    if gate_up.shape[1] != H or two_i % 2 or down.shape != (H, two_i // 2):
        raise KernelInputError(f"expert shapes do not fit: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} "
                               f"(want (2I, {H})), down {tuple(down.shape)} (want ({H}, I))")
    if gate_up.dtype != down.dtype:
        raise KernelInputError(f"gate_up is {gate_up.dtype} but down is {down.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device.type != "cpu"
                            or out.stride(1) != 1):
        raise KernelInputError(f"out must be a CPU {x.dtype} tensor of shape {tuple(x.shape)} with unit stride per row")
    inter = two_i // 2
    nat = native.module()
    if (nat is None or n > _native_max_tokens or H % 16 or inter % 16
            or gate_up.stride(1) != 1 or down.stride(1) != 1):
        y = expert_ffn_torch(x.to(gate_up.dtype), gate_up, down).to(x.dtype)
        return out.copy_(y) if out is not None else y
    if x.stride(1) != 1:
        x = x.contiguous()  # (n, H): activations are small; weights are never copied
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    code = native.DTYPE_CODES
    nat.expert_ffn(x.data_ptr(), code[x.dtype], n, H, inter, x.stride(0), gate_up.data_ptr(), down.data_ptr(),
                   code[gate_up.dtype], gate_up.stride(0), down.stride(0), y.data_ptr(), code[y.dtype], y.stride(0),
                   threads or native.threads())
    return y


def __getattr__(name: str):
    # IMPLEMENTATION: the kernel at decode sizes, as a plain name for stats (read when asked, so it
    # stays true if the extension is hidden or the crossover moves).
    if name == "IMPLEMENTATION":
        return implementation(1)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
