"""The GPU kernels over GGUF blocks at Qwen3-30B-A3B's shapes, against the bytes they must read.

    python3 -m engine.bench.quant_gpu                  # the table (needs CUDA)
    python3 -m engine.bench.quant_gpu --json out.json  # the record, with the machine's header

Rows, each the median of `--reps` CUDA-graph replays (no launch cost in the figure):
  - a MoE layer's 8 routed experts of one token (Q4_K gate/up, Q6_K down, as Q4_K_M lays them out)
    by `quant_moe_gpu.moe_decode_quant` over a pool of 256 slots, at each tile setting of the sweep;
    beside it `moe_decode_gpu.moe_decode` over the same experts in BF16;
  - dense products at one token by `quant_linear_gpu.linear`: q_proj 4096×2048 Q4_K, o_proj 2048×4096
    Q4_K and the output head 151936×2048 Q6_K at each tile setting of its sweep, beside `F.linear` over
    the same weights in BF16;
  - a prefill chunk's routed experts (512 tokens, 128 experts of Q4_K/Q4_K/Q6_K) by
    `quant_moe_gemm_gpu.moe_prefill_quant` at each tile setting of its sweep, beside torch's grouped
    GEMM over the same experts in BF16;
  - the device's copy bandwidth (a 1 GiB tensor copied: read + write), the bound a GEMV can reach.
GB/s counts the bytes the kernel must read (quantised blocks, or BF16 weights). The blocks are random
bytes with small fp16 factors: the kernels' work does not depend on the values.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from engine.kernels import quant_moe_gemm_gpu

H, I, TOP_K, SLOTS = 2048, 768, 8, 256  # Qwen3-30B-A3B's expert shapes, a decode step's routing
# The kernels' tile settings swept. A program's loop waits on memory once an iteration: 8 experts of one
# token took 42–44 µs whether a weight cost 14 PTX instructions or 6 (benchmarks/h200/2026-12-05-int16-dot-h100),
# so the sweep varies the iterations a program makes (CHUNK sub-blocks of a row a step) and the warps.
SWEEP = {"ROWS_GATE_UP": (4, 8), "ROWS_DOWN": (8, 16), "CHUNK": (8, 16, 32), "WARPS": (4, 8)}
LINEAR_SWEEP = {"ROWS": (4, 8, 16), "CHUNK": (8, 16, 32), "WARPS": (4, 8)}  # quant_linear_gpu's tile at one token
# A prefill chunk (runtime/generator.py PREFILL_CHUNK) over a layer's experts: quant_moe_gemm_gpu's tile
PREFILL_TOKENS, EXPERTS = 512, 128
PREFILL_SWEEP = {"BM": (16, 32, 64), "BN": (64, 128), "SUB": (2, 4), "WARPS": (4, 8)}


def random_blocks(n_rows: int, cols: int, code: int, gen: torch.Generator, device) -> torch.Tensor:
    """(n_rows, row bytes) uint8 of ggml type `code`: random bytes, every fp16 factor 2^-10."""
    from engine.quant.blocks import qtype

    qt = qtype(code)
    w = torch.randint(0, 256, (n_rows, cols // qt.block_weights, qt.block_bytes), dtype=torch.uint8, generator=gen)
    half = torch.tensor([2.0 ** -10], dtype=torch.float16).view(torch.uint8)
    for at in {12: (0, 2), 13: (0, 2), 14: (208,), 8: (0,)}.get(code, ()):
        w[..., at:at + 2] = half
    return w.reshape(n_rows, -1).to(device)


def graph_us(fn, reps: int) -> float:
    """Median µs of one call of fn, captured once as a CUDA graph and replayed `reps` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def timed(fn, reps: int, nbytes: int) -> dict:
    """{"us", "GBps"} of fn reading nbytes, or {"error"}: one setting of a sweep that does not launch
    here is a row of the record, not the end of the run."""
    try:
        us = graph_us(fn, reps)
    except Exception as e:  # a tile the device refuses (grid or register limits)
        torch.cuda.synchronize()
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    return {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}


def swept(module, settings: dict, sweep: bool, measure) -> list[dict]:
    """measure() → a row, at each combination of the values `settings` gives module's tile constants
    (sweep=False: their current values only), each row led by its setting; the constants restored."""
    combos = list(itertools.product(*settings.values())) if sweep else [tuple(getattr(module, k) for k in settings)]
    default = {k: getattr(module, k) for k in settings}
    rows = []
    try:
        for values in combos:
            for k, v in zip(settings, values):
                setattr(module, k, v)
            rows.append({**dict(zip(settings, values)), **measure()})
    finally:
        for k, v in default.items():
            setattr(module, k, v)
    return rows


