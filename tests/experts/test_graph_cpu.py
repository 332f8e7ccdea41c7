"""The one-graph step's CPU experts (engine/experts/graph_cpu.py): the device split of a layer's
misses (interpreted on the CPU where there is no GPU), and the native host-node function, called
here through its C address as the CUDA driver calls it, against a float64 reference."""

import ctypes

import numpy as np
import pytest
import torch

from engine.experts.graph_cpu import GraphCpuSet
from engine.experts.store import ExpertStore
from engine.kernels import native
from engine.kernels.experts_torch import moe_experts

L, E, H, I = 2, 6, 32, 16


def _store(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    return ExpertStore.from_layers(gate_up, down, dtype=dtype), gate_up, down


def _host_moe(store, max_rows, k, x, pairs, weights, out, threads=2):
    m = native.module()
    table = np.ascontiguousarray(store.moe_table(slice(None), slice(None)))  # (L, E, 5)
    code = {torch.float32: 0, torch.bfloat16: 1}[store.dtype]
    host = m.HostMoe(x.data_ptr(), code, pairs.data_ptr(), weights.data_ptr(), out.data_ptr(), max_rows, k, H, I,
                     code, table.ctypes.data, L, E, threads)
    return host, table


needs_native = pytest.mark.skipif(native.module() is None or not hasattr(native.module(), "HostMoe"),
                                  reason="the native extension is not built")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_node_function_computes_the_listed_pairs(dtype):
    """Pairs marked −1 are skipped; two tokens of one expert share it; rows without pairs are zeros."""
    store, gate_up, down = _store(dtype)
    N, k, layer = 3, 2, 1
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, H, generator=g).to(dtype)
    ids = torch.tensor([[4, 1], [1, 0], [2, 3]])  # expert 1 twice; token 2 entirely on the GPU
    on_cpu = torch.tensor([[True, True], [True, False], [False, False]])
    weights = torch.softmax(torch.randn(N, k, generator=g), -1)
    pairs = torch.where(on_cpu, ids, -1).reshape(-1).contiguous()
    w32 = weights.reshape(-1).float().contiguous()
    out = torch.full((N, H), float("nan"))  # every row must be written
    host, table = _host_moe(store, N, k, x, pairs, w32, out)
    entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(type(host).entry_address)
    entry(host.call_address(layer, N))  # what the driver's callback thread runs
    ref = moe_experts(x.double(), torch.where(on_cpu, ids, E), torch.where(on_cpu, weights, 0).double(),
                      torch.cat([gate_up[layer].to(dtype).double(), torch.zeros(1, 2 * I, H, dtype=torch.double)]),
                      torch.cat([down[layer].to(dtype).double(), torch.zeros(1, H, I, dtype=torch.double)]))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol)
    assert (out[2] == 0).all()
    stats = host.take()
    assert (stats["calls"], stats["experts"], stats["pairs"], stats["error"]) == (1, 2, 3, "")  # experts 4 and 1
    assert host.take()["calls"] == 0  # counters restart after each take


@needs_native
def test_host_node_failure_is_kept_for_the_caller_and_zeroes_the_rows():
    store, _, _ = _store()
    x = torch.randn(2, H)
    pairs = torch.tensor([E + 3, -1, 0, -1])  # an expert id past the layer's experts
    out = torch.full((2, H), 7.0)
    host, table = _host_moe(store, 2, 2, x, pairs, torch.ones(4), out)
    host.run(0, 2)
    assert (out == 0).all()
    assert "expert id out of range" in host.take()["error"]
    with pytest.raises(ValueError):
        host.call_address(L, 1)  # no such layer
    with pytest.raises(ValueError):
        host.call_address(0, 3)  # more rows than the buffers hold


@needs_native
def test_nothing_listed_writes_zeros():
    store, _, _ = _store()
    out = torch.full((2, H), 7.0)
    host, table = _host_moe(store, 2, 2, torch.randn(2, H), torch.full((4,), -1), torch.ones(4), out)
    host.run(0, 1)
    assert (out[0] == 0).all() and (out[1] == 7).all()  # only the call's rows


def _split_reference(ids, offsets, spares, counter0, share, pool_numel):
    """The split as plain Python: the misses' distinct experts, most tokens first (then first pair),
    round(share · n) of them to the CPU; the rest claim the list's next free slots in pair order."""
    flat = ids.reshape(-1).tolist()
    outside = [0 <= e < len(offsets) and not (0 <= offsets[e] < pool_numel) for e in flat]
    experts = []
    for p, e in enumerate(flat):
        if outside[p] and e not in [x for x, _ in experts]:
            experts.append((e, p))
    tokens = {e: sum(1 for q, f in enumerate(flat) if f == e and outside[q]) for e, _ in experts}
    ranked = sorted(experts, key=lambda ep: (-tokens[ep[0]], ep[1]))
    n_cpu = int(len(experts) * share + 0.5)
    cpu = {e for e, _ in ranked[:n_cpu]}
    gpu_ids, spare, cpu_ids, c = [], [], [], counter0
    for p, e in enumerate(flat):
        if outside[p] and e in cpu:
            gpu_ids.append(-1), spare.append(-2), cpu_ids.append(e)
            continue
        gpu_ids.append(e), cpu_ids.append(-1)
        if outside[p]:
            spare.append(spares[c] if c < len(spares) else -1)
            c += 1
        else:
            spare.append(-1)
    return gpu_ids, spare, cpu_ids, c


@pytest.mark.parametrize("share", [0.0, 0.4, 0.6, 1.0])
@pytest.mark.parametrize("n_tokens", [1, 4])
def test_split_misses_matches_the_reference(share, n_tokens):
    pytest.importorskip("triton")
    from engine.kernels import moe_decode_gpu

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_experts, k, slot_numel, pool_numel = 12, 3, 100, 400
    g = torch.Generator().manual_seed(int(share * 10) + n_tokens)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n_tokens)])
    in_slot = torch.randperm(n_experts, generator=g)[:4]
    offsets = torch.full((n_experts,), -5000, dtype=torch.int64)  # the store lies before the pool
    offsets[in_slot] = torch.arange(4) * slot_numel
    spares = torch.tensor([2 * slot_numel, 3 * slot_numel, -1, -1], dtype=torch.int64)[:3]
    weights = torch.rand(n_tokens, k, generator=g)
    counter = torch.tensor([1], dtype=torch.int32, device=device)  # a layer before claimed one slot already
    gpu_ids, spare, cpu_ids, cpu_w = moe_decode_gpu.split_misses(
        ids.to(device), weights.to(device), offsets.to(device), spares.to(device), counter,
        torch.tensor([share], device=device), pool_numel)
    want = _split_reference(ids, offsets.tolist(), spares.tolist(), 1, share, pool_numel)
    assert gpu_ids.reshape(-1).tolist() == want[0]
    assert spare.tolist() == want[1]
    assert cpu_ids.tolist() == want[2]
    assert counter.item() == want[3]  # the next layer's claims start past this layer's
    on_cpu = torch.tensor(want[2]) >= 0
    assert torch.equal(cpu_w.cpu(), torch.where(on_cpu, weights.reshape(-1), 0.0))


def test_share_follows_the_rates():
    assert GraphCpuSet.share_for(60.0, 40.0) == pytest.approx(0.6)
    assert GraphCpuSet.share_for(1e-9, 40.0) < 1e-6
