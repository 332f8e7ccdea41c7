"""Exact attention on the CPU over KV views read in place, returning output and natural-log LSE.

The one call site is `attend_blocks(q, blocks, scale)`:

    q       (B, nh, T, hs)  queries of B sequences (T = 1 in decode), the KV's dtype
    blocks  B lists of (k, v) views, each (n_kv, t, hs): any strides, contiguous last dim
    scale   softmax scale
    →       out (B, nh, T, hs) fp32, lse (B, nh, T) fp32; a sequence without views gets
            out 0 and lse −inf, so an LSE merge gives it weight 0.

GQA: query head h reads KV head h // (nh / n_kv), as transformers' `repeat_kv` does.

Two torch implementations sit behind it, both exact: "sdpa" (PyTorch's fused CPU flash kernel
per view, views merged by LSE) and "matmul" (fp32 scores of all views at once, one logsumexp).
Which is faster depends on the CPU (bf16 units or not) and the shape, so the first call for a
(dtype, shape) times both on a small synthetic problem and keeps the winner. A native kernel with
the same signature registers itself through `register()` and is preferred when present.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from engine.kernels.lse import merge_pair

KVView = tuple[torch.Tensor, torch.Tensor]  # (k, v), each (n_kv, t, hs)
Kernel = Callable[[torch.Tensor, list[list[KVView]], float], tuple[torch.Tensor, torch.Tensor]]

MATMUL_SCORE_LIMIT = 1 << 24  # fp32 score elements (64 MiB) above which "matmul" hands over to "sdpa"

_lock = threading.Lock()
_forced: str | None = None  # set_implementation(): one implementation for every shape
_chosen: dict[tuple, str] = {}  # (dtype, nh, n_kv, hs) → "sdpa" | "matmul", from the first-call probe
_registered: dict[str, Kernel] = {}  # e.g. "native" → the C++ kernel


def _sdpa_view(q1: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q1 (1, nh, T, hs); k, v (n_kv, t, hs) → o (1, nh, T, hs) fp32, lse (1, nh, T) fp32."""
    if q1.dtype != k.dtype:
        q1 = q1.to(k.dtype)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q1, k.unsqueeze(0), v.unsqueeze(0), 0.0, False, scale=scale)
    return o.float(), lse.contiguous()  # the LSE comes back as a transposed view


