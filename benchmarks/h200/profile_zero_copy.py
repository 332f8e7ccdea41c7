"""How fast the GPU reads experts in place from the pinned host store, and what the whole-step graph
of `adaptive` decodes at, each decode form forced (CUDA only).

    python3 benchmarks/h200/profile_zero_copy.py OUT_DIR [MODEL SLOTS]

1. `moe_decode` (with the pairs read from the store also copying into free slots) over Qwen3-30B-A3B-shaped experts (H=2048, I=768, bf16, 9.4 MB) for one token's 8
   experts: all in cache slots, all in the host store (read over PCIe in place), one of 8 in the
   store; and 4 tokens × 8 distinct store experts. Next to it, the DMA copy of one expert into a
   slot and a plain Triton read of the store (sum of 16 KiB rows per program), for the link's rate.
2. MODEL (default synthetic:qwen3-30b-a3b-L16, 737 slots) under `adaptive`, decode at bs=1 and 4
   with the step form forced to the whole-step graph, then to pieces: tok/s, hit rate, PCIe reads.
Writes OUT_DIR/zero-copy.json.
"""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from engine.experts.cache import ExpertCache
from engine.experts.store import ExpertStore
from engine.hw.hostmem import device_address
from engine.kernels.moe_decode_gpu import moe_decode

H, I, E = 2048, 768, 64


@triton.jit
def _sum_rows(src, out, ROW: tl.constexpr):
    p = tl.program_id(0)
    v = tl.load(src + p.to(tl.int64) * ROW + tl.arange(0, ROW)).to(tl.float32)
    tl.store(out + p, tl.sum(v, 0))


def _time(fn, repeats=20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]  # ms, median


def kernels() -> dict:
    store = ExpertStore.empty(1, [0], E, H, I, torch.bfloat16, pin=True)
    store.blocks.copy_(torch.randn(store.blocks.shape, dtype=torch.bfloat16) * 0.02)
    cache = ExpertCache(8, H, I, torch.bfloat16, torch.device("cuda"))
    for s in range(8):
        cache.copy_in(s, store.block(0, s))
    cache.synchronize()
    elt = 2
    host = (device_address(store.blocks) - cache.pool.data_ptr()) // elt
    offsets = torch.tensor([s * cache.pool.shape[1] if s < 8 else host + s * store.block_numel for s in range(E)],
                           device="cuda")
    mb = store.block_bytes / 1e6
    x1 = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    w1 = torch.full((1, 8), 0.125, device="cuda", dtype=torch.bfloat16)
    res = {}
    for name, ids in {"1 token, 8 in slots": [list(range(8))], "1 token, 8 in the store": [list(range(8, 16))],
                      "1 token, 7 in slots + 1 in the store": [list(range(7)) + [20]]}.items():
        t = _time(lambda: moe_decode(x1, torch.tensor(ids, device="cuda"), w1, cache.gate_up, cache.down, offsets=offsets))
        res[name] = {"ms": round(t, 4), "gbps": round(8 * mb / t, 1)}
    x4 = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    ids4 = torch.arange(16, 48, device="cuda").view(4, 8)
    t = _time(lambda: moe_decode(x4, ids4, w1.expand(4, 8).contiguous(), cache.gate_up, cache.down, offsets=offsets))
    res["4 tokens, 32 distinct in the store"] = {"ms": round(t, 4), "gbps": round(32 * mb / t, 1)}
    t = _time(lambda: cache.pool[0].copy_(store.block(0, 30), non_blocking=True))
    res["DMA copy of one expert into a slot"] = {"ms": round(t, 4), "gbps": round(mb / t, 1)}
    src = store.blocks[16:48].reshape(-1)  # 32 experts, 300 MB
    for row in (4096, 8192):
        out = torch.empty(src.numel() // row, device="cuda")
        t = _time(lambda: _sum_rows[(out.numel(),)](src, out, ROW=row), repeats=10)
        res[f"Triton read of the store, {row * 2 // 1024} KiB per program"] = {
            "ms": round(t, 3), "gbps": round(src.numel() * 2 / t / 1e6, 1)}
    store.close()
    return res


def forms(model: str, slots: int) -> list[dict]:
    from engine.api import Engine, EngineConfig
    from profile_offload import decode_batch  # the script's folder is on the path

    engine = Engine(EngineConfig(model=model, backend="tandem", device="cuda", expert_policy="adaptive",
                                 expert_cache_slots=slots, max_batch=4, max_context=1024, cpu_threads=15))
    vocab = engine.info()["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    runs = []
    try:
        for bs in (1, 4):
            for form in ("graph", "pieces"):
                graphs = engine.backend.generator.graphs
                graphs.chooser.form = lambda B, form=form: form  # forced
                sessions = [f"{form}-{bs}-{i}" for i in range(bs)]
                history = [torch.randint(0, vocab, (512,), generator=gen).tolist() for _ in range(bs)]

                def decode(n: int) -> float:
                    return decode_batch(engine, history, sessions, n)

                decode(4)
                ex = engine.backend.parts.experts
                before = ex.telemetry()
                dt = decode(32)
                after = ex.telemetry()
                zc0, zc1 = before["zero_copy"], after["zero_copy"]
                d = lambda k: after[k] - before[k]  # noqa: E731
                run = {"form": form, "batch": bs, "tok_s": round(32 * bs / dt, 2),
                       "hit_rate": round(d("hits") / max(1, d("hits") + d("misses")), 4),
                       "zero_copy_experts": zc1["zero_copy_experts"] - zc0["zero_copy_experts"],
                       "free_slots_listed": zc1["free_slots_listed"],
                       "graph_fills": zc1["graph_fills"] - zc0["graph_fills"], "fills": d("fills"),
                       "cpu_executed": d("cpu_executed"), "run_s": round(d("run_s"), 4),
                       "cuda_graphs": engine.info()["cuda_graphs"]}
                runs.append(run)
                print(json.dumps(run), flush=True)
                for s in sessions:
                    engine.end_session(s)
    finally:
        engine.close()
    return runs


def main() -> None:
    out = Path(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else "synthetic:qwen3-30b-a3b-L16"
    slots = int(sys.argv[3]) if len(sys.argv) > 3 else 737
    out.mkdir(parents=True, exist_ok=True)
    record = {"kernels": kernels()}
    print(json.dumps(record["kernels"], indent=1), flush=True)
    record["forms"] = forms(model, slots)
    (out / "zero-copy.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
