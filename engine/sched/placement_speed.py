"""How fast a placement would run: the decode step and the prefill of one placement of a model,
predicted from its part sizes and the machine's calibrated costs (sched/placement.py compares them).

The same cost models the engine schedules with: sched/roofline.py's A, B, Δ for spilled KV, and
sched/expert_cost.py's fill / CPU split for offloaded experts; on top, the per-layer costs of a
decode step as an H200 runs them (16 layers of Qwen3-30B-A3B, bf16, CUDA graphs) and as two CPU
cores run the built-in model (eager). Pure arithmetic, no tensors.

Units: bytes, milliseconds, GB/s (1e6 bytes/ms), TFLOP/s (1e9 FLOP/ms).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.sched.expert_cost import BYTES_PER_MS_PER_GBPS, FLOP_PER_MS_PER_TFLOPS, ExpertCostModel
from engine.sched.roofline import RooflineParams

GiB = 2**30

GPU_LAYER_MS = 0.05  # one decoder layer's kernels in a captured decode step, weight reads aside (resident 2K:
#                     650 tok/s, 1.54 ms a token over 16 layers, of which ~0.04 ms a layer reads weights)
GPU_KV_READ_GBPS = 900.0  # decode attention over resident KV (resident 2K → 32K: +1.15 ms a token for 1 GiB of KV)
CPU_LAYER_MS = 0.25  # one layer's operator overhead in eager CPU decode (the 30-layer built-in model, 2 cores)
CPU_STREAM_EFFICIENCY = 0.6  # share of the DRAM read rate a CPU decode step reaches over its weights
DEFAULT_DRAM_GBPS = 20.0  # without a profile: a dual-channel desktop's read rate, conservative
DEFAULT_HBM_GBPS = 3000.0  # without a profile: weight reads on the GPU (sched/expert_cost.py's gpu_gbps)
DEFAULT_CPU_TFLOPS = 1.0  # without a profile: prefill matmuls on the CPU


@dataclass(frozen=True)
class ModelParts:
    """A model's parts in bytes, as the engine holds them (one dtype), read from headers alone."""

    name: str
    n_layers: int
    embed_bytes: int  # token embeddings (read one row a token; kept on the compute device)
    output_bytes: int  # the output projection (0: tied to the embeddings)
    layer_dense_bytes: int  # one layer's attention, norms, router and dense FFN or shared experts
    moe_layers: int  # layers with routed experts
    n_experts: int  # routed experts per MoE layer (0: a dense model)
    top_k: int
    expert_bytes: int  # one routed expert (gate, up, down)
    expert_flops_per_token: float  # 6·H·I
    kv_bytes_per_token: int  # one chat's K and V of one token over all layers
    dense_flops_per_token: float  # 2 × the dense parameters a token multiplies through (prefill compute)
    attn_width: int  # n_heads · head_dim: attention FLOPs per (query, key) pair are 4 × this per layer
    can_spill_kv: bool = True  # the hybrid KV honours this model's attention (no sinks, no window < context)
    can_offload_experts: bool = True  # the offloading executors take its experts (SwiGLU, or gpt-oss's form)
    kv_layers: int | None = None  # layers that store KV and attend over it (hybrid models: fewer); None: all
    state_bytes_per_chat: int = 0  # a recurrent state per chat (linear-attention layers), kept with its KV
    # KV layers a hybrid policy keeps resident on the GPU: sliding windows shorter than the context
    # (gpt-oss's window layers, engine/kv/layer_split.py); only the others spill
    resident_kv_layers: int = 0
    # one routed expert as the host store and the GPU cache slots hold it where that differs from
    # expert_bytes (a GGUF's quantised blocks, which resident experts hold dequantised:
    # engine/experts/store.py); None: the same
    store_expert_bytes: int | None = None

    @property
    def attn_layers(self) -> int:
        return self.n_layers if self.kv_layers is None else self.kv_layers

    @property
    def dense_bytes(self) -> int:
        return self.embed_bytes + self.output_bytes + self.n_layers * self.layer_dense_bytes

    @property
    def n_routed(self) -> int:
        return self.moe_layers * self.n_experts

    @property
    def routed_bytes(self) -> int:
        return self.n_routed * self.expert_bytes

    @property
    def slot_bytes(self) -> int:
        """One routed expert as the store and a cache slot hold it."""
        return self.expert_bytes if self.store_expert_bytes is None else self.store_expert_bytes

    @property
    def host_routed_bytes(self) -> int:
        """The routed experts in host memory (the store, or every expert of a CPU placement)."""
        return self.n_routed * self.slot_bytes

    @property
    def weights_bytes(self) -> int:
        return self.dense_bytes + self.routed_bytes

    def kv_bytes(self, tokens: int, chats: int) -> int:
        return (self.kv_bytes_per_token * tokens + self.state_bytes_per_chat) * chats

    def resident_kv_bytes(self, tokens: int, chats: int) -> int:
        """The KV of the layers a hybrid policy keeps resident (their share of kv_bytes_per_token)."""
        return self.kv_bytes_per_token * self.resident_kv_layers // max(self.attn_layers, 1) * tokens * chats


