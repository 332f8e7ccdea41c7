"""A layer's CPU set: its operands, the kernel that computes it, and the thread that runs it.

The driving thread prepares the set: at decode sizes as the layer's routing, which the extension
groups in C++ on its way to the native worker (`routed_cpu_set`); a quantised store's set expert by
expert over its blocks (`quant_cpu_set`); else with the native extension
straight from the store's block addresses (`native_cpu_set`: a table built by a few numpy calls, no
tensor view per expert); else from per-expert views (`cpu_set_inputs`, then `prepare` from
`default_cpu_moe` or `per_expert_moe`).
`CpuSetRunner` runs it beside the driving thread: a set that is one native call goes to the native
worker thread (no Python there, so no GIL changes hands: a Python worker waits 0.09-0.17 ms per
layer step to start a set), anything else to a Python worker thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine.experts.store import ExpertStore
from engine.kernels.experts_torch import expert_ffn
from engine.quant import moe as quant_moe
from engine.quant.experts import clamped_swiglu_blocks, swiglu_blocks


def default_cpu_kernel():
    """The native CPU expert kernel where it is built, else torch: (expert_ffn, name)."""
    try:
        from engine.kernels import experts_cpu
    except ImportError:
        return expert_ffn, "torch"
    return experts_cpu.expert_ffn, str(getattr(experts_cpu, "IMPLEMENTATION", "experts_cpu"))


def per_expert_moe(ffn):
    """A layer's CPU set from a per-expert kernel ffn(x (n, H), gate_up, down) → (n, H) (an injected
    kernel, or torch without the experts_cpu module): same contract as experts_cpu.prepare_moe."""
    def prepare(x, experts, tokens, weights, out=None):
        def compute():
            result = torch.zeros(x.shape, dtype=torch.float32) if out is None else out.zero_()  # (N, H)
            for (gate_up, down), tok, w in zip(experts, tokens, weights):
                idx = torch.from_numpy(tok)
                result.index_add_(0, idx, ffn(x[idx], gate_up, down).float() * torch.from_numpy(w).unsqueeze(1))
            return result
        return compute
    return prepare


def form_cpu_set(form, x: torch.Tensor, expert_ids: list[int], experts, tokens, weights, out=None):
    """The CPU set of a layer whose experts have another form (experts_torch.ClampedSwiGLU, its
    biases on the host); inputs as `cpu_set_inputs` gives them → compute(). With experts_cpu: its
    prepare_moe with the form (a PreparedMoe: one native call where the extension takes the set, which
    CpuSetRunner hands to the native worker); else torch, one expert at a time."""
    try:
        from engine.kernels import experts_cpu
    except ImportError:
        experts_cpu = None
    if experts_cpu is not None:
        return experts_cpu.prepare_moe(x, experts, tokens, weights, out=out, form=form, expert_ids=expert_ids)

    def compute():
        result = torch.zeros(x.shape, dtype=torch.float32) if out is None else out.zero_()  # (N, H)
        for e, (gate_up, down), tok, w in zip(expert_ids, experts, tokens, weights):
            idx = torch.from_numpy(tok)
            result.index_add_(0, idx, form.ffn(x[idx], e, gate_up, down).float() * torch.from_numpy(w).unsqueeze(1))
        return result
    return compute


def prepare_cpu_set(store: ExpertStore, layer: int, experts: list[int], ids_h: np.ndarray, w_h: torch.Tensor,
                    x_h: torch.Tensor, out: torch.Tensor | None, form=None, prepare=None):
    """The layer's CPU set, ready for CpuSetRunner.submit: over a quantised store's blocks; through
    the form's kernel (gpt-oss); as one native call from the layer's routing or the store's addresses;
    else per expert with `prepare` (an injected kernel) or the default one. out: a result buffer
    (N, H) fp32 or None; form: the layer's ClampedSwiGLU with host biases, or None."""
    if store.quantised:
        return quant_cpu_set(store, layer, experts, ids_h, w_h, x_h, out, form)
    if form is not None:
        return form_cpu_set(form, x_h, experts, *cpu_set_inputs(store, layer, experts, ids_h, w_h), out=out)
    prepared = None
    if prepare is None:  # the default kernel: one native call
        out = out if out is not None else torch.empty(x_h.shape, dtype=torch.float32)
        prepared = routed_cpu_set(store, layer, experts, ids_h, w_h, x_h, out) or \
            native_cpu_set(store, layer, experts, ids_h, w_h, x_h, out)
        prepare = prepare or default_cpu_moe()[0]
    return prepared or prepare(x_h, *cpu_set_inputs(store, layer, experts, ids_h, w_h), out=out)


