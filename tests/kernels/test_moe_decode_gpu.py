"""The decode-sized expert kernels (Triton) against the reference expert loop, interpreted on the
CPU (compiled on CUDA where present)."""

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import moe_decode_gpu  # noqa: E402
from engine.kernels.experts_torch import moe_experts  # noqa: E402


def _case(n, k, e, h, i, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]) if n else torch.zeros(0, k, dtype=torch.long)
    w = torch.softmax(torch.randn(n, k, generator=gen), -1)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    down = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in (x, ids, w, gate_up, down)]


def _pool_and_store(gate_up, down, n_slots):
    """A pool of n_slots empty expert blocks and, in another allocation, every expert (the store):
    → (blocks (E, 3IH), pool (S, 3IH), gate_up and down views of the pool, offsets (E,) of each
    expert's store copy in elements from the pool's first element, the store). The caller keeps the
    store alive: the offsets point into it."""
    E, I, H = gate_up.shape[0], down.shape[2], gate_up.shape[2]
    blocks = torch.cat([gate_up.flatten(1), down.flatten(1)], 1)  # (E, 3IH) one block per expert
    pool = torch.zeros(n_slots, blocks.shape[1], device=gate_up.device)
    store = blocks.clone()  # a separate allocation standing in for the host store
    split = 2 * I * H
    pool_gu, pool_d = pool[:, :split].unflatten(1, (2 * I, H)), pool[:, split:].unflatten(1, (H, I))
    offsets = torch.tensor([(store[e].data_ptr() - pool.data_ptr()) // pool.element_size() for e in range(E)],
                           device=gate_up.device)
    return blocks, pool, pool_gu, pool_d, offsets, store


@pytest.mark.parametrize("n,k,e,h,i", [
    (1, 2, 4, 32, 16),     # one token
    (3, 3, 8, 40, 24),     # sizes that are not whole tiles
    (8, 8, 16, 64, 48),    # the largest decode batch, every expert chosen by several tokens
    (2, 1, 3, 130, 33),    # top-1, H beyond one tile of BLOCK_H
])
def test_moe_decode_matches_reference_fp32(n, k, e, h, i):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids, w, gate_up, down = _case(n, k, e, h, i, torch.float32, device, seed=n * 10 + k)
    out = moe_decode_gpu.moe_decode(x, ids, w, gate_up, down)
    ref = moe_experts(x.cpu().double(), ids.cpu(), w.cpu().double(), gate_up.cpu().double(), down.cpu().double())
    assert out.shape == x.shape
    assert torch.allclose(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)


def test_moe_decode_reads_expert_views_of_a_larger_pool():
    """The resident experts are per-layer views of one tensor: strides, not copies."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids, w, gate_up, down = _case(2, 2, 6, 32, 16, torch.float32, device, seed=3)
    pool_gu = torch.zeros(2, *gate_up.shape, device=device)
    pool_gu[1] = gate_up
    pool_d = torch.zeros(2, *down.shape, device=device)
    pool_d[1] = down
    out = moe_decode_gpu.moe_decode(x, ids, w, pool_gu[1], pool_d[1])
    assert torch.allclose(out, moe_decode_gpu.moe_decode(x, ids, w, gate_up, down))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter mis-casts fp32 to bf16")
def test_moe_decode_bf16_close_to_reference():
    x, ids, w, gate_up, down = _case(4, 8, 128, 2048, 768, torch.bfloat16, torch.device("cuda"), seed=7)
    out = moe_decode_gpu.moe_decode(x, ids, w, gate_up, down)
    ref = moe_experts(x.double(), ids, w.double(), gate_up.double(), down.double())
    assert (out.double() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_only_decode_sized_cuda_batches_take_the_kernel():
    assert not moe_decode_gpu.available(torch.zeros(1, 8))  # the CPU keeps the reference
    if torch.cuda.is_available():
        assert moe_decode_gpu.available(torch.zeros(8, 8, device="cuda"))
        assert not moe_decode_gpu.available(torch.zeros(9, 8, device="cuda"))


def test_moe_decode_skips_ids_outside_the_pool():
    """Offloaded experts mark the pairs the CPU computes with an id past the slot pool (or −1):
    those pairs add exactly zero, whatever their weight, and the rest match the reference."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids, w, gate_up, down = _case(3, 4, 8, 32, 16, torch.float32, device, seed=11)
    skip = torch.tensor([[True, False, False, True], [False, False, False, False], [True, True, True, True]],
                        device=device)
    marked = torch.where(skip, torch.where(torch.rand(skip.shape, device=device) < 0.5, -1, 8), ids)
    out = moe_decode_gpu.moe_decode(x, marked, w, gate_up, down)
    kept = torch.where(skip.cpu(), 0.0, w.cpu().double())  # skipped pairs weigh nothing in the reference
    ref = moe_experts(x.cpu().double(), ids.cpu(), kept, gate_up.cpu().double(), down.cpu().double())
    assert torch.allclose(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu()))  # all four pairs skipped: exactly zero


