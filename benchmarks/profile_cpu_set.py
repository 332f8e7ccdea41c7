"""Host time to prepare one decode layer's CPU set, per path (no GPU needed).

    python3 benchmarks/profile_cpu_set.py

bs=4 routing over 128 experts (top 8), a 5-expert CPU set, a 48-layer bf16 store of small experts
(the preparation does not depend on their size). Times, in µs per layer: the per-expert views and
their checks (`cpu_set.cpu_set_inputs` then `experts_cpu.prepare_moe`), and the table built from the
store's block addresses (`cpu_set.native_cpu_set`). Needs the native extension.
"""
import timeit

import numpy as np
import torch

from engine.experts.cpu_set import cpu_set_inputs, native_cpu_set
from engine.experts.store import ExpertStore
from engine.kernels import experts_cpu

E, K, N, L, H, I = 128, 8, 4, 48, 256, 128


def main() -> None:
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int64)  # (N, K)
    w = torch.rand(N, K, dtype=torch.bfloat16)
    x, out = torch.randn(N, H, dtype=torch.bfloat16), torch.empty(N, H)
    store = ExpertStore.empty(L, list(range(L)), E, H, I, torch.bfloat16)
    cpu = sorted(set(ids.ravel().tolist()))[:5]

    def views():
        return experts_cpu.prepare_moe(x, *cpu_set_inputs(store, 5, cpu, ids, w), out=out)

    def table():
        return native_cpu_set(store, 5, cpu, ids, w, x, out)

    assert table() is not None, "needs the native extension"
    for name, fn in (("views + prepare_moe", views), ("native_cpu_set", table)):
        us = min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6
        print(f"{name:22s} {us:6.1f} µs")


if __name__ == "__main__":
    main()
