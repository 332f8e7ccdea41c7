"""The streamed (pinned) share of one layer's decode attention as a CUDA graph, replayed while the
step's loads stay the same.

Eagerly each ping-pong load costs the driving thread about eight host calls (stream switches, event
waits and records, one DMA per extent-layer, one attention call), 20-60 µs each on a server host
and slower while the CPU side's threads run; at 32K that loop issues work more slowly than PCIe
drains it. A decode step's
loads change only when a flush places a D-window, a row joins or leaves, or a chat is cropped, so
between those events every layer repeats the same copies and attention calls: one graph launch.

    first step with a new load list     eager loop (its outputs tell the result dtype)
    second step with the same list      capture (copies + attention + two concatenations), replay
    later steps with the same list      replay

The graph reads the query from a fixed buffer and writes every load's output and LSE into fixed
buffers (allocated outside the capture, so all layers' graphs can share one memory pool: nothing a
graph allocates outlives its replay). Its copies read page-locked extents by address, which is
sound because placed extents never move or get unpinned while the cache is open.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.kernels.cuda_capture import GeneratorState

log = logging.getLogger("tandem")


@dataclass
class _Graph:
    key: tuple
    graph: torch.cuda.CUDAGraph
    q: torch.Tensor  # (B, nh, T, hs) the query the graph reads
    out: torch.Tensor  # (P, nh, T, hs) one row per load, in the loads' output dtype
    lse: torch.Tensor  # (P, nh, T) fp32


class StreamGraphs:
    """Per layer: the last load list seen and the graph captured for it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._graphs: dict[int, _Graph] = {}
        self._seen: dict[int, tuple] = {}  # layer → (key, output dtype) of the last eager run
        # One memory pool for every layer's graph (each graph's allocations die in its replay), kept
        # alive by a graph of its own: a pool is released with the last graph that uses it, and a later
        # capture into its id fails the device and host allocators' assertions (torch 2.11, when a
        # flush had dropped every layer's graph).
        self._anchor: torch.cuda.CUDAGraph | None = None
        self._capture_stream = None
        self.failed: str | None = None  # a capture failed: every later step streams eagerly
        self.captures = 0
        self.replays = 0
        self.capture_seconds = 0.0

    def find(self, layer: int, key: tuple) -> _Graph | None:
        g = self._graphs.get(layer)
        return g if g is not None and g.key == key else None

    def ready_to_capture(self, layer: int, key: tuple) -> torch.dtype | None:
        """The output dtype when the previous step ran this layer's loads eagerly with this very
        list; None otherwise (then run eagerly and call `seen`)."""
        if self.failed is not None:
            return None
        seen = self._seen.get(layer)
        return seen[1] if seen is not None and seen[0] == key else None

    def seen(self, layer: int, key: tuple, out_dtype: torch.dtype) -> None:
        self._graphs.pop(layer, None)  # its list is gone
        self._seen[layer] = (key, out_dtype)

    def capture(self, layer: int, key: tuple, q: torch.Tensor, n_loads: int, out_dtype: torch.dtype,
                body, out_width: int | None = None) -> _Graph | None:
        """Capture `body(q, compute, fork)` → list of (o (1, nh, T, hs), lse (1, nh, T)); None if the
        capture fails (logged once; the caller streams eagerly from then on). out_width: o's last
        dim where it is not q's (latent rows: r of q's r + dr)."""
        _, nh, T, hs = q.shape  # (B, nh, T, hs)
        hs = hs if out_width is None else out_width
        compute = torch.cuda.current_stream(self.device)
        t0 = time.perf_counter()
        static_q = q.clone()  # on the compute stream, outside the capture
        out = torch.empty((n_loads, nh, T, hs), dtype=out_dtype, device=self.device)
        lse = torch.empty((n_loads, nh, T), dtype=torch.float32, device=self.device)
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)  # capture needs a non-default stream
        cap = self._capture_stream
        cap.wait_stream(compute)
        rng = GeneratorState(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(cap):
                if self._anchor is None:
                    self._anchor = self._record(torch.cuda.CUDAGraph(), None, lambda: torch.zeros(1, device=self.device))
                self._record(graph, self._anchor.pool(), lambda: self._body(body, static_q, cap, out, lse))
        except Exception as e:  # e.g. a kernel or copy that cannot be captured on this stack
            rng.restore()  # a failed capture leaves the default generator in capture mode
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("streamed KV loads run eagerly: capturing them as a CUDA graph failed (%s)", self.failed)
            self._graphs.pop(layer, None)
            return None
        finally:
            compute.wait_stream(cap)
        entry = self._graphs[layer] = _Graph(key, graph, static_q, out, lse)
        self._seen.pop(layer, None)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        return entry

    @staticmethod
    def _record(graph: torch.cuda.CUDAGraph, pool, work) -> torch.cuda.CUDAGraph:
        # thread_local: the CPU side's thread and the pinning thread keep making CUDA calls
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            work()
        finally:
            graph.capture_end()
        return graph

    @staticmethod
    def _body(body, static_q: torch.Tensor, cap, out: torch.Tensor, lse: torch.Tensor) -> None:
        fork = torch.cuda.Event()
        fork.record(cap)
        parts = body(static_q, cap, fork)
        torch.cat([p[0] for p in parts], out=out)
        torch.cat([p[1] for p in parts], out=lse)

    def replay(self, entry: _Graph, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On the current (compute) stream → (out (P, nh, T, hs), lse (P, nh, T)), valid until the next replay."""
        entry.q.copy_(q, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.out, entry.lse

    def telemetry(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "capture_ms": self.capture_seconds * 1e3,
                "failed": self.failed}

    def close(self) -> None:
        self._graphs.clear()  # the graphs first, then the one that holds their pool
        self._seen.clear()
        self._anchor = None