def test_moe_decode_offset_table_reads_experts_in_other_allocations():
    """With an offset table an expert's weights may live in another allocation (the host store read
    in place): expert e at `offsets[e]` elements from the pool's first element; out= is written."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids, w, gate_up, down = _case(3, 2, 5, 40, 24, torch.float32, device, seed=11)
    blocks, pool, pool_gu, pool_d, offsets, _store = _pool_and_store(gate_up, down, 2)  # two "slots"
    pool[1] = blocks[3]
    offsets[3] = pool.shape[1]  # expert 3 from slot 1
    out = torch.full_like(x, float("nan"))
    got = moe_decode_gpu.moe_decode(x, ids, w, pool_gu, pool_d, offsets=offsets, out=out)
    assert got is out
    ref = moe_experts(x.cpu().double(), ids.cpu(), w.cpu().double(), gate_up.cpu().double(), down.cpu().double())
    assert torch.allclose(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)
    skipped = ids.clone()
    skipped[0, 0] = offsets.shape[0]  # outside the table: skipped
    part = moe_decode_gpu.moe_decode(x, skipped, w, pool_gu, pool_d, offsets=offsets)
    w0 = w.clone()
    w0[0, 0] = 0
    ref0 = moe_experts(x.cpu().double(), ids.cpu(), w0.cpu().double(), gate_up.cpu().double(), down.cpu().double())
    assert torch.allclose(part.cpu().double(), ref0, rtol=1e-4, atol=1e-5)


def test_pairs_read_from_outside_the_pool_claim_free_slots_and_copy_their_expert_there():
    """claim_free_slots hands the listed free slots to the pairs whose expert is outside the pool, in
    order, until the list runs out; moe_decode with those spares computes as before and leaves each
    claimed slot holding the expert its pair read."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids, w, gate_up, down = _case(3, 2, 6, 32, 16, torch.float32, device, seed=12)
    blocks, pool, pool_gu, pool_d, offsets, _store = _pool_and_store(gate_up, down, 5)
    P_el = blocks.shape[1]
    in_pool = int(ids[0, 0])
    pool[0] = blocks[in_pool]
    offsets[in_pool] = 0  # slot 0
    spares = torch.tensor([3 * P_el, 1 * P_el, -1, -1], device=device)  # two free slots listed
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    spare = moe_decode_gpu.claim_free_slots(ids, offsets, spares, counter, pool.numel())
    outside = [p for p, e in enumerate(ids.reshape(-1).tolist()) if e != in_pool]
    assert int(counter.item()) == len(outside)
    claimed = {p: int(s) for p, s in enumerate(spare.tolist()) if s >= 0}
    assert sorted(claimed.values()) == [1 * P_el, 3 * P_el][:len(outside)] and set(claimed) <= set(outside)
    out = moe_decode_gpu.moe_decode(x, ids, w, pool_gu, pool_d, offsets=offsets, spare=spare)
    ref = moe_experts(x.cpu().double(), ids.cpu(), w.cpu().double(), gate_up.cpu().double(), down.cpu().double())
    assert torch.allclose(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)
    for p, off in claimed.items():
        assert torch.equal(pool[off // P_el], blocks[int(ids.reshape(-1)[p])])
    assert torch.equal(pool[2], torch.zeros(P_el, device=device))  # not listed: untouched


def test_claim_free_slots_writes_into_given_rows_and_logs_the_pairs_experts():
    """With out and log, the claims land in the caller's row (no new tensor) and each pair's expert id
    in its log row; entries past the pairs stay as they were."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    E, P_el, N, k = 6, 10, 2, 3
    ids = torch.randint(0, E, (N, k), generator=gen).to(device)
    offsets = torch.full((E,), -7 * P_el, dtype=torch.int64, device=device)  # every expert outside the pool
    offsets[int(ids[0, 0])] = P_el  # one in slot 1
    spares = torch.tensor([4 * P_el, 2 * P_el, -1, -1, -1, -1, -1], device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    claims = torch.full((2, N * k + 2), -5, dtype=torch.int64, device=device)  # (layers, pairs + 2)
    log = torch.full_like(claims, -5)
    got = moe_decode_gpu.claim_free_slots(ids, offsets, spares, counter, 50 * P_el,
                                          out=claims[1, :N * k], log=log[1, :N * k])
    assert got.data_ptr() == claims[1].data_ptr()
    assert log[1, :N * k].tolist() == ids.reshape(-1).tolist()
    outside = [p for p, e in enumerate(ids.reshape(-1).tolist()) if e != int(ids[0, 0])]
    claimed = sorted(int(s) for s in claims[1, :N * k].tolist() if s >= 0)
    assert claimed == [2 * P_el, 4 * P_el][:len(outside)]
    assert (claims[0] == -5).all() and (log[0] == -5).all() and (claims[1, N * k:] == -5).all()
    assert (log[1, N * k:] == -5).all()


def test_admit_points_each_filled_expert_at_the_slot_its_first_pair_filled():
    """moe_decode with admit: after the fills, each expert a pair filled has its offset entry pointed at
    that slot (the first pair's where two tokens filled the same expert); the other entries stay."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, _, w, gate_up, down = _case(2, 2, 6, 32, 16, torch.float32, device, seed=5)
    ids = torch.tensor([[3, 1], [3, 4]], device=device)  # expert 3 routed by both tokens
    blocks, pool, pool_gu, pool_d, offsets, _store = _pool_and_store(gate_up, down, 6)
    P_el = blocks.shape[1]
    pool[0] = blocks[1]
    offsets[1] = 0  # expert 1 in slot 0: a hit
    before = offsets.clone()
    spare = torch.tensor([2 * P_el, -1, 5 * P_el, 4 * P_el], device=device)  # pairs (0,0)→2, (1,0)→5, (1,1)→4
    out = moe_decode_gpu.moe_decode(x, ids, w, pool_gu, pool_d, offsets=offsets, spare=spare, admit=True)
    ref = moe_experts(x.cpu().double(), ids.cpu(), w.cpu().double(), gate_up.cpu().double(), down.cpu().double())
    assert torch.allclose(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)
    want = before.clone()
    want[3], want[4] = 2 * P_el, 4 * P_el  # expert 3: the first pair's slot (2), not the second's (5)
    assert offsets.tolist() == want.tolist()
    assert torch.equal(pool[2], blocks[3]) and torch.equal(pool[4], blocks[4])
