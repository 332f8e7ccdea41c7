"""One gpt-oss-20b-shaped routed expert on the CPU (H = I = 2880, bf16, biases and the clamped SwiGLU):
the native kernel (experts_cpu.expert_ffn with the ClampedSwiGLU form) against the torch path it
replaces (ClampedSwiGLU.ffn: two F.linear with biases and the activation in bf16), and the native plain
SwiGLU of the same weights (what the form costs). Each call takes the next expert of a ring larger
than twice the L3, so the weights come from DRAM. Prints one JSON record: median ms per expert and
GB/s of weights (3·H·I·2 bytes per expert), per token count and thread count. The three kernels are
timed in turns (`ROUNDS` rounds of `REPEATS` calls each), so load from other processes hits them alike.

    python3 benchmarks/gpt_oss_cpu_expert.py [threads ...]     (default: 1 and every core)
    TANDEM_NATIVE_ISA=avx2 python3 benchmarks/gpt_oss_cpu_expert.py    (pin an ISA table)
"""
import itertools
import json
import statistics
import sys

import torch

from engine.hw.expert_costs import ExpertStore, rotation
from engine.hw.probe import probe_cpu
from engine.hw.shapes import ExpertShape
from engine.hw.timing import time_cpu
from engine.kernels import experts_cpu, native
from engine.kernels.experts_torch import ClampedSwiGLU

H = I = 2880  # gpt-oss-20b's hidden size and expert FFN width
TOKENS = [1, 4, 8]
ROUNDS, REPEATS = 5, 8


def point(store: ExpertStore, form: ClampedSwiGLU, ring, x: torch.Tensor, threads: int) -> dict:
    """Median ms per expert and weight GB/s of the three kernels for the tokens x (n, H)."""
    n_experts = len(store.flat)

    def call(kind: str):
        e = next(ring) % n_experts
        gu, dn = store.views(e)
        if kind == "native":
            return experts_cpu.expert_ffn(x, gu, dn, threads=threads, form=form, expert=e)
        if kind == "native_plain":
            return experts_cpu.expert_ffn(x, gu, dn, threads=threads)
        return form.ffn(x, e, gu, dn)

    times = {"native": [], "torch": [], "native_plain": []}
    for _ in range(ROUNDS):
        for kind, ms in times.items():
            ms.append(time_cpu(lambda i, k=kind: call(k), 2, REPEATS).median_ms)
    row = {"tokens": x.shape[0], "threads": threads}
    for kind, ms in times.items():
        m = statistics.median(ms)
        row[f"{kind}_ms"] = round(m, 3)
        row[f"{kind}_GBps"] = round(store.shape.bytes_per_expert / (m * 1e-3) / 1e9, 2)
    row["speedup_vs_torch"] = round(row["torch_ms"] / row["native_ms"], 2)
    return row


def main() -> None:
    threads = [int(a) for a in sys.argv[1:]] or sorted({1, native.available_cores()})
    shape = ExpertShape(hidden=H, ffn=I, dtype="bfloat16")
    store = ExpertStore(shape, rotation(shape.bytes_per_expert, probe_cpu().get("l3_bytes") or 64 * 2**20))
    n_experts = len(store.flat)
    for flat in store.flat:  # weights of a trained expert's scale: N(0, 0.02)
        flat.normal_(0, 0.02)
    g = torch.Generator().manual_seed(0)
    form = ClampedSwiGLU((torch.randn(n_experts, 2 * I, generator=g) * 0.5).bfloat16(),
                         (torch.randn(n_experts, H, generator=g) * 0.5).bfloat16())  # (E, 2I), (E, H)
    ring = itertools.count()
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for n in TOKENS:
            rows.append(point(store, form, ring, torch.randn(n, H, generator=g).bfloat16(), t))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"hidden": H, "ffn": I, "dtype": "bfloat16", "isa": native.isa(),
                      "bytes_per_expert": shape.bytes_per_expert, "experts_cycled": n_experts, "points": rows},
                     indent=1))


if __name__ == "__main__":
    main()