@dataclass(frozen=True)
class MachineCosts:
    """What the planner knows of the machine: the memory it may use and the calibrated rates."""

    gpu: bool  # a GPU side exists (CUDA, or the simulated hybrid)
    vram_bytes: int  # what Tandem may use on the GPU: the budget, else free VRAM less a margin
    ram_bytes: int  # host memory available
    experts: ExpertCostModel  # B_P, B_H, CPU and GPU expert costs (a profile's, else the defaults)
    kv: RooflineParams  # A, B, Δ per KV token per layer-step
    dram_gbps: float = DEFAULT_DRAM_GBPS
    hbm_gbps: float = DEFAULT_HBM_GBPS
    cpu_tflops: float = DEFAULT_CPU_TFLOPS
    budget_source: str = "budget"  # "budget" (vram_budget_gb) | "free VRAM" | "no GPU"
    simulated: bool = False  # the GPU side is simulated on the CPU (tests, CI)
    costs_source: str = "defaults"  # "calibrated (<profile>)" | "defaults"


@dataclass(frozen=True)
class Placement:
    """One way to place a model: the compute device, the KV and expert policies, the slots."""

    device: str  # "gpu" | "cpu"
    kv_policy: str  # "resident" | "writescope"
    expert_policy: str  # "resident" | "adaptive" | "cpu-only"
    slots: int  # expert cache slots (offloaded policies)
    kv_gpu_bytes: int
    kv_host_bytes: int
    kv_window_bytes: int = 0  # of kv_gpu_bytes under a hybrid policy: the resident window layers' KV


def unique_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts one layer routes `tokens` tokens to, top-k of E each, uniformly."""
    if n_experts == 0 or tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def lru_hit_rate(slots: int, n_routed: int, touched_per_pass: float) -> float:
    """Hit rate of an LRU cache shared by all layers under uniform routing (the synthetic models'
    random routers, a worst case: trained routers are more local). A step or chunk that touches more
    experts than the cache holds evicts them all before they come round again (LRU's cyclic worst
    case: prefill chunks); otherwise each expert is cached with probability slots / n_routed."""
    if n_routed == 0:
        return 1.0
    if touched_per_pass > slots:
        return 0.0
    return min(1.0, slots / n_routed)


def _expert_layer_ms(p: Placement, m: ModelParts, c: MachineCosts, tokens: int, prefill: bool) -> tuple[float, str]:
    """(ms, which side bounds it) for one MoE layer's routed experts over `tokens` tokens."""
    e = c.experts
    u = unique_experts(m.n_experts, m.top_k, tokens)
    routed = tokens * m.top_k
    if p.device == "cpu":  # resident in RAM: the decode step streams the routed experts' weights
        stream = u * m.expert_bytes / (c.dram_gbps * CPU_STREAM_EFFICIENCY * BYTES_PER_MS_PER_GBPS)
        return stream + routed * m.expert_flops_per_token / (c.cpu_tflops * FLOP_PER_MS_PER_TFLOPS), "CPU experts"
    if p.expert_policy == "resident":  # inside the captured step: weight reads and FLOPs, no launch cost
        return (u * m.expert_bytes / (c.hbm_gbps * BYTES_PER_MS_PER_GBPS)
                + routed * m.expert_flops_per_token / (e.gpu_tflops * FLOP_PER_MS_PER_TFLOPS)), "GPU layers"
    if p.expert_policy == "cpu-only":
        return e.cpu_ms(round(u), routed), "CPU experts"
    h = lru_hit_rate(p.slots, m.n_routed, u * m.moe_layers)
    hits = round(u * h)
    misses = max(0, round(u) - hits)
    per = routed / max(u, 1.0)  # tokens per touched expert
    if prefill:  # token-heavy: every miss fills (the cost model's q is the whole miss set)
        t_gpu, t_cpu = e.layer_ms(hits, round(hits * per), [round(per)] * misses, [])
        return max(t_gpu, t_cpu), "PCIe fills"
    q, t_gpu, t_cpu = e.best_split([max(1, round(per))] * misses, hits, round(hits * per), misses)
    bound = "PCIe fills" if t_gpu >= t_cpu and q else "CPU experts" if t_cpu > t_gpu else "GPU compute"
    return max(t_gpu, t_cpu), bound


