"""CPU experts inside the one-graph decode step: host nodes run each layer's CPU set.

The one-graph form (zero_copy.py) reads every miss over PCIe, so a step with many misses is bound by
the link: at 32K context and bs=1, with 15% of the experts cached, 40% of the pairs miss and the
graph ran no faster than on-demand's pieces (RESULTS.md, phase AZ). The CPU reads host DRAM at ~60
GB/s beside the link's ~43, but in the pieces form each layer's hand-off to the host costs the
driving thread 0.3–0.8 ms: 15–40 ms a step for 48 layers.

Here the split is made on the device and the CPU set runs from the graph itself. Per MoE layer:

    main stream:  split (moe_decode_gpu.split_misses) ─┬─ moe_decode(hits + PCIe misses) ──┬─ out += cpu_out
    side stream:                                       └─ x, pairs → pinned; host node;     │
                                                          cpu_out ← pinned ─────────────────┘

The GPU's experts must be queued between the fork and the join: joined first, they would wait for
the CPU instead of running beside it.

The host node (cuLaunchHostFunc, captured like any stream operation) calls the native HostMoe on
the driver's callback thread: one moe_ffn over the pairs the split sent to the CPU, into a pinned
fp32 buffer. No Python runs there, so the replay needs neither the GIL nor the driving thread.

The share of the missed experts that go to the CPU is a device scalar the host sets between steps,
from the CPU's measured rate (the host nodes' own timings) against the link's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import numpy as np
import torch

from engine.kernels import moe_decode_gpu

log = logging.getLogger("tandem")

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the native module's codes
LINK_GBPS = 43.0  # the expert kernel reading missed experts in place over PCIe on the H200 (RESULTS.md, phase V)
RATE_MEMORY = 0.8  # weight of the old CPU rate in its running average, per step
# Cores the host nodes' thread team leaves free: the driving thread spins in its device wait and the
# CUDA driver has threads of its own. On the 16-core H200 host 15 threads read 10–22 GB/s from host
# nodes, 12 threads 50–61 GB/s (RESULTS.md, phase BG): one preempted thread stalls the team's barriers.
SPARE_CORES = 4


def _launch_host_func():
    """cuLaunchHostFunc from the CUDA driver library, or None where there is none."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda"), "nvcuda.dll"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cuLaunchHostFunc
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def host_node_threads() -> int:
    """The host nodes' team: the CPU kernels' thread count, short of SPARE_CORES free cores."""
    from engine.kernels import native

    return max(1, min(native.threads(), native.available_cores() - SPARE_CORES))


def unavailable_reason(store, device: torch.device) -> str | None:
    """Why the one-graph step cannot run CPU experts here, or None when it can."""
    from engine.kernels import native

    if device.type != "cuda":
        return "needs CUDA"
    if native.module() is None or not hasattr(native.module(), "HostMoe"):
        return "the native extension is not built"
    if store.dtype not in DTYPE_CODES:
        return f"no native kernel for {store.dtype}"
    if store.hidden % 16 or store.expert_ffn % 16:
        return "the native expert kernel takes hidden and expert sizes in multiples of 16"
    if _launch_host_func() is None:
        return "the CUDA driver has no cuLaunchHostFunc"
    return None


