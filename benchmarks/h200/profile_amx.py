"""Expert FFN on AMX tiles against vector tiles, one host, alternated three times: Qwen3-30B-A3B's
expert shape (H = 2048, I = 768, bf16) with weight rows as stored (gate/up rows 4 KiB apart; phase AO
also padded them by 64 bytes: no change), 1…128 tokens, 15 threads, a ring of experts larger than L3
(each call reads a fresh one).

    python3 benchmarks/h200/profile_amx.py OUT.json
"""
import itertools
import json
import statistics
import sys

import torch

from engine.hw.timing import time_cpu
from engine.kernels import experts_cpu, native

H, I, RING, THREADS, TOKENS = 2048, 768, 40, 15, (1, 2, 4, 5, 8, 9, 12, 16, 32, 128)


def ring_of_experts(pad: int):
    gate_up = torch.empty(RING, 2 * I, H + pad, dtype=torch.bfloat16).uniform_(-0.05, 0.05)[:, :, :H]
    down = torch.empty(RING, H, I + pad, dtype=torch.bfloat16).uniform_(-0.05, 0.05)[:, :, :I]
    return gate_up, down


def main(path: str) -> None:
    m = native.module()
    experts_cpu.set_native_max_tokens(1 << 30)
    torch.set_num_threads(THREADS)
    nbytes = 3 * H * I * 2
    ring = itertools.count()
    record = {"isa": native.isa(), "H": H, "I": I, "ring": RING, "threads": THREADS, "points": []}
    saved = m.amx_min_tokens()
    for pad in (0,):
        gate_up, down = ring_of_experts(pad)
        for n in TOKENS:
            x = torch.randn(n, H).bfloat16()
            times = {"vector": [], "amx": []}
            for _ in range(3):
                for kind, threshold in (("vector", 1 << 30), ("amx", 1)):
                    m.set_amx_min_tokens(threshold)

                    def call(i):
                        j = next(ring) % RING
                        experts_cpu.expert_ffn(x, gate_up[j], down[j], threads=THREADS)

                    times[kind].append(time_cpu(call, 2, 15).median_ms)
            point = {"pad_elements": pad, "tokens": n}
            for kind, ms in times.items():
                point[f"{kind}_ms"] = round(statistics.median(ms), 4)
                point[f"{kind}_GBps"] = round(nbytes / statistics.median(ms) / 1e6, 1)
            print(point, flush=True)
            record["points"].append(point)
        del gate_up, down
    m.set_amx_min_tokens(saved)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
