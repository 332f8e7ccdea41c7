"""The starting A and B of a WriteScope backend, measured with its own kernels (seed 000 §5.2).

r(L) places a prompt's KV when the prompt arrives and a placed token never moves, so the first chats
are placed by whatever A and B the online estimators start from. A calibration profile gives them for
the shapes it measured; without one (or for another shape) the defaults can be far off — a latent row
read once for every head is compute-bound on the CPU, not bandwidth-bound, and a bandwidth default
says nothing of the host at hand. The backend then measures them when it is set up:

    A   its CPU kernel over a few rows of host KV laid out as the unpinned region's views, the
        working set cycled over copies so the reads come from DRAM as a long context's do
    B   one ping-pong load: the page-locked extent-layer's H2D copy and the device attention over
        it, which overlap in the stream (one buffer loads while the other is read): the slower one

Tens of milliseconds; the online estimators take over from the first decode step.
"""

from __future__ import annotations

import torch

from engine.hw.timing import time_cpu, time_cuda
from engine.sched.roofline import RooflineParams

PROBE_ROWS = 4  # sequences of one step: the CPU kernel's work spreads over rows and heads
PROBE_ROW_TOKENS = 4096  # per row: ~8 MiB of a 2 KiB-per-token layer, the fixed cost a few % of the step
PROBE_COPIES = 4  # working sets cycled: 4 × 32 MiB outruns a server's last-level cache
PROBE_REPEATS = 5  # timed steps per side after one warm-up; the median is kept
FILL = 0.01  # every element one small value: pages touched, no denormal or NaN to slow a kernel


def measure_costs(kv, n_heads: int, rows: int = PROBE_ROWS, row_tokens: int = PROBE_ROW_TOKENS,
                  copies: int = PROBE_COPIES) -> RooflineParams:
    """A and B (ns per KV token of one layer-step) of `kv` (a WriteScopeKV) for queries of n_heads
    heads; Δ and C_CPU stay its current ones (the defaults or a profile's)."""
    cache, dtype = kv.cache, kv.dtype
    scale = cache.head_dim ** -0.5
    q_host = torch.full((rows, n_heads, 1, kv.query_width), FILL, dtype=dtype)  # (B, nh, 1, w)
    arenas = [torch.full((2, cache.n_kv, row_tokens, cache.head_dim), FILL, dtype=dtype)
              for _ in range(copies * rows)]  # (2, n_kv, t, hs): K and V planes, as a region's layer
    blocks = [kv.prepare_cpu([[(a[0], a[1])] for a in arenas[c * rows:(c + 1) * rows]], n_heads)
              for c in range(copies)]
    cpu_ms = time_cpu(lambda i: kv.attend_cpu(q_host, blocks[i % copies], scale), 1, PROBE_REPEATS).median_ms
    c_cpu_ms = kv.share.A.fixed_ns / 1e6
    A = max(cpu_ms - c_cpu_ms, cpu_ms / 2) * 1e6 / (rows * row_tokens)  # the fixed part never more than half
    del arenas, blocks

    buf = cache.pingpong[0]  # (G·E, 2, n_kv, hs) on the device
    n = buf.shape[0]
    src = kv.transport.host(tuple(buf.shape), dtype, pinned=kv.transport.cuda)
    try:
        src.tensor.fill_(FILL)
        buf.fill_(FILL)
        k, v = kv.pingpong_views(0)  # (1, n_kv, G·E, hs)
        q = q_host[:1].to(kv.device)
        timer = time_cuda if kv.transport.cuda else time_cpu  # device work by CUDA events, host copies by the clock
        copy_ms = timer(lambda i: buf.copy_(src.tensor, non_blocking=True), 1, PROBE_REPEATS).median_ms
        attend_ms = timer(lambda i: kv.device_part(q, k, v, scale), 1, PROBE_REPEATS).median_ms
    finally:
        kv.transport.synchronize()
        src.release()
    B = max(copy_ms, attend_ms) * 1e6 / n
    return RooflineParams(A, B, kv.share.delta_ms, c_cpu_ms)

