"""Is the expert kernel at 5–8 tokens bound by DRAM or by its own arithmetic on this host?

Times `experts_cpu.expert_ffn` on Qwen3-30B-A3B's expert shape (H = 2048, I = 768, bf16) two ways,
per token count and thread count:
- `fresh`: each call takes the next expert of a ring larger than L3 (weights stream from DRAM, as in
  the engine's CPU sets);
- `hot`: the same expert every call. With 15 threads each thread's rows (~630 KB) stay in its L2,
  so this is the kernel's arithmetic and cache roof at that token count.
Where `hot` is not much faster than `fresh`, DRAM is not what limits the kernel.

    python3 benchmarks/h200/profile_roof.py OUT.json

ROOF_THREADS and ROOF_TOKENS (comma lists) narrow the sweep; TANDEM_AMX_MIN_TOKENS=1 puts every
token count on the AMX tiles (amx-bf16 hosts).
"""
import itertools
import json
import os
import sys

import torch

from engine.hw.hostmem import huge_page_advice, huge_page_bytes, large_host_tensor
from engine.hw.timing import time_cpu
from engine.kernels import experts_cpu, native

H, I, RING = 2048, 768, 40
TOKENS = tuple(int(t) for t in os.environ.get("ROOF_TOKENS", "1,2,4,5,8,12,16").split(","))
THREADS = tuple(int(t) for t in os.environ.get("ROOF_THREADS", "1,8,15").split(","))


def main(path: str) -> None:
    experts_cpu.set_native_max_tokens(1 << 30)
    # As the engine's expert store holds them (huge pages where Linux has them; TANDEM_HUGE_PAGES=0: not).
    gate_up = large_host_tensor((RING, 2 * I, H), torch.bfloat16).uniform_(-0.05, 0.05)
    down = large_host_tensor((RING, H, I), torch.bfloat16).uniform_(-0.05, 0.05)
    nbytes = 3 * H * I * 2
    ring = itertools.count()
    record = {"isa": native.isa(), "amx_min_tokens": native.module().amx_min_tokens(), "H": H, "I": I, "ring": RING, "cpu_count": os.cpu_count(), "huge_pages": huge_page_advice(),
              "huge_page_MiB": [(huge_page_bytes(t) or 0) >> 20 for t in (gate_up, down)], "points": []}
    print("huge pages", record["huge_pages"], "MiB on them (gate_up, down):", record["huge_page_MiB"], flush=True)
    for threads in THREADS:
        torch.set_num_threads(threads)
        for n in TOKENS:
            x = torch.randn(n, H).bfloat16()
            point = {"threads": threads, "tokens": n}
            for kind in ("fresh", "hot", "fresh"):  # fresh twice around hot: the host drifts
                def call(i):
                    j = next(ring) % RING if kind == "fresh" else 0
                    experts_cpu.expert_ffn(x, gate_up[j], down[j], threads=threads)
                ms = time_cpu(call, 3, 21).median_ms
                point[f"{kind}_ms"] = min(ms, point.get(f"{kind}_ms", ms))
            for kind in ("fresh", "hot"):
                point[f"{kind}_GBps"] = round(nbytes / point[f"{kind}_ms"] / 1e6, 1)
                point[f"{kind}_ms"] = round(point[f"{kind}_ms"], 4)
            print(point, flush=True)
            record["points"].append(point)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
