"""Expert cost model: how long one MoE layer's GPU side and CPU side take, and the miss split that
makes them finish together.

Seed 004: at each layer the misses M split into a fill set F (q experts copied over PCIe into cache
slots, then computed on the GPU and kept) and a CPU set C (computed in place from host DRAM). Fills
and CPU experts read the same DRAM, so while fills stream at B_P the CPU is left the residual
bandwidth B_R = max(B_H − B_P, 0). PDScope §4.3: an expert's cost grows with the tokens routed to it
(prefill: many, decode: one per sequence); fills take the token-heavy experts first (on-demand
monotonicity) and the prefetch depth follows the link's idle time and the predictor's hit rate.

Pure arithmetic, no torch. Units: bytes, milliseconds, GB/s (= 1e6 bytes/ms), TFLOP/s (= 1e9 FLOP/ms).
The defaults are the GPU machine's measurements (Qwen3-30B-A3B expert shape, bf16, 16 threads);
a calibration profile replaces them through the constructor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

BYTES_PER_MS_PER_GBPS = 1e6  # 1 GB/s moves 1e6 bytes a millisecond: costs here are in ms
# In-place reads by the GPU's kernels over DMA fills of the same link: 38.6 GB/s against 52.7 on the
# H100 host (PCIe Gen5). Until calibration times in-place reads itself, a machine's measured B_P times
# this stands for them (a Gen4 desktop's link is not the server's).
ZERO_COPY_OF_DMA = 38.6 / 52.7
FLOP_PER_MS_PER_TFLOPS = 1e9  # 1 TFLOP/s does 1e9 FLOP a millisecond


@dataclass(frozen=True)
class ExpertCostModel:
    expert_bytes: float  # one expert's gate_up + down as the store holds it (its dtype, or quantised blocks)
    flops_per_token: float  # 6·H·I: three (H × I) matmuls, 2 FLOP per multiply-add
    pcie_gbps: float = 52.7  # B_P: pinned H2D into a slot (0.179 ms per 9.4 MB expert)
    # The GPU's own kernels reading an expert in place from pinned host memory (the one decode graph's
    # misses): H100, PCIe Gen5, BF16 graph steps bound by the link read 38.6-39.6 GB/s. A calibration
    # that measured B_P scales it by ZERO_COPY_OF_DMA.
    zero_copy_gbps: float = 38.6
    host_gbps: float = 76.0  # B_H: DRAM bandwidth fills and CPU experts share (23 GB/s CPU beside a 53.7 GB/s fill)
    cpu_gbps: float = 31.0  # the CPU kernel's own weight-streaming rate when alone (0.30 ms per 9.4 MB expert)
    cpu_tflops: float = 3.2  # CPU per-token compute (0.45 ms at 64 tokens, 1.05 ms at 256)
    cpu_overhead_ms: float = 0.05  # per layer with a CPU set: hidden state to the host, hand-off, result back
    gpu_launch_ms: float = 0.08  # per layer: the grouped FFN's few launches (a torch expert call costs 0.078 ms)
    gpu_gbps: float = 3000.0  # HBM reads of slot weights
    gpu_tflops: float = 300.0  # bf16 tensor-core throughput actually reached by grouped GEMMs
    fill_latency_ms: float = 0.01  # α: DMA start-up of a layer's fills
    attn_ms: float = 0.1  # next layer's attention + router: link time a prefetch can hide behind
    cpu_correction: float = 1.0  # measured / modelled CPU-set time, tracked online by the executor

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0 or (value == 0 and f.name.endswith(("gbps", "tflops"))):
                raise ValueError(f"ExpertCostModel.{f.name} must be a positive number (got {value!r})")

    @classmethod
    def from_shape(cls, hidden: int, expert_ffn: int, dtype_bytes: float, **measured) -> "ExpertCostModel":
        """Cost model of an expert of shape (H, I); `measured` overrides the default constants."""
        return cls(expert_bytes=3 * hidden * expert_ffn * dtype_bytes, flops_per_token=6.0 * hidden * expert_ffn,
                   **measured)

    @classmethod
    def from_calibration(cls, hidden: int, expert_ffn: int, dtype_bytes: float, cpu_ms_by_tokens: dict[int, float],
                         pcie_gbps: float | None = None,
                         cpu_beside_fills_gbps: float | None = None) -> "ExpertCostModel":
        """The model with a calibration's measurements of the engine's own kernels (engine/hw/expert_costs.py):
        the CPU kernel's weight rate from its one-token time (ms), its cost per token from the slope between
        its two largest token counts, B_P, and B_H as B_P plus what the CPU read while fills ran. What was
        not measured (no GPU: no B_P) keeps the default."""
        model = cls.from_shape(hidden, expert_ffn, dtype_bytes)
        counts = sorted(n for n, ms in cpu_ms_by_tokens.items() if n >= 1 and ms > 0)
        if not counts:
            raise ValueError("the calibration has no CPU expert times")
        measured: dict = {"cpu_gbps": model.expert_bytes / (cpu_ms_by_tokens[counts[0]] * BYTES_PER_MS_PER_GBPS)}
        if len(counts) >= 2:
            lo, hi = counts[-2], counts[-1]
            per_token_ms = (cpu_ms_by_tokens[hi] - cpu_ms_by_tokens[lo]) / (hi - lo)
            if per_token_ms > 0:
                measured["cpu_tflops"] = model.flops_per_token / (per_token_ms * FLOP_PER_MS_PER_TFLOPS)
        if pcie_gbps:
            measured["pcie_gbps"] = pcie_gbps
            measured["zero_copy_gbps"] = ZERO_COPY_OF_DMA * pcie_gbps
            if cpu_beside_fills_gbps:
                measured["host_gbps"] = pcie_gbps + cpu_beside_fills_gbps
        return cls.from_shape(hidden, expert_ffn, dtype_bytes, **measured)

    # -- bandwidths -----------------------------------------------------------------------------
    @property
    def residual_gbps(self) -> float:
        """B_R = max(B_H − B_P, 0): host bandwidth left to CPU experts while fills saturate PCIe."""
        return max(self.host_gbps - self.pcie_gbps, 0.0)

    @property
    def cpu_alone_gbps(self) -> float:
        return min(self.cpu_gbps, self.host_gbps)

    @property
    def cpu_beside_fills_gbps(self) -> float:
        return min(self.cpu_gbps, self.residual_gbps)

    # -- per-side times -------------------------------------------------------------------------
    def fill_ms(self) -> float:
        """One expert over PCIe (t_io)."""
        return self.expert_bytes / (self.pcie_gbps * BYTES_PER_MS_PER_GBPS)

    def zero_copy_ms(self) -> float:
        """One expert read in place over PCIe by the GPU's kernels."""
        return self.expert_bytes / (self.zero_copy_gbps * BYTES_PER_MS_PER_GBPS)

    def cpu_expert_ms(self, tokens: int = 1) -> float:
        """One expert on the CPU alone, its weights streamed at the CPU's own rate: a set of one without
        the set's overhead."""
        return self.cpu_ms(1, tokens) - self.cpu_correction * self.cpu_overhead_ms

    def fills_ms(self, q: int) -> float:
        """q fills in series on one copy stream (PDScope premise 3: serial I/O)."""
        return self.fill_latency_ms + q * self.fill_ms() if q else 0.0

    def cpu_ms(self, n_experts: int, tokens: int, fills_ms: float = 0.0) -> float:
        """CPU set of n experts routed `tokens` tokens in all, while fills occupy the first fills_ms.

        Weights stream at the residual rate while fills run and at the CPU's own rate after; with
        B_R = 0 the CPU waits for the fills. The per-token compute adds on top.
        """
        if n_experts == 0:
            return 0.0
        stream = n_experts * self.expert_bytes  # bytes
        beside = self.cpu_beside_fills_gbps * BYTES_PER_MS_PER_GBPS * fills_ms  # bytes read during fills
        if stream <= beside:
            t_stream = stream / (self.cpu_beside_fills_gbps * BYTES_PER_MS_PER_GBPS)
        else:
            t_stream = fills_ms + (stream - beside) / (self.cpu_alone_gbps * BYTES_PER_MS_PER_GBPS)
        return self.cpu_correction * (t_stream + self.cpu_overhead_ms
                                      + tokens * self.flops_per_token / (self.cpu_tflops * FLOP_PER_MS_PER_TFLOPS))

    def gpu_ms(self, n_experts: int, tokens: int) -> float:
        """One grouped computation over n cached experts routed `tokens` tokens in all."""
        if n_experts == 0:
            return 0.0
        return (self.gpu_launch_ms + n_experts * self.expert_bytes / (self.gpu_gbps * BYTES_PER_MS_PER_GBPS)
                + tokens * self.flops_per_token / (self.gpu_tflops * FLOP_PER_MS_PER_TFLOPS))

    def layer_ms(self, n_hits: int, hit_tokens: int, fill_tokens: Sequence[int],
                 cpu_tokens: Sequence[int]) -> tuple[float, float]:
        """(T_G, T_C): the GPU side (fills, then one grouped computation over hits + fills) and the
        CPU side (in place, concurrently) of one layer."""
        t_fill = self.fills_ms(len(fill_tokens))
        t_gpu = t_fill + self.gpu_ms(n_hits + len(fill_tokens), hit_tokens + sum(fill_tokens))
        return t_gpu, self.cpu_ms(len(cpu_tokens), sum(cpu_tokens), t_fill)

    # -- decisions ------------------------------------------------------------------------------
    def best_split(self, miss_tokens_desc: Sequence[int], n_hits: int, hit_tokens: int,
                   capacity: int) -> tuple[int, float, float]:
        """q minimising the layer's makespan max(T_G, T_C), where the q most token-heavy misses fill
        and the rest run on the CPU; ties go to more fills (a fill is kept for later hits).

        miss_tokens_desc: tokens per missed expert, heaviest first; capacity: slots free for fills.
        Returns (q, T_G, T_C).
        """
        # The loop inlines fills_ms, gpu_ms and cpu_ms (same arithmetic): it runs on the driving thread
        # before each decode layer's CPU set can start, where method calls per q cost ~30 µs a layer.
        m = len(miss_tokens_desc)
        total = sum(miss_tokens_desc)
        per_ms = BYTES_PER_MS_PER_GBPS
        t_one_fill = self.expert_bytes / (self.pcie_gbps * per_ms)
        gpu_expert_ms = self.expert_bytes / (self.gpu_gbps * per_ms)
        gpu_token_ms = self.flops_per_token / (self.gpu_tflops * FLOP_PER_MS_PER_TFLOPS)
        cpu_token_ms = self.flops_per_token / (self.cpu_tflops * FLOP_PER_MS_PER_TFLOPS)
        beside_rate = self.cpu_beside_fills_gbps * per_ms  # bytes/ms while fills stream
        alone_rate = self.cpu_alone_gbps * per_ms
        best_span = best_q = best_gpu = best_cpu = None
        filled_tokens = 0
        for q in range(0, min(m, max(capacity, 0)) + 1):
            if q:
                filled_tokens += miss_tokens_desc[q - 1]
            t_fill = self.fill_latency_ms + q * t_one_fill if q else 0.0
            n_gpu = n_hits + q
            t_gpu = t_fill + (self.gpu_launch_ms + n_gpu * gpu_expert_ms
                              + (hit_tokens + filled_tokens) * gpu_token_ms if n_gpu else 0.0)
            n_cpu = m - q
            if n_cpu:
                stream = n_cpu * self.expert_bytes
                beside = beside_rate * t_fill
                t_stream = stream / beside_rate if stream <= beside else t_fill + (stream - beside) / alone_rate
                t_cpu = self.cpu_correction * (t_stream + self.cpu_overhead_ms + (total - filled_tokens) * cpu_token_ms)
            else:
                t_cpu = 0.0
            span = max(t_gpu, t_cpu)
            if best_span is None or span <= best_span + 1e-12:
                best_span, best_q, best_gpu, best_cpu = span, q, t_gpu, t_cpu
        return best_q, best_gpu, best_cpu

    def prefetch_depth(self, idle_ms: float, hit_rate: float, aggressive: bool) -> int:
        """How many predicted experts to prefetch into an idle link window of idle_ms.

        f = idle / t_io prefetches hide completely; the partial (⌈f⌉-th) one is issued when its
        expected gain beats its expected loss, ξ = R·frac·t_io − (1 − R)·(1 − frac)·t_io > 0
        (PDScope §4.3.4), or always when `aggressive` (prefill: a starved GPU costs more than a
        late prefetch).
        """
        if idle_ms <= 0:
            return 0
        f = idle_ms / self.fill_ms()
        whole = math.floor(f)
        frac = f - whole
        if frac <= 1e-9:
            return whole
        if aggressive:
            return whole + 1
        xi = hit_rate * frac - (1.0 - hit_rate) * (1.0 - frac)
        return whole + (1 if xi > 0 else 0)
