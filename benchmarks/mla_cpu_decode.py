"""MLA decode on the CPU (DeepSeek-V2's absorbed form): the native kernel
(engine/kernels/attention_mla_native.py) against the torch path it replaces, over latent rows laid
out as the hybrid KV format holds them: (tokens, 2 planes, 1 head, w) bf16, the K and V planes of a
token adjacent, read in place in one view per sequence.

    PYTHONPATH=. python3 benchmarks/mla_cpu_decode.py [TOKENS] [HEADS] [THREADS,...]

Defaults: 32768 tokens, 16 heads (DeepSeek-V2-Lite), r = 512 latent + dr = 64 RoPE columns (w = 288),
one query, 1 and 2 threads. Prints the median ms of a call and the GB/s of latent rows read
(tokens × (r + dr) × 2 bytes per call) for each path.
"""

import sys
import time

import torch

from engine.kernels import attention_mla_native, native

R, DR, REPEATS = 512, 64, 15


def timed(fn) -> float:
    fn()  # warm-up: first-touch and the kernels' scratch
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    heads = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    threads = [int(t) for t in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 2]
    w = (R + DR) // 2
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn((tokens, 2, 1, w), generator=gen).to(torch.bfloat16)  # as the format's region
    blocks = [[(rows[:, 0].transpose(0, 1), rows[:, 1].transpose(0, 1))]]  # (1, tokens, w) each
    q = torch.randn((1, heads, 1, R + DR), generator=gen).to(torch.bfloat16)
    scale = (128 + DR) ** -0.5
    row_bytes = tokens * (R + DR) * rows.element_size()
    table = attention_mla_native.prepare(blocks)
    out, lse = torch.empty((1, heads, 1, R)), torch.empty((1, heads, 1))
    print(f"MLA decode, {tokens} tokens x {heads} heads, rows {R}+{DR} bf16 ({row_bytes / 1e6:.1f} MB), "
          f"ISA {native.isa()}")
    for t in threads:
        torch.set_num_threads(t)
        paths = {"torch": lambda: attention_mla_native.attend_latent_torch(q, blocks, R, scale, out, lse)}
        if attention_mla_native.available():
            paths["native"] = lambda t=t: attention_mla_native.attend_latent_blocks(q, table, R, scale, out=out,
                                                                                     lse=lse, threads=t)
        for name, fn in paths.items():
            ms = timed(fn)
            print(f"  threads={t}  {name:6s}  {ms:8.2f} ms  {row_bytes / ms / 1e6:6.2f} GB/s")


if __name__ == "__main__":
    main()
