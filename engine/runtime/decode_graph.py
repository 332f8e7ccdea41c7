"""CUDA graphs of the decode step: the whole model's forward for B sequences, one token each, replayed.

A decode step of an MoE model launches ~70 small kernels per layer; eagerly, Python and the launch
path take ~2 ms per layer on the H200 (benchmarks/RESULTS.md), far more than the kernels' own time.
Captured once per batch size, the step becomes one graph launch.

What makes the step capturable: the resident KV puts the step's inputs (write slots, positions, key
counts, block table) at fixed device addresses and the paged kernel sizes its splits on the device
(engine/kv/resident.py); the grouped experts find their groups without reading back to the host
(engine/kernels/experts_gpu.py). Only the resident KV's paged decode with resident (or no) experts
qualifies; hybrid KV and offloaded experts decide placement on the host every step and run eagerly.

The first step of a batch size runs eagerly on a side stream (Triton compiles, cuBLAS picks its
algorithms), then is captured and replayed: K, V of that step are written twice with the same values.
"""

from __future__ import annotations

import logging

import torch

from engine.experts.executor import GROUPED_MAX_TOKENS, ResidentExperts
from engine.kernels.experts_gpu import MAX_GROUPS, uses_grouped_mm
from engine.kv.resident import ResidentKV

log = logging.getLogger("tandem")


def unsupported_reason(kv, experts, device: torch.device, max_batch: int) -> str | None:
    """Why decode steps cannot be replayed as graphs here, or None when they can."""
    if not isinstance(kv, ResidentKV):
        return f"the {kv.policy} KV decides placement on the host every step"
    if experts is not None and not isinstance(experts, ResidentExperts):
        return f"the {experts.policy} expert policy decides placement on the host every step"
    if device.type != "cuda":
        return "graphs need CUDA"
    if max_batch > GROUPED_MAX_TOKENS:
        return f"max_batch above {GROUPED_MAX_TOKENS} takes the per-expert path, which syncs with the host"
    if not kv.paged:
        return "the paged decode kernel does not take this model's head dim (powers of two ≥ 16 only)"
    if experts is not None and experts.gate_up:
        dtype = experts.gate_up[0].dtype
        if experts.gate_up[0].shape[0] > MAX_GROUPS or not uses_grouped_mm(device, dtype):
            return "the grouped expert GEMM does not run here"
    return None


class DecodeGraphs:
    """One captured decode forward per batch size, sharing one memory pool."""

    def __init__(self, model, kv: ResidentKV, experts, device: torch.device, max_batch: int):
        self.model, self.kv, self.experts, self.device = model, kv, experts, device
        self.tokens = torch.zeros((max_batch, 1), dtype=torch.int64, device=device)  # (B, 1) static input
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # B → (graph, logits (B, V))
        self.pool = None
        self.failed: str | None = None  # set when a capture failed: every later step runs eagerly
        self.replays = 0

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """tokens (B, 1) on the host, positions (B, 1) from kv.begin_step → logits (B, V) fp32, or None
        when this step must run eagerly (the caller then runs the model itself)."""
        if self.failed is not None or not self.kv.replayable_step():
            return None
        B = tokens.shape[0]
        self.tokens[:B].copy_(tokens, non_blocking=True)
        entry = self.graphs.get(B)
        if entry is None:
            entry = self._capture(B, positions)
            if entry is None:
                return None
        graph, logits = entry
        graph.replay()
        self.replays += 1
        if isinstance(self.experts, ResidentExperts):  # the counter Python would have bumped
            self.experts.tokens_routed += B * self.model.args.top_k
        return logits.clone()  # the graph's output buffer is overwritten by the next replay

    def _capture(self, B: int, positions: torch.Tensor):
        tokens = self.tokens[:B]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles kernels, settles cuBLAS workspaces
            self.model(tokens, positions, self.kv)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (the app polling memory) cannot spoil the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = self.model(tokens, positions, self.kv)  # (B, V) fp32, a buffer of the pool
        except Exception as e:  # an op that syncs with the host or is not capturable: stay eager
            self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("decode steps run without CUDA graphs: capture failed (%s)", self.failed)
            torch.cuda.synchronize(self.device)
            return None
        self.pool = graph.pool()
        self.graphs[B] = (graph, logits)
        log.info("captured the decode step for batch %d", B)
        return self.graphs[B]

    def telemetry(self) -> dict:
        return {"captured_batches": sorted(self.graphs), "replays": self.replays, "failed": self.failed}

    def close(self) -> None:
        self.graphs.clear()
        self.pool = None
