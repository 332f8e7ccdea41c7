"""The placement plan: where a model's parts live and which KV and expert policies run, chosen for
the user from part sizes, the memory budgets and the machine's calibrated costs (DESIGN.md §4b).

Pure arithmetic over bytes and milliseconds, no tensors. Three steps:

1. Refuse early: weights + the KV of `max_batch` chats of `max_context` tokens must fit in VRAM + RAM.
2. Enumerate the placements the engine can run — everything on the GPU; KV resident or spilled
   (writescope) × experts resident, cached in the slots the rest of the budget leaves, or all on the
   CPU; everything on the CPU when the dense weights do not fit the GPU — and predict each one's
   decode step from the same cost models the engine schedules with (sched/roofline.py for the KV,
   sched/expert_cost.py for the experts).
3. Keep the fastest. VRAM is thereby shared between KV and experts by value per byte: a byte of KV
   on the GPU is read at every step, an expert slot only when its expert is routed (top-k of E), so
   a long context or many chats hand the budget to the KV, a short one to the expert cache.

Units: bytes, milliseconds, GB/s (1e6 bytes/ms), TFLOP/s (1e9 FLOP/ms). The constants below were
measured on the GPU machine (16 layers of Qwen3-30B-A3B, bf16, H200, CUDA graphs); a calibration
profile replaces the bandwidths and expert costs (`MachineCosts`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.sched.expert_cost import BYTES_PER_MS_PER_GBPS, FLOP_PER_MS_PER_TFLOPS, ExpertCostModel
from engine.sched.roofline import RooflineParams

GiB = 2**30
DEVICE_RESERVE_BYTES = 1 << 30  # activations, grouped-GEMM intermediates, allocator slack (at most 10% of the budget)
HOST_RESERVE_BYTES = 2 << 30  # the process itself: torch, the tokenizer, the loader's transient copies
PREFILL_CHUNK = 512  # tokens per prefill forward (runtime/generator.py)
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
    def weights_bytes(self) -> int:
        return self.dense_bytes + self.routed_bytes

    def kv_bytes(self, tokens: int, chats: int) -> int:
        return self.kv_bytes_per_token * tokens * chats


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


@dataclass
class PlanRow:
    part: str
    where: str  # "GPU" | "RAM"
    bytes: int


@dataclass
class Plan:
    """The chosen placement, what it costs in memory, and its predicted speed."""

    fits: bool
    device: str  # "gpu" (the engine's compute device holds the dense weights) | "cpu"
    kv_policy: str
    expert_policy: str
    expert_cache_slots: int | None  # GPU slots of an offloaded expert cache (None: not offloaded)
    kv_gpu_tokens: int  # tokens of each chat whose KV stays on the GPU (the rest spills to host memory)
    d_window: int
    r_start: float | None  # the KV split's CPU share at the full context (None: no split)
    rows: list[PlanRow] = field(default_factory=list)
    vram_bytes: int = 0
    ram_bytes: int = 0
    vram_available: int = 0
    ram_available: int = 0
    max_context: int = 0
    max_batch: int = 1
    decode_tok_s: float | None = None  # one chat at the full context
    decode_tok_s_short: float | None = None  # one chat at the start of a chat
    decode_tok_s_all: float | None = None  # all max_batch chats together at the full context
    prefill_tok_s: float | None = None  # a prompt of the full context
    bottleneck: str = ""
    reason: str = ""  # why this placement, in a sentence
    problem: str | None = None  # when it does not fit: what
    remedy: str | None = None  # … and what would make it fit
    costs_source: str = "defaults"
    simulated: bool = False  # the "GPU" is the CPU standing in for one (simulate_hybrid)
    candidates: list[dict] = field(default_factory=list)  # every placement considered, with its prediction

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line for a person: where things live and about how fast."""
        if not self.fits:
            return f"does not fit: {self.problem}"
        if self.device == "cpu":
            where = "runs on the CPU"
        elif self.expert_policy == "resident" and self.kv_policy == "resident":
            where = "fits on the GPU"
        else:
            parts = []
            if self.expert_policy not in ("resident", "auto"):
                if self.expert_cache_slots:
                    n = next((r.bytes for r in self.rows if r.part == "routed experts (cache)"), 0)
                    total = sum(r.bytes for r in self.rows if r.part.startswith("routed experts ("))
                    parts.append(f"experts cached {n / max(total, 1):.0%} on the GPU, the rest in RAM")
                else:
                    parts.append("experts in RAM, computed on the CPU")
            if self.kv_policy != "resident":
                parts.append(f"KV on the GPU for the newest {self.kv_gpu_tokens} tokens, the rest in RAM")
            else:
                parts.append(f"KV on the GPU up to {self.kv_gpu_tokens:,} tokens")
            where = "fits: " + "; ".join(parts)
        speed = f"about {self.decode_tok_s:.0f} tok/s" if self.decode_tok_s else ""
        return ", ".join(s for s in (where, speed) if s)


