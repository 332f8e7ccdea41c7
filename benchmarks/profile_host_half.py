"""Host time of a decode layer's host half in the pieces form, per part, on the CPU (no GPU needed).

    python3 benchmarks/profile_host_half.py [N]

`OffloadedExperts.run(..., cpu_buf=)` with `adaptive` over a 48-layer bf16 store of small experts
(128 per layer, top 8; the host work does not depend on their size), 2,202 slots, Zipf-like routing
(about 0.6 hits at N=4; at N=1 the planner sends most misses to the CPU, so few enter the cache), no
predictor, N tokens (default 4): the executor's own split of the driving thread's
time (`host_split`, the parts in engine/experts/offload.py HOST_PARTS), µs per layer step, after 20
warm-up steps, over 30 steps. The device is the CPU, so the fills are plain copies and the CPU set's
threads share the cores with the driving thread; compare runs on one machine, not across machines.
"""
import sys
import time

import numpy as np
import torch

from engine.experts.offload import HOST_PARTS, OffloadedExperts
from engine.experts.store import ExpertStore
from engine.sched.expert_cost import ExpertCostModel

E, K, L, H, I = 128, 8, 48, 256, 128


def main() -> None:
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    store = ExpertStore.empty(L, list(range(L)), E, H, I, torch.bfloat16)
    store.blocks.normal_()
    ex = OffloadedExperts("adaptive", store, device=torch.device("cpu"), n_slots=2202, max_decode_tokens=4,
                          costs=ExpertCostModel.from_shape(2048, 768, 2))  # planned as Qwen3-30B-A3B's experts
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    p /= p.sum()
    popular = [rng.permutation(E) for _ in range(L)]  # each layer's own popular experts
    x = torch.randn(N, H, dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(N, K), -1).to(torch.bfloat16)
    cpu_buf = torch.empty(N, H)

    def step():
        for layer in range(L):
            ids = np.stack([popular[layer][rng.choice(E, K, replace=False, p=p)] for _ in range(N)])
            ex.run(layer, x, torch.from_numpy(ids), w, cpu_buf=cpu_buf)

    for _ in range(20):
        step()
    split0, run0, wait0 = dict(ex.host_split), ex.run_s, ex.cpu_wait_s
    n = 30
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    per = 1e6 / (n * L)
    print(f"N={N}, µs per layer step:", {k: round((ex.host_split[k] - split0[k]) * per, 1) for k in HOST_PARTS},
          f"run {(ex.run_s - run0) * per:.1f}, CPU wait {(ex.cpu_wait_s - wait0) * per:.1f},"
          f" wall {(time.perf_counter() - t0) * per:.1f}; hit rate {ex.hit_rate():.2f}")
    ex.close()


if __name__ == "__main__":
    main()
