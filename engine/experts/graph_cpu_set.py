"""The CPU's share of a decode step's misses inside the one decode graph (seed 004's split, in-graph).

The one-graph step (zero_copy.py) reads every miss in place over PCIe; at 32K bs=1 with the cache
sized for four chats about 150 misses a step leave the CPU idle, while the pieces form, which does
split misses with the CPU, hands every layer to the host (0.3–0.6 ms of Python a layer). Here the
split stays inside the graph:

1. the claim kernel ranks a layer's misses as it meets them and gives the CPU every pair whose rank
   r crosses a multiple of 1/share (⌊(r+1)·share⌋ > ⌊r·share⌋): ⌊m·share⌋ of m misses, interleaved,
   and none while a layer has fewer than 1/share; the other misses are read in place and filled;
2. on a side stream the graph copies the layer's input, routing weights and the CPU's pairs into
   pinned buffers, runs the native CPU set as a host node (on the CUDA driver's callback thread:
   no Python and no sync of the driving thread), and copies the fp32 result back;
3. the expert kernels skip the CPU's pairs, and the sum over the choices adds the CPU's result once
   the side stream is done — the CPU set runs while the GPU reads its own misses.

share = t_link / (t_link + t_cpu), per expert: t_link from the cost model's PCIe rate, t_cpu measured
from the sets the host nodes ran (seconds per pair, a running mean) once there are some, the cost
model's CPU rate beside fills before. It lives on the device, so a new value needs no new capture.
Experts the CPU computes are not cached (no PCIe read brought them).

On the simulated GPU (tests on a CPU-only machine) the same steps run in order on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.cuda_streams import copy_async, launch_host_func
from engine.kernels.native import DTYPE_CODES
from engine.sched.expert_cost import ExpertCostModel

SHARE_SMOOTHING = 0.2  # weight of the latest step's measured CPU time per pair in the running mean


class GraphCpuSet:
    def __init__(self, native, store, device: torch.device, max_tokens: int, costs: ExpertCostModel,
                 threads: int | None = None):
        """native: the engine._native module; threads: the CPU set's (None: engine.kernels.native's
        count when a job is made). Buffers wait for `open`, when the routing's shape is known."""
        if store.dtype not in DTYPE_CODES:
            raise ValueError(f"the native CPU set does not take {store.dtype} weights")
        if store.hidden % 16 or store.expert_ffn % 16:
            raise ValueError("the native CPU set needs hidden and expert sizes that are multiples of 16")
        self.native, self.store, self.device, self.max_tokens = native, store, device, max_tokens
        self.sets = native.GraphCpuSets()
        self.host_fn = native.GraphCpuSets.host_function()
        self.costs, self.threads = costs, threads
        self.top_k = self.x_dtype = self.w_dtype = None  # set by open
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: dict[tuple[int, int], int] = {}  # (layer, N) → the native job's address
        self._counted = (0, 0, 0, 0.0)  # the native counters at the last update
        self.cpu_ms_per_pair: float | None = None  # measured, a running mean
        self.share_host = self._host((1,), torch.float32)
        self.share = torch.zeros(1, dtype=torch.float32, device=device)
        self.misses = torch.zeros(store.n_layers, dtype=torch.int32, device=device)  # per layer: misses ranked this step
        self.set_share(self.modelled_share())

    def _host(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def open(self, top_k: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
        """The buffers, at the first layer that gives the CPU a share (a warm-up, outside any capture).
        x_dtype, w_dtype: of the hidden state and of the routing weights."""
        if self.top_k is not None:
            if (top_k, x_dtype, w_dtype) != (self.top_k, self.x_dtype, self.w_dtype):
                raise ValueError("a decode graph's CPU set serves one routing shape and dtype")
            return
        for dtype in (x_dtype, w_dtype):
            if dtype not in DTYPE_CODES:
                raise ValueError(f"the native CPU set does not take {dtype}")
        L, H, B = self.store.n_layers, self.store.hidden, self.max_tokens
        self.x_host = self._host((B, H), x_dtype)  # the layer's MoE input
        self.w_host = self._host((B, top_k), w_dtype)  # its routing weights
        self.ids_host = self._host((L, B * top_k), torch.int64)  # per layer: the CPU's pairs (expert id, else -1)
        self.out_host = self._host((B, H), torch.float32)  # Σ over the CPU's pairs
        self.ids = torch.full((L, B * top_k), -1, dtype=torch.int64, device=self.device)  # written by the claim kernel
        self.gpu_ids = torch.empty(B * top_k, dtype=torch.int64, device=self.device)  # the pairs the GPU computes
        self.out = torch.zeros((B, H), dtype=torch.float32, device=self.device)
        self.top_k, self.x_dtype, self.w_dtype = top_k, x_dtype, w_dtype

    # -- the share -------------------------------------------------------------------------------
    def modelled_share(self) -> float:
        """Before anything is measured: the cost model's PCIe time per expert against its CPU time
        beside fills."""
        return self._share_for(self.costs.cpu_ms(1, 1, fills_ms=float("inf")))

    def _share_for(self, cpu_ms: float) -> float:
        link_ms = self.costs.fill_ms()
        return link_ms / (link_ms + max(cpu_ms, 1e-6))

    def set_share(self, share: float) -> None:
        """Queued on the current stream behind the last replay (the caller's between-steps work)."""
        self.share_host[0] = min(max(share, 0.0), 1.0)
        self.share.copy_(self.share_host, non_blocking=True)

    def update(self) -> None:
        """Between replays, after the last one finished: raise a failed CPU set, fold the last step's
        measured CPU time into the share."""
        err = self.sets.take_error()
        if err:
            raise RuntimeError(f"a CPU set inside the decode graph failed: {err}")
        counters = self.sets.counters()  # (sets, experts, pairs, seconds)
        pairs, seconds = counters[2] - self._counted[2], counters[3] - self._counted[3]
        self._counted = counters
        if pairs:
            ms = 1e3 * seconds / pairs
            mean = self.cpu_ms_per_pair
            self.cpu_ms_per_pair = ms if mean is None else (1 - SHARE_SMOOTHING) * mean + SHARE_SMOOTHING * ms
            self.set_share(self._share_for(self.cpu_ms_per_pair))

    def begin_step(self) -> None:
        self.misses.zero_()

    # -- inside the graph ------------------------------------------------------------------------
    def launch(self, layer: int, x: torch.Tensor, weights: torch.Tensor) -> torch.cuda.Event | None:
        """After the claim kernel wrote this layer's row of `ids`: the CPU set of the layer, on the
        side stream (on the simulated GPU: now). x (N, H), weights (N, k). The result lands in
        self.out[:N]; wait on the returned event before reading it (None: it is there)."""
        N, k = weights.shape
        job = self._job(layer, N)
        ids_host, ids = self.ids_host[layer, :N * k], self.ids[layer, :N * k]
        if self.side is None:
            self.x_host[:N].copy_(x)
            self.w_host[:N].copy_(weights)
            ids_host.copy_(ids)
            self.sets.run(job)
            self.out[:N].copy_(self.out_host[:N])
            return None
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)  # x, the weights and the claimed pairs are written
        copy_async(self.x_host[:N], x.contiguous(), self.side)
        copy_async(self.w_host[:N], weights.contiguous(), self.side)
        copy_async(ids_host, ids, self.side)
        launch_host_func(self.side, self.host_fn, job)
        copy_async(self.out[:N], self.out_host[:N], self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def _job(self, layer: int, N: int) -> int:
        job = self._jobs.get((layer, N))
        if job is None:
            from engine.kernels import native

            code, s = DTYPE_CODES, self.store
            threads = self.threads if self.threads is not None else native.threads()
            job = self.sets.add_job(s.moe_rows(layer), self.x_host.data_ptr(), code[self.x_dtype], code[s.dtype],
                                    code[self.w_dtype], N, s.hidden, s.expert_ffn, self.top_k,
                                    self.ids_host[layer].data_ptr(), self.w_host.data_ptr(),
                                    self.out_host.data_ptr(), threads)
            self._jobs[(layer, N)] = job
        return job

    # -- after a replay --------------------------------------------------------------------------
    def cpu_pairs(self, n_tokens: int) -> np.ndarray:
        """(L, n·k) the last replay's CPU pairs per layer (expert id, -1 for the rest): read after
        its end."""
        return self.ids_host[:, :n_tokens * self.top_k].numpy()

    def telemetry(self) -> dict:
        sets, experts, pairs, seconds = self.sets.counters()
        return {"graph_cpu_sets": sets, "graph_cpu_experts": experts, "graph_cpu_pairs": pairs,
                "graph_cpu_s": round(seconds, 4), "graph_cpu_share": round(float(self.share_host[0]), 3),
                "graph_cpu_ms_per_pair": None if self.cpu_ms_per_pair is None else round(self.cpu_ms_per_pair, 4)}
