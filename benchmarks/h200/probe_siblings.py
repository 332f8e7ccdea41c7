"""Do any two of this host's CPUs share a physical core?

Inside a virtual machine `lscpu` reports one thread per core whatever the host's hyperthreads are.
The expert kernel at 8 tokens is bound by its arithmetic (RESULTS.md, phases AW-BY), and its
in-cache rate per thread fell from ~6.5-6.8 GB/s on 4-8 threads to ~4.1 on 12-15: that is what two
threads sharing one core's vector units would look like. This probe measures it directly: a
single-threaded, in-cache fp32 matmul loop (compute-bound) runs on CPU 0 alone, then on CPU 0 while
the same loop runs on CPU j, for every j. A sibling of CPU 0 roughly halves its rate; another core
leaves it alone. Then every CPU at once, and every even-numbered CPU at once, per CPU.

    python3 benchmarks/h200/probe_siblings.py OUT.json
"""
import json
import multiprocessing as mp
import os
import sys
import time

import torch  # imported once here: the forked workers inherit it

SECONDS = 0.6
N = 192  # (N, N) fp32 operands: 147 KB each, in L2


def _loop(cpu: int, slot: int, start, results) -> None:
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    a, b = torch.randn(N, N), torch.randn(N, N)
    c = torch.empty(N, N)
    for _ in range(20):  # warm
        torch.mm(a, b, out=c)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < SECONDS:
        for _ in range(20):
            torch.mm(a, b, out=c)
        n += 20
    results[slot] = 2 * N**3 * n / (time.perf_counter() - t0) / 1e9  # GFLOP/s


def _together(cpus: list[int]) -> dict[int, float]:
    ctx = mp.get_context("fork")
    results = ctx.Array("d", len(cpus))
    start = ctx.Barrier(len(cpus))
    procs = [ctx.Process(target=_loop, args=(c, i, start, results)) for i, c in enumerate(cpus)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return dict(zip(cpus, results[:]))


def main(path: str) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    alone = _together([cpus[0]])[cpus[0]]
    pairs = {}
    for j in cpus[1:]:
        r = _together([cpus[0], j])
        pairs[j] = {"cpu0": round(r[cpus[0]], 1), "other": round(r[j], 1), "cpu0_share": round(r[cpus[0]] / alone, 3)}
        print(f"cpu {cpus[0]} with cpu {j}: {r[cpus[0]]:.1f} GFLOP/s ({r[cpus[0]] / alone:.2f} of alone)", flush=True)
    everyone = _together(cpus)
    evens = _together(cpus[::2])
    record = {"cpus": cpus, "alone_gflops": round(alone, 1), "pairs_with_cpu0": pairs,
              "all_per_cpu": {c: round(v, 1) for c, v in sorted(everyone.items())},
              "evens_per_cpu": {c: round(v, 1) for c, v in sorted(evens.items())}}
    print(f"alone {alone:.1f}; all {len(cpus)} at once: mean {sum(everyone.values()) / len(everyone):.1f} per CPU; "
          f"{len(evens)} even CPUs at once: mean {sum(evens.values()) / len(evens):.1f} per CPU", flush=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
