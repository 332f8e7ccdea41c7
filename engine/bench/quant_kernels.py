"""The K-quant products at routed-expert shapes, one token, one thread, against a STREAM-style read;
and a MoE layer's CPU set in one native call at several thread counts.

    python3 -m engine.bench.quant_kernels                  # the table
    python3 -m engine.bench.quant_kernels --json out.json  # the record, with the machine's header

For each type and shape: µs per product and GB/s of quantised weights, once with the matrix warm in
the caches (the same one again and again) and once cold (products over distinct matrices filling
`--cold-gib`, far beyond any cache, as a decode step reads its experts); beside them the native
STREAM read on one thread, the bound a cold product can reach. The blocks are random bytes with
small fp16 factors: the kernels' work does not depend on the values. Best of `--rounds` passes.
The MoE set: 8 experts of one token through native/quant_moe.h, cold, at `--moe-threads` threads.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import torch

# (type name, ggml code, rows, cols): Qwen3-30B-A3B's expert shapes (hidden 2048, expert FFN 768) as
# llama.cpp's Q4_K_M lays them out: gate/up Q4_K, down Q6_K or Q4_K; Q5_K for Q5_K_M files.
SHAPES = [("Q4_K", 12, 768, 2048), ("Q4_K", 12, 2048, 768), ("Q6_K", 14, 2048, 768), ("Q6_K", 14, 768, 2048),
          ("Q5_K", 13, 768, 2048)]
BLOCK_BYTES = {12: 144, 13: 176, 14: 210}  # per 256-weight super-block
HALVES = {12: (0, 2), 13: (0, 2), 14: (208,)}  # byte offsets of each super-block's fp16 factors


def _blocks(code: int, n: int, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """(n, rows, row bytes) uint8: random quants and scales, fp16 factors 2^-10 (no inf, NaN or subnormal)."""
    w = torch.randint(0, 256, (n, rows, cols // 256, BLOCK_BYTES[code]), dtype=torch.uint8, generator=gen)
    half = torch.tensor([2.0 ** -10], dtype=torch.float16).view(torch.uint8)  # (2,) little-endian bytes
    for at in HALVES[code]:
        w[..., at:at + 2] = half
    return w.reshape(n, rows, -1)


def _product_us(nat, w: torch.Tensor, code: int, rows: int, cols: int, rounds: int, reps: int) -> float:
    """Best over `rounds` of the mean µs per product, cycling through w's matrices (n, rows, bytes)."""
    x, y = torch.randn(1, cols), torch.empty(1, rows)
    n, row_bytes = w.shape[0], w.shape[2]
    parts = [np.array([[w[i].data_ptr(), code, rows, row_bytes]], dtype=np.int64) for i in range(n)]

    def call(i: int) -> None:
        nat.quant_matmul(parts[i % n], cols, x.data_ptr(), 1, cols, y.data_ptr(), rows, 1)

    for i in range(min(n, reps)):
        call(i)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(reps):
            call(i)
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def moe_set_ms(threads: list[int], layers: int = 24, rounds: int = 3) -> list[dict]:
    """One MoE layer's CPU set in one native call (native/quant_moe.h) per thread count: 8 experts of
    one token at Qwen3-30B-A3B's shapes (gate and up Q4_K 768×2048, down Q6_K 2048×768), cold (a
    different layer's experts each call, `layers` of them: 24 are ~68 MB). Best of `rounds` of the mean
    ms per set, and GB/s of blocks."""
    import numpy as np

    from engine.kernels import native
    from engine.quant import moe as quant_moe

    H, I, E = 2048, 768, 8
    gen = torch.Generator().manual_seed(1)
    gate_up, down = _blocks(12, layers * E * 2, I, H, gen), _blocks(14, layers * E, H, I, gen)
    x, w = torch.randn(1, H), torch.full((1, E), 1.0 / E)
    chosen, counts, rows, pair_w = quant_moe.group_pairs(np.arange(E)[None, :], w, list(range(E)), E)
    before, out = native.threads_setting(), []
    try:
        for t in threads:
            native.set_threads(t)
            sets = [quant_moe.prepare(x, np.array([[gate_up[2 * (l * E + e)].data_ptr(),
                                                    gate_up[2 * (l * E + e) + 1].data_ptr(),
                                                    down[l * E + e].data_ptr(), c] for e, c in zip(chosen, counts)],
                                                  dtype=np.int64), rows, pair_w, (12, 12, 14), I)
                    for l in range(layers)]
            for s in sets:  # warm-up: the team, the set's buffers
                s()
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                for s in sets:
                    s()
                best = min(best, (time.perf_counter() - t0) / layers)
            nbytes = E * (2 * I * H // 256 * BLOCK_BYTES[12] + H * I // 256 * BLOCK_BYTES[14])
            out.append({"threads": t, "ms": round(best * 1e3, 3), "GBps": round(nbytes / best / 1e9, 2)})
    finally:
        native.set_threads(before)
    return out


def main(cold_gib: float = 1.0, rounds: int = 3, stream_mib: int = 512, moe_threads: list[int] | None = None,
         moe_layers: int = 24) -> dict:
    from engine.kernels import native

    nat = native.module()
    if nat is None or not hasattr(nat, "quant_matmul"):
        raise SystemExit("the native extension is not built")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for name, code, rows, cols in SHAPES:
        row_bytes = cols // 256 * BLOCK_BYTES[code]
        nbytes = rows * row_bytes
        warm = _product_us(nat, _blocks(code, 1, rows, cols, gen), code, rows, cols, rounds, 200)
        n_cold = max(2, int(cold_gib * 2**30 // nbytes))
        cold_w = _blocks(code, n_cold, rows, cols, gen)
        cold = _product_us(nat, cold_w, code, rows, cols, rounds, n_cold)
        del cold_w
        rows_out.append({"type": name, "rows": rows, "cols": cols, "bytes": nbytes, "warm_us": round(warm, 1),
                         "warm_GBps": round(nbytes / warm / 1e3, 2), "cold_us": round(cold, 1),
                         "cold_GBps": round(nbytes / cold / 1e3, 2)})
    src = torch.ones(stream_mib * 2**20, dtype=torch.uint8)
    best = float("inf")
    for _ in range(max(rounds, 3)):
        t0 = time.perf_counter()
        nat.stream_read(src.data_ptr(), src.numel(), 1)
        best = min(best, time.perf_counter() - t0)
    stream = round(src.numel() / best / 1e9, 2)
    for r in rows_out:
        r["cold_over_stream"] = round(r["cold_GBps"] / stream, 2)
    print(f"isa {nat.quant_isa()}, 1 thread, 1 token; STREAM read {stream} GB/s")
    for r in rows_out:
        print(f"{r['type']} {r['rows']}x{r['cols']}: warm {r['warm_us']:7.1f} µs {r['warm_GBps']:5.2f} GB/s | "
              f"cold {r['cold_us']:7.1f} µs {r['cold_GBps']:5.2f} GB/s ({r['cold_over_stream']} of the read)")
    moe = moe_set_ms(moe_threads or [1, native.available_cores()], moe_layers, rounds)
    for m in moe:
        print(f"MoE layer set, 8 experts × 1 token, {m['threads']} threads: {m['ms']:.3f} ms, {m['GBps']} GB/s")
    return {"isa": nat.quant_isa(), "threads": 1, "tokens": 1, "cold_gib": cold_gib, "rounds": rounds,
            "stream_mib": stream_mib, "stream_read_GBps": stream, "products": rows_out, "moe_set": moe}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cold-gib", type=float, default=1.0, help="bytes of distinct matrices for the cold figure")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--moe-threads", default=None, help="thread counts of the MoE set figure, e.g. 1,2,16 "
                   "(default: 1 and every usable core)")
    p.add_argument("--json", default=None, help="write the record here")
    a = p.parse_args()
    result = main(a.cold_gib, a.rounds, moe_threads=[int(t) for t in a.moe_threads.split(",")] if a.moe_threads else None)
    if a.json:
        from engine.bench.common import header, write_json

        import os
        import sys

        write_json({**header(), "command": "python3 -m engine.bench.quant_kernels " + " ".join(sys.argv[1:]),
                    "bench": "quant_kernels", "load_average_after": os.getloadavg()[0], **result}, a.json, echo=False)