class GraphCpuSet:
    """Pinned buffers, the native HostMoe and the side stream that one-graph steps use for their CPU
    experts. x's dtype is the store's (the model's)."""

    def __init__(self, store, max_tokens: int, device: torch.device, cpu_gbps: float):
        self.store, self.device, self.max_tokens = store, device, max_tokens
        H = store.hidden
        P = moe_decode_gpu.SPLIT_MAX_PAIRS
        self.x_host = torch.empty((max_tokens, H), dtype=store.dtype, pin_memory=True)  # (B, H)
        self.pairs_host = torch.full((P,), -1, dtype=torch.int64, pin_memory=True)  # (B·k,) expert or -1
        self.weights_host = torch.zeros(P, dtype=torch.float32, pin_memory=True)  # (B·k,)
        self.out_host = torch.zeros((max_tokens, H), dtype=torch.float32, pin_memory=True)  # (B, H)
        self.out = torch.zeros((max_tokens, H), dtype=torch.float32, device=device)  # (B, H) the sum, on the GPU
        self.table = np.ascontiguousarray(store.moe_table(slice(None), slice(None)))  # (L, E, 5) int64
        self.native = None  # made at the first layer, which tells the top-k
        self._launch = _launch_host_func()
        self.side = torch.cuda.Stream(device)
        self.cpu_gbps = float(cpu_gbps)  # running average of the host nodes' weight rate
        self.share = torch.full((1,), self.share_for(self.cpu_gbps), dtype=torch.float32, device=device)
        self.calls = self.experts = self.pairs = 0
        self.compute_s = 0.0

    def _native_for(self, top_k: int):
        from engine.kernels import native

        if self.native is None:
            code = DTYPE_CODES[self.store.dtype]
            self.native = native.module().HostMoe(
                self.x_host.data_ptr(), code, self.pairs_host.data_ptr(), self.weights_host.data_ptr(),
                self.out_host.data_ptr(), self.max_tokens, top_k, self.store.hidden, self.store.expert_ffn, code,
                self.table.ctypes.data, self.store.n_layers, self.store.n_experts, host_node_threads())
            self.top_k = top_k
        elif top_k != self.top_k:
            raise ValueError(f"the CPU experts were set up for top-{self.top_k} routing (got top-{top_k})")
        return self.native

    @staticmethod
    def share_for(cpu_gbps: float, link_gbps: float = LINK_GBPS) -> float:
        """The CPU's share of a layer's missed experts so that both sides finish together."""
        return cpu_gbps / (cpu_gbps + link_gbps)

    # -- inside the graph -------------------------------------------------------------------------
    def fork(self, layer: int, x: torch.Tensor, cpu_ids: torch.Tensor, cpu_weights: torch.Tensor) -> None:
        """Queue the layer's CPU set on the side stream, forked from the current stream: the caller
        queues the GPU's experts next, then `join`s. x (N, H); cpu_ids, cpu_weights (N·k,) from
        split_misses."""
        N = x.shape[0]
        if x.dtype != self.store.dtype:
            raise TypeError(f"the CPU experts take {self.store.dtype} hidden states (got {x.dtype})")
        host_moe = self._native_for(cpu_ids.shape[0] // max(N, 1))
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            self.x_host[:N].copy_(x, non_blocking=True)
            self.pairs_host[:cpu_ids.shape[0]].copy_(cpu_ids, non_blocking=True)
            self.weights_host[:cpu_weights.shape[0]].copy_(cpu_weights, non_blocking=True)
            status = self._launch(self.side.cuda_stream, type(host_moe).entry_address, host_moe.call_address(layer, N))
            if status != 0:
                raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {status})")
            self.out[:N].copy_(self.out_host[:N], non_blocking=True)

    def join(self, N: int) -> torch.Tensor:
        """The current stream waits for the CPU set → its sum (N, H) fp32 on the device."""
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        return self.out[:N]

    # -- between replays --------------------------------------------------------------------------
    def before_replay(self) -> None:
        if self.native is not None:
            self.native.set_threads(host_node_threads())  # follows the CPU kernels' count, which the user may change

    def after_replay(self) -> None:
        """Read the host nodes' counters (the replay has finished), raise what they failed with, and
        move the CPU share toward the measured rate."""
        if self.native is None:
            return
        stats = self.native.take()
        if stats["error"]:
            raise RuntimeError(f"the decode graph's CPU experts failed: {stats['error']}")
        self.calls += stats["calls"]
        self.experts += stats["experts"]
        self.pairs += stats["pairs"]
        self.compute_s += stats["compute_s"]
        if stats["experts"] and stats["compute_s"] > 0:
            rate = stats["experts"] * self.store.block_bytes / stats["compute_s"] / 1e9
            self.cpu_gbps = RATE_MEMORY * self.cpu_gbps + (1 - RATE_MEMORY) * rate
            self.share.fill_(self.share_for(self.cpu_gbps))

    def telemetry(self) -> dict:
        return {"cpu_threads": host_node_threads(), "cpu_calls": self.calls, "cpu_experts": self.experts, "cpu_pairs": self.pairs,
                "cpu_s": round(self.compute_s, 4), "cpu_gbps": round(self.cpu_gbps, 2),
                "cpu_share": round(self.share_for(self.cpu_gbps), 3)}

