"""The placement plan: where a model's parts live and which KV and expert policies run, chosen for
the user from part sizes, the memory budgets and the machine's calibrated costs (DESIGN.md §4b).

Pure arithmetic over bytes and milliseconds, no tensors. Three steps:

1. Refuse early: weights + the KV of `max_batch` chats of `max_context` tokens must fit in VRAM + RAM.
2. Enumerate the placements the engine can run — everything on the GPU; KV resident or spilled
   (writescope) × experts resident, cached in the slots the rest of the budget leaves, or all on the
   CPU; everything on the CPU when the dense weights do not fit the GPU — and predict each one's
   decode step (sched/placement_speed.py).
3. Keep the fastest. VRAM is thereby shared between KV and experts by value per byte: a byte of KV
   on the GPU is read at every step, an expert slot only when its expert is routed (top-k of E), so
   a long context or many chats hand the budget to the KV, a short one to the expert cache.

Where the caller leaves the number of chats to it, `held_chats` plans again for 4 … 1 chats and
holds the most whose KV does not slow the chat in use: KV of chats not in use is read by none of
its steps, so it never outbids the experts or the KV of the chat in use for VRAM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import chain

from engine.sched.placement_speed import GiB, MachineCosts, ModelParts, Placement, decode_ms, prefill_ms

DEVICE_RESERVE_BYTES = 1 << 30  # activations, grouped-GEMM intermediates, allocator slack (at most 10% of the budget)
HOST_RESERVE_BYTES = 2 << 30  # the process itself: torch, the tokenizer, the loader's transient copies
# Chats whose KV is held when max_batch is left to the plan: llama-server's default slots. Fewer where
# their KV would take VRAM that the chat in use reads from (experts pushed off the GPU, its KV spilled):
# 16 layers of Qwen3-30B-A3B as Q4_K_M under 8 GB, 32K context, read a 32K prompt at 6,677 tok/s and
# decoded 175 with four chats' KV planned, 29,262 and 489 with the one chat this rule holds there
# (one H100, benchmarks/h200/2026-12-06-held-chats-h100).
AUTO_CHATS = 4
# What one more held chat may cost the chat in use, as a share of its predicted decode step: above the
# rounding of the prediction (a spilled KV's D-windows move a few expert slots), far below a placement change.
HELD_CHAT_COST = 0.02


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
    max_batch: int = 1  # chats whose KV is held
    chats_reason: str = ""  # why that many, where the plan chose it (`held_chats`)
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
        chats = f"the KV of {self.max_batch} chats held" if self.max_batch > 1 else "one chat's KV held"
        return ", ".join(s for s in (where, speed) if s) + ("; " + chats if self.chats_reason else "")


def _candidates(m: ModelParts, cpu_m: ModelParts, c: MachineCosts, max_context: int, max_batch: int,
                d_window: int, block_size: int, spill_device_bytes: int) -> list[Placement]:
    ctx = -(-max_context // block_size) * block_size
    kv_full = m.kv_bytes(ctx, max_batch)
    out = [Placement("cpu", "resident", "resident", 0, 0, cpu_m.kv_bytes(ctx, max_batch))]
    if not c.gpu:
        return out
    reserve = min(DEVICE_RESERVE_BYTES, c.vram_bytes // 10)
    kv_choices, kv_window = [("resident", kv_full, 0)], 0
    if ctx > d_window and m.can_spill_kv:  # the window layers' KV (if any) stays on the GPU beside the D-windows
        kv_window = m.resident_kv_bytes(ctx, max_batch)
        kv_choices.append(("writescope", spill_device_bytes + kv_window, kv_full - kv_window))
    for kv_policy, kv_gpu, kv_host in kv_choices:
        room = c.vram_bytes - reserve - m.dense_bytes - kv_gpu
        if room < 0:
            continue
        window = kv_window if kv_policy != "resident" else 0
        if m.routed_bytes <= room:
            out.append(Placement("gpu", kv_policy, "resident", 0, kv_gpu, kv_host, window))
            continue
        if not m.can_offload_experts:
            continue
        slots = min(int(room // max(m.slot_bytes, 1)), m.n_routed)
        if slots > 0:
            out.append(Placement("gpu", kv_policy, "adaptive", slots, kv_gpu, kv_host, window))
        out.append(Placement("gpu", kv_policy, "cpu-only", 0, kv_gpu, kv_host, window))
    return out


def _memory(p: Placement, m: ModelParts) -> tuple[list[PlanRow], int, int]:
    rows: list[PlanRow] = []
    dense_where = "GPU" if p.device == "gpu" else "RAM"
    rows.append(PlanRow("embeddings and output layer", dense_where, m.embed_bytes + m.output_bytes))
    rows.append(PlanRow(f"attention and dense weights ({m.n_layers} layers)", dense_where,
                        m.n_layers * m.layer_dense_bytes))
    if m.n_experts:
        if p.device == "cpu" or p.expert_policy == "cpu-only":
            rows.append(PlanRow("routed experts (all)", "RAM", m.host_routed_bytes))
        elif p.expert_policy == "resident":
            rows.append(PlanRow("routed experts (all)", "GPU", m.routed_bytes))
        else:
            rows.append(PlanRow("routed experts (cache)", "GPU", p.slots * m.slot_bytes))
            rows.append(PlanRow("routed experts (store)", "RAM", m.host_routed_bytes))
    if p.device == "cpu":
        rows.append(PlanRow("KV cache", "RAM", p.kv_host_bytes))
    elif p.kv_policy == "resident":
        rows.append(PlanRow("KV cache", "GPU", p.kv_gpu_bytes))
    else:
        rows.append(PlanRow("KV D-window and ping-pong", "GPU", p.kv_gpu_bytes - p.kv_window_bytes))
        if p.kv_window_bytes:
            rows.append(PlanRow(f"KV of the sliding-window layers ({m.resident_kv_layers})", "GPU",
                                p.kv_window_bytes))
        rows.append(PlanRow("KV cache (spilled)", "RAM", p.kv_host_bytes))
    vram = sum(r.bytes for r in rows if r.where == "GPU")
    ram = sum(r.bytes for r in rows if r.where == "RAM")
    return rows, vram, ram


def _label(p: Placement) -> str:
    return f"{p.device}: kv {p.kv_policy}, experts {p.expert_policy}" + (f" ({p.slots} slots)" if p.slots else "")


def plan(m: ModelParts, c: MachineCosts, *, max_context: int, max_batch: int, spill_device_bytes: int,
         prefill_chunk: int, d_window: int = 256, block_size: int = 64, cpu_parts: ModelParts | None = None) -> Plan:
    """The fastest placement of `m` that fits, by predicted decode time over a chat's life (the mean
    of its start and its full context), ties to the one using less VRAM; or a Plan with fits=False
    saying what does not fit and what would.

    spill_device_bytes: what spilled KV keeps on the GPU (the D-window of every chat and the two
    ping-pong buffers: kv/partition.py's PartitionSpec.device_bytes). cpu_parts: the model in the
    CPU's dtype, when the engine computes in another one there (fp32 on the CPU, bf16 on a GPU).
    prefill_chunk: tokens per prefill forward (runtime/generator.py)."""
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
    pre_ms, pre_bound = prefill_ms(p, mp, c, max_context, prefill_chunk)
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


def held_chats(plan_for) -> Plan:
    """The plan of the most chats, up to AUTO_CHATS, whose KV leaves one chat's predicted decode step
    within HELD_CHAT_COST of the one-chat plan's; `chats_reason` says why that many.
    plan_for: chats → Plan."""
    one = plan_for(1)
    if not one.fits:
        return one
    more = plan_for(AUTO_CHATS)  # fewer chats are planned only when this many would cost something
    chosen = next((p for p in chain([more], map(plan_for, range(AUTO_CHATS - 1, 1, -1)))
                   if p.fits and p.device == one.device and _step_ms(p) <= _step_ms(one) * (1 + HELD_CHAT_COST)), one)
    n = chosen.max_batch
    if n == AUTO_CHATS:
        chosen.chats_reason = f"the KV of {n} chats fits beside the chat in use without slowing it"
    else:
        chosen.chats_reason = (
            f"the KV of {AUTO_CHATS} chats does not fit" if not more.fits else
            f"the KV of {AUTO_CHATS} chats would slow the chat in use to about {more.decode_tok_s:.0f} tok/s "
            f"from {one.decode_tok_s:.0f}") + \
            f"; {n} {'chats are' if n > 1 else 'chat is'} held, and a chat reopened after others re-reads its history"
    return chosen


def _step_ms(p: Plan) -> float:
    """A chat's predicted decode step over its life (the mean of its start and full context), ms: what
    `plan` ranks placements by."""
    return (1000.0 / p.decode_tok_s + 1000.0 / p.decode_tok_s_short) / 2


def _reason(p: Placement, m: ModelParts, c: MachineCosts) -> str:
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


__all__ = ["AUTO_CHATS", "GiB", "MachineCosts", "ModelParts", "Plan", "PlanRow", "held_chats", "plan"]