def cpu_set_kernel(store: ExpertStore, ffn=None) -> str:
    """The name the stats give the CPU set's kernel."""
    if ffn is not None:
        return getattr(ffn, "__module__", "custom")
    if store.quantised:
        from engine.quant.matmul import implementation

        return f"{implementation(1)} over quantised blocks"
    return default_cpu_moe()[1]


def default_cpu_moe():
    """A layer's whole CPU set in one call (one fork of the native thread team per layer):
    (prepare(x, experts, tokens, weights, out) → compute(), name)."""
    try:
        from engine.kernels import experts_cpu
    except ImportError:
        return per_expert_moe(expert_ffn), "torch"
    return experts_cpu.prepare_moe, str(getattr(experts_cpu, "IMPLEMENTATION", "experts_cpu"))


def cpu_set_inputs(store: ExpertStore, layer: int, experts: list[int], ids_h: np.ndarray, w_h: torch.Tensor):
    """The CPU set's operands, grouped here so the worker thread spends no Python on them:
    (store views per expert, token rows per expert, fp32 routing weights per expert)."""
    k = ids_h.shape[1]
    flat = ids_h.ravel()
    order = np.argsort(flat, kind="stable")  # (token, choice) pairs grouped by expert
    sorted_ids = flat[order]
    lo = np.searchsorted(sorted_ids, experts, side="left")
    hi = np.searchsorted(sorted_ids, experts, side="right")
    w_flat = w_h.reshape(-1).float().numpy()  # (N·k,)
    pairs = [order[a:b] for a, b in zip(lo.tolist(), hi.tolist())]
    return [store.expert(layer, e) for e in experts], [p // k for p in pairs], [w_flat[p] for p in pairs]


def quant_cpu_set(store: ExpertStore, layer: int, experts: list[int], ids_h: np.ndarray, w_h: torch.Tensor,
                  x_h: torch.Tensor, out: torch.Tensor | None, form=None):
    """The CPU set of a quantised store → compute(): expert by expert over the blocks in place
    (engine/quant's products, which leave the GIL to the driving thread while they run), in fp32.
    form: the layer's experts_torch.ClampedSwiGLU with host biases (gpt-oss), or None (SwiGLU).
    Decode sizes go as one native call (engine/quant/moe.py) instead."""
    chosen, counts, rows, pair_w = quant_moe.group_pairs(ids_h, w_h, experts, store.n_experts)
    table = np.concatenate([store.quant_addresses(layer)[chosen], counts[:, None]], axis=1)  # (J, 4)
    types = tuple(code for code, *_ in store.layouts[layer].parts)
    prepared = quant_moe.prepare(x_h, table, rows, pair_w, types, store.expert_ffn, out, form, chosen)
    if prepared is not None:
        return prepared
    views, tokens, weights = cpu_set_inputs(store, layer, experts, ids_h, w_h)

    def compute():
        result = torch.zeros(x_h.shape, dtype=torch.float32) if out is None else out.zero_()  # (N, H)
        for e, (gate_up, down), tok, w in zip(experts, views, tokens, weights):
            idx = torch.from_numpy(tok)
            x = x_h[idx].float()  # (n, H): fp32 through the products
            y = swiglu_blocks(x, gate_up, down) if form is None else clamped_swiglu_blocks(x, gate_up, down, form, e)
            result.index_add_(0, idx, y * torch.from_numpy(w).unsqueeze(1))
        return result
    return compute


def native_cpu_set(store: ExpertStore, layer: int, experts: list[int], ids_h: np.ndarray, w_h: torch.Tensor,
                   x_h: torch.Tensor, out: torch.Tensor):
    """The CPU set as one native call built from the store's block addresses → experts_cpu.PreparedMoe,
    or None where the native kernel does not take it (then use cpu_set_inputs and a prepare).
    ids_h (N, k): the layer's routing; w_h (N, k) its weights; x_h (N, H) on the host."""
    try:
        from engine.kernels import experts_cpu, native
    except ImportError:
        return None
    if native.module() is None:  # before the numpy work: without the extension every layer falls back
        return None
    chosen, counts, tokens, weights = quant_moe.group_pairs(ids_h, w_h, experts, store.n_experts)
    table = store.moe_table(layer, chosen)  # (J, 5) int64
    table[:, 4] = counts  # pairs per expert
    return experts_cpu.prepare_moe_table(x_h, table, tokens, weights, store.expert_ffn, store.dtype, out=out)


def routed_cpu_set(store: ExpertStore, layer: int, experts: list[int], ids_h: np.ndarray, w_h: torch.Tensor,
                   x_h: torch.Tensor, out: torch.Tensor):
    """The CPU set handed to the native worker as the layer's routing: the extension groups the pairs
    in C++, so the driving thread does no numpy work before the set starts → experts_cpu.RoutedMoe, or
    None where that path does not take it (then `native_cpu_set`). Same result, bit for bit."""
    try:
        from engine.kernels import experts_cpu
    except ImportError:
        return None
    return experts_cpu.prepare_routed(x_h, store.moe_rows(layer), np.asarray(experts, dtype=np.int64),
                                      np.ascontiguousarray(ids_h, dtype=np.int64), w_h, store.expert_ffn,
                                      store.dtype, out=out)


class CpuSetRunner:
    """Runs one layer's CPU set at a time beside the driving thread and hands back (out, seconds from
    submit to start, seconds computing)."""

    def __init__(self):
        self._native = None  # experts_cpu.MoeWorker: its thread starts with the first set of one native call
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-cpu-experts")
        self._pending: Future | None = None
        self._on_native = False

    @property
    def native(self) -> bool:
        """Whether the native worker thread has started (a set of one native call has run there)."""
        return self._native is not None

    def submit(self, prepared) -> None:
        """prepared: a PreparedMoe, or any callable computing the set → out (N, H) fp32. A set a failed
        layer left uncollected is waited for and dropped first."""
        if self._on_native or self._pending is not None:
            try:
                self.result()
            except Exception:  # that layer has reported its failure already
                pass
        one_call = getattr(prepared, "one_native_call", False)
        if one_call and self._native is None:
            from engine.kernels import experts_cpu  # a PreparedMoe comes from there: it imports

            self._native = experts_cpu.MoeWorker.create()
        if one_call and self._native is not None:
            self._native.submit(prepared)
            self._on_native = True
        else:
            self._pending = self._pool.submit(_run_in_worker, prepared, time.perf_counter())
            self._on_native = False

    def result(self) -> tuple[torch.Tensor, float, float]:
        if self._on_native:
            self._on_native = False
            return self._native.wait()
        future, self._pending = self._pending, None
        return future.result()

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
            self._native = None
        self._pool.shutdown(wait=True)


def _run_in_worker(compute, submitted: float) -> tuple[torch.Tensor, float, float]:
    """In the Python worker thread: the prepared set → (out, queue seconds, compute seconds)."""
    with torch.inference_mode():  # grad mode is per thread
        t0 = time.perf_counter()
        out = compute()  # (N, H) fp32
        return out, t0 - submitted, time.perf_counter() - t0