# -- the decode and prefill models -----------------------------------------------------------------

@dataclass(frozen=True)
class _Placement:
    device: str  # "gpu" | "cpu"
    kv_policy: str  # "resident" | "writescope"
    expert_policy: str  # "resident" | "adaptive" | "cpu-only"
    slots: int  # expert cache slots (offloaded policies)
    kv_gpu_bytes: int
    kv_host_bytes: int


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


def _expert_layer_ms(p: _Placement, m: ModelParts, c: MachineCosts, tokens: int, prefill: bool) -> tuple[float, str]:
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


def _attention_layer_ms(p: _Placement, m: ModelParts, c: MachineCosts, context: int, chats: int,
                        d_window: int) -> float:
    layer_token_bytes = m.kv_bytes_per_token / max(m.n_layers, 1)
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


def decode_ms(p: _Placement, m: ModelParts, c: MachineCosts, context: int, chats: int, d_window: int
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
    attn = m.n_layers * _attention_layer_ms(p, m, c, context, chats, d_window)
    parts["KV in host memory" if p.kv_policy != "resident" and p.device != "cpu" else "attention"] = attn
    if m.n_experts:
        ms, bound = _expert_layer_ms(p, m, c, chats, prefill=False)
        parts[bound] = parts.get(bound, 0.0) + m.moe_layers * ms
    total = sum(parts.values())
    return total, max(parts, key=parts.get)


def prefill_ms(p: _Placement, m: ModelParts, c: MachineCosts, prompt: int) -> tuple[float, str]:
    """A prompt of `prompt` tokens in chunks of PREFILL_CHUNK: (ms, the bottleneck in words)."""
    parts: dict[str, float] = {}
    tflops = c.cpu_tflops if p.device == "cpu" else c.experts.gpu_tflops
    dense = 0.0
    start = 0
    while start < prompt:
        n = min(PREFILL_CHUNK, prompt - start)
        # matmuls through the dense weights, attention over the keys so far (causal: start + n/2 each)
        flops = n * m.dense_flops_per_token + m.n_layers * 4.0 * n * (start + n / 2) * m.attn_width
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


# -- choosing --------------------------------------------------------------------------------------

def _candidates(m: ModelParts, cpu_m: ModelParts, c: MachineCosts, max_context: int, max_batch: int,
                d_window: int, block_size: int, spill_device_bytes: int) -> list[_Placement]:
    ctx = -(-max_context // block_size) * block_size
    kv_full = m.kv_bytes(ctx, max_batch)
    out = [_Placement("cpu", "resident", "resident", 0, 0, cpu_m.kv_bytes(ctx, max_batch))]
    if not c.gpu:
        return out
    reserve = min(DEVICE_RESERVE_BYTES, c.vram_bytes // 10)
    kv_choices = [("resident", kv_full, 0)]
    if ctx > d_window:
        kv_choices.append(("writescope", spill_device_bytes, kv_full))
    for kv_policy, kv_gpu, kv_host in kv_choices:
        room = c.vram_bytes - reserve - m.dense_bytes - kv_gpu
        if room < 0:
            continue
        if m.routed_bytes <= room:
            out.append(_Placement("gpu", kv_policy, "resident", 0, kv_gpu, kv_host))
            continue
        slots = int(room // max(m.expert_bytes, 1))
        if slots > 0:
            out.append(_Placement("gpu", kv_policy, "adaptive", slots, kv_gpu, kv_host))
        out.append(_Placement("gpu", kv_policy, "cpu-only", 0, kv_gpu, kv_host))
    return out


def _memory(p: _Placement, m: ModelParts) -> tuple[list[PlanRow], int, int]:
    rows: list[PlanRow] = []
    dense_where = "GPU" if p.device == "gpu" else "RAM"
    rows.append(PlanRow("embeddings and output layer", dense_where, m.embed_bytes + m.output_bytes))
    rows.append(PlanRow(f"attention and dense weights ({m.n_layers} layers)", dense_where,
                        m.n_layers * m.layer_dense_bytes))
    if m.n_experts:
        if p.device == "cpu" or p.expert_policy == "cpu-only":
            rows.append(PlanRow("routed experts (all)", "RAM", m.routed_bytes))
        elif p.expert_policy == "resident":
            rows.append(PlanRow("routed experts (all)", "GPU", m.routed_bytes))
        else:
            rows.append(PlanRow("routed experts (cache)", "GPU", p.slots * m.expert_bytes))
            rows.append(PlanRow("routed experts (store)", "RAM", m.routed_bytes))
    if p.device == "cpu":
        rows.append(PlanRow("KV cache", "RAM", p.kv_host_bytes))
    elif p.kv_policy == "resident":
        rows.append(PlanRow("KV cache", "GPU", p.kv_gpu_bytes))
    else:
        rows.append(PlanRow("KV D-window and ping-pong", "GPU", p.kv_gpu_bytes))
        rows.append(PlanRow("KV cache (spilled)", "RAM", p.kv_host_bytes))
    vram = sum(r.bytes for r in rows if r.where == "GPU")
    ram = sum(r.bytes for r in rows if r.where == "RAM")
    return rows, vram, ram


def _label(p: _Placement) -> str:
    return f"{p.device}: kv {p.kv_policy}, experts {p.expert_policy}" + (f" ({p.slots} slots)" if p.slots else "")


def plan(m: ModelParts, c: MachineCosts, *, max_context: int, max_batch: int, spill_device_bytes: int,
         d_window: int = 256, block_size: int = 64, cpu_parts: ModelParts | None = None) -> Plan:
    """The fastest placement of `m` that fits, by predicted decode time over a chat's life (the mean
    of its start and its full context), ties to the one using less VRAM; or a Plan with fits=False
    saying what does not fit and what would.

    spill_device_bytes: what spilled KV keeps on the GPU (the D-window of every chat and the two
    ping-pong buffers: kv/partition.py's PartitionSpec.device_bytes). cpu_parts: the model in the
    CPU's dtype, when the engine computes in another one there (fp32 on the CPU, bf16 on a GPU)."""
    cpu_m = cpu_parts or m
    host_room = c.ram_bytes - HOST_RESERVE_BYTES
    best: tuple | None = None
    considered = []
    for p in _candidates(m, cpu_m, c, max_context, max_batch, d_window, block_size, spill_device_bytes):
        mp = cpu_m if p.device == "cpu" else m
        rows, vram, ram = _memory(p, mp)
        if ram > host_room:
            considered.append({"placement": _label(p), "fits": False, "ram_bytes": ram, "vram_bytes": vram})
            continue
        full, bound = decode_ms(p, mp, c, max_context, 1, d_window)
        short, _ = decode_ms(p, mp, c, min(max_context, d_window), 1, d_window)
        score = (full + short) / 2
        considered.append({"placement": _label(p), "fits": True, "vram_bytes": vram, "ram_bytes": ram,
                           "decode_tok_s": round(1000.0 / full, 2)})
        key = (score, vram)
        if best is None or key < best[0]:
            best = (key, p, mp, rows, vram, ram, full, short, bound)
    if best is None:
        return _refusal(m, cpu_m, c, max_context, max_batch, d_window, block_size, spill_device_bytes, considered)
    _, p, mp, rows, vram, ram, full, short, bound = best
    all_ms, _ = decode_ms(p, mp, c, max_context, max_batch, d_window)
    pre_ms, pre_bound = prefill_ms(p, mp, c, max_context)
    r_start = None
    if p.device == "gpu" and p.kv_policy == "writescope":
        A, B = c.kv.A_ns_per_token, c.kv.B_ns_per_token
        placed = max(1, max_context - d_window)
        r_start = min(1.0, max(0.0, B / (A + B) + c.kv.delta_ms * 1e6 / ((A + B) * placed)))
    return Plan(
        fits=True, device=p.device, kv_policy=p.kv_policy, expert_policy=p.expert_policy,
        expert_cache_slots=p.slots if p.expert_policy in ("adaptive", "cpu-only") and p.device == "gpu" else None,
        kv_gpu_tokens=0 if p.device == "cpu" else (max_context if p.kv_policy == "resident" else d_window),
        d_window=d_window, r_start=r_start, rows=rows, vram_bytes=vram, ram_bytes=ram,
        vram_available=c.vram_bytes if c.gpu else 0, ram_available=c.ram_bytes, max_context=max_context,
        max_batch=max_batch, decode_tok_s=1000.0 / full, decode_tok_s_short=1000.0 / short,
        decode_tok_s_all=1000.0 * max_batch / all_ms, prefill_tok_s=1000.0 * max_context / pre_ms,
        bottleneck=f"decode: {bound}; prefill: {pre_bound}", reason=_reason(p, mp, c),
        costs_source=c.costs_source, simulated=c.simulated, candidates=considered)


def _reason(p: _Placement, m: ModelParts, c: MachineCosts) -> str:
    if not c.gpu:
        return "no GPU: every part runs on the CPU from RAM"
    if p.device == "cpu":
        return (f"the dense weights ({m.dense_bytes / GiB:.2f} GiB) leave no room on the GPU "
                f"({c.vram_bytes / GiB:.2f} GiB, {c.budget_source}): every part runs on the CPU")
    if p.expert_policy == "resident" and p.kv_policy == "resident":
        return "everything fits on the GPU"
    return "the fastest predicted placement that fits the GPU budget; the rest lives in RAM"


def _fits(m: ModelParts, cpu_m: ModelParts, c: MachineCosts, context: int, max_batch: int, d_window: int,
          block_size: int, spill_device_bytes: int) -> bool:
    host_room = c.ram_bytes - HOST_RESERVE_BYTES
    for p in _candidates(m, cpu_m, c, context, max_batch, d_window, block_size, spill_device_bytes):
        if _memory(p, cpu_m if p.device == "cpu" else m)[2] <= host_room:
            return True
    return False


def _refusal(m: ModelParts, cpu_m: ModelParts, c: MachineCosts, max_context: int, max_batch: int, d_window: int,
             block_size: int, spill_device_bytes: int, considered: list[dict]) -> Plan:
    ctx = -(-max_context // block_size) * block_size
    kv = m.kv_bytes(ctx, max_batch)
    tips = []
    lo, hi = 0, ctx // block_size  # the longest context (in blocks) that fits, if any does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(m, cpu_m, c, mid * block_size, max_batch, d_window, block_size, spill_device_bytes):
            lo = mid
        else:
            hi = mid - 1
    if lo:
        tips.append(f"a context of at most {lo * block_size:,} tokens (max_context)")
    if max_batch > 1 and _fits(m, cpu_m, c, max_context, 1, d_window, block_size, spill_device_bytes):
        tips.append("one chat at a time (max_batch 1)")
    tips.append("a smaller or more quantised model file")
    tips.append("closing other programs to free RAM")
    problem = (f"{m.name} needs {(m.weights_bytes + kv) / GiB:.1f} GiB: weights {m.weights_bytes / GiB:.1f} GiB "
               f"and the KV of {max_batch} × {max_context:,} tokens {kv / GiB:.1f} GiB; this machine offers "
               f"{max(0, c.ram_bytes - HOST_RESERVE_BYTES) / GiB:.1f} GiB of RAM"
               + (f" and {c.vram_bytes / GiB:.1f} GiB of VRAM (the routed experts live in RAM even when "
                  f"the GPU caches some)" if c.gpu else " and no GPU"))
    return Plan(fits=False, device="none", kv_policy="none", expert_policy="none", expert_cache_slots=None,
                kv_gpu_tokens=0, d_window=0, r_start=None, vram_available=c.vram_bytes if c.gpu else 0,
                ram_available=c.ram_bytes, max_context=max_context, max_batch=max_batch,
                bottleneck="memory", problem=problem, remedy="try " + ", or ".join(tips),
                costs_source=c.costs_source, candidates=considered)


__all__ = ["MachineCosts", "ModelParts", "Plan", "PlanRow", "decode_ms", "lru_hit_rate", "plan", "prefill_ms",
           "unique_experts"]
