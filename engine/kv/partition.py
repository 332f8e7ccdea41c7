"""PartitionSpec: the physical layout and roofline parameters of one InplaceKVCache (seed 000, §4.3).

Block size (the routing quantum), the D-window size D (decode tokens staged on the device and
evicted D at a time), the ping-pong size E (tokens per ping-pong buffer, and per host extent, so
one extent-layer is one DMA filling one buffer), the roofline's A, B, Δ, the device budget of the
two GPU regions and a cap on page-locked memory. `for_shape` derives the defaults from one layer's
KV bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import ConfigError
from engine.sched.roofline import RooflineParams

# Starting costs until a calibration profile or the online estimators say otherwise.
DEFAULT_CPU_GBPS = 10.0  # torch CPU attention reads ~10-19 GB/s of KV on a 16-core host
DEFAULT_H2D_GBPS = 25.0  # pinned PCIe H2D, Gen4 (Gen5 reaches ~55)
DEFAULT_DELTA_MS = 0.1  # the GPU side's extra launches per layer-step (window, chunks, merge)
PINGPONG_TARGET_BYTES = 8 << 20  # per extent-layer: where pinned H2D reaches its plateau (≥52 GB/s Gen5)
# G: extent-layers of one row per ping-pong buffer, i.e. DMAs per attention call: two halve the
# attention calls of a streamed layer, for two buffers of 2 × PINGPONG_TARGET_BYTES on the device.
PINGPONG_EXTENTS = 2


@dataclass
class PartitionSpec:
    """Physical layout and roofline parameters of one InplaceKVCache."""

    block_size: int = 64  # tokens; the routing quantum
    d_window: int = 256  # D: decode tokens staged on the device, evicted D at a time
    pingpong_tokens: int = 4096  # E: tokens per ping-pong buffer and per host extent
    # Defaults for the Qwen3-30B-A3B layer in bf16 (2 KiB of KV per token); for_shape() derives them.
    roofline: RooflineParams = field(default_factory=lambda: RooflineParams(
        A_ns_per_token=2048 / DEFAULT_CPU_GBPS, B_ns_per_token=2048 / DEFAULT_H2D_GBPS, delta_ms=DEFAULT_DELTA_MS))
    pinned_cap_bytes: int | None = None  # most page-locked host memory to use (None: no cap)
    cost_window: int = 256  # layer-steps in the sliding window of the online cost estimators
    vram_budget_bytes: int | None = None  # device memory the D-window and ping-pong may take (None: no check)

    def validate(self) -> None:
        bs, D, E = self.block_size, self.d_window, self.pingpong_tokens
        if bs < 1 or D < bs or D % bs:
            raise ConfigError(f"d_window ({D}) must be a positive multiple of block_size ({bs})",
                              "e.g. --d-window 256 --block-size 64")
        if E < D or E % bs:
            raise ConfigError(f"the ping-pong size ({E} tokens) must be a multiple of block_size ({bs}) "
                              f"and at least d_window ({D})", "raise it or lower d_window")

    @classmethod
    def for_shape(cls, n_kv_heads: int, head_dim: int, dtype: torch.dtype, *, cuda: bool,
                  block_size: int = 64, d_window: int = 256, pingpong_tokens: int | None = None,
                  roofline: RooflineParams | None = None, pinned_cap_bytes: int | None = None,
                  max_context: int | None = None, vram_budget_bytes: int | None = None) -> PartitionSpec:
        """Defaults derived from the per-token KV size of one layer (2 · n_kv · hs · element): the
        ping-pong size makes one extent-layer ~8 MiB (one context's worth at most)."""
        token_bytes = 2 * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if pingpong_tokens is None:
            pingpong_tokens = min(16384, PINGPONG_TARGET_BYTES // token_bytes)
            if max_context:
                pingpong_tokens = min(pingpong_tokens, max_context)
            pingpong_tokens = max(d_window, pingpong_tokens // d_window * d_window)
        if roofline is None:  # bytes / (GB/s) = ns; in simulate mode both sides are host copies
            h2d = DEFAULT_H2D_GBPS if cuda else DEFAULT_CPU_GBPS
            roofline = RooflineParams(A_ns_per_token=token_bytes / DEFAULT_CPU_GBPS,
                                      B_ns_per_token=token_bytes / h2d,
                                      delta_ms=DEFAULT_DELTA_MS if cuda else 0.0)
        spec = cls(block_size, d_window, pingpong_tokens, roofline, pinned_cap_bytes,
                   vram_budget_bytes=vram_budget_bytes)
        spec.validate()
        return spec

    def device_bytes(self, n_layers: int, max_batch: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """VRAM of the D-window and the ping-pong buffers."""
        token_bytes = 2 * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return token_bytes * (n_layers * max_batch * self.d_window + 2 * PINGPONG_EXTENTS * self.pingpong_tokens)
