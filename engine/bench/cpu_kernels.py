"""`tandem bench cpu-kernels`: the native CPU kernels next to DRAM bandwidth and torch, same run.

Attention (seed 000 §6.1): decode attention of one layer over a block pool, bs sequences × L tokens
of bf16 KV in 64-token blocks placed in shuffled order (as a long-lived pool fragments), Qwen3-30B-A3B's
shape by default (32 query heads, 4 KV heads × 128: GQA 8). Reported: KV bytes read per second
for 1…N threads, next to a STREAM-style read and copy measured with the same threads, and torch's
CPU flash attention (`_scaled_dot_product_flash_attention_for_cpu`, on a contiguous copy of the
same KV — the layout it needs) with torch set to the same threads.

Experts: one SwiGLU expert (default H=2048, I=768, bf16: Qwen3-30B-A3B) for 1…256 tokens, native
vs torch (`experts_torch.expert_ffn`, oneDNN), ms per expert and weight GB/s, cycling through enough
experts that weights come from DRAM; the crossover (largest token count where native wins). With
CUDA: the same while expert fills stream over PCIe (seed 004's residual bandwidth).

MoE layer (issue #5): the CPU side of one MoE layer, per-expert calls vs one call, from a worker
thread as the engine runs it (engine/bench/cpu_moe_layer.py).

Every figure is the median of `repeats` timed calls after a warm-up. One JSON record.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

import torch

from engine.bench.common import header
from engine.bench.cpu_moe_layer import moe_layer
from engine.hw.hostmem import huge_page_advice, large_host_tensor
from engine.hw.timing import time_cpu
from engine.kernels import attention_native, experts_cpu, native
from engine.kernels.attention_native import KVBlockTable, attend_blocks
from engine.kernels.experts_torch import expert_ffn as torch_expert_ffn

QUICK_LENGTHS = [2048, 8192, 32768]
FULL_LENGTHS = [2048, 4096, 8192, 16384, 32768, 65536]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
SECTIONS = ["stream", "attention", "experts", "moe"]
BLOCK = 64  # tokens per KV block (EngineConfig.block_size's default)


def default_threads() -> list[int]:
    cores = native.available_cores()
    return sorted({t for t in (1, 2, 4, 8, 12, 16, cores - 1, cores) if 1 <= t <= cores})


def _gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / (ms * 1e-3) / 1e9, 2)


def stream(threads: list[int], nbytes: int, repeats: int) -> list[dict]:
    """STREAM-style read (sum of 64-bit words) and copy (memcpy; read + write bytes counted)."""
    nat = native.module()
    # On the pages the kernels' buffers get (huge pages where Linux has them), so the bound compares.
    src = large_host_tensor((nbytes,), torch.uint8).fill_(1)
    dst = large_host_tensor((nbytes,), torch.uint8).zero_()  # written once: its pages exist before the timed copies
    rows = []
    for t in threads:
        if nat is not None:
            read = time_cpu(lambda i: nat.stream_read(src.data_ptr(), nbytes, t), 1, repeats).median_ms
            copy = time_cpu(lambda i: nat.stream_copy(dst.data_ptr(), src.data_ptr(), nbytes, t), 1, repeats).median_ms
        else:  # torch's reduction and copy, as the fallback has nothing better
            torch.set_num_threads(t)
            words = src.view(torch.int64)
            read = time_cpu(lambda i: words.sum(), 1, repeats).median_ms
            copy = time_cpu(lambda i: dst.copy_(src), 1, repeats).median_ms
        rows.append({"threads": t, "read_GBps": _gbps(nbytes, read), "copy_GBps": _gbps(2 * nbytes, copy)})
    return rows


def _kv_pool(batch: int, length: int, n_kv: int, hs: int, dtype: torch.dtype, seed: int):
    """A block pool (N, n_kv, BLOCK, hs) for K and V, and each sequence's blocks in shuffled order."""
    per_seq = -(-length // BLOCK)
    gen = torch.Generator().manual_seed(seed)
    # Ordinary pages, as the engine's KV compute region (regions.UnpinnedRegion) holds its rows.
    k_pool = torch.empty(batch * per_seq, n_kv, BLOCK, hs, dtype=dtype).uniform_(-1, 1, generator=gen)
    v_pool = torch.empty_like(k_pool).uniform_(-1, 1, generator=gen)
    order = torch.randperm(batch * per_seq, generator=gen)
    ids = [order[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
    return k_pool, v_pool, ids


def attention(batches: list[int], lengths: list[int], threads: list[int], repeats: int, *, q_heads: int,
              kv_heads: int, head_dim: int, dtype: torch.dtype, torch_sdpa: bool, read_gbps: dict[int, float],
              progress: Callable[[str], None]) -> list[dict]:
    rows = []
    for B in batches:
        for L in lengths:
            k_pool, v_pool, ids = _kv_pool(B, L, kv_heads, head_dim, dtype, seed=B * 100003 + L)
            table = KVBlockTable.from_pool(k_pool, v_pool, ids, [L] * B)
            kv_bytes = 2 * B * L * kv_heads * head_dim * k_pool.element_size()
            q = torch.empty(B, q_heads, 1, head_dim, dtype=dtype).uniform_(-1, 1)
            out, lse = torch.empty(B, q_heads, 1, head_dim), torch.empty(B, q_heads, 1)
            dense = None
            if torch_sdpa:  # the same KV, contiguous (B, n_kv, L, hs), which torch's kernel needs
                flat = torch.cat(ids)
                k = k_pool[flat].view(B, -1, kv_heads, BLOCK, head_dim).permute(0, 2, 1, 3, 4)
                v = v_pool[flat].view(B, -1, kv_heads, BLOCK, head_dim).permute(0, 2, 1, 3, 4)
                dense = (k.reshape(B, kv_heads, -1, head_dim)[:, :, :L].contiguous(),
                         v.reshape(B, kv_heads, -1, head_dim)[:, :, :L].contiguous())
            for t in threads:
                progress(f"attention bs={B} L={L} threads={t}")
                row = {"batch": B, "length": L, "threads": t, "q_heads": q_heads, "kv_heads": kv_heads,
                       "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "block_size": BLOCK,
                       "kv_bytes": kv_bytes, "kernel": attention_native.implementation(),
                       "stream_read_GBps": read_gbps.get(t)}
                ms = time_cpu(lambda i: attend_blocks(q, table, out=out, lse=lse, threads=t), 1, repeats).median_ms
                row.update(native_ms=round(ms, 4), native_GBps=_gbps(kv_bytes, ms))
                if read_gbps.get(t):
                    row["native_fraction_of_read"] = round(row["native_GBps"] / read_gbps[t], 3)
                if dense is not None:
                    torch.set_num_threads(t)
                    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                    ms = time_cpu(lambda i: sdpa(q, dense[0], dense[1], 0.0, False, scale=head_dim ** -0.5), 1,
                                  min(repeats, 3)).median_ms
                    row.update(torch_sdpa_ms=round(ms, 4), torch_sdpa_GBps=_gbps(kv_bytes, ms))
                rows.append(row)
            k_pool = v_pool = table = dense = None  # the KV freed before the next size is made
    return rows


def experts(tokens: list[int], threads: list[int], repeats: int, *, hidden: int, ffn: int, dtype: str,
            pcie_ms: float, progress: Callable[[str], None], read_gbps: dict[int, float] | None = None) -> dict:
    from engine.hw.expert_costs import ExpertStore, concurrent_bandwidths, fill_ms, rotation
    from engine.hw.probe import probe_cpu
    from engine.hw.shapes import ExpertShape

    shape = ExpertShape(hidden=hidden, ffn=ffn, dtype=dtype)
    nbytes = shape.bytes_per_expert
    store = ExpertStore(shape, rotation(nbytes, probe_cpu().get("l3_bytes") or 64 * 2**20))
    rows = []
    # Every timed call takes the next expert of the ring, across calls and kernels: restarting at expert 0
    # for each timing re-read the first few from L3 (figures above the STREAM read).
    ring = itertools.count()
    for t in threads:
        torch.set_num_threads(t)
        native_fn = lambda x, gu, dn: experts_cpu.expert_ffn(x, gu, dn, threads=t)  # noqa: E731
        for n in tokens:
            progress(f"experts tokens={n} threads={t}")
            x = torch.empty(n, hidden, dtype=getattr(torch, dtype)).uniform_(-1, 1)
            row = {"tokens": n, "threads": t, "kernel": experts_cpu.implementation(n)}
            if native.module() is not None:
                with _native_for_all_tokens():
                    ms = time_cpu(lambda i: native_fn(x, *store.views(next(ring))), 2, repeats).median_ms
                row.update(native_ms=round(ms, 4), native_GBps=_gbps(nbytes, ms))
                if native.isa() == "amx-bf16":  # both tile kinds at every count, alternated three times
                    times = {"vector": [], "amx": []}
                    for _ in range(3):
                        for kind, threshold in (("vector", 1 << 30), ("amx", 1)):
                            with _amx_min_tokens(threshold), _native_for_all_tokens():
                                times[kind].append(time_cpu(lambda i: native_fn(x, *store.views(next(ring))), 2,
                                                            repeats).median_ms)
                    for kind, ms in times.items():
                        row[f"native_{kind}_GBps"] = _gbps(nbytes, statistics.median(ms))
                if (read_gbps or {}).get(t):  # per-core efficiency: weights read vs a plain read, same threads
                    row.update(stream_read_GBps=read_gbps[t],
                               native_fraction_of_read=round(row["native_GBps"] / read_gbps[t], 3))
            ms = time_cpu(lambda i: torch_expert_ffn(x, *store.views(next(ring))), 2, repeats).median_ms
            row.update(torch_ms=round(ms, 4), torch_GBps=_gbps(nbytes, ms))
            rows.append(row)
    out = {"hidden": hidden, "ffn": ffn, "dtype": dtype, "bytes_per_expert": nbytes, "experts_cycled": len(store.flat),
           "points": rows, "crossover_tokens": _crossover(rows)}
    if torch.cuda.is_available() and pcie_ms > 0:
        from engine.hw.hostmem import registered

        progress("experts under a concurrent PCIe fill stream")
        with registered(store.buffer):
            solo_fill = fill_ms(store, 2, repeats)
            under = {"fill_ms_alone": round(solo_fill, 4)}
            kernels = {"torch": torch_expert_ffn}
            if native.module() is not None:
                kernels["native"] = lambda x, gu, dn: experts_cpu.expert_ffn(x, gu, dn, threads=threads[-1])
            torch.set_num_threads(threads[-1])
            for name, fn in kernels.items():
                x = torch.empty(1, hidden, dtype=getattr(torch, dtype)).uniform_(-1, 1)
                alone = time_cpu(lambda i: fn(x, *store.views(i)), 2, repeats).median_ms
                both = concurrent_bandwidths(store, fn, solo_fill, pcie_ms)
                under[name] = {"threads": threads[-1], "cpu_ms_alone": round(alone, 4),
                               "cpu_ms_with_fill": round(both["cpu_ms_per_expert"], 4),
                               "slowdown": round(both["cpu_ms_per_expert"] / alone, 3),
                               "fill_GBps_with_cpu": round(both["B_P_GBps"], 2)}
        out["with_pcie_fill"] = under
    else:
        out["with_pcie_fill"] = None
        out["with_pcie_fill_reason"] = "no CUDA device" if not torch.cuda.is_available() else "disabled"
    return out


class _native_for_all_tokens:
    """Times the native kernel at every token count, whatever the crossover currently says."""

    def __enter__(self):
        self.saved = experts_cpu.native_max_tokens()
        experts_cpu.set_native_max_tokens(1 << 30)

    def __exit__(self, *exc):
        experts_cpu.set_native_max_tokens(self.saved)


class _amx_min_tokens:
    """Sends experts with at least n tokens to the AMX tiles (amx-bf16 only), then restores the setting."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.saved = native.module().amx_min_tokens()
        native.module().set_amx_min_tokens(self.n)

    def __exit__(self, *exc):
        native.module().set_amx_min_tokens(self.saved)


def _crossover(rows: list[dict]) -> dict:
    """Per thread count: the largest token count up to which native is at least as fast as torch
    at every measured count (None: torch wins already at the smallest)."""
    result = {}
    for t in sorted({r["threads"] for r in rows}):
        pts = sorted((r for r in rows if r["threads"] == t and "native_ms" in r), key=lambda r: r["tokens"])
        best = None
        for r in pts:
            if r["native_ms"] > r["torch_ms"]:
                break
            best = r["tokens"]
        result[str(t)] = best
    return result


def run(*, threads: list[int] | None = None, lengths: list[int] | None = None, batches: list[int] | None = None,
        tokens: list[int] | None = None, quick: bool = False, repeats: int = 5, torch_sdpa: bool = True,
        stream_bytes: int | None = None, q_heads: int = 32, kv_heads: int = 4, head_dim: int = 128,
        hidden: int = 2048, ffn: int = 768, pcie_ms: float = 200.0, moe_tokens: list[int] | None = None,
        moe_layer_experts: int = 8, moe_cycled: int = 64, sections: list[str] | None = None,
        progress: Callable[[str], None] = lambda s: None) -> dict:
    explicit_threads = threads is not None
    threads = threads or default_threads()
    lengths = lengths or (QUICK_LENGTHS if quick else FULL_LENGTHS)
    batches = batches or [1, 4]
    tokens = tokens or TOKENS
    cores = native.available_cores()
    record = {**header(), "benchmark": "cpu-kernels", "huge_pages": huge_page_advice(),
              "native": {"isa": native.isa(), "supported_isas": native.module().supported_isas() if native.module() else [],
                         "load_error": native.load_error()},
              "usable_cores": cores}
    torch_threads = torch.get_num_threads()
    t0 = time.perf_counter()
    wanted = set(sections or SECTIONS)
    if wanted - set(SECTIONS):
        raise ValueError(f"unknown cpu-kernels sections {sorted(wanted - set(SECTIONS))}; choose from {SECTIONS}")
    read = {}
    try:
        if "stream" in wanted:
            progress("stream read/copy")
            record["stream"] = stream(threads, stream_bytes or (256 if quick else 1024) * 2**20, repeats)
            read = {r["threads"]: r["read_GBps"] for r in record["stream"]}
        if "attention" in wanted:
            record["attention"] = attention(batches, lengths, threads, repeats, q_heads=q_heads, kv_heads=kv_heads,
                                            head_dim=head_dim, dtype=torch.bfloat16, torch_sdpa=torch_sdpa,
                                            read_gbps=read, progress=progress)
        # Thread counts given explicitly (e.g. 1,2 for per-core efficiency) apply to the experts too.
        expert_threads = (threads if explicit_threads else
                          sorted({max(1, cores - 1), threads[-1]}) if not quick else [threads[-1]])
        if "experts" in wanted:
            record["experts"] = experts(tokens, expert_threads, repeats, hidden=hidden, ffn=ffn, dtype="bfloat16",
                                        pcie_ms=pcie_ms, progress=progress, read_gbps=read)
        if "moe" in wanted:  # the engine's setting on a hybrid run: all cores but the GPU-driving one's
            record["moe"] = moe_layer(moe_tokens or [1, 4], threads if explicit_threads else [max(1, cores - 1)],
                                      repeats, hidden=hidden, ffn=ffn, layer_experts=moe_layer_experts,
                                      cycled=moe_cycled, progress=progress)
    finally:
        torch.set_num_threads(torch_threads)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["summary"] = summary(record)
    return record


def summary(record: dict) -> dict:
    """The headline figures: attention at 32K (or the longest length run) with one core left free."""
    out = {}
    for p in (record.get("moe") or {}).get("points", []):  # per-expert loop vs one call, per layer
        out[f"moe_{p['tokens_per_expert']}_tokens_threads_{p['threads']}"] = {
            "per_expert_ms": p["per_expert"]["worker_busy_main_ms"], "moe_ffn_ms": p["moe_ffn"]["worker_busy_main_ms"],
            "speedup": p["speedup_worker_busy_main"]}
    att = record.get("attention") or []
    if not att:
        return out
    cores = record["usable_cores"]
    length = 32768 if any(r["length"] == 32768 for r in att) else max(r["length"] for r in att)
    t_free = max((r["threads"] for r in att if r["threads"] <= max(1, cores - 1)), default=None)
    out.update(length=length, threads=t_free)
    for r in att:
        if r["length"] == length and r["threads"] == t_free:
            out[f"bs{r['batch']}"] = {k: r.get(k) for k in ("native_GBps", "torch_sdpa_GBps", "stream_read_GBps",
                                                            "native_fraction_of_read")}
    ex = record.get("experts") or {}
    pts = [p for p in ex.get("points", []) if p["threads"] == max(p2["threads"] for p2 in ex["points"])] if ex else []
    small = [p for p in pts if p["tokens"] <= 8 and "native_GBps" in p]
    if small:
        out["experts_1_to_8_tokens_native_GBps_min"] = min(p["native_GBps"] for p in small)
        out["experts_1_to_8_tokens_torch_GBps_min"] = min(p["torch_GBps"] for p in small)
    out["experts_crossover_tokens"] = ex.get("crossover_tokens")
    return out


def parse_list(text: str | None) -> list[int] | None:
    """'1,2,4' → [1, 2, 4]; '2k,32K' → [2048, 32768]."""
    if not text:
        return None
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        values.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return values