def copy_gbps(reps: int) -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), max(5, reps // 20))
    return 2 * a.numel() / us / 1e3  # read + write


def run(reps: int = 200, sweep: bool = True) -> dict:
    from engine.experts.store import QuantLayout
    from engine.kernels import moe_decode_gpu, quant_linear_gpu, quant_moe_gpu
    from engine.quant.blocks import QuantTensor

    if not torch.cuda.is_available():
        raise SystemExit("engine.bench.quant_gpu times CUDA kernels: no CUDA device here")
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    layout = QuantLayout((12, 12, 14), H, I)  # Q4_K, Q4_K, Q6_K
    pool = torch.cat([random_blocks(SLOTS * rows, cols, code, gen, dev).view(SLOTS, -1)
                      for code, rows, cols, _, _ in layout.parts], dim=1)  # (S, B): gate | up | down
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    ids = torch.randperm(SLOTS, generator=gen)[:TOP_K].view(1, TOP_K).to(dev)
    w = torch.softmax(torch.randn(1, TOP_K, generator=gen), -1).to(dev, torch.bfloat16)
    expert_bytes = TOP_K * layout.nbytes
    rows = [{"what": "8 experts, 1 token, Q4_K/Q4_K/Q6_K blocks", **row} for row in swept(
        quant_moe_gpu, SWEEP, sweep,
        lambda: timed(lambda: quant_moe_gpu.moe_decode_quant(x, ids, w, pool, layout.kernel_parts, I), reps,
                      expert_bytes))]
    bf16 = torch.randn(SLOTS, 3 * H * I, device=dev, dtype=torch.bfloat16) * 0.02
    gate_up, down = bf16[:, :2 * I * H].unflatten(1, (2 * I, H)), bf16[:, 2 * I * H:].unflatten(1, (H, I))
    rows.append({"what": "8 experts, 1 token, BF16 (moe_decode)",
                 **timed(lambda: moe_decode_gpu.moe_decode(x, ids, w, gate_up, down), reps, TOP_K * 3 * H * I * 2)})
    for name, code, n_out, n_in in (("q_proj 4096×2048 Q4_K", 12, 4096, H), ("o_proj 2048×4096 Q4_K", 12, H, 4096),
                                    ("output head 151936×2048 Q6_K", 14, 151936, H)):
        blocks = random_blocks(n_out, n_in, code, gen, dev)
        qw = QuantTensor(blocks, code, (n_out, n_in), name)
        xin = torch.randn(1, n_in, device=dev, dtype=torch.bfloat16)
        rows += [{"what": f"{name}, 1 token", **row} for row in swept(
            quant_linear_gpu, LINEAR_SWEEP, sweep, lambda: timed(lambda: quant_linear_gpu.linear(xin, qw), reps,
                                                                 blocks.numel()))]
        dense = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16)
        rows.append({"what": f"{name.rsplit(' ', 1)[0]} BF16 (F.linear), 1 token",
                     **timed(lambda: F.linear(xin, dense), reps, dense.numel() * 2)})
    rows += prefill_rows(reps, sweep, gen, dev)
    return {"rows": rows, "device_copy_GBps": round(copy_gbps(reps), 1),
            "defaults": {**{k: getattr(quant_moe_gpu, k) for k in SWEEP},
                         **{f"linear {k}": getattr(quant_linear_gpu, k) for k in LINEAR_SWEEP},
                         **{f"prefill {k}": getattr(quant_moe_gemm_gpu, k) for k in PREFILL_SWEEP}}}


def prefill_rows(reps: int, sweep: bool, gen: torch.Generator, dev) -> list[dict]:
    """A prefill chunk's routed experts: PREFILL_TOKENS tokens over EXPERTS experts of Q4_K/Q4_K/Q6_K
    blocks (one pool row each, the resident form) by `quant_moe_gemm_gpu.moe_prefill_quant` at each tile
    of its sweep, beside torch's grouped GEMM over the same experts in BF16 (3.5× the bytes)."""
    from engine.experts.store import QuantLayout
    from engine.kernels import experts_gpu

    layout = QuantLayout((12, 12, 14), H, I)
    pool = torch.cat([random_blocks(EXPERTS * rows, cols, code, gen, dev).view(EXPERTS, -1)
                      for code, rows, cols, _, _ in layout.parts], dim=1)  # (E, B)
    x = torch.randn(PREFILL_TOKENS, H, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(PREFILL_TOKENS, EXPERTS, generator=gen).topk(TOP_K, dim=1).indices.to(dev)  # (N, k)
    w = torch.softmax(torch.randn(PREFILL_TOKENS, TOP_K, generator=gen), -1).to(dev, torch.bfloat16)
    row_of = torch.arange(EXPERTS, device=dev)
    flops = 2 * PREFILL_TOKENS * TOP_K * 3 * H * I
    what = f"{PREFILL_TOKENS} tokens over {EXPERTS} experts, Q4_K/Q4_K/Q6_K blocks"
    def measure() -> dict:
        row = timed(lambda: quant_moe_gemm_gpu.moe_prefill_quant(x, ids, w, pool, layout.kernel_parts, I, row_of),
                    reps, EXPERTS * layout.nbytes)
        return {**row, **({"TFLOPs": round(flops / row["us"] / 1e6, 1)} if "us" in row else {})}

    rows = [{"what": what, **row} for row in swept(quant_moe_gemm_gpu, PREFILL_SWEEP, sweep, measure)]
    bf16 = torch.randn(EXPERTS, 3 * H * I, device=dev, dtype=torch.bfloat16) * 0.02
    gate_up, down = bf16[:, :2 * I * H].unflatten(1, (2 * I, H)), bf16[:, 2 * I * H:].unflatten(1, (H, I))
    row = timed(lambda: experts_gpu.moe_experts_grouped(x, ids, w, gate_up, down), reps, bf16.numel() * 2)
    rows.append({"what": f"{PREFILL_TOKENS} tokens over {EXPERTS} experts, BF16 (torch grouped GEMM)", **row,
                 **({"TFLOPs": round(flops / row["us"] / 1e6, 1)} if "us" in row else {})})
    return rows


def main(argv=None) -> None:
    from engine.bench.common import header

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-sweep", action="store_true", help="the kernels' own tile sizes only")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)
    result = run(args.reps, sweep=not args.no_sweep)
    print(f"device copy {result['device_copy_GBps']} GB/s (read + write)")
    for row in result["rows"]:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header(), **result}, f, indent=1)


if __name__ == "__main__":
    main()
