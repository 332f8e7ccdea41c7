"""The host's work between two one-graph decode steps (engine/experts/zero_copy.py, `before_step`):
read the last replay's routing and claims, refresh the LRU, admit the filled misses, list free slots
for the next step. The GPU waits for it at every step, so it is timed on its own here, on the CPU.

    python3 benchmarks/profile_zero_copy_host.py [SLOTS] [STEPS]

Qwen3-30B-A3B's routing shape (48 layers, 128 experts, top-8, one sequence) over a tiny expert size
(the host work does not depend on it). The replay is stood in for by its two logs: each layer routes
mostly within 40 "popular" experts of its own (about 0.95 hits at 2,202 slots), and each pair read
from the store claims the next listed slot, as the graph's claim kernel would, and a claimed slot's
victim (the cached entry it held) is read from the store from then on. Prints the median and 90th
percentile of `before_step` (the host work the next replay waits for) and the median of `after_step`
(the last step's logs, read while the next replay runs) over the steps after the first 10.
"""

import sys
import time

import numpy as np
import torch

from engine.experts.cache import ExpertCache
from engine.experts.store import ExpertStore
from engine.experts.zero_copy import ZeroCopyDecode

L, E, K, B = 48, 128, 8, 1
H = I = 16  # expert size: irrelevant to the host work


def main() -> None:
    slots = int(sys.argv[1]) if len(sys.argv) > 1 else 2202
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 110
    store = ExpertStore.from_layers([torch.zeros(E, 2 * I, H)] * L, [torch.zeros(E, H, I)] * L, dtype=torch.float32)
    cache = ExpertCache(slots, H, I, torch.float32, torch.device("cpu"))
    zc = ZeroCopyDecode(store, cache, torch.device("cpu"), max_tokens=4, window=[])
    zc.log = torch.full((L, zc.max_tokens * K), -1, dtype=torch.int64)  # what the graph's first run makes
    zc.claims = torch.full_like(zc.log, -1)
    zc.logs_host = [(torch.empty_like(zc.log), torch.empty_like(zc.claims)) for _ in range(2)]
    rng = np.random.default_rng(0)
    popular = [rng.choice(E, 40, replace=False) for _ in range(L)]
    before, after = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        zc.before_step()
        before.append(time.perf_counter() - t0)
        table, spares, victims = zc.table.numpy(), zc.spares.numpy(), zc.victims.numpy()
        flat_table, store_offsets = table.reshape(-1), zc.host_table.numpy()
        claimed = 0
        for layer in range(L):  # the replay's logs
            pool = popular[layer] if rng.random() < 0.97 else np.arange(E)
            ids = np.stack([rng.choice(pool, K, replace=False) for _ in range(B)]).ravel()  # (B·k,)
            offsets = table[layer, ids]
            outside = (offsets < 0) | (offsets >= zc.pool_numel)
            claims = np.full(B * K, -1, dtype=np.int64)
            for p in np.flatnonzero(outside):
                if claimed < len(spares) and spares[claimed] >= 0:
                    claims[p] = spares[claimed]
                    victim = victims[claimed]
                    if victim >= 0:  # its later layers read the store
                        flat_table[victim] = store_offsets[victim]
                claimed += 1
            for p in np.flatnonzero(claims >= 0):  # the sum kernel: the first pair's fill of an expert is kept
                if not any(ids[q] == ids[p] and claims[q] >= 0 for q in range(p)):
                    table[layer, ids[p]] = claims[p]
            zc.log[layer, :B * K] = torch.from_numpy(ids)
            zc.claims[layer, :B * K] = torch.from_numpy(claims)
        t0 = time.perf_counter()
        zc.after_step(B)
        after.append(time.perf_counter() - t0)
    zc.drain()
    lru = cache.lru
    b, a = 1e3 * np.array(before[10:]), 1e3 * np.array(after[10:])
    print(f"slots {slots}: before_step median {np.median(b):.3f} ms, p90 {np.percentile(b, 90):.3f} ms; "
          f"after_step (reads the step before's logs while the next replay runs) median {np.median(a):.3f} ms "
          f"(hits {lru.hits}, misses {lru.misses}, fills {lru.fills}, evictions {lru.evictions})")


if __name__ == "__main__":
    main()
