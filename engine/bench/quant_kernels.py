"""The K-quant products at routed-expert shapes, one token, one thread, against a STREAM-style read.

    python3 -m engine.bench.quant_kernels                  # the table
    python3 -m engine.bench.quant_kernels --json out.json  # the record, with the machine's header

For each type and shape: µs per product and GB/s of quantised weights, once with the matrix warm in
the caches (the same one again and again) and once cold (products over distinct matrices filling
`--cold-gib`, far beyond any cache, as a decode step reads its experts); beside them the native
STREAM read on one thread, the bound a cold product can reach. The blocks are random bytes with
small fp16 factors: the kernels' work does not depend on the values. Best of `--rounds` passes.
"""

from __future__ import annotations

import argparse
import time

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

    def call(i: int) -> None:
        nat.quant_matmul(w[i % n].data_ptr(), code, rows, cols, row_bytes, x.data_ptr(), 1, cols, y.data_ptr(), rows, 1)

    for i in range(min(n, reps)):
        call(i)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(reps):
            call(i)
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def main(cold_gib: float = 1.0, rounds: int = 3, stream_mib: int = 512) -> dict:
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
    return {"isa": nat.quant_isa(), "threads": 1, "tokens": 1, "cold_gib": cold_gib, "rounds": rounds,
            "stream_mib": stream_mib, "stream_read_GBps": stream, "products": rows_out}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cold-gib", type=float, default=1.0, help="bytes of distinct matrices for the cold figure")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the record here")
    a = p.parse_args()
    result = main(a.cold_gib, a.rounds)
    if a.json:
        from engine.bench.common import header, write_json

        import os
        import sys

        write_json({**header(), "command": "python3 -m engine.bench.quant_kernels " + " ".join(sys.argv[1:]),
                    "bench": "quant_kernels", "load_average_after": os.getloadavg()[0], **result}, a.json, echo=False)
