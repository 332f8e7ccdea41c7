"""Tile and split choices of the paged decode kernel, timed on the GPU (a tuning harness, not a test).

    python3 benchmarks/h200/tune_paged.py --json out.json

Qwen3-30B-A3B attention shape (32 q heads, 4 KV heads, hs 128, bf16), block 64, shuffled blocks;
eight layers' pools in rotation so that the 60 MB L2 does not serve repeated reads. Reports µs per
call and GB/s of KV read for each (splits per SM, BLOCK_N, warps, stages) at bs 1/4 × 8K/32K.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from engine.kernels import paged_attention_gpu as pa

N_KV, G, HS, BLOCK = 4, 8, 128, 64
LAYERS = 8


def case(batch: int, length: int):
    n_blocks = batch * (length // BLOCK)
    pools = [(torch.randn(n_blocks * BLOCK, N_KV, HS, device="cuda", dtype=torch.bfloat16),
              torch.randn(n_blocks * BLOCK, N_KV, HS, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    table = torch.randperm(n_blocks, device="cuda").view(batch, -1).to(torch.int64)
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int64)
    q = torch.randn(batch, N_KV * G, HS, device="cuda", dtype=torch.bfloat16)
    return q, pools, table, lengths


def time_config(q, pools, table, lengths, splits, block_n, warps, stages) -> float:
    B, nh, hs = q.shape
    o_part, lse_part, o, lse = pa.scratch_for(B, nh, hs, splits, q.device)

    def call(i):
        k, v = pools[i % LAYERS]
        pa._split_kernel[(B, N_KV, splits)](
            q, k, v, table, lengths, o_part, lse_part, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), table.stride(0), hs ** -0.5 * 1.4426950408889634, BLOCK, 2**30, splits, nh,
            G=G, G_PAD=16, HS=hs, BLOCK=block_n, PRECISION="tf32", num_warps=warps, num_stages=stages)
        pa._merge_kernel[(B * nh,)](o_part, lse_part, o, lse, splits, HS=hs,
                                    SPLITS_PAD=max(2, triton.next_power_of_2(splits)))

    for i in range(LAYERS):
        call(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 64
    start.record()
    for i in range(n):
        call(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3  # µs per call


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, length in [(1, 8192), (1, 32768), (4, 8192), (4, 32768)]:
        q, pools, table, lengths = case(batch, length)
        kv_bytes = 2 * batch * length * N_KV * HS * 2
        for per_sm, block_n, warps, stages in itertools.product([2, 4, 8], [32, 64], [4, 8], [2, 3]):
            splits = max(1, min(-(-per_sm * sms // (batch * N_KV)), length // block_n))
            try:
                us = time_config(q, pools, table, lengths, splits, block_n, warps, stages)
            except Exception as e:  # a tile that does not fit shared memory
                print(f"bs={batch} L={length} per_sm={per_sm} BLOCK_N={block_n} warps={warps} stages={stages}: {e}")
                continue
            row = {"batch": batch, "length": length, "splits_per_sm": per_sm, "splits": splits, "block_n": block_n,
                   "warps": warps, "stages": stages, "us": round(us, 2), "GBps": round(kv_bytes / us / 1e3, 1)}
            rows.append(row)
        best = min((r for r in rows if (r["batch"], r["length"]) == (batch, length)), key=lambda r: r["us"])
        print(f"bs={batch} L={length}: best {best}")
        current = [r for r in rows if (r["batch"], r["length"], r["splits_per_sm"], r["block_n"], r["warps"],
                                       r["stages"]) == (batch, length, 2, 64, 4, 3)]
        print(f"  current (2 per SM, BLOCK_N 64, 4 warps, 3 stages): {current[0] if current else None}")
        del pools
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"sms": sms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