def _sdpa_seq(q1: torch.Tensor, views: list[KVView], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _sdpa_view(q1, *views[0], scale)
    for k, v in views[1:]:
        o2, l2 = _sdpa_view(q1, k, v, scale)
        out, lse = merge_pair(out, lse, o2, l2)
    return out, lse


def _matmul_seq(q1: torch.Tensor, views: list[KVView], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every view at once in fp32; exact softmax over their concatenation."""
    _, nh, T, hs = q1.shape
    n_kv = views[0][0].shape[0]
    total = sum(k.shape[1] for k, _ in views)
    if nh * T * total > MATMUL_SCORE_LIMIT:  # long prefill: do not materialise the scores
        return _sdpa_seq(q1, views, scale)
    qg = q1.reshape(n_kv, (nh // n_kv) * T, hs).float() * scale  # (n_kv, g·T, hs): head h = kv·g + j
    scores = torch.cat([torch.matmul(qg, k.float().transpose(1, 2)) for k, _ in views], dim=-1)  # (n_kv, gT, S)
    lse = torch.logsumexp(scores, dim=-1)  # (n_kv, gT)
    p = torch.exp(scores - lse.unsqueeze(-1))
    out, start = None, 0
    for k, v in views:
        t = k.shape[1]
        part = torch.matmul(p[..., start:start + t], v.float())  # (n_kv, gT, hs)
        out = part if out is None else out.add_(part)
        start += t
    return out.view(1, nh, T, hs), lse.view(1, nh, T)


_SEQ_KERNELS = {"sdpa": _sdpa_seq, "matmul": _matmul_seq}


def _torch_kernel(name: str) -> Kernel:
    seq_kernel = _SEQ_KERNELS[name]

    def attend(q: torch.Tensor, blocks: list[list[KVView]], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        B, nh, T, hs = q.shape
        out = torch.zeros((B, nh, T, hs), dtype=torch.float32)
        lse = torch.full((B, nh, T), float("-inf"), dtype=torch.float32)
        for b, views in enumerate(blocks):
            views = [(k, v) for k, v in views if k.shape[1] > 0]
            if views:
                o_b, lse_b = seq_kernel(q[b:b + 1], views, scale)  # (1, nh, T, hs), (1, nh, T)
                out[b], lse[b] = o_b[0], lse_b[0]
        return out, lse

    return attend


def _probe(dtype: torch.dtype, nh: int, n_kv: int, hs: int) -> str:
    """Time both torch kernels on one 2048-token decode problem of this shape; the faster wins."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((1, nh, 1, hs), generator=gen).to(dtype)
    k = torch.randn((n_kv, 2048, hs), generator=gen).to(dtype)
    v = torch.randn((n_kv, 2048, hs), generator=gen).to(dtype)
    best, best_t = "sdpa", float("inf")
    for name, fn in _SEQ_KERNELS.items():
        fn(q, [(k, v)], hs ** -0.5)  # warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            fn(q, [(k, v)], hs ** -0.5)
        t = time.perf_counter() - t0
        if t < best_t:
            best, best_t = name, t
    return best


def implementation(dtype: torch.dtype, nh: int, n_kv: int, hs: int) -> str:
    """Name of the kernel that serves this shape ("native", "sdpa" or "matmul")."""
    if _forced is not None:
        return _forced
    if "native" in _registered:
        return "native"
    key = (dtype, nh, n_kv, hs)
    with _lock:
        if key not in _chosen:
            _chosen[key] = _probe(dtype, nh, n_kv, hs)
        return _chosen[key]


def kernel_name(dtype: torch.dtype, nh: int, n_kv: int, hs: int) -> str:
    """For StatsSnapshot's `kernels.cpu_attention`: "native", "torch-sdpa" or "torch-matmul"."""
    name = implementation(dtype, nh, n_kv, hs)
    if name == "native":
        from engine.kernels import attention_native
        return attention_native.implementation()  # "native-<isa>"
    return f"torch-{name}"


def set_implementation(name: str | None) -> None:
    """Force "sdpa", "matmul" (or a registered kernel such as "native") for every shape (benchmarks,
    tests); None returns to the default: the native kernel when present, else the probe's choice."""
    global _forced
    if name is not None and name not in _SEQ_KERNELS and name not in _registered:
        raise ValueError(f"unknown CPU attention implementation {name!r}")
    _forced = name


def register(name: str, kernel: Kernel) -> None:
    """Plug in another implementation of `attend_blocks` (the native C++ kernel registers as "native")."""
    _registered[name] = kernel


def prepare(blocks: list[list[KVView]]):
    """The blocks in the form the kernel serving them reads: the native kernel's block table (one
    int64 row per view, built in Python) or the lists as they are. A caller that attends over the
    same views again and again (each layer's CPU share between two flushes) prepares them once and
    passes the result to attend_blocks; the views' memory must stay as it is meanwhile."""
    first = next((views[0][0] for views in blocks if views), None)
    serving = _forced or ("native" if "native" in _registered else None)
    if first is None or serving != "native":
        return blocks
    from engine.kernels import attention_native

    if not attention_native.native_head_dim(first.shape[-1]):
        return blocks
    return attention_native.KVBlockTable.from_blocks([[k for k, _ in views] for views in blocks],
                                                     [[v for _, v in views] for views in blocks])


def attend_blocks(q: torch.Tensor, blocks, scale: float, *, out: torch.Tensor | None = None,
                  lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. q (B, nh, T, hs) → out (B, nh, T, hs) fp32, lse (B, nh, T) fp32.
    `blocks` may also be what prepare() made of them. `out` and `lse`, when given (contiguous fp32
    of those shapes, e.g. views of a page-locked buffer the result leaves from), receive the result;
    the native kernel writes them directly."""
    B, nh, T, hs = q.shape
    if not isinstance(blocks, list):  # a prepared block table: the native kernel reads it as it is
        from engine.kernels import attention_native

        return attention_native.attend_blocks(q, blocks, None, scale, out=out, lse=lse)
    first = next((views[0][0] for views in blocks if views), None)
    if first is None:
        o = torch.zeros((B, nh, T, hs), dtype=torch.float32) if out is None else out.zero_()
        return o, (torch.full((B, nh, T), float("-inf")) if lse is None else lse.fill_(float("-inf")))
    name = implementation(first.dtype, nh, first.shape[0], hs)
    if name == "native" and name in _registered:
        return _registered[name](q, blocks, scale, out=out, lse=lse)
    kernel = _registered[name] if name in _registered else _torch_kernel(name)
    o, l = kernel(q, blocks, scale)
    if out is None:
        return o, l
    out.copy_(o)
    lse.copy_(l)
    return out, lse


def attend_view(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of dense attention on the CPU in fp32 accuracy (the simulate-mode "GPU" kernel too).

    q (b, nh, T, hs); k, v (b, n_kv, S, hs) → o (b, nh, T, hs) fp32, lse (b, nh, T) fp32.
    With causal, the keys are the queries' own tokens (T == S) and query i sees keys 0..i.
    """
    if q.dtype != k.dtype:
        q = q.to(k.dtype)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("causal attention here expects the queries' own keys only (T == S)")
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return o.float(), lse.contiguous()


def _register_native() -> None:
    """The C++ kernel (engine/kernels/attention_native.py) serves every call when the extension loaded."""
    from engine.kernels import attention_native

    if not attention_native.implementation().startswith("native"):
        return

    def native_kernel(q: torch.Tensor, blocks: list[list[KVView]], scale: float, out=None, lse=None):
        return attention_native.attend_blocks(q, [[k for k, _ in views] for views in blocks],
                                              [[v for _, v in views] for views in blocks], scale, out=out, lse=lse)

    register("native", native_kernel)


_register_native()
