"""The expert kernel's arithmetic rate on one thread, per ISA table: an expert small enough for L2
(H = 1024, I = 256, bf16: 1.5 MB), the same one every call, the best of 5 runs of 200 calls.
Prints GB/s of weights per token count (1, 4, 6, 8). Pin a table with TANDEM_NATIVE_ISA.

    TANDEM_NATIVE_ISA=avx2 python3 benchmarks/profile_expert_l2.py
"""
import json
import time

import torch

from engine.kernels import experts_cpu, native

H, I = 1024, 256
CALLS, RUNS = 200, 5


def main() -> None:
    native.set_threads(1)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(2 * I, H, generator=g) * 0.02).bfloat16()  # (2I, H)
    down = (torch.randn(H, I, generator=g) * 0.02).bfloat16()  # (H, I)
    nbytes = 3 * H * I * 2
    out = {"isa": native.isa(), "impl": experts_cpu.implementation(1)}
    for n in (1, 4, 6, 8):
        x = torch.randn(n, H, generator=g).bfloat16()  # (n, H)
        for _ in range(50):
            experts_cpu.expert_ffn(x, gate_up, down)
        seconds = []
        for _ in range(RUNS):
            t0 = time.perf_counter()
            for _ in range(CALLS):
                experts_cpu.expert_ffn(x, gate_up, down)
            seconds.append((time.perf_counter() - t0) / CALLS)
        out[n] = round(nbytes / min(seconds) / 1e9, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