def _attention_layer_ms(p: Placement, m: ModelParts, c: MachineCosts, context: int, chats: int,
                        d_window: int) -> float:
    layer_token_bytes = m.kv_bytes_per_token / max(m.attn_layers, 1)
    if p.device == "cpu":
        return chats * context * layer_token_bytes / (c.dram_gbps * CPU_STREAM_EFFICIENCY * BYTES_PER_MS_PER_GBPS)
    if p.kv_policy == "resident":
        return chats * context * layer_token_bytes / (GPU_KV_READ_GBPS * BYTES_PER_MS_PER_GBPS)
    placed = max(0, context - d_window) * chats  # spilled tokens: split between CPU (A) and GPU stream (B)
    window = min(context, d_window) * chats * layer_token_bytes / (GPU_KV_READ_GBPS * BYTES_PER_MS_PER_GBPS)
    if placed == 0:
        return window
    A, B = c.kv.A_ns_per_token, c.kv.B_ns_per_token
    both = placed * A * B / (A + B) * 1e-6 + max(c.kv.c_cpu_ms, c.kv.c_cpu_ms + c.kv.delta_ms)
    return window + both


def decode_ms(p: Placement, m: ModelParts, c: MachineCosts, context: int, chats: int, d_window: int
              ) -> tuple[float, str]:
    """One decode step of `chats` chats at `context` tokens each: (ms, the bottleneck in words)."""
    parts: dict[str, float] = {}
    if p.device == "cpu":
        rate = c.dram_gbps * CPU_STREAM_EFFICIENCY * BYTES_PER_MS_PER_GBPS
        parts["CPU weights"] = (m.output_bytes or m.embed_bytes) / rate + m.n_layers * (
            CPU_LAYER_MS + m.layer_dense_bytes / rate)
    else:
        parts["GPU layers"] = (m.output_bytes or m.embed_bytes) / (c.hbm_gbps * BYTES_PER_MS_PER_GBPS) + m.n_layers * (
            GPU_LAYER_MS + m.layer_dense_bytes / (c.hbm_gbps * BYTES_PER_MS_PER_GBPS))
    attn = m.attn_layers * _attention_layer_ms(p, m, c, context, chats, d_window)
    if p.kv_policy != "resident" and p.device != "cpu" and m.resident_kv_layers:
        # the window layers attend resident KV: costed over the whole context, an upper bound (a
        # window reads fewer keys)
        resident = replace(p, kv_policy="resident")
        attn = (m.attn_layers - m.resident_kv_layers) * _attention_layer_ms(p, m, c, context, chats, d_window) + \
            m.resident_kv_layers * _attention_layer_ms(resident, m, c, context, chats, d_window)
    parts["KV in host memory" if p.kv_policy != "resident" and p.device != "cpu" else "attention"] = attn
    if m.n_experts:
        ms, bound = _expert_layer_ms(p, m, c, chats, prefill=False)
        parts[bound] = parts.get(bound, 0.0) + m.moe_layers * ms
    total = sum(parts.values())
    return total, max(parts, key=parts.get)


def prefill_ms(p: Placement, m: ModelParts, c: MachineCosts, prompt: int, chunk: int) -> tuple[float, str]:
    """A prompt of `prompt` tokens in forwards of `chunk` tokens: (ms, the bottleneck in words)."""
    parts: dict[str, float] = {}
    tflops = c.cpu_tflops if p.device == "cpu" else c.experts.gpu_tflops
    dense = 0.0
    start = 0
    while start < prompt:
        n = min(chunk, prompt - start)
        # matmuls through the dense weights, attention over the keys so far (causal: start + n/2 each)
        flops = n * m.dense_flops_per_token + m.attn_layers * 4.0 * n * (start + n / 2) * m.attn_width
        dense += flops / (tflops * FLOP_PER_MS_PER_TFLOPS)
        if m.n_experts:
            ms, bound = _expert_layer_ms(p, m, c, n, prefill=True)
            parts[bound] = parts.get(bound, 0.0) + m.moe_layers * ms
        start += n
    parts["CPU compute" if p.device == "cpu" else "GPU compute"] = dense
    if p.kv_policy == "writescope" and p.device != "cpu":  # the chats' KV leaves the GPU as it is written
        parts["PCIe KV writes"] = m.kv_bytes(prompt, 1) / (c.experts.pcie_gbps * BYTES_PER_MS_PER_GBPS)
    total = sum(parts.values())
    return total, max(parts, key=parts.get)


__all__ = ["MachineCosts", "ModelParts", "Placement", "decode_ms", "lru_hit_rate", "prefill_ms", "unique_experts"]
